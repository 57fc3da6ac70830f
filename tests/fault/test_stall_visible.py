"""Every stall is visible, and nothing is retried in a tight loop
(docs/DESIGN.md, "Observability"):

  - a statement that keeps failing (the relay's role loses UPDATE on the
    table: SQLSTATE 42501 on every lock statement) is retried with a capped
    backoff, logged once per state change naming the statement and the
    SQLSTATE (not once per attempt), counted in
    outbox_statement_errors_total{statement,sqlstate}, and makes /readyz 503
    with the "statements" condition naming both; it recovers by itself once
    the privilege is back;
  - a stall of any cause (here: the broker hung, SIGSTOP, with rows waiting)
    makes /readyz 503 with the "stall" condition within its bound
    (2 x OUTBOX_POLL_INTERVAL_MS + OUTBOX_STATEMENT_TIMEOUT_MS) plus a
    scrape's slack, sets outbox_relay_stalled 1 and leaves
    outbox_relay_last_lock_timestamp_seconds behind; both clear when it ends;
  - the chart has an alert on the stall.
Once the cause is gone every row is PUBLISHED and on Kafka (G1), first copies
in version order (G2).

Broker: Apache Kafka (tests/run's); the hung broker is SIGSTOPped (every test
of the run sees it, tests run one at a time)."""
import os
import re
import time
import urllib.parse

import yaml

from conftest import check_audit, check_kafka, relay_env
from harness import Relay, free_port, make_events, repo_root, wait_until
from observe import NEW_CORE, readyz, scrape, warn_records

POLL_MS = 100
STATEMENT_TIMEOUT_MS = 2000
STALL_BOUND_S = (2 * POLL_MS + STATEMENT_TIMEOUT_MS) / 1000
# /readyz is computed by the relay's loop; allow a second beyond the bound
# for the loop's turn and the test's polling.
SEEN_WITHIN_S = STALL_BOUND_S + 1.0
WINDOW_S = 10        # the observation window of the failing statement
MAX_WARN_LINES = 5   # "a handful" of warn lines in WINDOW_S (not one per attempt)
# Attempts in WINDOW_S: at the poll interval that would be 100; a backoff
# doubling from the poll interval to a cap of a few seconds makes about 7-10.
MAX_ATTEMPTS = 20


def g1_g2(db, kafka):
    """Every row PUBLISHED and on Kafka once, first copies in version order."""
    table = db.rows()
    assert all(r["status"] == "PUBLISHED" for r in table), db.status_counts()
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    kc, problems = check_kafka(kafka, ["%s.Order" % db.schema], table,
                               dup_allowed=audit.relocked_after_stale)
    assert not problems, problems
    assert len(kc.ids) == len(table)


def with_user(url, user):
    u = urllib.parse.urlsplit(url)
    host = u.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit((u.scheme, "%s@%s" % (user, host), u.path, u.query,
                                    u.fragment))


def relay_role(db):
    """A login role (no superuser) with what a relay needs on the test's
    schema: its table, and the audit tables the fault suite's triggers write.
    The server trusts local connections: no password."""
    role = "relay_%s" % db.schema[-8:]
    db.execute("CREATE ROLE %s LOGIN" % role)
    db.execute("GRANT USAGE ON SCHEMA %s TO %s" % (db.schema, role))
    db.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %s TO %s"
               % (db.schema, role))
    db.execute("GRANT USAGE ON ALL SEQUENCES IN SCHEMA %s TO %s" % (db.schema, role))
    return role


def drop_role(db, role):
    db.execute("DROP OWNED BY %s" % role)
    db.execute("DROP ROLE %s" % role)


@NEW_CORE
def test_failing_statement_backs_off_and_is_named(db, kafka, tmp_path, report):
    kafka.create_topic("%s.Order" % db.schema, 4)
    role = relay_role(db)
    port = free_port()
    env = relay_env(db, kafka, "r-fail", OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port,
                    OUTBOX_POLL_INTERVAL_MS=POLL_MS,
                    OUTBOX_STATEMENT_TIMEOUT_MS=STATEMENT_TIMEOUT_MS)
    env["OUTBOX_DATABASE_URL"] = with_user(env["OUTBOX_DATABASE_URL"], role)
    try:
        first = db.insert_events(make_events(aggregates=20, id_prefix="before"))
        with Relay("outbox-relay", name="r-fail", log_dir=tmp_path, env=env) as relay:
            wait_until(lambda: db.count("status = 'PUBLISHED'") == len(first), 30,
                       what="rows PUBLISHED by the relay's own role")
            wait_until(lambda: readyz(port).status == 200, 10, what="/readyz 200")

            db.execute("REVOKE UPDATE ON %s FROM %s" % (db.table, role))
            revoked_at = time.monotonic()
            lines_before = len(relay.log_text().splitlines())
            errors_before = scrape(port).total("outbox_statement_errors_total")
            more = db.insert_events(make_events(aggregates=20, id_prefix="during"))

            # the window: poll /readyz, then count lines and attempts
            answers = []
            while time.monotonic() - revoked_at < WINDOW_S:
                answers.append((time.monotonic() - revoked_at, readyz(port)))
                time.sleep(0.2)
            window = relay.log_text().splitlines()[lines_before:]
            warns = warn_records("\n".join(window))
            errors = scrape(port).total("outbox_statement_errors_total") - errors_before
            by_state = scrape(port).total("outbox_statement_errors_total", sqlstate="42501")
            assert len(warns) <= MAX_WARN_LINES, \
                "%d warn lines in %d s, e.g.:\n%s" % (len(warns), WINDOW_S,
                                                   "\n".join(w["_line"] for w in warns[:5]))
            # /readyz: 503 within the bound, the statements condition naming
            # the statement and the SQLSTATE, and so to the window's end
            named = [(t, r) for t, r in answers if r.status == 503 and r.condition("statements")
                     and r.condition("statements").get("ok") is False
                     and "42501" in r.condition("statements").get("reason", "")]
            assert named, ("/readyz never 503 naming 42501", answers[-3:])
            assert named[0][0] <= SEEN_WITHIN_S + 5, named[0]
            assert all(r.status == 503 for t, r in answers if t >= named[0][0]), answers
            reason = named[-1][1].condition("statements")["reason"]
            statement = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)", reason).group(1)
            lines = [w for w in warns if "42501" in w["_line"] and statement in w["_line"]]
            assert lines, ("no warn line names %s and 42501" % statement,
                           [w["_line"] for w in warns])
            assert len(lines) <= 3, [w["_line"] for w in lines]  # once per statement at most
            assert 2 <= errors <= MAX_ATTEMPTS, ("attempts in the window", errors)
            assert by_state >= 2, by_state
            assert db.count("outbox_id = ANY(%s::uuid[]) AND status = 'PUBLISHED'",
                            (more,)) == 0

            # fixed: it recovers without a restart, and says so once
            db.execute("GRANT UPDATE ON %s TO %s" % (db.table, role))
            fixed_at = time.monotonic()
            wait_until(lambda: db.count("status = 'PUBLISHED'") == len(first) + len(more), 30,
                       what="rows PUBLISHED once the privilege is back")
            recovered_s = time.monotonic() - fixed_at
            wait_until(lambda: readyz(port).status == 200, 10, what="/readyz 200 again")
            after = relay.log_text().splitlines()[lines_before + len(window):]
            assert any(statement in line for line in after), \
                ("no line says %s works again" % statement, after[-10:])
            assert relay.stop() == 0
    finally:
        drop_role(db, role)
    g1_g2(db, kafka)
    report("UPDATE revoked: /readyz 503 (%s); %d warn lines and %d attempts in %d s "
           "(backoff); recovered %.1f s after GRANT", reason, len(warns), errors, WINDOW_S,
           recovered_s)


@NEW_CORE
def test_a_stall_of_any_cause_makes_the_relay_not_ready(db, kafka, tmp_path, report):
    """The broker hangs (SIGSTOP) while rows wait: nothing is locked or
    marked, and the relay says so within the stall bound."""
    kafka.create_topic("%s.Order" % db.schema, 4)
    port = free_port()
    env = relay_env(db, kafka, "r-stall", OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port,
                    OUTBOX_POLL_INTERVAL_MS=POLL_MS,
                    OUTBOX_STATEMENT_TIMEOUT_MS=STATEMENT_TIMEOUT_MS,
                    OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=20000, OUTBOX_BATCH_SIZE=50)
    rows = make_events(aggregates=200, versions=10)
    db.insert_events(rows[:200])
    with Relay("outbox-relay", name="r-stall", log_dir=tmp_path, env=env) as relay:
        wait_until(lambda: db.count("status = 'PUBLISHED'") == 200, 30, what="warm-up")
        wait_until(lambda: readyz(port).status == 200, 10, what="/readyz 200")
        with kafka.paused():
            db.insert_events(rows[200:])
            hung_at = time.monotonic()
            r = wait_until(lambda: (lambda x: x.status == 503 and x)(readyz(port)),
                           SEEN_WITHIN_S + 2, interval=0.1,
                           what="/readyz 503 while nothing is locked or marked")
            seen_s = time.monotonic() - hung_at
            stall = r.condition("stall")
            assert stall is not None and stall.get("ok") is False, r
            assert stall.get("reason"), r
            m = scrape(port)
            assert m.value("outbox_relay_stalled") == 1, m.text[-2000:]
            last_lock = m.value("outbox_relay_last_lock_timestamp_seconds")
            assert last_lock is not None and time.time() - last_lock > STALL_BOUND_S, last_lock
            assert m.value("outbox_ready") == 0
        wait_until(lambda: db.count("status = 'PUBLISHED'") == len(rows), 60,
                   what="every row PUBLISHED once the broker is back")
        wait_until(lambda: readyz(port).status == 200, 10, what="/readyz 200 again")
        assert scrape(port).value("outbox_relay_stalled") == 0
        assert relay.stop() == 0
    assert seen_s <= SEEN_WITHIN_S + 2
    g1_g2(db, kafka)
    report("broker hung: /readyz 503 after %.1f s (bound %.1f s): %s", seen_s,
           STALL_BOUND_S, stall["reason"])


@NEW_CORE
def test_the_chart_alerts_on_a_stall():
    """The chart's alert rules use the stall's metrics (outbox_relay_stalled
    or the age of outbox_relay_last_lock_timestamp_seconds)."""
    path = os.path.join(repo_root(), "helm", "outbox-relay", "files", "alerts.yaml")
    with open(path) as f:
        text = f.read()
    # the file is a Helm template: drop the template actions, keep the YAML
    plain = re.sub(r"\{\{.*?\}\}", "", text, flags=re.S)
    rules = [r for g in yaml.safe_load(plain)["groups"] for r in g["rules"]]
    stall = [r for r in rules if "outbox_relay_stalled" in r.get("expr", "")
             or "outbox_relay_last_lock_timestamp_seconds" in r.get("expr", "")]
    assert stall, "no alert on outbox_relay_stalled / outbox_relay_last_lock_timestamp_seconds"
