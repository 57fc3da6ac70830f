"""OUTBOX_DATABASE_URL as libpq reads it, in the relay, the sweeper and
outboxctl: every form libpq accepts connects and is logged without its
password; what libpq refuses exits 2 at once with one line naming the
variable, without the password, instead of being retried forever.

The test server trusts every local connection, so the passwords below are
markers that must never show, not credentials that are checked."""
import os
import subprocess
import urllib.parse

import pytest

from conftest import relay_env
from harness import Relay, bin_path

OUTBOXCTL = bin_path("outboxctl")


def forms(pg_url, tmp_path):
    """(name, connection string) for every form libpq accepts, on the test server."""
    u = urllib.parse.urlsplit(pg_url)
    host, port, db, user = u.hostname, u.port, u.path.lstrip("/"), u.username
    passfile = tmp_path / "pgpass"
    passfile.write_text("%s:%d:%s:%s:SECRET-passfile\n" % (host, port, db, user))
    os.chmod(passfile, 0o600)
    kw = "host=%s port=%d dbname=%s user=%s" % (host, port, db, user)
    return [
        ("uri", "postgresql://%s:SECRET-uri@%s:%d/%s?application_name=x&sslmode=disable"
         % (user, host, port, db)),
        ("uri-escaped", "postgres://%s:SECRET%%20%%27esc@%s:%d/%s" % (user, host, port, db)),
        ("uri-query", "postgresql:///%s?host=%s&port=%d&user=%s&password=SECRET-query"
         % (db, host, port, user)),
        ("keyword", kw + " password=SECRET-kw"),
        ("newlines-tabs", "host=%s\n\tport=%d\ndbname=%s\r\nuser=%s\npassword=SECRET-nl\n"
         % (host, port, db, user)),
        ("quoted", kw + " password = 'SECRET quoted \\'x\\' \\\\ y' application_name='a b'"),
        ("password-twice", "password=SECRET-first " + kw + " password=SECRET-second"),
        ("passfile", kw + " passfile=%s" % passfile),
    ]


BAD = [
    "postgresql://outbox:SECRET@[::1:5432/outbox",
    "postgresql://outbox:SECRET@127.0.0.1:5432/outbox?sslmode=bogus",
    "postgresql://outbox:SECRET@127.0.0.1:5432/outbox?foo=bar",
    "host=127.0.0.1 password=SECRET port=notaport",
    "host=127.0.0.1\npassword='SECRET\nport=5432",
]


def ctl(env, *args):
    return subprocess.run([OUTBOXCTL, *args], env={**os.environ, **env}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=30)


def test_every_form_libpq_accepts_connects_without_showing_the_password(db, kafka, tmp_path):
    for name, url in forms(db.pg.url, tmp_path):
        env = relay_env(db, kafka, OUTBOX_DATABASE_URL=url)
        with Relay("outbox-relay", env=env, log_dir=tmp_path, name="relay-" + name) as relay:
            relay.wait_log(r'msg="connected"', 20)
            assert relay.stop() == 0
        sweeper = Relay("outbox-sweeper", args=["--once"], log_dir=tmp_path,
                        name="sweeper-" + name,
                        env={**db.env(), "OUTBOX_DATABASE_URL": url, "OUTBOX_HTTP_ADDR": "off",
                             "OUTBOX_LOG_FORMAT": "text"})
        assert sweeper.wait(30) == 0, (name, sweeper.log_text())
        r = ctl({"OUTBOX_DATABASE_URL": url, "OUTBOX_TABLE": db.table}, "stats")
        assert r.returncode == 0, (name, r.stdout, r.stderr)
        assert "PENDING" in r.stdout
        for proc in (relay, sweeper):
            log = proc.log_text()
            assert "SECRET" not in log, (name, log)
            assert "cannot connect" not in log, (name, log)
            start = [ln for ln in log.splitlines() if 'msg="starting"' in ln]
            assert len(start) == 1, (name, log)
            # the redacted form is libpq's parse: host and port as the server's
            assert "host=127.0.0.1" in start[0] and "port=" in start[0], start[0]
            if name != "passfile":
                assert "password=****" in start[0], start[0]
        assert "SECRET" not in r.stdout + r.stderr


@pytest.mark.parametrize("url", BAD)
def test_what_libpq_refuses_exits_2_naming_the_variable(db, kafka, tmp_path, url):
    runs = [Relay("outbox-relay", env=relay_env(db, kafka, OUTBOX_DATABASE_URL=url),
                  log_dir=tmp_path, name="relay"),
            Relay("outbox-sweeper", log_dir=tmp_path, name="sweeper",
                  env={**db.env(), "OUTBOX_DATABASE_URL": url, "OUTBOX_HTTP_ADDR": "off"})]
    for proc in runs:
        assert proc.wait(10) == 2, proc.log_text()
        lines = proc.log_text().splitlines()
        assert len(lines) == 1, lines  # one line, and nothing retried
        assert "OUTBOX_DATABASE_URL" in lines[0] and "SECRET" not in lines[0], lines
    r = ctl({"OUTBOX_DATABASE_URL": url, "OUTBOX_TABLE": db.table}, "stats")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "OUTBOX_DATABASE_URL" in lines[0], lines
    assert "SECRET" not in r.stdout + r.stderr
