"""What a running daemon makes visible, and the servers' side of a stall,
for the tests of docs/DESIGN.md "Observability" and of hostile input:

    readyz(port)            -> Ready (status, body dict, condition(name))
    scrape(port)            -> Metrics (value(name, **labels), total(name, **labels))
    log_records(text)       -> [dict] of logfmt text lines (OUTBOX_LOG_FORMAT=text)
    vm_hwm_kib(pid)         -> a process's peak resident set (VmHWM)
    release_binary(name)    -> the Release build's program when there is one
    OtherDatabase(pg, name) -> a database of its own on the same server
    backend_pids(conn, ...) -> pids of sessions from pg_stat_activity
    NEW_CORE                -> pytest mark of tests that need the relay core of
                               docs/DESIGN.md's new observable interface

Import after tests/support is on sys.path (the conftests put it there).
"""
import json
import math
import os
import re
import secrets
import urllib.error
import urllib.parse
import urllib.request

import pytest

from harness import bin_path, build_dir, repo_root

# Tests that need the relay core with the observable interface of
# docs/DESIGN.md (readiness conditions, statement errors, session settings,
# test hooks such as OUTBOX_TEST_MARK_DELAY_MS): `pytest -m new_core`.
NEW_CORE = pytest.mark.new_core


def register_markers(config):
    """Called from the conftests' pytest_configure."""
    config.addinivalue_line(
        "markers", "new_core: needs the relay core of docs/DESIGN.md's observable "
                   "interface (/readyz conditions, statement backoff, session settings)")


# ---------------------------------------------------------------- /readyz

class Ready:
    """One /readyz answer: status (None when nothing answered), body (the
    parsed JSON object, or None when the body is not JSON), text."""

    def __init__(self, status, text):
        self.status = status
        self.text = text
        try:
            self.body = json.loads(text) if text else None
        except ValueError:
            self.body = None
        if not isinstance(self.body, dict):
            self.body = None

    def condition(self, name):
        """{"ok": bool, "reason": str, ...} of condition `name`, or None."""
        if not self.body:
            return None
        return (self.body.get("conditions") or {}).get(name)

    def failing(self):
        """Names of the conditions whose ok is false."""
        if not self.body:
            return []
        return sorted(k for k, v in (self.body.get("conditions") or {}).items()
                      if isinstance(v, dict) and v.get("ok") is False)

    def __repr__(self):
        return "Ready(%s, %s)" % (self.status, self.text[:400] if self.text else self.text)


def readyz(port, path="/readyz"):
    """GET /readyz (or path) on 127.0.0.1:port."""
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=3) as r:
            return Ready(r.status, r.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as e:
        return Ready(e.code, e.read().decode("utf-8", "replace"))
    except OSError:
        return Ready(None, None)


# ---------------------------------------------------------------- /metrics

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Metrics:
    """A /metrics page: samples as (name, {labels}, value)."""

    def __init__(self, text):
        self.text = text or ""
        self.samples = []
        for line in self.text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            if not m:
                continue
            labels = dict(_LABEL.findall(m.group(2) or ""))
            try:
                value = float(m.group(3))
            except ValueError:
                value = float("nan")
            self.samples.append((m.group(1), labels, value))

    def values(self, name, **labels):
        return [v for n, l, v in self.samples
                if n == name and all(l.get(k) == str(x) for k, x in labels.items())]

    def value(self, name, **labels):
        """The one sample's value (None when absent; the first when several)."""
        vs = self.values(name, **labels)
        return vs[0] if vs else None

    def total(self, name, **labels):
        """Sum over the matching samples (0 when none)."""
        return sum(self.values(name, **labels))

    def has(self, name):
        return any(n == name for n, _, _ in self.samples)

    def non_finite(self):
        """Samples whose value is NaN or infinite (a +Inf bucket label is fine)."""
        return [(n, l, v) for n, l, v in self.samples if not math.isfinite(v)]


def scrape(port):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=3) as r:
            return Metrics(r.read().decode("utf-8", "replace"))
    except OSError:
        return Metrics("")


# ---------------------------------------------------------------- logs

_FIELD = re.compile(r'([A-Za-z_][A-Za-z0-9_.]*)=("(?:[^"\\]|\\.)*"|\S*)')


def _unquote(v):
    if len(v) >= 2 and v[0] == '"' and v[-1] == '"':
        try:
            return json.loads(v)
        except ValueError:
            return v[1:-1]
    return v


def log_records(text):
    """The logfmt lines of `text` (OUTBOX_LOG_FORMAT=text) as dicts of their
    fields (ts, level, mod, msg, ...), in order; other lines are skipped."""
    out = []
    for line in (text or "").splitlines():
        if not line.startswith("ts="):
            continue
        rec = {k: _unquote(v) for k, v in _FIELD.findall(line)}
        rec["_line"] = line
        out.append(rec)
    return out


def warn_records(text):
    return [r for r in log_records(text) if r.get("level") in ("warn", "error")]


# ---------------------------------------------------------------- processes

def vm_hwm_kib(pid):
    """Peak resident set size of a running process (VmHWM, KiB)."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/%d/status" % pid)


def release_binary(name):
    """The program from the Release build (<repo>/build) when it exists, else
    from $OUTBOX_BUILD_DIR: for measurements of the program itself (memory,
    latency), which a sanitizer build would distort (shadow memory, the
    freed-memory quarantine). Returns (path, "release" | "sanitized or other")."""
    rel = os.path.join(repo_root(), "build")
    p = bin_path(name)
    candidate = os.path.join(rel, os.path.relpath(p, build_dir()))
    if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        return candidate, "release"
    return p, "the build in %s" % build_dir()


# ---------------------------------------------------------------- databases

def with_database(url, dbname, user=None):
    """`url` (postgresql://user:pw@host:port/db?...) with another database
    (and user)."""
    u = urllib.parse.urlsplit(url)
    netloc = u.netloc
    if user is not None:
        host = netloc.rsplit("@", 1)[-1]
        netloc = "%s@%s" % (urllib.parse.quote(user, safe=""), host)
    return urllib.parse.urlunsplit((u.scheme, netloc, "/" + dbname, u.query, u.fragment))


class OtherDatabase:
    """A database of its own on the test server (CREATE DATABASE), dropped
    (WITH (FORCE)) on exit. .name, .url, .connect(**kw) (autocommit)."""

    def __init__(self, pg, prefix="d"):
        import psycopg2
        self._psycopg2 = psycopg2
        self.pg = pg
        self.name = "%s_%s" % (prefix, secrets.token_hex(4))
        c = pg.connect()
        try:
            with c.cursor() as cur:
                cur.execute("CREATE DATABASE %s" % self.name)
        finally:
            c.close()
        self.url = with_database(pg.url, self.name)

    def connect(self, **kw):
        conn = self._psycopg2.connect(self.url, **kw)
        conn.autocommit = True
        return conn

    def drop(self):
        if self.name:
            c = self.pg.connect()
            try:
                with c.cursor() as cur:
                    cur.execute("DROP DATABASE IF EXISTS %s WITH (FORCE)" % self.name)
            finally:
                c.close()
            self.name = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.drop()


def backend_pids(conn, application_name_like=None, where="TRUE"):
    """pids of client backends (of every database) matching the filters."""
    sql = ("SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend'"
           " AND pid <> pg_backend_pid() AND (%s)" % where)
    params = ()
    if application_name_like is not None:
        sql += " AND application_name LIKE %s"
        params = (application_name_like,)
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return [r[0] for r in cur.fetchall()]


def migrations_sql():
    """[(file name, text)] of schemas/postgres/*.sql in order (to set up a
    schema by hand)."""
    d = os.path.join(repo_root(), "schemas", "postgres")
    out = []
    for name in sorted(os.listdir(d)):
        if name.endswith(".sql"):
            with open(os.path.join(d, name), encoding="utf-8") as f:
                out.append((name, f.read()))
    return out


@pytest.fixture
def report(request, capsys):
    """report(fmt, *args): prints a line of what the test checked, visible in
    the pytest/ctest output even when the test passes (the fault suite's
    conftest has its own, the same)."""
    name = request.node.name

    def out(fmt, *args):
        line = "[%s] %s" % (name, fmt % args if args else fmt)
        with capsys.disabled():
            import sys
            sys.stdout.write("\n" + line)
            sys.stdout.flush()
    return out
