"""A row that another transaction changes while a relay's lock statement runs
(after the statement began, before it locks the row). FOR UPDATE then locks,
and returns, the row's newest version, which the statement itself cannot see
or update. G2 must hold: the changed version sits the batch out and its
aggregate's later versions wait for it; nothing is lost or published out of
order. The relay's test hook OUTBOX_TEST_LOCK_DELAY_MS (compiled in only with
-DOUTBOX_TEST_HOOKS=ON, as tests/run builds the binaries it tests) pauses every lock
statement between its start and its row locks, so the test can change the row
in that window every time.

Broker: Apache Kafka (tests/run's)."""
import psycopg2

from conftest import KafkaCheck, check_audit, check_kafka, relay_env, wait_quiet
from harness import Relay, make_events, read_topics, wait_until

PAUSED = ("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
          " AND query LIKE '/* relay: lock%%' AND query LIKE %s")


def test_row_changed_during_the_lock_statement_holds_back_its_successors(
        db, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    rows = make_events(aggregates=1, versions=4, id_prefix="race")
    rows += make_events(aggregates=5, versions=2, id_prefix="calm")
    ids = db.insert_events(rows)
    head = ids[0]  # race0 version 1
    env = relay_env(db, kafka, "r-race", OUTBOX_TEST_LOCK_DELAY_MS=1500)
    with Relay("outbox-relay", name="r-race", log_dir=tmp_path, env=env) as relay:
        wait_until(lambda: db.execute(PAUSED, ("%%%s%%" % db.schema,))[0]["n"] > 0, 30,
                   what="the relay's first lock statement paused before its row locks")
        db.execute("UPDATE %s SET trace_id = 'changed mid-lock' WHERE outbox_id = %%s"
                   % db.table, (head,))
        counts = wait_quiet(db, 60, "every row PUBLISHED")
        assert relay.stop() == 0
    assert counts["PUBLISHED"] == len(rows), counts

    table = db.rows()
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=set())
    assert not problems, problems  # includes G2: first copies in version order
    assert len(kc.ids) == len(table)
    # Each lock statement pauses 1.5 s: versions locked by different statements
    # are that far apart; within one statement, microseconds.
    locks = db.execute("SELECT outbox_id::text AS id, min(ts) AS first FROM %s.lock_audit"
                       " WHERE new_status = 'PUBLISHING' GROUP BY 1" % db.schema)
    first = {r["id"]: r["first"] for r in locks}
    head_at = first[head]
    early = [i for i, r in zip(ids, rows) if r["aggregate_id"] == "race0" and i != head
             and (head_at - first[i]).total_seconds() > 0.5]
    assert not early, "later versions of race0 locked before version 1: %s" % early
    report("a row changed between the lock statement's start and its row locks: its "
           "aggregate's 4 versions locked and published in order, the 10 other rows "
           "unaffected, nothing lost or duplicated")


def test_a_lock_ages_from_its_statement_start(db, kafka, tmp_path, report):
    """The sweeper counts a lock's age from locked_at, the lock statement's
    now(); the relay must count from no later (docs/DESIGN.md, "Bounded lock
    age"). Its lock statements here take 12 s (the pause before their row
    locks) and its produce deadline is 11 s (OUTBOX_LOCK_TIMEOUT_S 34 less
    the delivery timeout 3 and 20): the rows are too old to produce by the
    time the answer arrives, so the relay gives them back unattempted and
    nothing reaches Kafka. Counted from the answer, they would have gone
    out with a lock already 12 s into its 34."""
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 1)
    rows = make_events(aggregates=5, versions=1, id_prefix="slow")
    db.insert_events(rows)
    env = relay_env(db, kafka, "r-slow", OUTBOX_TEST_LOCK_DELAY_MS=12000,
                    OUTBOX_STATEMENT_TIMEOUT_MS=20000, OUTBOX_LOCK_TIMEOUT_S=34)
    assert int(env["OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS"]) == 3000
    with Relay("outbox-relay", name="r-slow", log_dir=tmp_path, env=env) as relay:
        wait_until(lambda: check_audit(db).releases[("relay", "RELEASED")] >= len(rows), 30,
                   interval=0.2, what="the first lock's rows given back unattempted")
        assert relay.stop(timeout=40) == 0
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    assert db.count("status = 'PUBLISHED'") == 0, db.status_counts()
    assert db.count("status = 'PENDING' AND attempt_count = 0") == len(rows), db.rows()
    kc, problems = check_kafka(kafka, [topic], db.rows(), dup_allowed=set(), timeout_s=10)
    assert not problems, problems
    assert not kc.msgs, "rows produced with a lock older than the produce deadline"
    report("lock statements of 12 s, produce deadline 11 s: the %d rows locked given back "
           "unattempted (%d releases), none produced", len(rows),
           audit.releases[("relay", "RELEASED")])


def event(agg, v):
    return {"aggregate_type": "Order", "aggregate_id": agg, "aggregate_version": v,
            "event_type": "Changed", "payload_json": {"v": v}}


def lt_row(db, v):
    """Version v of aggregate `lt`: its status and error code."""
    return db.execute("SELECT status, last_error_code FROM %s WHERE aggregate_id = 'lt'"
                      " AND aggregate_version = %%s" % db.table, (v,))[0]


def publish_lt_2_and_5(db, kafka):
    """Versions 2 and 5 of `lt` published (3 and 4 were missing when a gap
    release let 5 go); the topic created. Returns it."""
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 2)
    db.insert_events([event("lt", 2), event("lt", 5)])
    # published by hand: the operator's doing, as the audit sees it
    db.execute("SET outbox.actor = 'operator'; UPDATE %s SET status = 'PUBLISHED',"
               " published_at = now(); RESET outbox.actor" % db.table)
    return topic


def assert_3_and_4_late(db, kafka, topic, counts, late, calm):
    """Versions 3 and 4 of `lt` went DEAD as late, below 5; nothing of `lt`
    reached Kafka, the calm aggregate's events did; the audit is clean."""
    rows = {(r["aggregate_id"], r["aggregate_version"]): r for r in db.rows()}
    for v in (3, 4):
        r = rows[("lt", v)]
        assert (r["status"], r["last_error_code"]) == ("DEAD", "LATE_VERSION"), r
        assert "after version 5 was published" in r["last_error_message"], r
    assert counts["PUBLISHED"] == 4 and counts["DEAD"] == 2, counts
    sent = KafkaCheck(read_topics(kafka.bootstrap, topics=[topic])).ids
    assert not set(late) & set(sent), "late version 3 reached Kafka after version 5"
    assert sorted(sent) == sorted(calm), sent
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]


def test_a_version_below_one_locked_as_late_is_late_too(db, kafka, tmp_path, report):
    """Versions 2 and 5 of `lt` are published (3 and 4 were missing when a gap
    release let 5 go). Version 4 commits: relay r-slow locks it to go DEAD
    unsent as late, and its DEAD mark waits 5 s (OUTBOX_TEST_MARK_DELAY_MS), so
    4 stays PUBLISHING. Version 3 commits meanwhile: the lowest version above it
    is 4, in flight to DEAD, and above that 5, published. 3 is late too, and
    must not reach Kafka after 5, whichever relay locks it (r-slow, or r-fast,
    which marks without delay)."""
    topic = publish_lt_2_and_5(db, kafka)
    slow_env = relay_env(db, kafka, "r-slow", OUTBOX_TEST_MARK_DELAY_MS=5000)
    with Relay("outbox-relay", name="r-slow", log_dir=tmp_path, env=slow_env) as slow:
        db.insert_events([event("lt", 4)])
        wait_until(lambda: lt_row(db, 4)["status"] == "PUBLISHING", 30,
                   what="version 4 locked to go DEAD (its mark paused)")
        with Relay("outbox-relay", name="r-fast", log_dir=tmp_path,
                   env=relay_env(db, kafka, "r-fast")) as fast:
            late = db.insert_events([event("lt", 3)])
            calm = db.insert_events([event("calm", 1), event("calm", 2)])
            counts = wait_quiet(db, 30, "every row final")
            assert fast.stop() == 0
        assert slow.stop() == 0
    assert_3_and_4_late(db, kafka, topic, counts, late, calm)
    report("version 3 committed while version 4 was in flight to DEAD as late, with 5 "
           "published: 3 went DEAD as late too, never to Kafka")


def test_a_version_below_one_another_transaction_holds_is_late_too(db, kafka, tmp_path, report):
    """Versions 2 and 5 of `lt` are published; versions 4 and then 3 commit late.
    Another transaction holds version 4 locked, as another relay's lock
    statement does while it locks 4 to go DEAD: the relay's window steps over 4
    (SKIP LOCKED) and, in its snapshot, 4 is PENDING with no error code. 3 is
    late all the same (5 reached Kafka before it committed) and must go DEAD
    unsent, not to Kafka after 5; then 4 too, once released."""
    topic = publish_lt_2_and_5(db, kafka)
    db.insert_events([event("lt", 4)])
    holder = psycopg2.connect(db.pg.url)
    try:
        with holder.cursor() as cur:  # a transaction opens: 4 stays locked until rollback
            cur.execute("SELECT 1 FROM %s WHERE aggregate_id = 'lt' AND aggregate_version = 4"
                        " FOR UPDATE" % db.table)
            assert cur.rowcount == 1
        late = db.insert_events([event("lt", 3)])
        calm = db.insert_events([event("calm", 1), event("calm", 2)])
        with Relay("outbox-relay", name="r-held", log_dir=tmp_path,
                   env=relay_env(db, kafka, "r-held")) as relay:
            wait_until(lambda: lt_row(db, 3)["status"] not in ("PENDING", "FAILED", "PUBLISHING")
                       and db.count("aggregate_id = 'calm' AND status = 'PUBLISHED'") == 2,
                       30, what="version 3 and the calm aggregate settled")
            assert tuple(lt_row(db, 3).values()) == ("DEAD", "LATE_VERSION")
            assert lt_row(db, 4)["status"] == "PENDING"
            holder.rollback()
            counts = wait_quiet(db, 30, "every row final")
            assert relay.stop() == 0
    finally:
        holder.close()
    assert_3_and_4_late(db, kafka, topic, counts, late, calm)
    report("version 3 committed late while another transaction held late version 4 "
           "locked (PENDING in the relay's snapshot), with 5 published: 3 went DEAD as "
           "late, never to Kafka; 4 followed once released")
