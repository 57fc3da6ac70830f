#!/usr/bin/python3
"""Row group D of tests/bench/run: outbox-relay against Debezium, measured in one run.

Both systems run alone, one after the other, on the same PostgreSQL (one server of
this group's own, wal_level=logical for both, fsync as PG_FSYNC) and the same
single-node Apache Kafka broker (deploy/local/kafka; Kafka's own JVM defaults:
1 GiB heap, G1). Every run has a fresh table and a fresh topic (6 partitions by
default) with message.timestamp.type=LogAppendTime, so a record's timestamp is the
broker's append time on this machine's clock. Each scenario runs --rounds times;
within a round the systems alternate, and which goes first alternates between
rounds; the tables give medians (ratios: the median of each round's ratio).

  D1 burst        statistics of an idle outbox: a warm-up of W events drains (the
                  JVMs compile their hot paths; the relay marks every row), then
                  ANALYZE of the table while nothing is unpublished, as autovacuum
                  leaves a table after any quiet spell; then a writer commits N
                  events (500-byte payloads, A aggregates, 100 rows per transaction)
                  as fast as one connection can while the system runs, with no
                  ANALYZE in between. Events/s = N / (last append - first COMMIT);
                  drained = last append - last COMMIT. 1 relay (and --burst-relays)
                  against Debezium's one task.
  D6 catch-up     as D1 up to the ANALYZE; then the relays are stopped (SIGTERM) or
                  the connector paused through Connect's REST API (PUT
                  /connectors/NAME/pause), N events are committed, and the relays
                  started (resume: PUT /connectors/NAME/resume). Events/s = N /
                  (last append - start or resume). 1 and 2 relays against Debezium.
  D2 latency      steady R events/s offered (R/1000 rows per transaction, 1000
                  transactions/s) for S seconds after a warm-up; commit (when COMMIT
                  returned to the writer) -> broker append: p50 / p99 / max. The
                  append time has millisecond resolution.
  D3 CPU          per event, in the D1 and D6 runs, from the first COMMIT to the
                  last event on Kafka (and, for the relay, its last row marked):
                  the relay or Connect process; PostgreSQL (i) the system's own
                  backends (the relay's: application_name LIKE 'outbox-relay%',
                  re-read every 0.25 s since connections may be re-made; Debezium's:
                  its role's backends, WAL sender included) and (ii) every
                  PostgreSQL process but the writer's backend (checkpointer, WAL
                  writer, autovacuum, WAL sender, exited backends through the
                  postmaster's reaped-children times); the broker.
  D4 RSS          peak RSS (VmHWM) of the relays or the Connect JVM in D1 and D6.
  D5 start-up     process start -> first event appended, with 1000 events waiting
                  (Debezium: a restart on a slot and offsets of a previous run).

Debezium runs as tests/bench/debezium/connect starts it (Kafka Connect standalone,
G1, heap -Xms256M -Xmx1g by default: --connect-heap) with the throughput settings in
DBZ_CONNECTOR / DBZ_WORKER below (--dbz-set / --dbz-worker change them); all are
recorded in results-debezium.json, with the targets' verdicts.

    compare.py --relay build-bench/outbox/relay/outbox-relay --rounds 1 \\
        --burst-events 10000 --catchup-events 20000 --latency-seconds 5
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
sys.path.insert(0, HERE)

import dbz  # noqa: E402
import harness  # noqa: E402
import psycopg2  # noqa: E402
from confluent_kafka import Consumer, KafkaException, TopicPartition  # noqa: E402

PAYLOAD_BYTES = 500
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
RELAY_APP = "outbox-relay%"  # application_name of the relay's sessions (LIKE)

# Debezium's documented throughput knobs (PostgreSQL connector: a larger batch and
# queue than the defaults 2048/8192; poll.interval.ms, the longest a poll waits for a
# batch to fill, down from 500 ms) and the producer's (Kafka's batching: a larger
# batch.size than 16 KiB, linger.ms as the relay's; zstd level 1, the relay's
# compression, so the broker gets the same bytes).
DBZ_CONNECTOR = {
    "max.batch.size": "8192",
    "max.queue.size": "32768",
    "poll.interval.ms": "10",
    "producer.override.linger.ms": "5",
    "producer.override.batch.size": "262144",
    "producer.override.compression.type": "zstd",
    "producer.override.compression.zstd.level": "1",
}
DBZ_WORKER = {}

# The targets (docs of the issue that set them: "as fast as Debezium, then faster").
BURST_DRAIN_S = 2.0        # 1 relay: last append within this of the last COMMIT
BURST_RATIO = 1.0          # 1 relay / Debezium, events/s
CATCHUP_RATIO = 1.0        # 2 relays / Debezium, events/s (and 2 relays > 1 relay)
P99_RATIO = 0.5            # relay p99 / Debezium p99 at 1000/s and 5000/s
PG_US_PER_EVENT = 35.0     # the relay's own backends, default ordering
RSS_RATIO = 1.0 / 20       # relay peak RSS / Connect's


def log(msg):
    print("bench D: %s" % msg, file=sys.stderr, flush=True)


def role_of(application_name):
    """A backend's part in its system: the relay's connection (lock, mark,
    side: its application_name is outbox-relay:<connection>:<relay id>), or the
    application_name itself (Debezium's backends)."""
    parts = (application_name or "").split(":")
    return parts[1] if len(parts) >= 3 and parts[0] == "outbox-relay" else parts[0] or "-"


def pct(values, q):
    """Nearest-rank percentile of a sorted list."""
    if not values:
        return float("nan")
    k = max(0, min(len(values) - 1, int(round(q / 100.0 * len(values) + 0.5)) - 1))
    return values[k]


def proc_fields(pid):
    """/proc/PID/stat after the command name (fields[1] ppid, fields[11:15] utime,
    stime, cutime, cstime in clock ticks), or None when the process is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_s(pid):
    """utime + stime of a process in seconds (0 when it is gone)."""
    f = proc_fields(pid)
    return (int(f[11]) + int(f[12])) / CLOCK_TICKS if f else 0.0


def hwm_mib(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def threads_cpu(pids):
    """{thread name: CPU seconds} over the threads of pids, names with their
    digits dropped (a JVM's "GC Thread#1", librdkafka's "rdk:broker3") so that
    a pool adds up; /proc gives at most 15 characters of a name."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir("/proc/%d/task" % pid)
        except OSError:
            continue
        for tid in tids:
            try:
                with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                    head, rest = f.read().rsplit(")", 1)
            except OSError:
                continue
            name = "".join(ch for ch in head.split("(", 1)[1] if not ch.isdigit()).rstrip("#-")
            fields = rest.split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return out


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class PgMeter:
    """The PostgreSQL server seen from one connection of its own (.conn), which
    the bench uses for every query it makes while a figure is taken.

    start(exclude) .. stop() measures, in CPU seconds:
      own  the backends `own_where` selects in pg_stat_activity, re-read every
           0.25 s; a backend counts from the first sample that sees it (from 0
           when it appeared after start), up to the last sample that saw it;
      all  every process of the server: the postmaster, its live children, and
           through the postmaster's cutime/cstime the children that exited
           meanwhile (backends, autovacuum and parallel workers), minus the
           processes in `exclude` (the writer's backend) and this connection's.
    """

    def __init__(self, pg):
        self._lock = threading.Lock()
        self._ev = None
        self.conn = pg.connect()
        self.pid = self.query("SELECT pg_backend_pid()")[0][0]
        self.postmaster = int(proc_fields(self.pid)[1])

    def query(self, sql, params=None):
        with self._lock, self.conn.cursor() as cur:
            cur.execute(sql, params)
            return cur.fetchall() if cur.description else None

    def pids(self, where):
        return [r[0] for r in self.query("SELECT pid FROM pg_stat_activity WHERE " + where)]

    def wal_lsn(self):
        """The server's current WAL position, in bytes."""
        return int(self.query("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")[0][0])

    def _server_total(self):
        pm = proc_fields(self.postmaster)
        total = sum(int(x) for x in pm[11:15]) / CLOCK_TICKS
        for name in os.listdir("/proc"):
            if name.isdigit():
                f = proc_fields(int(name))
                if f and int(f[1]) == self.postmaster:
                    total += (int(f[11]) + int(f[12])) / CLOCK_TICKS
        return total

    def _sample(self, first=False):
        for pid, app in self.query("SELECT pid, application_name FROM pg_stat_activity"
                                   " WHERE " + self.own_where):
            c = cpu_s(pid)
            seen = self.own.setdefault(pid, [c if first else 0.0, c])
            seen[1] = max(seen[1], c)
            self.role[pid] = role_of(app)

    def _run(self):
        while not self._ev.wait(0.25):
            self._sample()

    def start(self, own_where, exclude=()):
        self.own_where = own_where
        self.exclude = set(exclude) | {self.pid}
        self.own = {}
        self.role = {}
        self.t0_excl = {p: cpu_s(p) for p in self.exclude}
        self.t0_total = self._server_total()
        self._sample(first=True)
        self._ev = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def stop(self):
        self._ev.set()
        self._t.join()
        self._sample()
        total = self._server_total() - self.t0_total
        total -= sum(cpu_s(p) - t0 for p, t0 in self.t0_excl.items())
        by_role = {}
        for pid, (a, b) in self.own.items():
            by_role[self.role[pid]] = by_role.get(self.role[pid], 0.0) + b - a
        return {"pg_own": sum(b - a for a, b in self.own.values()), "pg_all": total,
                "pg_own_backends": len(self.own), "pg_own_by_connection": by_role}

    def table_stats(self, table):
        """Counters of one table and of the server, for deltas over a run:
        pg_stat_user_tables (analyze and vacuum runs; tuples updated, HOT,
        deleted; scans), each index's scans and entries read
        ("idx:<name>:scan", ":read"), heap blocks hit and read, WAL records
        and full-page images, and the database's commits (every relay
        statement is one transaction). Backends publish their counters at
        most once a second (PostgreSQL 15+), so read them a second after the
        work."""
        schema, name = table.split(".", 1)
        out = {}
        r = self.query("SELECT analyze_count, autoanalyze_count, vacuum_count,"
                       " autovacuum_count, n_tup_upd, n_tup_hot_upd, n_tup_del,"
                       " coalesce(idx_scan, 0), coalesce(idx_tup_fetch, 0), seq_scan,"
                       " seq_tup_read FROM pg_stat_user_tables"
                       " WHERE schemaname = %s AND relname = %s", (schema, name))
        if r:
            out.update(zip(("analyze", "autoanalyze", "vacuum", "autovacuum", "tup_upd",
                            "tup_hot_upd", "tup_del", "idx_scan", "idx_tup_fetch",
                            "seq_scan", "seq_tup_read"), r[0]))
        for iname, scans, read in self.query(
                "SELECT indexrelname, idx_scan, idx_tup_read FROM pg_stat_user_indexes"
                " WHERE schemaname = %s AND relname = %s", (schema, name)):
            out["idx:%s:scan" % iname], out["idx:%s:read" % iname] = scans, read
        r = self.query("SELECT heap_blks_hit, heap_blks_read FROM pg_statio_user_tables"
                       " WHERE schemaname = %s AND relname = %s", (schema, name))
        if r:
            out["heap_blks_hit"], out["heap_blks_read"] = r[0]
        r = self.query("SELECT wal_records, wal_fpi FROM pg_stat_wal")
        if r:
            out["wal_records"], out["wal_fpi"] = r[0]
        r = self.query("SELECT xact_commit FROM pg_stat_database"
                       " WHERE datname = current_database()")
        if r:
            out["xact_commit"] = r[0][0]
        return {k: int(v or 0) for k, v in out.items()}

    def unpublished(self, table):
        return self.query("SELECT count(*) FROM %s WHERE published_at IS NULL" % table)[0][0]

    def close(self):
        self.conn.close()


class Group:
    def __init__(self, opts):
        self.o = opts
        self.out = opts.out
        os.makedirs(self.out, exist_ok=True)
        self.pg = self.kafka = self.meter = self.wm = None
        try:
            self._start_servers()
        except BaseException:
            self.close()
            raise
        self.runs = 0
        ordering = opts.relay_env.get("OUTBOX_ORDERING", "aggregate (default)")
        self.results = {"versions": dbz.versions(), "dbz_connector": dict(DBZ_CONNECTOR),
                        "dbz_worker": dict(DBZ_WORKER), "connect_heap": opts.connect_heap,
                        "relay_env": dict(opts.relay_env), "ordering": ordering,
                        "burst_events": opts.burst_events,
                        "catchup_events": opts.catchup_events,
                        "warm_events": opts.warm_events, "rounds": opts.rounds,
                        "aggregates": opts.aggregates, "partitions": opts.partitions,
                        "fsync": opts.fsync, "batch": opts.batch, "runs": []}

    def _start_servers(self):
        """The group's own PostgreSQL (wal_level=logical) and Kafka broker (Kafka's
        JVM defaults: 1 GiB heap, G1), and the meter's connection."""
        self.pg = harness.Postgres(settings={"PG_WAL_LEVEL": "logical",
                                             "PG_FSYNC": self.o.fsync})
        saved = {k: os.environ.get(k) for k in ("KAFKA_HEAP", "KAFKA_JVM_OPTS")}
        os.environ["KAFKA_HEAP"] = "1g"
        os.environ["KAFKA_JVM_OPTS"] = "-XX:+UseG1GC -XX:MaxGCPauseMillis=20"
        try:
            self.kafka = harness.KafkaCluster()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.meter = PgMeter(self.pg)

    def close(self):
        if self.wm is not None:
            self.wm.close()
        if self.meter is not None:
            self.meter.close()
        if self.kafka is not None:
            self.kafka.stop()
        if self.pg is not None:
            self.pg.close()

    def record(self, **kw):
        kw["load"] = "%.2f %.2f %.2f" % os.getloadavg()
        self.results["runs"].append(kw)
        log("result %s" % json.dumps(kw))
        return kw

    # ------------------------------------------------------------ set-up

    def new_table(self, name):
        self.runs += 1
        s = harness.TestSchema(self.pg, "%s%d" % (name, self.runs))
        topic = "%s.Order" % s.schema
        self.kafka.create_topic(topic, partitions=self.o.partitions,
                                config={"message.timestamp.type": "LogAppendTime"})
        return s, topic

    def start_relays(self, s, n, name):
        """n relays started at once; returns when each serves /metrics."""
        procs, ports = [], []
        for i in range(n):
            port = harness.free_port()
            env = {**s.env(), "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": self.kafka.bootstrap,
                   "OUTBOX_HTTP_ADDR": "127.0.0.1:%d" % port, "OUTBOX_LOG_LEVEL": "warn",
                   "OUTBOX_LOG_FORMAT": "text", "OUTBOX_RELAY_ID": "%s-%d" % (name, i),
                   "OUTBOX_BATCH_SIZE": str(self.o.batch), "OUTBOX_VALUE_FORMAT": "payload",
                   "OUTBOX_TOPIC_TEMPLATE": "%s.{aggregate_type}" % s.schema,
                   **self.o.relay_env}
            procs.append(harness.Relay(self.o.relay, env=env, log_dir=self.out,
                                       name="%s-%d" % (name, i)))
            ports.append(port)
        for p, port in zip(procs, ports):
            harness.wait_until(lambda: p.running() and _http_ok(port), 15,
                               what="relay /metrics on %d" % port)
        return procs

    def stop_relays(self, procs):
        codes = [p.stop(timeout=60) for p in procs]
        if any(codes):
            raise RuntimeError("relay exit codes %s" % codes)

    def start_debezium(self, s, name, cdir=None, slot=None):
        slot = slot or "dbz_%s" % s.schema
        dbz.prepare_database(self.pg, [s.table], "pub_%s" % s.schema)
        # value = the payload, key = the aggregate id, the `id` header only
        settings = dbz.router_settings("%s.${routedByValue}" % s.schema)
        del settings["table.fields.additional.placement"]
        props = dbz.connector_properties(name, self.pg.url, slot, "pub_%s" % s.schema,
                                         [(s.schema, settings)], extra=DBZ_CONNECTOR)
        cdir = cdir or os.path.join(self.out, "connect-%s" % s.schema)
        c = dbz.Connect(cdir, self.kafka.bootstrap, props, worker=DBZ_WORKER,
                        env={"CONNECT_HEAP_OPTS": self.o.connect_heap})
        # Streaming has started once the slot is in use.
        harness.wait_until(lambda: self.meter.pids("backend_type = 'walsender' AND usename"
                                                   " = '%s'" % dbz.ROLE), 60, what="WAL sender")
        return c

    def stop_debezium(self, c, s, drop=True):
        c.stop()
        if drop:
            harness.wait_until(lambda: not self.meter.pids("backend_type = 'walsender'"), 30,
                               what="WAL sender gone")
            dbz.drop_slot(self.pg, "dbz_%s" % s.schema)

    @staticmethod
    def own_where(system):
        """The system's own backends in pg_stat_activity."""
        if system == "relay":
            return "application_name LIKE '%s'" % RELAY_APP
        return "usename = '%s'" % dbz.ROLE

    # ------------------------------------------------------------ Kafka reads

    def consumer(self):
        return Consumer({"bootstrap.servers": self.kafka.bootstrap, "group.id": "bench-d",
                         "enable.auto.commit": False, "log_level": 0})

    def appended(self, topic):
        """Records appended to topic so far (high watermarks), or -1 while the
        broker cannot tell (a partition's leadership still settling)."""
        if self.wm is None:
            self.wm = self.consumer()
        try:
            return sum(self.wm.get_watermark_offsets(TopicPartition(topic, p), timeout=5)[1]
                       for p in range(self.o.partitions))
        except KafkaException:
            return -1

    def wait_appended(self, topic, n, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.appended(topic) >= n:
                return True
            time.sleep(0.2)
        return False

    def wait_marked(self, s, timeout=60):
        """The relay marked every row (nothing unpublished): its work is done."""
        harness.wait_until(lambda: self.meter.unpublished(s.table) == 0, timeout,
                           interval=0.1, what="every row of %s marked" % s.table)

    def read(self, topic, last_only=False):
        """[(LogAppendTime ms, event id)] of every record (or the last of each
        partition)."""
        c = self.consumer()
        try:
            tps, ends = [], {}
            for p in range(self.o.partitions):
                lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=5)
                if hi > lo:
                    tps.append(TopicPartition(topic, p, hi - 1 if last_only else lo))
                    ends[p] = hi
            c.assign(tps)
            out, done = [], set()
            deadline = time.monotonic() + 300
            while len(done) < len(tps) and time.monotonic() < deadline:
                for m in c.consume(10000, timeout=1.0):
                    if m.error():
                        continue
                    hdrs = dict(m.headers() or [])
                    eid = hdrs.get("event-id") or hdrs.get("id")
                    out.append((m.timestamp()[1], eid.decode() if eid else None))
                    if m.offset() + 1 >= ends[m.partition()]:
                        done.add(m.partition())
            return out
        finally:
            c.close()

    def last_append(self, topic):
        return max(t for t, _ in self.read(topic, last_only=True)) / 1000.0

    # ------------------------------------------------------------ writers

    def writer_conn(self):
        """(connection, its backend pid) for a writer."""
        conn = psycopg2.connect(self.pg.url)
        with conn.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            pid = cur.fetchone()[0]
        conn.commit()
        return conn, pid

    def write_fast(self, s, n, start=0, conn=None):
        """n events (numbers start.. start+n-1, which give the versions), 100 per
        transaction, as fast as one connection commits them; returns (first
        commit, last commit) wall times. `conn` (kept open) or a connection of
        its own."""
        own = conn is None
        if own:
            conn = psycopg2.connect(self.pg.url)
        pad = max(0, PAYLOAD_BYTES - 150)
        sql = """
        INSERT INTO {t} (aggregate_type, aggregate_id, aggregate_version, event_type,
                         payload_json)
        SELECT 'Order', 'order-' || (g %% %(a)s), g / %(a)s + 1, 'OrderChanged',
               jsonb_build_object('order_id', 'order-' || (g %% %(a)s), 'seq', g,
                   'status', 'CONFIRMED', 'currency', 'EUR', 'amount', (g %% 100000) / 100.0,
                   'customer', jsonb_build_object('id', 'c-' || (g %% 7919), 'tier', 'gold'),
                   'note', left(repeat(md5(g::text), 40), %(pad)s))
        FROM generate_series(%(lo)s, %(hi)s) g""".format(t=s.table)
        first = None
        with conn.cursor() as cur:
            for lo in range(start, start + n, 100):
                cur.execute(sql, {"a": self.o.aggregates, "pad": pad, "lo": lo,
                                  "hi": min(start + n, lo + 100) - 1})
                conn.commit()
                if first is None:
                    first = time.time()
        last = time.time()
        if own:
            conn.close()
        return first, last

    def write_steady(self, s, rate, seconds, warmup):
        """rate events/s as 1000 transactions/s of rate/1000 rows for warmup +
        seconds; returns {outbox_id: commit wall time} of the measured part and
        the achieved rate."""
        per_tx = max(1, rate // 1000)
        tx_rate = rate / per_tx
        conn = psycopg2.connect(self.pg.url)
        payload = json.dumps({"status": "CONFIRMED", "note": "x" * (PAYLOAD_BYTES - 40)})
        sql = ("INSERT INTO {t} (aggregate_type, aggregate_id, aggregate_version, event_type,"
               " payload_json) SELECT 'Order', 'order-' || ((%(i)s + g) %% %(a)s),"
               " (%(i)s + g) / %(a)s + 1, 'OrderChanged', %(p)s::jsonb"
               " FROM generate_series(0, %(k)s - 1) g RETURNING outbox_id::text").format(t=s.table)
        commits = {}
        n_tx = int(tx_rate * (warmup + seconds))
        n_warm = int(tx_rate * warmup)
        t0 = time.monotonic()
        t_first = None
        with conn.cursor() as cur:
            for j in range(n_tx):
                if j == n_warm and self.o.analyze:
                    cur.execute("ANALYZE %s" % s.table)
                    conn.commit()
                d = t0 + j / tx_rate - time.monotonic()
                if d > 0:
                    time.sleep(d)
                cur.execute(sql, {"i": j * per_tx, "a": self.o.aggregates, "p": payload,
                                  "k": per_tx})
                ids = [r[0] for r in cur.fetchall()]
                conn.commit()
                now = time.time()
                if j >= n_warm:
                    t_first = t_first or now
                    for oid in ids:
                        commits[oid] = now
        span = time.time() - t_first if t_first else 0
        conn.close()
        return commits, (len(commits) / span if span else 0.0)

    # ------------------------------------------------------------ D1, D6 (D3, D4)

    def warm_idle(self, system, s, topic):
        """The warm-up drain, then ANALYZE of a table with nothing unpublished
        (the relay marked every row; Debezium never changes a row)."""
        warm = self.o.warm_events
        if warm:
            self.write_fast(s, warm)
            if not self.wait_appended(topic, warm, self.o.timeout):
                raise RuntimeError("warm-up events did not arrive")
            if system == "relay":
                self.wait_marked(s)
        self.meter.query("ANALYZE %s" % s.table)
        return warm

    def scenario(self, kind, system, instances=1, rnd=0):
        """One D1 (kind "burst") or D6 ("catchup") run; returns its record."""
        s, topic = self.new_table(kind)
        n = self.o.burst_events if kind == "burst" else self.o.catchup_events
        name = "%s-%d" % (kind, self.runs)
        procs, c, pids = [], None, []
        try:
            if system == "relay":
                procs = self.start_relays(s, instances, name)
                pids = [p.pid for p in procs]
            else:
                c = self.start_debezium(s, name)
                pids = [c.pid]
            warm = self.warm_idle(system, s, topic)
            if kind == "catchup":
                if system == "relay":
                    self.stop_relays(procs)
                    procs = []
                else:
                    c.pause()
            conn, writer_pid = self.writer_conn()
            time.sleep(1.2)  # the warm-up's counters published before the first reading
            stats0 = self.meter.table_stats(s.table)
            self.meter.start(self.own_where(system), exclude=[writer_pid])
            threads0, wal0 = threads_cpu(pids), self.meter.wal_lsn()
            proc0 = {p: cpu_s(p) for p in pids}
            broker0 = cpu_s(self.kafka.pid(1))
            rss = RssWatch(pids) if kind == "burst" else None
            first, last_commit = self.write_fast(s, n, start=warm, conn=conn)
            start_at = None
            if kind == "catchup":
                start_at = time.time()
                if system == "relay":
                    procs = self.start_relays(s, instances, name + "-up")
                    pids = [p.pid for p in procs]
                    proc0 = dict.fromkeys(pids, 0.0)
                    rss = RssWatch(pids)
                else:
                    c.resume()
                    rss = RssWatch(pids)
            ok = self.wait_appended(topic, warm + n, self.o.timeout)
            if ok and system == "relay":
                self.wait_marked(s)
            pg = self.meter.stop()
            process = sum(cpu_s(p) - proc0.get(p, 0.0) for p in pids)
            broker = cpu_s(self.kafka.pid(1)) - broker0
            threads = {k: v - threads0.get(k, 0.0) for k, v in threads_cpu(pids).items()}
            wal_bytes = self.meter.wal_lsn() - wal0
            time.sleep(1.2)  # the backends' counters are published once a second
            stats1 = self.meter.table_stats(s.table)
            rss_mib = rss.stop()
            conn.close()
        finally:
            if procs:
                self.stop_relays(procs)
            if c is not None:
                self.stop_debezium(c, s)
        last = self.last_append(topic)
        s.drop()
        since = first if kind == "burst" else start_at
        return self.record(
            row=kind, system=system, instances=instances, round=rnd, events=n,
            warm_events=warm, complete=ok, seconds=last - since, events_per_s=n / (last - since),
            drained_after_last_commit_s=last - last_commit,
            writer_events_per_s=n / (last_commit - first) if last_commit > first else None,
            cpu_us_per_event={"process": process / n * 1e6, "pg_own": pg["pg_own"] / n * 1e6,
                              "pg_all_but_writer": pg["pg_all"] / n * 1e6,
                              "broker": broker / n * 1e6},
            pg_own_backends=pg["pg_own_backends"],
            pg_own_us_per_event_by_connection={k: round(v / n * 1e6, 1) for k, v in
                                               sorted(pg["pg_own_by_connection"].items())},
            threads_us_per_event={k: round(v / n * 1e6, 2) for k, v in
                                  sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0},
            wal_bytes_per_event=wal_bytes / n, rss_mib=rss_mib,
            table_stats_during={k: stats1.get(k, 0) - stats0.get(k, 0) for k in stats1})

    # ------------------------------------------------------------ D2

    def latency(self, system, rate, rnd=0):
        s, topic = self.new_table("lat%d" % rate)
        procs, c = [], None
        try:
            if system == "relay":
                procs = self.start_relays(s, 1, "lat-%d" % self.runs)
            else:
                c = self.start_debezium(s, "lat-%d" % self.runs)
            self.meter.start(self.own_where(system))
            commits, achieved = self.write_steady(s, rate, self.o.latency_seconds,
                                                  self.o.warmup)
            total = s.count()
            ok = self.wait_appended(s.schema + ".Order", total, 120)
            pg = self.meter.stop()
        finally:
            if procs:
                self.stop_relays(procs)
            if c is not None:
                self.stop_debezium(c, s)
        lat = sorted(t / 1000.0 - commits[eid] for t, eid in self.read(topic) if eid in commits)
        s.drop()
        n = len(commits)
        return self.record(row="latency", system=system, offered_per_s=rate, round=rnd,
                           achieved_per_s=achieved, events=n, seen=len(lat), complete=ok,
                           p50_ms=pct(lat, 50) * 1e3, p99_ms=pct(lat, 99) * 1e3,
                           max_ms=lat[-1] * 1e3 if lat else None,
                           pg_own_us_per_event=pg["pg_own"] / total * 1e6)

    # ------------------------------------------------------------ D5

    def startup(self, system, waiting=1000):
        s, topic = self.new_table("start")
        if system == "relay":
            self.write_fast(s, waiting)
            t0 = time.time()
            procs = self.start_relays(s, 1, "start-%d" % self.runs)
            ok = self.wait_appended(topic, waiting, 60)
            self.stop_relays(procs)
            ready_s = None
        else:
            # A first start creates the slot and stores offsets; the measured one
            # is a restart with events written while Connect was down.
            cdir = os.path.join(self.out, "connect-start-%s" % s.schema)
            c = self.start_debezium(s, "start-%d" % self.runs, cdir=cdir)
            self.stop_debezium(c, s, drop=False)
            self.write_fast(s, waiting)
            t0 = time.time()
            c = self.start_debezium(s, "start-%d" % self.runs, cdir=cdir)
            ready_s = c.start_s
            ok = self.wait_appended(topic, waiting, 120)
            self.stop_debezium(c, s)
        first = min(t for t, _ in self.read(topic)) / 1000.0
        s.drop()
        return self.record(row="startup", system=system, waiting=waiting, complete=ok,
                           first_event_s=first - t0, running_s=ready_s)

    def run(self, only=("burst", "catchup", "latency", "startup")):
        for rnd in range(self.o.rounds):
            def alternate(systems):
                return systems if rnd % 2 == 0 else list(reversed(systems))
            log("round %d of %d" % (rnd + 1, self.o.rounds))
            if "burst" in only:
                for system, inst in alternate([("relay", i) for i in self.o.burst_relays]
                                              + [("debezium", 1)]):
                    self.scenario("burst", system, inst, rnd)
            if "catchup" in only:
                for system, inst in alternate([("relay", i) for i in self.o.catchup_relays]
                                              + [("debezium", 1)]):
                    self.scenario("catchup", system, inst, rnd)
            if "latency" in only:
                for rate in self.o.rates:
                    for system in alternate(["relay", "debezium"]):
                        self.latency(system, rate, rnd)
        if "startup" in only:
            for system in ("relay", "debezium"):
                self.startup(system)
        self.results["targets"] = targets(self.results)
        return self.results


class RssWatch:
    """Peak VmHWM (MiB) of a set of processes, read every second (VmHWM is the
    kernel's own peak, so the interval only has to catch each process alive)."""

    def __init__(self, pids):
        self.pids = pids
        self.peak = dict.fromkeys(pids, 0.0)
        self.ev = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _sample(self):
        for p in self.pids:
            self.peak[p] = max(self.peak[p], hwm_mib(p))

    def _run(self):
        while not self.ev.wait(1.0):
            self._sample()

    def stop(self):
        self._sample()
        self.ev.set()
        self.t.join()
        return max(self.peak.values())


def _http_ok(port):
    import urllib.request
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=2):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------- tables

def _select(runs, **kw):
    return [r for r in runs if all(r.get(k) == v for k, v in kw.items())]


def _med(runs, key, **kw):
    """Median of a figure over the matching runs (key may be a path a.b)."""
    vals = []
    for r in _select(runs, **kw):
        v = r
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        vals.append(v)
    return median(vals)


def _round_ratio(runs, key, a, b):
    """Median over rounds of (figure of runs a) / (figure of runs b), a and b
    dicts selecting one run per round."""
    ratios = []
    for rnd in sorted({r["round"] for r in runs if r.get("round") is not None}):
        x, y = _med(runs, key, round=rnd, **a), _med(runs, key, round=rnd, **b)
        if x is not None and y:
            ratios.append(x / y)
    return median(ratios)


def _fmt(v, spec="%.1f"):
    return spec % v if v is not None else "-"


def table(res):
    """Markdown rows of group D: figure, outbox-relay, Debezium, ratio (medians
    over the rounds; ratios: median of each round's ratio)."""
    runs = res["runs"]
    out = ["| # | measurement (median of %d round%s) | outbox-relay | Debezium |"
           " outbox-relay / Debezium |" % (res["rounds"], "s" if res["rounds"] > 1 else ""),
           "|---|---|---|---|---|"]
    dbz_sel = {"system": "debezium"}
    for kind, label, num in (("burst", "burst after idle statistics", "D1"),
                             ("catchup", "catch-up of a backlog", "D6")):
        insts = sorted({r["instances"] for r in _select(runs, row=kind, system="relay")})
        d = _select(runs, row=kind, **dbz_sel)
        for i in insts:
            rel = {"row": kind, "system": "relay", "instances": i}
            dsel = {"row": kind, **dbz_sel}
            n = _select(runs, **rel)[0]["events"]
            out.append("| %s | %s, %dk events, %d relay%s vs 1 task: events/s | %s | %s | %s |"
                       % (num, label, n // 1000, i, "s" if i > 1 else "",
                          _fmt(_med(runs, "events_per_s", **rel), "%.0f"),
                          _fmt(_med(runs, "events_per_s", **dsel), "%.0f") if d else "-",
                          _fmt(_round_ratio(runs, "events_per_s", rel, dsel), "%.2f")))
            if kind == "burst":
                out.append("| %s | ... drained, last append - last COMMIT (s); writer alone"
                           " %s / %s events/s | %s | %s | |"
                           % (num, _fmt(_med(runs, "writer_events_per_s", **rel), "%.0f"),
                              _fmt(_med(runs, "writer_events_per_s", **dsel), "%.0f"),
                              _fmt(_med(runs, "drained_after_last_commit_s", **rel), "%.2f"),
                              _fmt(_med(runs, "drained_after_last_commit_s", **dsel), "%.2f")))
            for part, what in (("process", "process"),
                               ("pg_own", "PostgreSQL, the system's own backends"),
                               ("pg_all_but_writer", "PostgreSQL, all but the writer's backend"),
                               ("broker", "broker")):
                key = "cpu_us_per_event." + part
                out.append("| D3 | ... CPU µs per event, %s | %s | %s | %s |"
                           % (what, _fmt(_med(runs, key, **rel)),
                              _fmt(_med(runs, key, **dsel)),
                              _fmt(_round_ratio(runs, key, rel, dsel), "%.2f")))
            conns = sorted({c for r in _select(runs, **rel)
                            for c in r.get("pg_own_us_per_event_by_connection", {})})
            if conns:
                out.append("| D3 | ... of which the relay's %s connection%s | %s | | |"
                           % (" / ".join(conns), "s" if len(conns) > 1 else "",
                              " / ".join(_fmt(_med(runs, "pg_own_us_per_event_by_connection."
                                                   + c, **rel)) for c in conns)))
    for rate in sorted({r["offered_per_s"] for r in runs if r["row"] == "latency"}):
        rel = {"row": "latency", "system": "relay", "offered_per_s": rate}
        dsel = {"row": "latency", "system": "debezium", "offered_per_s": rate}
        out.append("| D2 | latency at %d/s offered: achieved events/s | %s | %s | |"
                   % (rate, _fmt(_med(runs, "achieved_per_s", **rel), "%.0f"),
                      _fmt(_med(runs, "achieved_per_s", **dsel), "%.0f")))
        for q in ("p50", "p99", "max"):
            key = q + "_ms"
            out.append("| D2 | ... commit -> append, %s (ms) | %s | %s | %s |"
                       % (q, _fmt(_med(runs, key, **rel)), _fmt(_med(runs, key, **dsel)),
                          _fmt(_round_ratio(runs, key, rel, dsel), "%.2f")))
    rel_rss = [r["rss_mib"] for r in runs if r.get("rss_mib") and r["system"] == "relay"]
    dbz_rss = [r["rss_mib"] for r in runs if r.get("rss_mib") and r["system"] == "debezium"]
    if rel_rss and dbz_rss:
        out.append("| D4 | peak RSS in D1/D6 (MiB; relay: largest instance, Connect %s) |"
                   " %.1f | %.1f | %.3f |" % (res.get("connect_heap"), max(rel_rss),
                                              max(dbz_rss), max(rel_rss) / max(dbz_rss)))
    r, d5 = _select(runs, row="startup", system="relay"), _select(runs, row="startup",
                                                                  system="debezium")
    if r and d5:
        r, d5 = r[-1], d5[-1]
        out.append("| D5 | process start -> first event appended, %d waiting (s; Connect"
                   " RUNNING after %.1f s) | %.2f | %.2f | %.2f |"
                   % (r["waiting"], d5["running_s"] or 0, r["first_event_s"],
                      d5["first_event_s"], r["first_event_s"] / d5["first_event_s"]))
    return "\n".join(out)


def targets(res):
    """[(target, figure text, verdict)] of the issue's targets, from the medians:
    verdict "met", "MISSED" or "not measured"."""
    runs = res["runs"]
    out = []

    def add(target, value, ok, text):
        out.append((target, text if value is not None else "-",
                    "not measured" if value is None else ("met" if ok(value) else "MISSED")))

    b1 = {"row": "burst", "system": "relay", "instances": 1}
    bd = {"row": "burst", "system": "debezium"}
    v = _med(runs, "drained_after_last_commit_s", **b1)
    add("burst: 1 relay drains within %.0f s of the last COMMIT" % BURST_DRAIN_S, v,
        lambda x: x <= BURST_DRAIN_S, "%.2f s" % (v or 0))
    v = _round_ratio(runs, "events_per_s", b1, bd)
    add("burst: 1 relay / Debezium events/s >= %.1f" % BURST_RATIO, v,
        lambda x: x >= BURST_RATIO, "%.2f (%s / %s events/s)"
        % (v or 0, _fmt(_med(runs, "events_per_s", **b1), "%.0f"),
           _fmt(_med(runs, "events_per_s", **bd), "%.0f")))
    c1 = {"row": "catchup", "system": "relay", "instances": 1}
    c2 = {"row": "catchup", "system": "relay", "instances": 2}
    cd = {"row": "catchup", "system": "debezium"}
    v = _round_ratio(runs, "events_per_s", c2, cd)
    add("catch-up: 2 relays / Debezium events/s >= %.1f" % CATCHUP_RATIO, v,
        lambda x: x >= CATCHUP_RATIO, "%.2f (%s / %s events/s)"
        % (v or 0, _fmt(_med(runs, "events_per_s", **c2), "%.0f"),
           _fmt(_med(runs, "events_per_s", **cd), "%.0f")))
    v = _round_ratio(runs, "events_per_s", c2, c1)
    add("catch-up: 2 relays faster than 1", v, lambda x: x > 1.0,
        "%.2f (%s / %s events/s)" % (v or 0, _fmt(_med(runs, "events_per_s", **c2), "%.0f"),
                                     _fmt(_med(runs, "events_per_s", **c1), "%.0f")))
    for rate in (1000, 5000):
        rel = {"row": "latency", "system": "relay", "offered_per_s": rate}
        dsel = {"row": "latency", "system": "debezium", "offered_per_s": rate}
        v = _round_ratio(runs, "p99_ms", rel, dsel)
        add("latency p99 at %d/s <= %.1fx Debezium's" % (rate, P99_RATIO), v,
            lambda x: x <= P99_RATIO, "%.2f (%s / %s ms)"
            % (v or 0, _fmt(_med(runs, "p99_ms", **rel)), _fmt(_med(runs, "p99_ms", **dsel))))
    default = res.get("relay_env", {}).get("OUTBOX_ORDERING", "aggregate") == "aggregate"
    for sel, what in ((b1, "burst, 1 relay"), (c1, "catch-up, 1 relay"),
                      (c2, "catch-up, 2 relays")):
        v = _med(runs, "cpu_us_per_event.pg_own", **sel)
        if not default:
            v = None
        add("PostgreSQL CPU of the relay's backends <= %.0f µs/event, default ordering (%s)"
            % (PG_US_PER_EVENT, what), v, lambda x: x <= PG_US_PER_EVENT,
            "%.1f µs (all but the writer: %s)"
            % (v or 0, _fmt(_med(runs, "cpu_us_per_event.pg_all_but_writer", **sel))))
    rel_rss = [r["rss_mib"] for r in runs if r.get("rss_mib") and r["system"] == "relay"]
    dbz_rss = [r["rss_mib"] for r in runs if r.get("rss_mib") and r["system"] == "debezium"]
    v = max(rel_rss) / max(dbz_rss) if rel_rss and dbz_rss else None
    add("peak RSS < 1/20 of Connect's", v, lambda x: x < RSS_RATIO,
        "%.3f (%.1f / %.1f MiB)" % (v or 0, max(rel_rss or [0]), max(dbz_rss or [0])))
    return out


def targets_table(res):
    rows = res.get("targets") or targets(res)
    out = ["| target | figure | verdict |", "|---|---|---|"]
    out += ["| %s | %s | %s |" % r for r in rows]
    return "\n".join(out)


def add_args(ap, prefix=""):
    """Options of this group (prefix "dbz-" inside bench.py)."""
    ap.add_argument("--%srounds" % prefix, type=int, default=3,
                    help="rounds of every scenario, systems alternated (medians reported)")
    ap.add_argument("--%sburst-events" % prefix, type=int, default=100000,
                    help="events of a D1 burst")
    ap.add_argument("--%scatchup-events" % prefix, type=int, default=200000,
                    help="events committed while the systems are stopped (D6)")
    ap.add_argument("--%sburst-relays" % prefix, default="1",
                    help="relay instance counts of D1, e.g. 1,2")
    ap.add_argument("--%scatchup-relays" % prefix, default="1,2",
                    help="relay instance counts of D6")
    ap.add_argument("--%spartitions" % prefix, type=int, default=6,
                    help="partitions of every topic of the group")
    ap.add_argument("--%sconnect-heap" % prefix, default="-Xms256M -Xmx1g",
                    help="the Connect JVM's heap options (CONNECT_HEAP_OPTS)")
    ap.add_argument("--%srates" % prefix, default="1000,5000",
                    help="offered rates of the latency rows, events/s")
    ap.add_argument("--%swarmup" % prefix, type=float, default=10.0,
                    help="seconds of steady load before the latency window")
    ap.add_argument("--%swarm-events" % prefix, type=int, default=None,
                    help="events drained before the idle ANALYZE of D1/D6"
                         " (default: a tenth of --burst-events)")
    ap.add_argument("--%sno-analyze" % prefix, action="store_true",
                    help="no ANALYZE at the end of the latency rows' warm-up")
    ap.add_argument("--%stimeout" % prefix, type=float, default=900.0,
                    help="longest wait for a run's last event")
    ap.add_argument("--%sfsync" % prefix, default=os.environ.get("PG_FSYNC", "off"),
                    choices=("on", "off"))
    ap.add_argument("--dbz-set", action="append", default=[], metavar="KEY=VALUE",
                    help="Debezium connector setting (repeatable)")
    ap.add_argument("--dbz-worker", action="append", default=[], metavar="KEY=VALUE",
                    help="Kafka Connect worker setting (repeatable)")


def options(args, out, relay, relay_env, prefix=""):
    """The namespace Group reads, from parsed arguments."""
    g = lambda k: getattr(args, (prefix + k).replace("-", "_"))  # noqa: E731
    DBZ_CONNECTOR.update(kv.split("=", 1) for kv in args.dbz_set)
    DBZ_WORKER.update(kv.split("=", 1) for kv in args.dbz_worker)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    return argparse.Namespace(out=out, relay=relay, relay_env=relay_env,
                              rounds=g("rounds"), burst_events=g("burst-events"),
                              catchup_events=g("catchup-events"),
                              burst_relays=ints(g("burst-relays")),
                              catchup_relays=ints(g("catchup-relays")),
                              partitions=g("partitions"), connect_heap=g("connect-heap"),
                              aggregates=args.aggregates, batch=args.batch,
                              latency_seconds=args.latency_seconds,
                              rates=ints(g("rates")),
                              warmup=g("warmup"), timeout=g("timeout"), fsync=g("fsync"),
                              analyze=not g("no-analyze"),
                              warm_events=g("burst-events") // 10 if g("warm-events") is None
                              else g("warm-events"))


def run(opts, only=("burst", "catchup", "latency", "startup")):
    g = Group(opts)
    try:
        return g.run(only)
    finally:
        with open(os.path.join(opts.out, "results-debezium.json"), "w") as f:
            json.dump(g.results, f, indent=1)
        g.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--relay", default=os.path.join(ROOT, "build-bench", "outbox", "relay",
                                                    "outbox-relay"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--aggregates", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--latency-seconds", type=float, default=20)
    ap.add_argument("--only", default="burst,catchup,latency,startup")
    ap.add_argument("--relay-env", action="append", default=[], metavar="NAME=VALUE")
    add_args(ap)
    args = ap.parse_args()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.relay)), "..",
                                   "bench-results", "debezium-" + time.strftime("%Y%m%d-%H%M%S"))
    opts = options(args, os.path.abspath(out), os.path.abspath(args.relay),
                   dict(kv.split("=", 1) for kv in args.relay_env))
    res = run(opts, args.only.split(","))
    print_tables(res)
    print("raw results and logs: %s" % opts.out)


def print_tables(res):
    print("versions: %s; Connect heap %s; Debezium connector %s; worker %s; relay env %s;"
          " ordering %s" % (res["versions"], res["connect_heap"],
                            json.dumps(res["dbz_connector"]), json.dumps(res["dbz_worker"]),
                            json.dumps(res["relay_env"]), res["ordering"]))
    print(table(res))
    print()
    print(targets_table(res))


if __name__ == "__main__":
    main()
