"""Every value the table admits gives its row an outcome and stops nothing
else (docs/DESIGN.md, "Row-level outcomes for hostile values"): versions
anywhere in bigint, attempt counts anywhere in int, timestamps at infinity, BC
or past year 9999, rows too large for Kafka. Each test puts such rows beside
100 ordinary ones and asserts:

  - the ordinary rows are all published, and nothing the relay runs fails on
    the table (no statement error in its log, none counted in
    outbox_statement_errors_total, /readyz's statements condition ok);
  - each hostile row is PUBLISHED (when its order rule lets it), or DEAD with
    a last_error_message naming the column, or was refused at INSERT by a
    CHECK constraint the application sees (the schema may choose that);
  - what reached Kafka (Apache Kafka, read back) is in per-aggregate order,
    and every occurred-at header is RFC 3339 for the row's own instant.
"""
import datetime
import json
import math
import re

import psycopg2
import psycopg2.errors
import pytest

from conftest import relay_env
from harness import Relay, check_order, free_port, header, make_events, read_topics, wait_until
from observe import NEW_CORE, readyz, scrape

BIGINT_MIN, BIGINT_MAX = -2 ** 63, 2 ** 63 - 1
INT_MIN, INT_MAX = -2 ** 31, 2 ** 31 - 1
ORDINARY = 100
# Time for 100 ordinary rows and a handful of hostile ones (one or two
# batches; the sanitized build on a shared 2-core machine): generous.
PUBLISH_S = 20
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|[+-]\d{2}:\d{2})$")
# What a log line says when a statement failed on a value: SQLSTATE class 22
# texts, and the relay's own "... failed" lines of the db module.
STATEMENT_FAILED = re.compile(r"out of range|cannot subtract infinite|22003|22008|"
                              r'level=(warn|error) mod=db msg="[^"]*fail')


def hostile(agg, version=1, **cols):
    row = {"aggregate_type": "Hostile", "aggregate_id": agg, "aggregate_version": version,
           "event_type": "E", "payload_json": {"agg": agg, "v": version}}
    row.update(cols)
    return row


class Table:
    """The test's table, with the hostile rows inserted one by one so that
    a CHECK refusing one is seen (and recorded) without losing the others."""

    def __init__(self, db):
        self.db = db
        self.ids = {}       # (aggregate_id, version) -> outbox_id
        self.refused = {}   # (aggregate_id, version) -> (constraint, message)

    def insert(self, rows):
        for r in rows:
            key = (r["aggregate_id"], r["aggregate_version"])
            try:
                (oid,) = self.db.insert_events([r])
                self.ids[key] = oid
            except psycopg2.errors.CheckViolation as e:
                self.refused[key] = (e.diag.constraint_name or "", str(e).strip())

    def row(self, agg, version=1):
        key = (agg, version)
        if key not in self.ids:
            return None
        # timestamps as text: BC and year 10000 have no Python datetime
        (r,) = self.db.execute(
            "SELECT outbox_id::text, status, attempt_count, last_error_code,"
            " last_error_message, (occurred_at AT TIME ZONE 'UTC')::text AS occurred_utc"
            " FROM %s WHERE outbox_id = %%s" % self.db.table, (self.ids[key],))
        return r


def start(db, kafka, tmp_path, ordering="aggregate", **extra):
    port = free_port()
    env = relay_env(db, kafka, OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port,
                    OUTBOX_ORDERING=ordering, OUTBOX_BACKOFF_INITIAL_MS=200,
                    OUTBOX_BACKOFF_MAX_MS=1000, **extra)
    return Relay("outbox-relay", env=env, log_dir=tmp_path), port


def topics(db, kafka):
    names = ["%s.Order" % db.schema, "%s.Hostile" % db.schema]
    for t in names:
        kafka.create_topic(t, 4)
    return names


def ordinary(db):
    return db.insert_events(make_events(aggregates=ORDINARY, id_prefix="ok"))


def wait_ordinary(db, ids, relay):
    """Waits for the ordinary rows; on time-out says how many went and what
    the relay logged about failures."""
    try:
        wait_until(lambda: db.count("outbox_id = ANY(%s::uuid[]) AND status = 'PUBLISHED'",
                                    (ids,)) == len(ids),
                   PUBLISH_S, what="the %d ordinary rows PUBLISHED" % len(ids))
    except AssertionError as e:
        n = db.count("outbox_id = ANY(%s::uuid[]) AND status = 'PUBLISHED'", (ids,))
        warns = [line for line in relay.log_text().splitlines()
                 if "level=warn" in line or "level=error" in line]
        raise AssertionError("%s: %d of %d published; %d warn/error lines, e.g.:\n%s"
                             % (e, n, len(ids), len(warns), "\n".join(warns[:3]))) from None


def wait_settled(db, t, keys):
    """Waits until each row of keys is PUBLISHED or DEAD."""
    def settled():
        left = [k for k in keys if k in t.ids and t.row(*k)["status"] not in
                ("PUBLISHED", "DEAD")]
        return not left or None
    wait_until(settled, PUBLISH_S, what="hostile rows PUBLISHED or DEAD")


def no_statement_errors(relay, port):
    """Nothing the relay ran failed on the table: the log and the metrics."""
    bad = [line for line in relay.log_text().splitlines() if STATEMENT_FAILED.search(line)]
    assert not bad, "statements failed on the table:\n" + "\n".join(bad[:10])
    m = scrape(port)
    assert m.total("outbox_statement_errors_total") == 0, \
        [s for s in m.samples if s[0] == "outbox_statement_errors_total"]


def statements_ok(port):
    r = readyz(port)
    cond = r.condition("statements")
    assert cond is not None and cond.get("ok") is True, r


def outcome_names_column(t, key, column, code=None):
    """The row went DEAD with a message naming `column` (and code), or a
    CHECK refused it at INSERT naming the column."""
    if key in t.refused:
        constraint, message = t.refused[key]
        assert column in constraint or column in message, t.refused[key]
        return "refused"
    r = t.row(*key)
    assert r["status"] == "DEAD", (key, r["status"], r["last_error_code"],
                                   r["last_error_message"])
    assert column in (r["last_error_message"] or ""), (key, r["last_error_message"])
    if code:
        assert r["last_error_code"] == code, (key, r["last_error_code"])
    return "DEAD"


def read_back(kafka, names):
    msgs = read_topics(kafka.bootstrap, topics=names)
    ok, details = check_order(msgs)
    assert ok, details[:10]
    return msgs


def by_event(msgs):
    return {header(m, "event-id"): m for m in msgs}


def parse_rfc3339(text):
    text = text.replace("Z", "+00:00")
    if "." in text:  # Python takes at most 6 fraction digits
        head, rest = text.split(".", 1)
        frac = re.match(r"\d+", rest).group(0)
        text = head + "." + (frac + "000000")[:6] + rest[len(frac):]
    return datetime.datetime.fromisoformat(text)


# ---------------------------------------------------------------- versions

@NEW_CORE
@pytest.mark.parametrize("ordering", ["aggregate", "increasing", "none"])
def test_versions_anywhere_in_bigint(db, kafka, tmp_path, ordering):
    names = topics(db, kafka)
    ok_ids = ordinary(db)
    t = Table(db)
    runs = {"vmin": [BIGINT_MIN],
            "vminrun": [BIGINT_MIN, BIGINT_MIN + 1, BIGINT_MIN + 2],
            "vmaxrun": [BIGINT_MAX - 2, BIGINT_MAX - 1, BIGINT_MAX],
            "vmax": [BIGINT_MAX],
            "vzero": [-1, 0, 1]}
    rows = [hostile(agg, v) for agg, vs in runs.items() for v in vs]
    rows.append(hostile("evmin", 1, event_version=INT_MIN))
    rows.append(hostile("evmax", 1, event_version=INT_MAX))
    # a gap of 2^64 - 2 versions: held under `aggregate` (the rule), sent
    # under the others; either way no arithmetic on it may fail
    rows += [hostile("vgap", BIGINT_MIN), hostile("vgap", BIGINT_MAX)]
    t.insert(rows)
    assert not t.refused, t.refused  # the schema admits every bigint version
    relay, port = start(db, kafka, tmp_path, ordering)
    with relay:
        wait_ordinary(db, ok_ids, relay)
        settle = [(a, v) for a, vs in runs.items() for v in vs] + [("evmin", 1), ("evmax", 1),
                                                                     ("vgap", BIGINT_MIN)]
        if ordering != "aggregate":
            settle.append(("vgap", BIGINT_MAX))
        wait_settled(db, t, settle)
        for k in settle:
            assert t.row(*k)["status"] == "PUBLISHED", (k, t.row(*k))
        if ordering == "aggregate":
            held = t.row("vgap", BIGINT_MAX)
            assert held["status"] == "PENDING", held  # held by its gap, nothing else
        no_statement_errors(relay, port)
        statements_ok(port)
        assert relay.stop() == 0
    msgs = by_event(read_back(kafka, names))
    for (agg, v), oid in t.ids.items():
        if t.row(agg, v)["status"] == "PUBLISHED":
            m = msgs.get(oid)
            assert m is not None, (agg, v)
            assert header(m, "aggregate-version") == str(v), (agg, v, m["headers"])
    assert header(msgs[t.ids[("evmin", 1)]], "event-version") == str(INT_MIN)
    assert header(msgs[t.ids[("evmax", 1)]], "event-version") == str(INT_MAX)


# ---------------------------------------------------------------- attempt counts

@NEW_CORE
@pytest.mark.parametrize("ordering", ["aggregate", "increasing", "none"])
def test_attempt_counts_anywhere_in_int(db, kafka, tmp_path, ordering):
    names = topics(db, kafka)
    ok_ids = ordinary(db)
    t = Table(db)
    rows = [hostile("amax", 1, attempt_count=INT_MAX),
            hostile("amin", 1, attempt_count=INT_MIN),
            hostile("aneg", 1, attempt_count=-1),
            hostile("afailed", 1, attempt_count=INT_MAX, status="FAILED",
                    last_error_code="_MSG_TIMED_OUT", last_error_message="earlier attempt"),
            hostile("arun", 1, attempt_count=INT_MAX), hostile("arun", 2, attempt_count=INT_MAX),
            hostile("arun", 3, attempt_count=INT_MIN)]
    t.insert(rows)
    assert not t.refused, t.refused
    relay, port = start(db, kafka, tmp_path, ordering)
    keys = [(r["aggregate_id"], r["aggregate_version"]) for r in rows]
    with relay:
        wait_ordinary(db, ok_ids, relay)
        wait_settled(db, t, keys)
        for k in keys:
            r = t.row(*k)
            # published, or DEAD because its attempts are used up: a row outcome
            if r["status"] == "DEAD":
                assert "attempt" in (r["last_error_message"] or ""), r
            assert INT_MIN <= r["attempt_count"] <= INT_MAX
        no_statement_errors(relay, port)
        statements_ok(port)
        assert relay.stop() == 0
    read_back(kafka, names)


# ---------------------------------------------------------------- occurred_at

# occurred_at values that have no RFC 3339 form (years 0001-9999, UTC).
BAD_OCCURRED = {
    "oinf": "infinity",
    "oneginf": "-infinity",
    "obc": "0044-03-15 12:00:00+00 BC",
    "o10000": "10000-01-01 00:00:00+00",
    "o9999east": "9999-12-31 23:00:00-05",  # 10000-01-01T04:00:00Z
    "o0001west": "0001-01-01 00:30:00+01",  # 0000-12-31T23:30:00Z, 1 BC
}
# ... and the edges that have one.
GOOD_OCCURRED = {
    "ofirst": "0001-01-01 00:00:00+00",
    "olast": "9999-12-31 23:59:59.999999+00",
}


@NEW_CORE
def test_occurred_at_without_an_rfc3339_form_goes_dead_naming_it(db, kafka, tmp_path):
    names = topics(db, kafka)
    ok_ids = ordinary(db)
    t = Table(db)
    rows = [hostile(agg, 1, occurred_at=v) for agg, v in {**BAD_OCCURRED,
                                                          **GOOD_OCCURRED}.items()]
    # a later version behind a DEAD one waits (G4: its own aggregate only)
    rows.append(hostile("oinf", 2))
    t.insert(rows)
    relay, port = start(db, kafka, tmp_path)
    with relay:
        wait_ordinary(db, ok_ids, relay)
        wait_settled(db, t, [(a, 1) for a in list(BAD_OCCURRED) + list(GOOD_OCCURRED)])
        outcomes, wrong = {}, []
        for a in BAD_OCCURRED:
            try:
                outcomes[a] = outcome_names_column(t, (a, 1), "occurred_at", "INVALID_VALUE")
            except AssertionError as e:
                wrong.append("%s (%s): %s" % (a, BAD_OCCURRED[a], e))
        assert not wrong, "\n".join(wrong)
        for a in GOOD_OCCURRED:
            assert t.row(a)["status"] == "PUBLISHED", t.row(a)
        behind = t.row("oinf", 2)
        assert behind is None or behind["status"] != "PUBLISHED", behind
        no_statement_errors(relay, port)
        statements_ok(port)
        m = scrape(port)
        assert m.has("outbox_publish_latency_seconds_sum"), m.text[:500]
        assert not m.non_finite(), m.non_finite()
        assert math.isfinite(m.value("outbox_publish_latency_seconds_sum"))
        assert relay.stop() == 0
    msgs = read_back(kafka, names)
    headers = [header(m, "occurred-at") for m in msgs]
    assert all(h is not None and RFC3339.match(h) for h in headers), \
        [h for h in headers if not h or not RFC3339.match(h)][:5]
    events = by_event(msgs)
    for a in BAD_OCCURRED:
        if a in outcomes and outcomes[a] == "DEAD":
            assert t.ids[(a, 1)] not in events, a
    for a in GOOD_OCCURRED:
        row = t.row(a)
        m = events[row["outbox_id"]]
        sent = parse_rfc3339(header(m, "occurred-at"))
        stored = datetime.datetime.fromisoformat(row["occurred_utc"]).replace(
            tzinfo=datetime.timezone.utc)
        assert sent == stored, (a, header(m, "occurred-at"), row["occurred_utc"])
        envelope = json.loads(m["value"])
        assert envelope["occurred_at"] == header(m, "occurred-at"), envelope


# ---------------------------------------------------------------- other timestamps

@NEW_CORE
def test_other_timestamps_at_infinity_stop_no_statement(db, kafka, tmp_path):
    """created_at, updated_at, available_at, locked_at, last_attempt_at at
    the ends of timestamptz: the table sample, the gap scan, the ages
    (outbox_oldest_pending_age_seconds) and the lock order must not fail on
    them; the rows themselves are ordinary and go out."""
    names = topics(db, kafka)
    ok_ids = ordinary(db)
    t = Table(db)
    rows = [hostile("cneginf", 1, created_at="-infinity"),
            hostile("cinf", 1, created_at="infinity"),
            hostile("cbc", 1, created_at="0044-03-15 BC"),
            hostile("uinf", 1, updated_at="infinity"),
            hostile("aneginf", 1, available_at="-infinity"),
            hostile("abc", 1, available_at="0044-03-15 BC"),
            hostile("linf", 1, locked_at="infinity", last_attempt_at="-infinity"),
            # an aggregate held by a gap, so that the gap scan reads it
            hostile("gapneg", 1, created_at="-infinity"),
            hostile("gapneg", 3, created_at="-infinity")]
    t.insert(rows)
    assert not t.refused, t.refused
    relay, port = start(db, kafka, tmp_path)
    keys = [(r["aggregate_id"], r["aggregate_version"]) for r in rows
            if r["aggregate_version"] == 1]
    with relay:
        wait_ordinary(db, ok_ids, relay)
        wait_settled(db, t, keys)
        for k in keys:
            assert t.row(*k)["status"] == "PUBLISHED", t.row(*k)
        # the relay samples the table at start and every 10 s: let one more
        # sample and gap scan run over the remaining rows
        wait_until(lambda: scrape(port).has("outbox_oldest_pending_age_seconds"), 15,
                   what="a table sample")
        m = scrape(port)
        assert not m.non_finite(), m.non_finite()
        no_statement_errors(relay, port)
        statements_ok(port)
        assert relay.stop() == 0
    read_back(kafka, names)


# ---------------------------------------------------------------- sizes

def test_values_too_large_for_kafka_go_dead(db, kafka, tmp_path):
    """A key or a header larger than the producer's message.max.bytes
    (librdkafka's default 1000000): the row is DEAD (MSG_SIZE_TOO_LARGE or
    INVALID_HEADERS), the others go out."""
    names = topics(db, kafka)
    ok_ids = ordinary(db)
    db.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
               " payload_json, partition_key) VALUES ('Hostile', 'bigkey', 1, 'E', '{}',"
               " repeat('k', 2000000))" % db.table)
    db.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
               " payload_json, headers_json) VALUES ('Hostile', 'bighdr', 1, 'E', '{}',"
               " jsonb_build_object('h', repeat('h', 2000000)))" % db.table)
    relay, port = start(db, kafka, tmp_path)
    with relay:
        wait_ordinary(db, ok_ids, relay)
        wait_until(lambda: db.count("aggregate_type = 'Hostile' AND status = 'DEAD'") == 2,
                   PUBLISH_S, what="both oversized rows DEAD")
        for r in db.rows(where="aggregate_type = 'Hostile'"):
            assert r["last_error_code"] in ("MSG_SIZE_TOO_LARGE", "INVALID_HEADERS"), r
        assert relay.stop() == 0
    msgs = read_back(kafka, names)
    assert len(by_event(msgs)) == ORDINARY
