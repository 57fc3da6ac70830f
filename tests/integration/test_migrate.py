"""outboxctl migrate (docs/DESIGN.md, "outboxctl migrate"): the migrations
built into the program create the table on a fresh schema, a second run
applies nothing, two runs at once serialise on the advisory lock, a database
that records a newer migration is refused, a table of another name is bad
configuration; and the migration files themselves print no NOTICE, neither on
a fresh schema nor applied a second time.

Each test works on a schema of its own, made empty (no migrations applied)."""
import glob
import json
import os
import secrets
import subprocess
import threading

import psycopg2
import pytest

from harness import TestSchema, bin_path, repo_root

OUTBOXCTL = bin_path("outboxctl")


@pytest.fixture
def schema(pg):
    name = "m_%s" % secrets.token_hex(4)
    conn = pg.connect()
    with conn.cursor() as cur:
        cur.execute("CREATE SCHEMA %s" % name)
    yield name
    with conn.cursor() as cur:
        cur.execute("DROP SCHEMA %s CASCADE" % name)
    conn.close()


def migrate(pg, table, *args, expect=0, url=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env = {**base, "OUTBOX_DATABASE_URL": url or pg.url, "OUTBOX_TABLE": table}
    r = subprocess.run([OUTBOXCTL, "migrate", *args], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    assert expect is None or r.returncode == expect, (args, r.returncode, r.stdout, r.stderr)
    return r


def files():
    return sorted(glob.glob(os.path.join(repo_root(), "schemas", "postgres", "*.sql")))


def names():
    return [os.path.basename(f)[:-4] for f in files()]


def recorded(pg, schema):
    conn = pg.connect()
    with conn.cursor() as cur:
        cur.execute("SELECT version, name FROM %s.outbox_schema_migrations ORDER BY version"
                    % schema)
        rows = cur.fetchall()
    conn.close()
    return rows


def columns(pg, schema):
    conn = pg.connect()
    with conn.cursor() as cur:
        cur.execute("SELECT column_name FROM information_schema.columns WHERE table_schema = %s"
                    " AND table_name = 'outbox_event' ORDER BY ordinal_position", (schema,))
        cols = [c for (c,) in cur.fetchall()]
    conn.close()
    return cols


def test_fresh_schema_then_nothing_to_apply(pg, schema):
    table = "%s.outbox_event" % schema
    # --dry-run lists every migration and changes nothing
    r = migrate(pg, table, "--dry-run")
    assert ["would apply %s" % n for n in names()] == r.stdout.splitlines()[:-1], r.stdout
    assert "level 0 (no table)" in r.stdout
    assert columns(pg, schema) == []
    r = migrate(pg, table)
    assert ["applied %s" % n for n in names()] == r.stdout.splitlines()[:-1], r.stdout
    known = int(names()[-1].split("_")[0])
    assert r.stdout.splitlines()[-1] == "schema %s: level %d" % (schema, known)
    assert [v for v, _ in recorded(pg, schema)] == [int(n.split("_")[0]) for n in names()]
    assert "txid" in columns(pg, schema) and "published_at" in columns(pg, schema)
    # the server said nothing while migrating a fresh schema (no NOTICE logged)
    assert "server message" not in r.stderr, r.stderr
    # idempotent: the second run applies nothing and says so
    r = migrate(pg, table)
    assert r.stdout == "schema %s: level %d (nothing to apply)\n" % (schema, known), r.stdout
    out = json.loads(migrate(pg, table, "--json").stdout)
    assert out == {"schema": schema, "table": "outbox_event", "dry_run": False,
                   "level_before": known, "level": known, "known_level": known,
                   "migrations": []}, out
    # the table works: the other commands resolve it
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    s = subprocess.run([OUTBOXCTL, "stats", "--json"], stdout=subprocess.PIPE, text=True,
                       env={**base, "OUTBOX_DATABASE_URL": pg.url, "OUTBOX_TABLE": table})
    assert json.loads(s.stdout)["counts"]["PENDING"] == 0


def test_table_applied_by_hand_is_recorded(pg, schema):
    """A table the files created before migrate existed: every migration is
    applied again (they are safe twice) and recorded."""
    conn = pg.connect()
    with conn.cursor() as cur:
        cur.execute("SET search_path TO %s" % schema)
        for f in files():
            cur.execute(open(f, encoding="utf-8").read())
        cur.execute("INSERT INTO outbox_event (aggregate_type, aggregate_id, aggregate_version,"
                    " event_type) VALUES ('Order', 'kept', 1, 'E')")
    conn.close()
    r = migrate(pg, "%s.outbox_event" % schema, "--dry-run")
    assert "(no migrations recorded; the table exists)" in r.stdout, r.stdout
    migrate(pg, "%s.outbox_event" % schema)
    assert len(recorded(pg, schema)) == len(names())
    conn = pg.connect()
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM %s.outbox_event" % schema)
        assert cur.fetchone()[0] == 1
    conn.close()


def test_unqualified_table_goes_where_search_path_says(pg, schema):
    url = pg.url + ("&" if "?" in pg.url else "?") + "options=-csearch_path%3D" + schema
    r = migrate(pg, "outbox_event", url=url)
    assert r.stdout.splitlines()[-1].startswith("schema %s: level" % schema), r.stdout
    assert "txid" in columns(pg, schema)


def test_two_at_once_serialise(pg, schema):
    """Two Jobs at once: one applies everything, the other waits for the
    advisory lock, then finds nothing to apply; each migration is recorded
    once."""
    table = "%s.outbox_event" % schema
    # hold the lock from a session of our own, so both runs must wait for it
    holder = pg.connect()
    with holder.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(8031453476610927975)")
    results = []

    def run():
        results.append(migrate(pg, table, "--json"))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    conn = pg.connect()
    try:
        # both wait on the advisory lock
        from harness import wait_until

        def waiting():
            with conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                            " AND NOT granted")
                return cur.fetchone()[0] == 2
        wait_until(waiting, 30, what="two migrates waiting for the advisory lock")
        assert columns(pg, schema) == []
    finally:
        with holder.cursor() as cur:
            cur.execute("SELECT pg_advisory_unlock(8031453476610927975)")
        holder.close()
        conn.close()
    for t in threads:
        t.join()
    outs = sorted((json.loads(r.stdout) for r in results), key=lambda o: len(o["migrations"]))
    assert outs[0]["migrations"] == [] and outs[1]["migrations"] == names(), outs
    assert any("waiting" in r.stderr for r in results)
    assert [n for _, n in recorded(pg, schema)] == names()


def test_a_migration_that_times_out_on_the_table_lock_is_tried_again(pg, schema):
    """007 builds its indexes under a 5 s lock_timeout, so that the
    application's inserts never queue behind it for long; a relay's
    statement may hold the table longer (up to its statement timeout).
    migrate tries such a migration again, naming the sessions that hold the
    table, and it applies once the table is free, instead of failing the
    hook Job."""
    from harness import wait_until
    table = "%s.outbox_event" % schema
    migrate(pg, table)
    conn = pg.connect()
    holder = pg.connect()
    holder.autocommit = False
    with conn.cursor() as cur:
        cur.execute("DROP INDEX %s.outbox_event_agg_published_idx" % schema)
        cur.execute("DELETE FROM %s.outbox_schema_migrations WHERE version = 7" % schema)
    with holder.cursor() as cur:  # as a relay's UPDATE holds it
        cur.execute("SET application_name = 'dba-holding'")
        cur.execute("SELECT pg_backend_pid()")
        holder_pid = cur.fetchone()[0]
        cur.execute("LOCK TABLE %s IN ROW EXCLUSIVE MODE" % table)

    def waiting():
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_locks WHERE relation = %s::regclass"
                        " AND NOT granted", (table,))
            return cur.fetchone()[0] > 0
    results = []
    t = threading.Thread(target=lambda: results.append(migrate(pg, table, expect=None)))
    t.start()
    try:
        wait_until(waiting, 30, what="migrate waiting for the table's lock")
        wait_until(lambda: not waiting(), 30, what="its lock_timeout")
        wait_until(waiting, 30, what="migrate waiting for the lock again")
    finally:
        holder.commit()
        holder.close()
        t.join()
    with conn.cursor() as cur:
        cur.execute("SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid ="
                    " to_regclass(%s)", ("%s.outbox_event_agg_published_idx" % schema,))
        valid = cur.fetchall()
    conn.close()
    r = results[0]
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert "applied 007_guard_split" in r.stdout, r.stdout
    retries = [ln for ln in r.stderr.splitlines() if "lock wait timed out, retrying" in ln]
    assert retries and "migration=007_guard_split try=2 of=" in retries[0], r.stderr
    # the line names who holds the table: the session to look at, or wait for
    assert "pid=%d application=dba-holding state=idle in transaction" % holder_pid \
        in retries[0], retries[0]
    assert valid == [(True,)], valid
    assert [v for v, _ in recorded(pg, schema)][-1] == 7


def test_newer_database_is_refused(pg, schema):
    table = "%s.outbox_event" % schema
    migrate(pg, table)
    known = int(names()[-1].split("_")[0])
    conn = pg.connect()
    with conn.cursor() as cur:
        cur.execute("INSERT INTO %s.outbox_schema_migrations (version, name) VALUES (%d,"
                    " 'from_a_newer_release')" % (schema, known + 1))
    conn.close()
    for args in ((), ("--dry-run",)):
        r = migrate(pg, table, *args, expect=1)
        assert r.stdout == "", r.stdout
        assert "newer schema than this program knows" in r.stderr, r.stderr
        assert "level=%d known_level=%d" % (known + 1, known) in r.stderr


@pytest.mark.parametrize("table", ["orders_outbox", "public.orders_outbox"])
def test_other_table_name_is_bad_configuration(pg, table):
    r = migrate(pg, table, expect=2)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "OUTBOX_TABLE" in lines[0], lines


def test_missing_schema_is_a_runtime_error(pg):
    r = migrate(pg, "no_such_schema_%s.outbox_event" % secrets.token_hex(3), expect=1)
    assert "does not exist" in r.stderr, r.stderr


def test_migration_files_print_no_notice(pg, schema):
    """Every file, applied on a fresh schema and then again, with the client
    asking for NOTICEs: the server sends none."""
    conn = psycopg2.connect(pg.url, options="-c client_min_messages=notice")
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SET search_path TO %s" % schema)
            for run in ("fresh", "again"):
                for f in files():
                    del conn.notices[:]
                    cur.execute(open(f, encoding="utf-8").read())
                    assert conn.notices == [], (run, os.path.basename(f), conn.notices)
        assert "txid" in columns(pg, schema)
    finally:
        conn.close()


def test_harness_schema_matches_migrate(pg, schema):
    """What migrate builds is what the tests' TestSchema (the files, applied in
    order) builds: the same columns, indexes and constraints."""
    migrate(pg, "%s.outbox_event" % schema)
    with TestSchema(pg, "cmp") as other:
        conn = pg.connect()
        with conn.cursor() as cur:
            def shape(s):
                cur.execute("SELECT pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid ="
                            " %s::regclass ORDER BY 1", ("%s.outbox_event" % s,))
                idx = [d.replace(s + ".", "") for (d,) in cur.fetchall()]
                cur.execute("SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint"
                            " WHERE conrelid = %s::regclass ORDER BY 1", ("%s.outbox_event" % s,))
                return idx, cur.fetchall()
            assert shape(schema) == shape(other.schema)
        conn.close()
        assert columns(pg, schema) == columns(pg, other.schema)
