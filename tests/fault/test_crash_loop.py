"""A row that kills every relay that takes it (an out-of-memory, a crash in a
library) must end DEAD, not loop: relays restarted under new ids (the default
hostname-pid, a Deployment's new pod names) cannot take their own locks back,
so the sweeper's stale-lock reset counts the attempts and parks the row DEAD
(STALE_LOCK) once OUTBOX_MAX_ATTEMPTS are used up. The crash is a SIGKILL
while the row's batch is in flight (the mock cluster is down, so the batch
waits for its delivery reports)."""
import signal

from conftest import check_audit, relay_env, sweeper_env
from harness import Relay, make_events, wait_until

MAX_ATTEMPTS = 3


def test_row_that_kills_its_relays_goes_dead(db, own_kafka, tmp_path, report):
    kafka = own_kafka
    kafka.create_topic("%s.Order" % db.schema, 4)
    (oid,) = db.insert_events(make_events(aggregates=1, id_prefix="killer"))
    kafka.down()
    sweeper = Relay("outbox-sweeper", name="sweeper-loop", log_dir=tmp_path,
                    env=sweeper_env(db, "sweeper-loop", OUTBOX_LOCK_TIMEOUT_S=1,
                                    OUTBOX_MAX_ATTEMPTS=MAX_ATTEMPTS))
    with sweeper:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            rid = "crashing-%d" % attempt  # a new id each time, as a restarted pod has
            relay = Relay("outbox-relay", name=rid, log_dir=tmp_path,
                          env=relay_env(db, kafka, rid, OUTBOX_MAX_ATTEMPTS=MAX_ATTEMPTS,
                                        OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=60000))
            wait_until(lambda: db.count("status = 'PUBLISHING' AND locked_by = %s", (rid,)), 30,
                       what="%s holding the row" % rid)
            relay.send_signal(signal.SIGKILL)
            relay.wait(10)
            want = "DEAD" if attempt == MAX_ATTEMPTS else "FAILED"
            wait_until(lambda: db.rows(where="outbox_id = %s", params=(oid,))[0]["status"] == want,
                       30, what="row %s after crash %d" % (want, attempt))
        sweeper.wait_log(r"stale locks with their attempts used up went DEAD", 10)
    kafka.up()
    (row,) = db.rows()
    assert row["status"] == "DEAD" and row["attempt_count"] == MAX_ATTEMPTS
    assert row["last_error_code"] == "STALE_LOCK"
    assert "attempt %d of %d" % (MAX_ATTEMPTS, MAX_ATTEMPTS) in row["last_error_message"]
    assert row["available_at"].year == 9999  # parked, as every DEAD row
    audit = check_audit(db, lock_timeout_s=1)
    assert not audit.violations, audit.violations[:10]
    assert audit.locks[oid] == MAX_ATTEMPTS
    report("a row whose batch died with its relay %d times under new ids: DEAD (STALE_LOCK, "
           "attempt %d of %d), parked", MAX_ATTEMPTS, row["attempt_count"], MAX_ATTEMPTS)
