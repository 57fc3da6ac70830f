"""outboxctl's table commands with --json (docs/DESIGN.md, "outboxctl"): one
JSON object per invocation with the documented keys, numbers as numbers,
timestamps RFC 3339 in UTC; gaps print one missing version as `2` and a range
as `2-5`; requeue --dry-run lists what it would move and the parked versions
it would free, and changes nothing. No Kafka needed."""
import json
import os
import re
import subprocess

from harness import bin_path

OUTBOXCTL = bin_path("outboxctl")
RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


def ctl(db, *args, expect=0):
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env = {**base, "OUTBOX_DATABASE_URL": db.pg.url, "OUTBOX_TABLE": db.table}
    r = subprocess.run([OUTBOXCTL, *map(str, args)], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=60)
    assert r.returncode == expect, (args, r.returncode, r.stdout, r.stderr)
    return r


def js(db, *args, expect=0):
    out = ctl(db, *args, "--json", expect=expect).stdout
    assert out.count("\n") == 1 and out.endswith("}\n"), "one object, one line: %r" % out
    return json.loads(out)


def row(agg, v, **kw):
    r = {"aggregate_type": "Order", "aggregate_id": agg, "aggregate_version": v,
         "event_type": "E"}
    r.update(kw)
    return r


def seed(db):
    """d/1 published, d/2 DEAD, d/3-4 parked behind it; g: 1, 3 (gap of 2);
    h: 1, 6 (gap of 2-5); p/1 PENDING."""
    db.insert_events([row("d", v) for v in (1, 2, 3, 4)] + [row("g", 1), row("g", 3),
                                                            row("h", 1), row("h", 6),
                                                            row("p", 1)])
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now()"
               " WHERE aggregate_version = 1 AND aggregate_id <> 'p'" % db.table)
    db.execute("UPDATE %s SET status = 'DEAD', available_at = 'infinity', attempt_count = 3,"
               " last_error_code = 'INVALID_HEADERS', last_error_message = 'headers_json \"x\"'"
               " WHERE aggregate_id = 'd' AND aggregate_version = 2" % db.table)
    db.execute("UPDATE %s SET available_at = 'infinity', last_error_code = 'BLOCKED'"
               " WHERE aggregate_id = 'd' AND aggregate_version > 2" % db.table)


def test_stats_json(db):
    out = js(db, "stats")
    assert out == {"counts": {"PENDING": 0, "PUBLISHING": 0, "PUBLISHED": 0, "FAILED": 0,
                              "DEAD": 0},
                   "oldest_due_age_s": None, "oldest_due_created_at": None}, out
    seed(db)
    out = js(db, "stats")
    assert out["counts"] == {"PENDING": 5, "PUBLISHING": 0, "PUBLISHED": 3, "FAILED": 0,
                             "DEAD": 1}, out
    assert isinstance(out["oldest_due_age_s"], int) and out["oldest_due_age_s"] >= 0, out
    assert RFC3339.fullmatch(out["oldest_due_created_at"]), out


def test_dead_json(db):
    seed(db)
    out = js(db, "dead")
    assert out["limit"] == 100 and out["truncated"] is False, out
    (d,) = out["dead"]
    assert {k: d[k] for k in ("tenant_id", "aggregate_type", "aggregate_id",
                              "aggregate_version", "attempt_count", "last_error_code",
                              "last_error_message")} == {
        "tenant_id": "default", "aggregate_type": "Order", "aggregate_id": "d",
        "aggregate_version": 2, "attempt_count": 3, "last_error_code": "INVALID_HEADERS",
        "last_error_message": 'headers_json "x"'}, d
    assert RFC3339.fullmatch(d["updated_at"]) and RFC3339.fullmatch(d["created_at"]), d
    assert js(db, "dead", "--limit", "0") == {"dead": [], "limit": 0, "truncated": True}
    # the table has the same times
    text = ctl(db, "dead").stdout
    assert "Order/d" in text and RFC3339.search(text), text


def test_gaps_one_version_and_a_range(db):
    seed(db)
    text = ctl(db, "gaps").stdout
    missing = {line.split("|")[1].strip(): line.split("|")[3].strip()
               for line in text.splitlines() if "Order/" in line}
    assert missing == {"Order/g": "2", "Order/h": "2-5"}, text
    out = js(db, "gaps")
    got = {g["aggregate_id"]: (g["held_version"], g["missing_from"], g["missing_to"])
           for g in out["gaps"]}
    assert got == {"g": (3, 2, 2), "h": (6, 2, 5)}, out
    assert all(RFC3339.fullmatch(g["held_since"]) and isinstance(g["held_for_s"], int)
               for g in out["gaps"]), out
    assert js(db, "gaps", "--limit", "1")["truncated"] is True


def test_requeue_dry_run_changes_nothing(db):
    seed(db)
    before = db.rows()
    text = ctl(db, "requeue", "--aggregate", "Order/d", "--dry-run").stdout
    assert text.startswith("would requeue 1 row(s), 2 parked version(s) due again"), text
    assert "INVALID_HEADERS" in text and re.search(r"\| +2 \| +3 \| +4\s*$", text, re.M), text
    out = js(db, "requeue", "--all-dead", "--code", "INVALID_HEADERS", "--dry-run")
    assert out["dry_run"] is True and out["requeued"] == 1 and out["freed"] == 2, out
    assert [r["aggregate_version"] for r in out["rows"]] == [2], out
    assert out["freed_aggregates"] == [{"tenant_id": "default", "aggregate_type": "Order",
                                        "aggregate_id": "d", "parked": 2, "from_version": 3,
                                        "to_version": 4}], out
    assert out["rows_truncated"] is False and out["freed_aggregates_truncated"] is False
    out = js(db, "requeue", "--all-dead", "--dry-run", "--limit", "0")
    assert out["rows"] == [] and out["rows_truncated"] is True and out["requeued"] == 1, out
    out = js(db, "requeue", "--id", "6f1c0000-0000-0000-0000-000000000000", "--dry-run")
    assert out["requeued"] == 0 and out["freed"] == 0 and out["rows"] == [], out
    assert db.rows() == before, "a dry run changed the table"
    # the real requeue does what the dry run said
    out = js(db, "requeue", "--aggregate", "Order/d")
    assert out == {"dry_run": False, "requeued": 1, "freed": 2}, out
    assert db.count("aggregate_id = 'd' AND status = 'PENDING' AND available_at <= now()") == 3


def test_release_gap_json(db):
    seed(db)
    out = js(db, "release-gap", "--aggregate", "Order/g")
    assert out == {"released": True, "tenant_id": "default", "aggregate_type": "Order",
                   "aggregate_id": "g", "missing_from": 2, "missing_to": 2}, out
    assert "released 2-5:" in ctl(db, "release-gap", "--aggregate", "Order/h").stdout
    out = js(db, "release-gap", "--aggregate", "Order/g", expect=1)
    assert out["released"] is False, out


def test_replay_json_published_at_is_rfc3339(db):
    seed(db)
    out = js(db, "replay", "--since", "1h", "--dry-run", "--examples", "5")
    assert out["dry_run"] is True and out["moved"] == 3 and out["aggregates"] == 3, out
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", out["since"]), out
    assert out["topics"] == [], out
    assert out["unpublished"]["DEAD"] == 1 and out["refused"] == 0, out
    assert all(RFC3339.fullmatch(e["published_at"]) for e in out["examples"]), out
    assert db.count("status = 'PUBLISHED'") == 3
