"""Test harness for outbox-relay integration and fault tests (pytest, /usr/bin/python3).

Put tests/support on sys.path and:

    from harness import Postgres, TestSchema, KafkaCluster, Relay, wait_until, read_topics

    pg = Postgres()                          # OUTBOX_TEST_DATABASE_URL or its own server
    with KafkaCluster() as kafka, TestSchema(pg, "basic") as db:
        kafka.create_topic("orders", partitions=3)
        db.insert_events([{"aggregate_type": "Order", "aggregate_id": "o1",
                           "aggregate_version": 1, "event_type": "OrderCreated",
                           "payload_json": {"n": 1}, "topic_name": "orders"}])
        with Relay("outbox-relay", env={**db.env(), "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap,
                                        "OUTBOX_HTTP_ADDR": "off"}, log_dir=tmp_path) as relay:
            wait_until(lambda: db.status_counts()["PUBLISHED"] == 1, 20, what="row published")
        msgs = read_topics(kafka.bootstrap, topics=["orders"])
        ok, details = check_order(msgs)

KafkaCluster is Apache Kafka (deploy/local/kafka: one node, or three); MockBroker is
librdkafka's mock cluster (outbox-mockbroker), kept for injected produce errors, RTT
and brokers down on command.

Environment read here: OUTBOX_BUILD_DIR (default <repo>/build), OUTBOX_TEST_DATABASE_URL,
OUTBOX_TEST_PG_DIR (the deploy/local/pg directory of that server, enables restarts),
OUTBOX_TEST_KAFKA_DIR (a deploy/local/kafka directory of a running single-node
broker that KafkaCluster.shared() uses instead of starting one),
ASAN_OPTIONS / UBSAN_OPTIONS / LSAN_OPTIONS (passed to spawned daemons).
"""

import collections
import contextlib
import glob
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import psycopg2
import psycopg2.extras

from kafka_dump import read_topics  # noqa: F401  (re-exported)

__all__ = [
    "repo_root", "build_dir", "bin_path", "have_binary", "free_port", "wait_until", "http_status",
    "Postgres", "TestSchema", "KafkaCluster", "MockBroker", "MockBrokerError", "Relay",
    "read_topics", "header", "check_order", "count_duplicates", "duplicates",
]

_HERE = os.path.dirname(os.path.abspath(__file__))

# Binary name -> path under the build directory.
_BINARIES = {
    "outbox-relay": "relay/outbox-relay",
    "outbox-sweeper": "sweeper/outbox-sweeper",
    "outbox-mockbroker": "deploy/local/outbox-mockbroker",
    "outboxctl": "tools/outboxctl",
}

STATUSES = ("PENDING", "PUBLISHING", "PUBLISHED", "FAILED", "DEAD")


# ---------------------------------------------------------------- paths, polling

def repo_root():
    """Absolute path of the repository (two levels above tests/support)."""
    return os.path.dirname(os.path.dirname(_HERE))


def build_dir():
    """$OUTBOX_BUILD_DIR, else <repo>/build."""
    return os.environ.get("OUTBOX_BUILD_DIR") or os.path.join(repo_root(), "build")


def bin_path(name):
    """Path of a built program: 'outbox-relay' (or 'relay'), 'outbox-sweeper'
    ('sweeper'), 'outbox-mockbroker' ('mockbroker'), 'outboxctl'. Does not check
    existence."""
    key = name if name.startswith("outbox") else "outbox-" + name
    if key not in _BINARIES:
        raise ValueError("unknown program %r (known: %s)" % (name, ", ".join(_BINARIES)))
    return os.path.join(build_dir(), _BINARIES[key])


def have_binary(name):
    """True if bin_path(name) exists and is executable (for pytest.skip)."""
    p = bin_path(name)
    return os.path.isfile(p) and os.access(p, os.X_OK)


def free_port():
    """A TCP port free on 127.0.0.1 right now (e.g. for OUTBOX_HTTP_ADDR)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout=10.0, interval=0.05, what="condition"):
    """Calls predicate() every interval seconds until it returns a truthy value,
    which is returned. Raises AssertionError naming `what` after timeout
    seconds (the last value or exception of predicate is included)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except Exception as e:  # a server briefly down is a normal state here
            last = e
        if time.monotonic() >= deadline:
            raise AssertionError("timed out after %.1fs waiting for %s (last: %r)"
                                 % (timeout, what, last))
        time.sleep(interval)


def http_status(where, path="/readyz"):
    """The HTTP status a daemon's endpoint answers: `where` is a port on
    127.0.0.1 or "host:port"; None when nothing answers."""
    addr = "127.0.0.1:%d" % where if isinstance(where, int) else where
    try:
        with urllib.request.urlopen("http://%s%s" % (addr, path), timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _read_log(path):
    """A process's log file as text ("" while it does not exist)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tmpdir(prefix):
    return tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("OUTBOX_TEST_TMP"))


# ---------------------------------------------------------------- PostgreSQL

class Postgres:
    """A PostgreSQL server for tests.

    Uses $OUTBOX_TEST_DATABASE_URL when set (tests/run starts one server for the
    whole run; $OUTBOX_TEST_PG_DIR names its deploy/local/pg directory and makes
    restart() possible), else starts its own with deploy/local/pg in a temporary
    directory, removed by close(). `settings` (deploy/local/pg's environment, e.g.
    {"PG_WAL_LEVEL": "logical"}) or own=True always give a server of its own.
    """

    def __init__(self, url=None, settings=None, own=False):
        self.owned = False
        self.dir = None
        self.settings = dict(settings or {})
        url = None if settings or own else url or os.environ.get("OUTBOX_TEST_DATABASE_URL")
        if url:
            self.url = url
            self.dir = os.environ.get("OUTBOX_TEST_PG_DIR") or None
        else:
            self.dir = _tmpdir("outbox-pg-")
            self.owned = True
            try:
                self.url = self._pg("start")
            except Exception:
                shutil.rmtree(self.dir, ignore_errors=True)
                raise

    def _pg(self, cmd):
        """Runs deploy/local/pg CMD DIR; returns the URL it printed (or '')."""
        script = os.path.join(repo_root(), "deploy", "local", "pg")
        r = subprocess.run([script, cmd, self.dir], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=120,
                           env={**os.environ, **self.settings})
        if r.returncode != 0:
            raise RuntimeError("deploy/local/pg %s failed (%d): %s"
                               % (cmd, r.returncode, r.stderr.strip()))
        for line in r.stdout.splitlines():
            if line.startswith("OUTBOX_DATABASE_URL="):
                return line.split("=", 1)[1]
        return ""

    @property
    def restartable(self):
        return self.dir is not None

    def _need_dir(self):
        if not self.restartable:
            raise RuntimeError("server not started by this harness and OUTBOX_TEST_PG_DIR "
                               "unset: cannot restart it")

    def connect(self, **kwargs):
        """New psycopg2 connection in autocommit mode (caller closes it)."""
        conn = psycopg2.connect(self.url, **kwargs)
        conn.autocommit = True
        return conn

    def ready(self):
        """True if a connection succeeds now."""
        try:
            self.connect(connect_timeout=2).close()
            return True
        except psycopg2.Error:
            return False

    def restart(self):
        """Fast restart on the same port; every client connection is dropped."""
        self._need_dir()
        self._pg("restart")

    def stop_server(self):
        """Fast shutdown (for 'database down' tests); start_server() brings it back."""
        self._need_dir()
        self._pg("stop")

    def start_server(self):
        self._need_dir()
        url = self._pg("start")
        if url != self.url:
            raise RuntimeError("server came back on another URL: %s" % url)

    def terminate_backends(self, application_name=None):
        """Drops other sessions of this database (all, or those whose
        application_name matches the SQL LIKE pattern); returns how many."""
        sql = ("SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
               "WHERE datname = current_database() AND pid <> pg_backend_pid() "
               "AND backend_type = 'client backend'")
        params = ()
        if application_name is not None:
            sql += " AND application_name LIKE %s"
            params = (application_name,)
        with self.connect() as conn, conn.cursor() as cur:
            cur.execute(sql, params)
            n = cur.fetchone()[0]
        conn.close()
        return n

    def close(self):
        """Stops and deletes a server this object started; otherwise nothing."""
        if self.owned and self.dir:
            try:
                self._pg("destroy")  # the server's files too, wherever they are
            finally:
                shutil.rmtree(self.dir, ignore_errors=True)
                self.owned = False
                self.dir = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- per-test schema

def _migrations():
    files = sorted(glob.glob(os.path.join(repo_root(), "schemas", "postgres", "*.sql")))
    if not files:
        raise RuntimeError("no migrations in schemas/postgres")
    return files


def _json_param(value):
    """jsonb parameter: dict/list/number/bool -> JSON; str -> passed as JSON text
    (so tests can insert e.g. '[1,2]' or '"text"'); None -> NULL."""
    if value is None or isinstance(value, str):
        return value
    return psycopg2.extras.Json(value)


class TestSchema:
    """A private schema with the migrations applied: t_<name>_<random>.

    .schema, .table (schema-qualified outbox_event), .conn (autocommit, with
    search_path set to the schema). Use as a context manager or call drop().
    """

    __test__ = False  # not a pytest test class despite its name

    JSON_COLUMNS = ("payload_json", "headers_json")

    def __init__(self, pg, name="t"):
        self.pg = pg
        slug = re.sub(r"[^a-z0-9_]", "_", name.lower())[:30]
        self.schema = "t_%s_%s" % (slug, secrets.token_hex(4))
        self.table = "%s.outbox_event" % self.schema
        self.conn = pg.connect()
        try:
            with self.conn.cursor() as cur:
                cur.execute("CREATE SCHEMA %s" % self.schema)
                # The migrations use unqualified names: they land in this schema.
                cur.execute("SET search_path TO %s" % self.schema)
                for path in _migrations():
                    with open(path, encoding="utf-8") as f:
                        cur.execute(f.read())
        except Exception:
            self.drop()
            raise

    def env(self):
        """Environment for a relay/sweeper working on this schema's table."""
        return {"OUTBOX_DATABASE_URL": self.pg.url, "OUTBOX_TABLE": self.table}

    def execute(self, sql, params=None):
        """Runs one statement; returns fetched rows as dicts if it returns any."""
        with self.conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
            cur.execute(sql, params)
            return [dict(r) for r in cur.fetchall()] if cur.description else None

    def insert_events(self, rows, page_size=1000):
        """Inserts rows (dicts of outbox_event columns, only the given keys, so
        defaults apply to the rest); rows with different key sets are fine.
        Returns the new outbox_ids (as strings) in the order given."""
        ids = [None] * len(rows)
        groups = collections.OrderedDict()
        for i, row in enumerate(rows):
            groups.setdefault(tuple(row.keys()), []).append(i)
        with self.conn.cursor() as cur:
            for cols, idx in groups.items():
                for c in cols:
                    if not re.fullmatch(r"[a-z_]+", c):
                        raise ValueError("bad column name %r" % c)
                values = [tuple(_json_param(rows[i][c]) if c in self.JSON_COLUMNS else rows[i][c]
                                for c in cols) for i in idx]
                sql = "INSERT INTO %s (%s) VALUES %%s RETURNING outbox_id::text" % (
                    self.table, ", ".join(cols))
                # execute_values returns RETURNING rows in VALUES order.
                res = psycopg2.extras.execute_values(cur, sql, values, page_size=page_size,
                                                     fetch=True)
                for i, (oid,) in zip(idx, res):
                    ids[i] = oid
        return ids

    def status_counts(self):
        """{status: count} with every status present (0 when none)."""
        counts = dict.fromkeys(STATUSES, 0)
        with self.conn.cursor() as cur:
            cur.execute("SELECT status, count(*) FROM %s GROUP BY status" % self.table)
            for status, n in cur.fetchall():
                counts[status] = n
        return counts

    def count(self, where="TRUE", params=None):
        with self.conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM %s WHERE %s" % (self.table, where), params)
            return cur.fetchone()[0]

    def rows(self, order_by="created_at, outbox_id", where="TRUE", params=None):
        """All rows (or those matching the SQL `where`) as dicts (uuid as str)."""
        with self.conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
            cur.execute("SELECT * FROM %s WHERE %s ORDER BY %s"
                        % (self.table, where, order_by), params)
            return [dict(r) for r in cur.fetchall()]

    def drop(self):
        """Drops the schema and closes the connection; safe to call twice."""
        if self.conn is None:
            return
        try:
            if self.conn.closed:
                self.conn = self.pg.connect()
            with self.conn.cursor() as cur:
                cur.execute("DROP SCHEMA IF EXISTS %s CASCADE" % self.schema)
        except psycopg2.OperationalError:
            # The server may have been restarted by the test: one more try.
            conn = self.pg.connect()
            with conn.cursor() as cur:
                cur.execute("DROP SCHEMA IF EXISTS %s CASCADE" % self.schema)
            conn.close()
        finally:
            try:
                self.conn.close()
            finally:
                self.conn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.drop()


def make_events(aggregates=1, versions=1, aggregate_type="Order", event_type="Changed",
                topic=None, payload_size=0, tenant_id=None, id_prefix="a"):
    """Rows for insert_events: `aggregates` aggregates x `versions` versions each,
    interleaved by version (v1 of all, then v2 ...), payload {"agg", "v", "pad"}."""
    rows = []
    for v in range(1, versions + 1):
        for a in range(aggregates):
            row = {"aggregate_type": aggregate_type, "aggregate_id": "%s%d" % (id_prefix, a),
                   "aggregate_version": v, "event_type": event_type,
                   "payload_json": {"agg": a, "v": v, "pad": "x" * payload_size}}
            if topic is not None:
                row["topic_name"] = topic
            if tenant_id is not None:
                row["tenant_id"] = tenant_id
            rows.append(row)
    return rows


# ---------------------------------------------------------------- Apache Kafka

sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "..", "deploy", "local"))
import kafka_admin  # noqa: E402  (deploy/local/kafka_admin.py)


class KafkaCluster:
    """Apache Kafka started by deploy/local/kafka: KafkaCluster(nodes=1|3, sasl=False,
    controller=False, settings=None).

    .bootstrap (plaintext listeners), .dir; with sasl, .sasl_bootstrap, .sasl_user,
    .sasl_password and .ca_path. controller=True runs the nodes as brokers beside
    a dedicated KRaft controller (node 0), so brokers can go down without the
    metadata quorum; settings {"auto.create.topics.enable": "false"} go into every
    broker's configuration. create_topic() makes a topic with the partitions,
    replication and configs asked for. Node control for fault tests: pid(n),
    kill(n) (SIGKILL), stop_node(n) (SIGTERM), pause(n)/resume(n)
    (SIGSTOP/SIGCONT), paused(n) (a context manager), start_node(n),
    leaders(topic). Context manager: stop() deletes everything it started.
    timeout: the most seconds the start may take (a cluster's four JVMs start
    beside the rest of the suite: over 180 s once on a loaded 2-core machine);
    once its nodes started, the script gives up on its own after 90 s without
    metadata (KAFKA_READY_TIMEOUT_S).

    KafkaCluster.shared() returns the single-node broker tests/run started
    ($OUTBOX_TEST_KAFKA_DIR), else starts one; stop() leaves a shared one running.
    """

    SCRIPT = os.path.join(repo_root(), "deploy", "local", "kafka")

    def __init__(self, nodes=1, sasl=False, dir=None, timeout=300, controller=False,
                 settings=None, version=None):
        self.nodes = nodes
        self.owned = dir is None
        self.dir = dir or _tmpdir("outbox-kafka-")
        if self.owned:
            shutil.rmtree(self.dir)  # the script makes it
            args = [self.SCRIPT, "start", self.dir, str(nodes)] + (["--sasl"] if sasl else [])
            args += ["--controller"] if controller else []
            args += ["--version", version] if version else []
            for k, v in (settings or {}).items():
                args += ["--set", "%s=%s" % (k, v)]
            r = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               timeout=timeout)
            if r.returncode != 0:
                raise RuntimeError("deploy/local/kafka start failed (%d): %s"
                                   % (r.returncode, r.stderr.strip()[-3000:]))
        self.bootstrap = self._read("bootstrap")
        self.sasl_bootstrap = self._read("bootstrap-sasl")
        self.sasl_user = self._read("sasl-user")
        self.sasl_password = self._read("sasl-password")
        self.ca_path = os.path.join(self.dir, "tls", "ca.pem") if self.sasl_bootstrap else None

    @classmethod
    def shared(cls):
        """tests/run's broker (OUTBOX_TEST_KAFKA_DIR), else one of its own. A
        module that pauses the broker (OUTBOX_TEST_KAFKA_PAUSES=1, set by
        tests/CMakeLists.txt) gets tests/run's second broker when there is
        one (OUTBOX_TEST_PAUSABLE_KAFKA_DIR), which no other module uses
        meanwhile: a pause stops every producer of the broker."""
        d = os.environ.get("OUTBOX_TEST_KAFKA_DIR")
        if os.environ.get("OUTBOX_TEST_KAFKA_PAUSES") == "1":
            d = os.environ.get("OUTBOX_TEST_PAUSABLE_KAFKA_DIR") or d
        return cls(dir=d) if d else cls()

    def _read(self, name):
        try:
            with open(os.path.join(self.dir, name)) as f:
                return f.read().strip()
        except OSError:
            return None

    def _script(self, *args, timeout=60):
        r = subprocess.run([self.SCRIPT, *map(str, args)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError("deploy/local/kafka %s failed (%d): %s"
                               % (" ".join(map(str, args)), r.returncode, r.stderr.strip()))
        return r.stdout

    def create_topic(self, name, partitions=1, replication=1, config=None, timeout=30.0):
        """Creates topic `name` and waits until every partition has a leader and a
        full ISR. config: {"min.insync.replicas": "2", "max.message.bytes": ...}."""
        kafka_admin.create_topic(self.bootstrap, name, partitions, replication,
                                 {k: str(v) for k, v in (config or {}).items()}, timeout)

    def leaders(self, topic):
        """{partition: (leader node id, [ISR node ids])}."""
        return kafka_admin.leaders(self.bootstrap, topic)

    def wait_brokers(self, n=None, timeout=60.0):
        """Waits until metadata lists n brokers (default all nodes)."""
        if not kafka_admin.wait_brokers(self.bootstrap, n or self.nodes, timeout):
            raise AssertionError("Kafka: fewer than %d brokers after %.0fs"
                                 % (n or self.nodes, timeout))

    def pid(self, n):
        """Node n's JVM pid, or None when it is not running: the pid file's
        process must still be that JVM (a SIGKILLed node leaves its pid file,
        and the pid may be reused by a process of another test)."""
        nd = os.path.realpath(os.path.join(self.dir, "node-%d" % n))
        pid = self._read("node-%d/pid" % n)
        try:
            with open("/proc/%d/cmdline" % int(pid), "rb") as f:
                args = f.read().split(b"\0")
        except (TypeError, ValueError, OSError):
            return None
        return int(pid) if os.path.join(nd, "server.properties").encode() in args else None

    def node_running(self, n):
        return self.pid(n) is not None

    def kill(self, n):
        """SIGKILL node n and wait for it to be gone."""
        self._script("node-stop", self.dir, n, "KILL")

    def stop_node(self, n):
        """SIGTERM node n (a controlled shutdown) and wait for it to exit."""
        self._script("node-stop", self.dir, n, "TERM", timeout=60)

    def _running_pid(self, n):
        pid = self.pid(n)
        if pid is None:
            raise AssertionError("Kafka node %d of %s is not running" % (n, self.dir))
        return pid

    def pause(self, n):
        os.kill(self._running_pid(n), signal.SIGSTOP)

    def resume(self, n):
        os.kill(self._running_pid(n), signal.SIGCONT)

    @contextlib.contextmanager
    def paused(self, n=1):
        """SIGSTOP node n for the with-block (SIGCONT on the way out, also on
        failure): a hung broker, its connections open and silent."""
        self.pause(n)
        try:
            yield
        finally:
            self.resume(n)

    def start_node(self, n):
        """Starts node n again, on its ports and data."""
        self._script("node-start", self.dir, n)

    def log_text(self, n=1):
        return _read_log(os.path.join(self.dir, "node-%d" % n, "server.log"))

    def stop(self):
        if self.owned and self.dir and os.path.isdir(self.dir):
            self._script("stop", self.dir, timeout=120)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# ---------------------------------------------------------------- mock Kafka

class MockBrokerError(RuntimeError):
    """The mock broker answered ERR, or could not be started."""


class MockBroker:
    """outbox-mockbroker in its own process.

    MockBroker(["orders:3", "-b", "1"]) passes the arguments through. After
    construction .bootstrap and .control_addr are set. Use as a context manager
    or call stop(). Its stderr goes to .log_path.
    """

    def __init__(self, args=(), timeout=15.0, log_dir=None, binary=None):
        self.binary = binary or bin_path("outbox-mockbroker")
        self.log_dir = str(log_dir) if log_dir else _tmpdir("outbox-mock-")
        self.log_path = os.path.join(self.log_dir, "mockbroker.log")
        self.bootstrap = None
        self.control_addr = None
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([self.binary, *map(str, args)], stdout=subprocess.PIPE,
                                         stderr=log, stdin=subprocess.DEVNULL)
        try:
            self._read_addresses(timeout)
        except Exception:
            self.kill()
            raise

    def _read_addresses(self, timeout):
        """Reads BOOTSTRAP= and CONTROL= lines from stdout, with a deadline."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        buf = b""
        while self.bootstrap is None or self.control_addr is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MockBrokerError("mock broker not ready after %.0fs: %s"
                                      % (timeout, self.log_text()[-2000:]))
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                self.proc.wait(5)
                raise MockBrokerError("mock broker exited (%s): %s"
                                      % (self.proc.returncode, self.log_text()[-2000:]))
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                text = line.decode()
                if text.startswith("BOOTSTRAP="):
                    self.bootstrap = text.split("=", 1)[1]
                elif text.startswith("CONTROL="):
                    self.control_addr = text.split("=", 1)[1]

    def log_text(self):
        return _read_log(self.log_path)

    def control(self, cmd, timeout=10.0):
        """Sends one control command; returns the text after 'OK ' or raises
        MockBrokerError with the broker's message."""
        host, port = self.control_addr.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.sendall(cmd.encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    raise MockBrokerError("control connection closed after %r" % cmd)
                buf += chunk
        answer = buf.decode().strip()
        if answer == "OK" or answer.startswith("OK "):
            return answer[3:]
        raise MockBrokerError("%s: %s" % (cmd, answer[4:] if answer.startswith("ERR ")
                                          else answer))

    def ping(self):
        return self.control("ping")

    def down(self, broker_id=None):
        """All brokers (or one, ids 1..N) stop answering."""
        return self.control("down" if broker_id is None else "down %d" % broker_id)

    def up(self, broker_id=None):
        return self.control("up" if broker_id is None else "up %d" % broker_id)

    def produce_errors(self, n, errname):
        """The next n Produce requests fail with errname (e.g. NOT_ENOUGH_REPLICAS)."""
        return self.control("produce_errors %d %s" % (n, errname))

    def clear_errors(self):
        return self.control("clear_errors")

    def set_rtt(self, ms, broker_id=None):
        return self.control("rtt %s %d" % ("all" if broker_id is None else broker_id, ms))

    def create_topic(self, name, partitions):
        return self.control("topic %s %d" % (name, partitions))

    def running(self):
        return self.proc.poll() is None

    def stop(self, timeout=10.0):
        """SIGTERM and wait; returns the exit code (0 expected)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError("mock broker ignored SIGTERM for %.0fs" % timeout)
        self._close_pipe()
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_pipe()
        return self.proc.returncode

    def _close_pipe(self):
        if self.proc.stdout and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        rc = self.stop()
        # Non-zero means a crash or a sanitizer report: fail, unless the test
        # already failed for its own reason.
        if rc != 0 and exc_type is None:
            raise AssertionError("mock broker exited %s: %s" % (rc, self.log_text()[-2000:]))


# ---------------------------------------------------------------- daemons

_PASSTHROUGH_ENV = ("PATH", "ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS",
                    "LD_LIBRARY_PATH", "TZ")


class Relay:
    """A relay or sweeper process.

    Relay("outbox-relay", env={...}, args=["--once"], log_dir=tmp_path, name="r1")
    starts it at once with env merged over a minimal base (PATH and the
    sanitizer options from os.environ). stdout and stderr go to
    <log_dir>/<name>.log. Context manager: stops it (SIGTERM) on exit.
    `binary` may be a program name for bin_path() or a path.
    """

    # Every process started, so a fixture can kill what a failed test left running.
    started = []

    @classmethod
    def kill_leftovers(cls):
        """SIGKILLs every process still running; returns their names."""
        left = [r for r in cls.started if r.running()]
        for r in left:
            r.kill()
        cls.started = []
        return [r.name for r in left]

    def __init__(self, binary="outbox-relay", env=None, args=(), log_dir=None, name=None):
        self.path = binary if os.sep in binary else bin_path(binary)
        self.name = name or os.path.basename(self.path)
        self.log_dir = str(log_dir) if log_dir else _tmpdir("outbox-%s-" % self.name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.log_path = os.path.join(self.log_dir, "%s.log" % self.name)
        base = {k: os.environ[k] for k in _PASSTHROUGH_ENV if k in os.environ}
        base.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        self.env = {**base, **{k: str(v) for k, v in (env or {}).items()}}
        self.args = [str(a) for a in args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([self.path, *self.args], env=self.env,
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        Relay.started.append(self)

    @property
    def pid(self):
        return self.proc.pid

    @property
    def returncode(self):
        return self.proc.poll()

    def running(self):
        return self.proc.poll() is None

    def wait(self, timeout=30.0):
        """Waits for exit; returns the exit code (negative: killed by signal).
        Raises AssertionError if still running after timeout."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("%s (pid %d) still running after %.0fs"
                                 % (self.name, self.pid, timeout)) from None

    def send_signal(self, sig):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig=signal.SIGTERM, timeout=30.0):
        """Sends sig and waits; returns the exit code. If it has not exited
        after timeout it is SIGKILLed and AssertionError is raised."""
        self.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("%s (pid %d) did not exit within %.0fs of signal %d"
                                 % (self.name, self.pid, timeout, sig)) from None

    def kill(self):
        """SIGKILL (no cleanup in the process); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def log_text(self):
        return _read_log(self.log_path)

    def wait_log(self, pattern, timeout=10.0):
        """Waits until the log matches regex pattern; returns the match."""
        rx = re.compile(pattern)
        return wait_until(lambda: rx.search(self.log_text()), timeout,
                          what="%s log matching %r" % (self.name, pattern))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if self.running():
            try:
                self.stop()
            except AssertionError:
                if exc_type is None:  # don't mask the test's own failure
                    raise


# ---------------------------------------------------------------- checks on messages

def header(msg, name):
    """First value of header `name` in a read_topics() message, or None."""
    for k, v in msg.get("headers") or ():
        if k == name:
            return v
    return None


def check_order(messages):
    """Checks G2 (docs/DESIGN.md): in each partition, for each aggregate
    (tenant-id, aggregate-type, aggregate-id headers), the first copies of its
    versions appear in increasing aggregate-version order; later duplicate
    copies of versions already seen are allowed.

    Returns (ok, details): details is a list of human-readable violations
    (empty when ok). A message without the needed headers is a violation."""
    details = []
    # (topic, partition) -> aggregate -> [highest first-seen version, seen set]
    state = collections.defaultdict(dict)
    for m in sorted(messages, key=lambda m: (m["topic"], m["partition"], m["offset"])):
        where = "%s[%d]@%d" % (m["topic"], m["partition"], m["offset"])
        agg = (header(m, "tenant-id"), header(m, "aggregate-type"), header(m, "aggregate-id"))
        version = header(m, "aggregate-version")
        if None in agg or version is None:
            details.append("%s: missing tenant-id/aggregate-type/aggregate-id/"
                           "aggregate-version header" % where)
            continue
        try:
            v = int(version)
        except ValueError:
            details.append("%s: aggregate-version %r is not an integer" % (where, version))
            continue
        aggs = state[(m["topic"], m["partition"])]
        top, seen = aggs.setdefault(agg, [None, set()])
        if v in seen:
            continue  # a redelivered copy: allowed anywhere after the first
        seen.add(v)
        if top is not None and v < top:
            details.append("%s: aggregate %s first copy of version %d after version %d"
                           % (where, "/".join(agg), v, top))
        else:
            aggs[agg][0] = v
    return (not details, details)


def duplicates(messages):
    """{event-id: copies} for event ids seen more than once."""
    c = collections.Counter(header(m, "event-id") for m in messages)
    return {k: n for k, n in c.items() if n > 1}


def count_duplicates(messages):
    """Number of extra copies: messages minus distinct event-id values
    (0 when every event was published exactly once)."""
    return sum(n - 1 for n in duplicates(messages).values())
