"""A PostgreSQL server older than the oldest supported major (deploy/versions'
PG_MIN_MAJOR; docs/DESIGN.md, "Supported versions") is refused right after
connecting: the relay, the sweeper (loop and --once) and outboxctl exit 2 with
one error line naming the server's version and the minimum, and touch nothing.

Server: one of this module's own, of the major just below the minimum
(deploy/local/pg with PG_MAJOR; Maven Central's binaries, fetched once)."""
import os
import re

import pytest

from harness import Postgres, Relay, repo_root


def pinned():
    """deploy/versions as a dict."""
    out = {}
    with open(os.path.join(repo_root(), "deploy", "versions"), encoding="utf-8") as f:
        for line in f:
            m = re.match(r'^([A-Z0-9_]+)="?([^"\n]*)"?$', line)
            if m:
                out[m.group(1)] = m.group(2)
    return out


MIN_MAJOR = int(pinned()["PG_MIN_MAJOR"])


@pytest.fixture(scope="module")
def old_pg():
    with Postgres(settings={"PG_MAJOR": str(MIN_MAJOR - 1)}) as p:
        yield p


def test_older_server_refused_with_exit_2_naming_its_version(old_pg, kafka, tmp_path):
    with old_pg.connect() as conn:
        v = conn.server_version  # e.g. 130023
    conn.close()
    assert v // 10000 == MIN_MAJOR - 1, v
    version = "%d.%d" % (v // 10000, v % 10000)
    env = {"OUTBOX_DATABASE_URL": old_pg.url, "OUTBOX_TABLE": "outbox_event",
           "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap, "OUTBOX_HTTP_ADDR": "off",
           "OUTBOX_LOG_FORMAT": "text"}
    for prog, args in (("outbox-relay", ()), ("outbox-sweeper", ()),
                       ("outbox-sweeper", ("--once",)), ("outboxctl", ("stats",))):
        name = "%s%s" % (prog, "".join(a.replace("-", "_") for a in args))
        p = Relay(prog, env=env, args=args, log_dir=tmp_path, name=name)
        code = p.wait(30)
        log = p.log_text()
        errors = [ln for ln in log.splitlines() if "level=error" in ln]
        assert code == 2, (prog, args, code, log)
        assert len(errors) == 1, (prog, args, log)
        assert re.search(r"PostgreSQL server %s: %d or newer needed" % (re.escape(version),
                                                                         MIN_MAJOR),
                         errors[0]), errors[0]
    # Nothing was created or changed on the server.
    with old_pg.connect() as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_class WHERE relname LIKE 'outbox%'")
        assert cur.fetchone()[0] == 0
    conn.close()
