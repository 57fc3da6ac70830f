"""The fault suite's audit (conftest.check_audit) itself: histories written
by hand, each as the actor named, in the shapes the relay, the sweeper and
outboxctl write them. A legitimate history passes; each breach of a rule is
reported. PostgreSQL only."""
import time

import psycopg2
import pytest

from conftest import REPLAY_HOLDER, actor_url, check_audit
from harness import make_events

LOCK = ("UPDATE {t} SET status = 'PUBLISHING', locked_by = %s, locked_at = {at},"
        " attempt_count = attempt_count + 1 WHERE outbox_id = %s")
PUBLISH = ("UPDATE {t} SET status = 'PUBLISHED', published_at = now(), locked_by = NULL,"
           " locked_at = NULL WHERE outbox_id = %s")
STALE = ("UPDATE {t} SET status = 'FAILED', last_error_code = 'STALE_LOCK', locked_by = NULL,"
         " locked_at = NULL WHERE outbox_id = %s")
HOLD = ("UPDATE {t} SET status = 'PUBLISHING', published_at = NULL, attempt_count = 0,"
        " locked_by = %s, locked_at = now() WHERE outbox_id = %s")
RELEASE = "UPDATE {t} SET status = 'PENDING', locked_by = NULL, locked_at = NULL" \
          " WHERE outbox_id = %s"
UNPUBLISH = "UPDATE {t} SET status = 'PENDING', published_at = NULL WHERE outbox_id = %s"


class Actors:
    """One autocommit connection per actor (outbox.actor set as the daemons
    set it, in the URL's options)."""

    def __init__(self, db):
        self.db, self.conns = db, {}

    def run(self, actor, sql, *params, at="now()"):
        if actor not in self.conns:
            c = psycopg2.connect(actor_url(self.db.pg.url, actor))
            c.autocommit = True
            self.conns[actor] = c
        with self.conns[actor].cursor() as cur:
            cur.execute(sql.format(t=self.db.table, at=at), params)

    def close(self):
        for c in self.conns.values():
            c.close()


@pytest.fixture
def actors(db):
    a = Actors(db)
    yield a
    a.close()


@pytest.fixture
def row(db):
    return db.insert_events(make_events(1, 1))[0]


def test_a_legitimate_history_passes(db, actors, row):
    actors.run("A", LOCK, "A", row)
    time.sleep(1.1)
    actors.run("sweeper", STALE, row)          # the lock is 1.1 s old, the timeout 1 s
    actors.run("B", LOCK, "B", row)
    actors.run("B", PUBLISH, row)
    actors.run("operator", HOLD, REPLAY_HOLDER, row)   # outboxctl replay, step 1
    actors.run("operator", RELEASE, row)               # step 2
    actors.run("A", LOCK, "A", row)
    actors.run("A", PUBLISH, row)
    audit = check_audit(db, lock_timeout_s=1)
    assert not audit.violations, audit.violations
    assert audit.locks[row] == 3 and audit.stale_resets[row] == 1
    assert audit.relocked_after_stale == {row}


def test_a_reset_before_the_lock_timeout_is_reported(db, actors, row):
    actors.run("A", LOCK, "A", row)
    actors.run("sweeper", STALE, row)
    v = check_audit(db, lock_timeout_s=5).violations
    assert len(v) == 1 and "sweeper reset a lock" in v[0], v


def test_a_backdated_lock_is_reported(db, actors, row):
    # a lock 10 s old the moment it is taken: the sweeper would take it back early
    actors.run("A", LOCK, "A", row, at="now() - interval '10 s'")
    v = check_audit(db).violations
    assert len(v) == 1 and "is not the lock's transaction start" in v[0], v


def test_a_published_row_changed_by_a_relay_is_reported(db, actors, row):
    actors.run("A", LOCK, "A", row)
    actors.run("A", PUBLISH, row)
    actors.run("B", UNPUBLISH, row)
    v = check_audit(db).violations
    assert any("changed after PUBLISHED" in x for x in v), v


def test_a_replay_hold_taken_by_a_relay_is_reported(db, actors, row):
    actors.run("A", LOCK, "A", row)
    actors.run("A", PUBLISH, row)
    actors.run("B", HOLD, REPLAY_HOLDER, row)
    v = check_audit(db).violations
    assert any("changed after PUBLISHED" in x for x in v), v
    assert any("B took a lock for %s" % REPLAY_HOLDER in x for x in v), v


def test_a_replay_hold_of_an_unpublished_row_is_reported(db, actors, row):
    actors.run("operator", HOLD, REPLAY_HOLDER, row)
    v = check_audit(db).violations
    assert len(v) == 1 and "a replay held a row that was PENDING" in v[0], v


def test_a_relay_lock_over_a_replay_hold_is_reported(db, actors, row):
    actors.run("A", LOCK, "A", row)
    actors.run("A", PUBLISH, row)
    actors.run("operator", HOLD, REPLAY_HOLDER, row)
    actors.run("B", LOCK, "B", row)
    v = check_audit(db).violations
    assert any("locked by B while held by %s" % REPLAY_HOLDER in x for x in v), v
