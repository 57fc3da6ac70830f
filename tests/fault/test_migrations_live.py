"""An application's routine migration while relays run and a writer commits
(G1, G2 on Apache Kafka): a column the relay reads changes type (ALTER TABLE
... ALTER COLUMN ... TYPE), which makes every prepared statement that returns
it fail with "cached plan must not change result type" (SQLSTATE 0A000) until
it is prepared again; a column is added and dropped. The relay prepares its
statements again by itself: the rows written after the migration go out
within RECOVER_S, with no restart, and the relay logs it at most a few
times."""
import threading
import time

import psycopg2
import pytest

from conftest import check_audit, check_kafka, relay_env
from harness import Relay, free_port, wait_until
from observe import NEW_CORE, warn_records

# A statement a fresh session cures is prepared again at once; a second
# relay turn (poll 100 ms) and one batch later the rows flow. The bound
# leaves room for the sanitized build on a shared machine.
RECOVER_S = 3.0
MIGRATIONS = {
    "event_type_varchar": ["ALTER TABLE {t} ALTER COLUMN event_type TYPE varchar(200)"],
    "aggregate_id_varchar": ["ALTER TABLE {t} ALTER COLUMN aggregate_id TYPE varchar(300)"],
    "trace_id_varchar_then_text": ["ALTER TABLE {t} ALTER COLUMN trace_id TYPE varchar(64)",
                                   "ALTER TABLE {t} ALTER COLUMN trace_id TYPE text"],
    "add_and_drop_column": ["ALTER TABLE {t} ADD COLUMN note text DEFAULT 'n'",
                            "ALTER TABLE {t} DROP COLUMN note"],
}


class Writer(threading.Thread):
    """Commits 10 rows every 50 ms: new versions of 50 aggregates in turn
    (version order kept), and records when each batch committed."""

    def __init__(self, db):
        super().__init__(daemon=True)
        self.db = db
        self.stopped = threading.Event()
        self.version = 0
        self.n = 0
        self.error = None

    def run(self):
        conn = psycopg2.connect(self.db.pg.url)
        conn.autocommit = True
        try:
            while not self.stopped.is_set():
                base = self.n
                with conn.cursor() as cur:
                    cur.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version,"
                                " event_type, payload_json, trace_id) SELECT 'Order',"
                                " 'm' || ((%%s + i) %%%% 50), (%%s + i) / 50 + 1, 'Changed',"
                                " jsonb_build_object('n', %%s + i), 'tr' FROM"
                                " generate_series(0, 9) i" % self.db.table, (base, base, base))
                self.n += 10
                time.sleep(0.05)
        except Exception as e:
            self.error = e
        finally:
            conn.close()

    def stop(self):
        self.stopped.set()
        self.join(30)
        assert self.error is None, self.error
        return self.n


# the type changes that leave a result type changed need statements prepared again
NEEDS_REPREPARE = ("event_type_varchar", "aggregate_id_varchar")


@pytest.mark.parametrize("name", [pytest.param(n, marks=NEW_CORE) if n in NEEDS_REPREPARE
                                  else n for n in MIGRATIONS])
def test_migration_while_publishing(db, kafka, tmp_path, report, name):
    kafka.create_topic("%s.Order" % db.schema, 4)
    port = free_port()
    env = relay_env(db, kafka, "r-mig", OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)
    writer = Writer(db)
    with Relay("outbox-relay", name="r-mig", log_dir=tmp_path, env=env) as relay:
        writer.start()
        wait_until(lambda: db.count("status = 'PUBLISHED'") >= 100 or writer.error, 30,
                   what="publishing")
        assert writer.error is None, writer.error
        lines_before = len(relay.log_text().splitlines())
        dba = psycopg2.connect(db.pg.url, application_name="migration")
        dba.autocommit = True
        try:
            with dba.cursor() as cur:
                cur.execute("SET lock_timeout = '10s'")
                for sql in MIGRATIONS[name]:
                    cur.execute(sql.format(t=db.table))
                cur.execute("SELECT clock_timestamp()")
                migrated = cur.fetchone()[0]
        finally:
            dba.close()
        time.sleep(3)  # the writer goes on after the migration
        n = writer.stop()
        try:
            wait_until(lambda: db.count("status <> 'PUBLISHED'") == 0, 30,
                       what="every row PUBLISHED after the migration")
        except AssertionError as e:
            warns = warn_records("\n".join(relay.log_text().splitlines()[lines_before:]))
            raise AssertionError("%s: %s; %d warn lines since the migration, e.g.:\n%s" % (
                e, db.status_counts(), len(warns),
                "\n".join(w["_line"] for w in warns[:3]))) from None
        after = db.execute("SELECT coalesce(max(extract(epoch FROM published_at - created_at)),"
                           " 0)::float8 AS s, count(*) AS n FROM %s WHERE created_at > %%s"
                           % db.table, (migrated,))[0]
        warns = warn_records("\n".join(relay.log_text().splitlines()[lines_before:]))
        assert relay.stop() == 0
    assert after["n"] > 0
    assert after["s"] < RECOVER_S, \
        "rows written after the migration waited up to %.1f s; relay said:\n%s" % (
            after["s"], "\n".join(w["_line"] for w in warns[:5]))
    assert len(warns) <= 3, "\n".join(w["_line"] for w in warns[:10])
    table = db.rows()
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    kc, problems = check_kafka(kafka, ["%s.Order" % db.schema], table, dup_allowed=set())
    assert not problems, problems
    assert len(kc.ids) == len(table) == n
    report("%s during publishing: %d rows, those written after it waited at most %.2f s;"
           " %d warn lines", name, n, after["s"], len(warns))
