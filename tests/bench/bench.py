#!/usr/bin/python3
"""tests/bench/bench.py - every benchmark row, in one run, as one table.

Run through tests/bench/run (it builds the programs first). Starts its own
throwaway PostgreSQL (deploy/local/pg, never the test suite's server), one
outbox-mockbroker per scenario and, for rows 2 and 4, one Apache Kafka node
(deploy/local/kafka, a fresh topic per run) beside it (--brokers); everything
is measured in this one run:

  1 ceiling   the relay's own lock/mark statements (outbox-bench-sqlcycle,
              linked to outbox-common) draining the backlog, 1 and 2 clients
  2 relay     outbox-relay draining the same backlog, 1 and 2 instances
              (each broker of --brokers: the mock cluster, Apache Kafka)
  3 backlog   time to lock one batch with 10k and with 1M pending rows
  4 latency   steady 1k events/s of single-row insert transactions, commit -> ack
              (each broker of --brokers)
  5 rss       relay VmRSS/VmHWM during the relay runs
  6 hot       200k events over 10 aggregates
  7 blocked   (beyond the issue) 20k events drained while 100k versions wait
              behind one DEAD row, without and with the sweeper's parking
  9 stale     row 2's drain (1 instance, mock) of a backlog that came after
              the planner's statistics were taken on an all-published table
              (autovacuum analyzed while the outbox was idle)
  8 big       1500 events of ~900 kB JSON each (message.max.bytes 2000000,
              defaults otherwise) on Apache Kafka: the relay's peak RSS (bounded
              by OUTBOX_BATCH_BYTES) and its rate
  D debezium  outbox-relay against Debezium on a PostgreSQL and an Apache Kafka
              broker of its own (tests/bench/debezium/compare.py, rows D1-D6: a
              burst after idle statistics, a catch-up of a backlog, latency, CPU,
              RSS, start-up; --dbz-rounds rounds, systems alternated)

fsync off first, then the server is restarted with fsync on and rows 1, 2
(and 4) are measured again. Rates are rows / (max(published_at) -
min(last_attempt_at)) read from the table, the same formula for the ceiling
and the relay, so process start-up is not counted for either. The targets'
pair (ceiling with 2 clients, relay with 2 instances) runs --repeat times,
alternating, and each relay run's ratio is taken against the ceiling run just
before it; the table gives medians.
"""

import argparse
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
os.environ.pop("OUTBOX_TEST_DATABASE_URL", None)  # never the test suite's server

import harness  # noqa: E402
import kafka_dump  # noqa: E402
import psycopg2  # noqa: E402

TOPIC = "outbox.event.Order"  # OUTBOX_TOPIC_TEMPLATE default with aggregate_type Order
PAYLOAD_BYTES = 500


def log(msg):
    print("bench: %s" % msg, file=sys.stderr, flush=True)


def loadavg():
    return "%.2f %.2f %.2f" % os.getloadavg()


def pct(values, q):
    """Nearest-rank percentile of a sorted list."""
    if not values:
        return float("nan")
    k = max(0, min(len(values) - 1, int(round(q / 100.0 * len(values) + 0.5)) - 1))
    return values[k]


# ---------------------------------------------------------------- database

class Db:
    def __init__(self, pg, checkpoint=True):
        self.pg = pg
        self.schemas = []
        self.checkpoint = checkpoint

    def new_table(self, name):
        s = harness.TestSchema(self.pg, name)
        self.schemas.append(s)
        return s

    def load(self, s, n, aggregates, payload_bytes=PAYLOAD_BYTES, chunk=50000, stale=False):
        """n rows, round robin over `aggregates` aggregates (version = g / aggregates
        + 1), ~payload_bytes of JSON each; due times 1 us apart in insert order, in
        the past. VACUUM (ANALYZE) and CHECKPOINT after, so neither they nor an
        insert-triggered autovacuum fall into the runs."""
        t0 = time.monotonic()
        # Fixed part of the payload is ~150 bytes; the note pads it with hex
        # (md5 of the row number: half compressible, like real ids/text).
        pad = max(0, payload_bytes - 150)
        reps = pad // 32 + 1
        sql = """
        INSERT INTO {t} (aggregate_type, aggregate_id, aggregate_version, event_type,
                         payload_json, occurred_at, available_at, created_at)
        SELECT 'Order', 'order-' || (g %% %(a)s), g / %(a)s + 1, 'OrderChanged',
               jsonb_build_object('order_id', 'order-' || (g %% %(a)s), 'seq', g,
                   'status', 'CONFIRMED', 'currency', 'EUR', 'amount', (g %% 100000) / 100.0,
                   'customer', jsonb_build_object('id', 'c-' || (g %% 7919), 'tier', 'gold'),
                   'note', left(repeat(md5(g::text), %(reps)s), %(pad)s)),
               ts, ts, ts
        FROM (SELECT g, now() - interval '1 hour' + g * interval '1 microsecond' AS ts
              FROM generate_series(%(lo)s, %(hi)s) g) x
        """.format(t=s.table)
        with s.conn.cursor() as cur:
            if stale:
                # statistics of an idle outbox: every row published
                cur.execute(sql.replace("now() - interval '1 hour'", "now() - interval '2 hours'"),
                            {"a": aggregates, "pad": pad, "reps": reps, "lo": -n, "hi": -1})
                cur.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now()"
                            " WHERE published_at IS NULL" % s.table)
                cur.execute("VACUUM (ANALYZE) %s" % s.table)
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk) - 1
                cur.execute(sql, {"a": aggregates, "pad": pad, "reps": reps, "lo": lo, "hi": hi})
            if not stale:  # (a burst arrives before autovacuum looks again)
                cur.execute("VACUUM (ANALYZE) %s" % s.table)
            if self.checkpoint:
                cur.execute("CHECKPOINT")
            cur.execute("SELECT avg(octet_length(payload_json::text)) FROM %s" % s.table)
            avg = float(cur.fetchone()[0])
        log("loaded %d rows (%d aggregates, payload %.0f B) in %.1fs"
            % (n, aggregates, avg, time.monotonic() - t0))
        return avg

    @staticmethod
    def drain_stats(s):
        """(published rows, seconds between first lock and last mark, seconds
        between first lock and first mark)."""
        r = s.execute("SELECT count(*) AS n, extract(epoch FROM max(published_at)"
                      " - min(last_attempt_at))::float8 AS secs,"
                      " extract(epoch FROM min(published_at) - min(last_attempt_at))::float8"
                      " AS first FROM %s WHERE status = 'PUBLISHED'" % s.table)[0]
        return r["n"], r["secs"] or 0.0, r["first"] or 0.0

    def drop_all(self):
        for s in self.schemas:
            try:
                s.drop()
            except Exception as e:  # server restarted in between: not fatal
                log("drop %s: %s" % (s.schema, e))
        self.schemas = []


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def proc_stat(pid):
    """The fields of /proc/PID/stat after the command name (fields[1] is the
    parent's pid, fields[11:15] utime, stime, cutime, cstime in clock ticks),
    or None when the process is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


# ---------------------------------------------------------------- relay processes

class RssSampler(threading.Thread):
    # VmHWM is exact whatever the interval; a slow sampler keeps the bench's
    # own CPU out of the relays' way (the ceiling runs have no sampler).
    def __init__(self, pids, interval=0.2):
        super().__init__(daemon=True)
        self.pids, self.interval = pids, interval
        self.max_rss_kb = dict.fromkeys(pids, 0)
        self.hwm_kb = dict.fromkeys(pids, 0)
        self.stop_ev = threading.Event()

    @staticmethod
    def read(pid):
        out = {}
        try:
            with open("/proc/%d/status" % pid) as f:
                for line in f:
                    if line.startswith(("VmRSS:", "VmHWM:")):
                        k, v = line.split(":", 1)
                        out[k] = int(v.split()[0])
        except OSError:
            pass
        return out

    def sample(self):
        for pid in self.pids:
            st = self.read(pid)
            self.max_rss_kb[pid] = max(self.max_rss_kb[pid], st.get("VmRSS", 0))
            self.hwm_kb[pid] = max(self.hwm_kb[pid], st.get("VmHWM", 0))

    def run(self):
        while not self.stop_ev.is_set():
            self.sample()
            self.stop_ev.wait(self.interval)

    @staticmethod
    def cpu_s(pid):
        """utime + stime of a process, seconds."""
        fields = proc_stat(pid)
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS if fields else 0.0

    def stop(self):
        self.sample()  # VmHWM just before the relays exit
        self.cpu = sum(self.cpu_s(p) for p in self.pids)
        self.stop_ev.set()
        self.join()


class CpuWindow:
    """Where the machine's CPU went between the constructor and stop(): busy
    core-seconds from /proc/stat, the bench's own share (its PostgreSQL server
    with every backend and parallel worker, its child processes: relays,
    broker, sqlcycle; and itself) and the rest, "other": whatever else runs on
    the shared machine. A pair whose runs had other work beside them compares
    two differently loaded machines."""
    def __init__(self, pg_dir, extra_pids=()):
        self.pg_dir, self.extra_pids = pg_dir, set(extra_pids)  # e.g. a broker's JVM
        self.t0, self.busy0, self.own0 = time.monotonic(), self.busy(), self.own()

    @staticmethod
    def busy():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        # user nice system idle iowait irq softirq steal: interrupts left out
        # (the bench's own loopback traffic is most of them, and no process is
        # charged for them); steal is another guest's work on these cores
        return (v[0] + v[1] + v[2] + v[7]) / CLOCK_TICKS

    def own(self):
        try:
            with open(os.path.join(self.pg_dir, "data", "postmaster.pid")) as f:
                roots = {int(f.readline()), os.getpid()} | self.extra_pids
        except (OSError, ValueError):
            roots = {os.getpid()} | self.extra_pids
        ticks = 0
        for name in os.listdir("/proc"):
            fields = proc_stat(int(name)) if name.isdigit() else None
            if fields and (int(name) in roots or int(fields[1]) in roots):
                # utime + stime + the reaped children's cutime + cstime
                ticks += sum(int(x) for x in fields[11:15])
        # this process's reaped children are in its cutime already
        return ticks / CLOCK_TICKS

    def stop(self):
        wall, busy = time.monotonic() - self.t0, self.busy() - self.busy0
        own = self.own() - self.own0
        return {"cpu_window_s": wall, "busy_cpu_s": busy, "other_cpu_s": max(0.0, busy - own)}


def scrape(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        return r.read().decode()


def metric_sum(text, name):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def histogram(text, name):
    """[(le, cumulative count)] of a Prometheus histogram (no labels)."""
    out = []
    for line in text.splitlines():
        m = re.match(r'%s_bucket\{le="([^"]+)"\} (\S+)' % re.escape(name), line)
        if m:
            le = float("inf") if m.group(1) == "+Inf" else float(m.group(1))
            out.append((le, float(m.group(2))))
    return sorted(out)


def hist_quantile(buckets, q):
    """histogram_quantile() as Prometheus computes it (linear within a bucket)."""
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0)
        prev_le, prev_c = le, c
    return prev_le


class Broker:
    """The broker of one run: kind ("mock" or "apache"), bootstrap, the
    broker process's pid, the run's topic and the relays' extra environment."""

    def __init__(self, kind, bootstrap, pid, topic, env):
        self.kind, self.bootstrap, self.pid, self.topic, self.env = \
            kind, bootstrap, pid, topic, env


class Relays:
    """n outbox-relay processes on one table, each with its own /metrics port."""

    def __init__(self, bench, s, n, broker, name, extra_env=None):
        self.ports, self.procs = [], []
        for i in range(n):
            port = harness.free_port()
            env = {**s.env(), "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
                   "OUTBOX_HTTP_ADDR": "127.0.0.1:%d" % port, "OUTBOX_LOG_LEVEL": "warn",
                   "OUTBOX_LOG_FORMAT": "text", "OUTBOX_RELAY_ID": "%s-%d" % (name, i),
                   "OUTBOX_BATCH_SIZE": str(bench.batch), **bench.relay_env,
                   **(extra_env or {})}
            self.procs.append(harness.Relay(bench.relay_bin, env=env, log_dir=bench.out_dir,
                                            name="%s-%d" % (name, i)))
            self.ports.append(port)
        self.rss = RssSampler([p.pid for p in self.procs])
        self.rss.start()
        for port, p in zip(self.ports, self.procs):
            harness.wait_until(lambda: p.running() and scrape(port), 15,
                               what="relay /metrics on %d" % port)

    def published(self):
        return sum(metric_sum(scrape(p), "outbox_events_published_total") for p in self.ports)

    def metric(self, name):
        return sum(metric_sum(scrape(p), name) for p in self.ports)

    def wait_published(self, n, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(not p.running() for p in self.procs):
                raise RuntimeError("a relay exited: %s" % self.procs[0].log_text()[-2000:])
            if self.published() >= n:
                return True
            time.sleep(0.25)  # rates come from the table's timestamps, not from this poll
        return False

    def stop(self):
        self.rss.stop()
        codes = [p.stop(timeout=60) for p in self.procs]
        if any(codes):
            raise RuntimeError("relay exit codes %s" % codes)
        return {"rss_max_mib": max(self.rss.max_rss_kb.values()) / 1024.0,
                "hwm_mib": max(self.rss.hwm_kb.values()) / 1024.0,
                "relay_cpu_s": self.rss.cpu}


def broker_counts(bootstrap, topic):
    """(messages retained in the broker, messages ever appended) over all partitions."""
    from kafka import KafkaConsumer, TopicPartition
    c = KafkaConsumer(bootstrap_servers=bootstrap, api_version=kafka_dump.API_VERSION)
    try:
        parts = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or [])]
        beg, end = c.beginning_offsets(parts), c.end_offsets(parts)
        return sum(end[p] - beg[p] for p in parts), sum(end.values())
    finally:
        c.close()


# ---------------------------------------------------------------- scenarios

class Bench:
    def __init__(self, args):
        self.args = args
        self.build = os.path.abspath(args.build)
        self.relay_bin = args.relay or find_bin(self.build, "relay/outbox-relay")
        self.mock_bin = find_bin(self.build, "deploy/local/outbox-mockbroker")
        self.sweeper_bin = find_bin(self.build, "sweeper/outbox-sweeper")
        self.sqlcycle = find_bin(self.build, "outbox-bench-sqlcycle",
                                 "tests/bench/outbox-bench-sqlcycle")
        self.out_dir = os.path.abspath(args.out)
        os.makedirs(self.out_dir, exist_ok=True)
        self.batch = args.batch
        self.relay_env = dict(kv.split("=", 1) for kv in args.relay_env)
        self.n = args.events
        self.results = {"machine": machine(), "batch": self.batch, "events": self.n,
                        "relay": self.relay_bin, "relay_env": self.relay_env, "runs": []}
        os.environ["PG_FSYNC"] = "off"
        self.pg = harness.Postgres()  # its own server in a temporary directory
        self.db = Db(self.pg)
        self.apache = None  # the Apache Kafka node, started at its first run
        self.topics = itertools.count(1)

    def record(self, **kw):
        kw["load"] = loadavg()
        kw["fsync"] = os.environ["PG_FSYNC"]
        self.results["runs"].append(kw)
        log("result %s" % json.dumps(kw))
        return kw

    def backend_cpu(self):
        """CPU seconds used so far by the relays' PostgreSQL backends."""
        with self.pg.connect() as c, c.cursor() as cur:
            cur.execute("SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'outbox-relay%'")
            pids = [r[0] for r in cur.fetchall()]
        c.close()
        return sum(RssSampler.cpu_s(p) for p in pids)

    @contextlib.contextmanager
    def broker(self, partitions, kind="mock", topic_config=None):
        """A broker with an empty topic of `partitions` for one run: a fresh
        mock cluster, or a fresh topic on the bench's Apache Kafka node (a JVM
        with its heap and JIT warm from the runs before, as in production).
        Yields a Broker: .bootstrap, .pid, .topic, .env (for the relays)."""
        if kind == "mock":
            with harness.MockBroker(["%s:%d" % (TOPIC, partitions)], log_dir=self.out_dir,
                                    binary=self.mock_bin) as m:
                yield Broker(kind, m.bootstrap, m.proc.pid, TOPIC, {})
            return
        if self.apache is None:
            # A production-like JVM (G1, full JIT, 1 GiB heap) unless told otherwise.
            os.environ.setdefault("KAFKA_HEAP", "1g")
            os.environ.setdefault("KAFKA_JVM_OPTS", "-XX:+UseG1GC -XX:MaxGCPauseMillis=20")
            t0 = time.monotonic()
            self.apache = harness.KafkaCluster(nodes=1)
            self.results["kafka_version"] = self.kafka_version()
            self.results["kafka_jvm"] = "%s heap, %s" % (os.environ["KAFKA_HEAP"],
                                                         os.environ["KAFKA_JVM_OPTS"])
            log("Apache Kafka %s up in %.1fs: %s" % (self.results["kafka_version"],
                                                    time.monotonic() - t0, self.apache.bootstrap))
            self.warm_up(partitions)
        prefix = "bench.run%d" % next(self.topics)
        topic = prefix + ".Order"  # OUTBOX_TOPIC_TEMPLATE below, aggregate_type Order
        self.apache.create_topic(topic, partitions, config=topic_config)
        yield Broker(kind, self.apache.bootstrap, self.apache.pid(1), topic,
                     {"OUTBOX_TOPIC_TEMPLATE": prefix + ".{aggregate_type}"})

    def warm_up(self, partitions, n=200000):
        """Produces n messages of the bench's size into a topic of their own,
        so the first measured run does not pay for the JVM's JIT and the
        broker's first segments."""
        from confluent_kafka import Producer
        t0 = time.monotonic()
        self.apache.create_topic("bench.warmup", partitions)
        p = Producer({"bootstrap.servers": self.apache.bootstrap, "acks": "all",
                      "enable.idempotence": True, "linger.ms": 5, "compression.type": "zstd",
                      "log_level": 0})
        value = b"x" * PAYLOAD_BYTES
        for i in range(n):
            while True:
                try:
                    p.produce("bench.warmup", value, key=b"order-%d" % (i % 2000))
                    break
                except BufferError:
                    p.poll(0.05)
            if i % 10000 == 0:
                p.poll(0)
        left = p.flush(120)
        log("warm-up: %d messages in %.1fs (%d undelivered)" % (n, time.monotonic() - t0, left))

    @staticmethod
    def kafka_version():
        return subprocess.run([harness.KafkaCluster.SCRIPT, "version"], capture_output=True,
                              text=True).stdout.strip()

    def set_fsync(self, on):
        os.environ["PG_FSYNC"] = "on" if on else "off"
        self.pg.restart()
        with self.pg.connect() as c, c.cursor() as cur:
            cur.execute("SHOW fsync")
            log("fsync is now %s" % cur.fetchone()[0])

    # 1
    def ceiling(self, clients, rep=0):
        s = self.db.new_table("ceil%d" % clients)
        self.db.load(s, self.n, self.args.aggregates)
        load = loadavg()
        cw = CpuWindow(self.pg.dir)
        r = subprocess.run([self.sqlcycle, "drain", self.pg.url, s.table, str(self.batch),
                            str(clients), str(self.n)], capture_output=True, text=True,
                           timeout=600)
        cpu = cw.stop()
        if r.returncode:
            raise RuntimeError("sqlcycle: %s" % r.stderr)
        kv = dict(x.split("=", 1) for x in r.stdout.split())
        n, secs, first = self.db.drain_stats(s)
        s.drop()
        return self.record(row="ceiling", clients=clients, rep=rep, rows=n, seconds=secs,
                           rows_per_s=n / secs, first_mark_s=first, load_before=load,
                           wall_rows_per_s=float(kv["rows_per_s"]),
                           lock_ms_avg=float(kv["lock_ms_avg"]),
                           mark_ms_avg=float(kv["mark_ms_avg"]),
                           pg_cpu_s=float(kv["backend_cpu_s"]), **cpu)

    # 2 and 5
    def relay_drain(self, instances, aggregates=None, name="relay", time_box=None, n=None,
                    check_order=False, rep=0, prepare=None, broker="mock",
                    payload_bytes=PAYLOAD_BYTES, env=None, topic_config=None, stale=False):
        n = n or self.n
        aggregates = aggregates or self.args.aggregates
        s = self.db.new_table("%s%d" % (name, instances))
        self.db.load(s, n, aggregates, payload_bytes=payload_bytes, stale=stale)
        extra = prepare(s) if prepare else {}
        with self.broker(self.args.partitions, broker, topic_config) as kafka:
            load = loadavg()
            t0 = time.monotonic()
            broker_cpu0 = RssSampler.cpu_s(kafka.pid)
            cw = CpuWindow(self.pg.dir, [kafka.pid])
            rel = Relays(self, s, instances, kafka, name, {**kafka.env, **(env or {})})
            try:
                done = rel.wait_published(n, time_box or 600)
                mem_cpu = cw.stop()
                batches = rel.metric("outbox_batches_total")
                failed = rel.metric("outbox_events_failed_total")
                pg_cpu = self.backend_cpu()
            finally:
                mem = rel.stop()
            mem["pg_cpu_s"] = pg_cpu
            mem.update(mem_cpu)
            wall = time.monotonic() - t0
            mem["broker_cpu_s"] = RssSampler.cpu_s(kafka.pid) - broker_cpu0
            pub, secs, first = self.db.drain_stats(s)
            log("%s x%d (%s): first mark %.2fs after the first lock, last after %.2fs"
                % (name, instances, broker, first, secs))
            retained, appended = broker_counts(kafka.bootstrap, kafka.topic)
            order = {}
            if retained < appended:
                log("WARNING: broker retained %d of %d messages (per-partition retention):"
                    " G2 not checked on this run" % (retained, appended))
            elif check_order or self.args.check_order:
                t1 = time.monotonic()
                msgs = harness.read_topics(kafka.bootstrap, topics=[kafka.topic], timeout_s=300)
                ok, details = harness.check_order(msgs)
                order = {"order_ok": ok, "order_violations": len(details),
                         "duplicates": harness.count_duplicates(msgs), "read": len(msgs)}
                log("G2 check of %d messages in %.0fs: %s" % (len(msgs), time.monotonic() - t1,
                                                            "ok" if ok else details[:5]))
        s.drop()
        res = dict(row=name, instances=instances, rep=rep, aggregates=aggregates, events=n,
                   broker=broker,
                   rows=pub, seconds=secs, rows_per_s=pub / secs if secs else 0,
                   first_mark_s=first,
                   complete=bool(done), wall_s=wall, batches=batches,
                   avg_batch=pub / batches if batches else 0, failed=failed,
                   broker_retained=retained, broker_appended=appended, load_before=load,
                   **order, **mem, **extra)
        return self.record(**res)

    # 7 (not in the list): a poison row with a long queue behind it
    def blocked(self, park, behind=100000, n=20000):
        """n events over the usual aggregates, drained by one relay while
        `behind` versions of another aggregate, due before all of them, wait
        behind its DEAD version 1; with `park`, one `outbox-sweeper --once`
        parks them first."""
        def prepare(s):
            s.execute("""
                INSERT INTO {t} (aggregate_type, aggregate_id, aggregate_version, event_type,
                                 payload_json, status, available_at, last_error_code,
                                 attempt_count)
                SELECT 'Order', 'stuck', v, 'OrderChanged', '{{}}',
                       CASE WHEN v = 1 THEN 'DEAD' ELSE 'PENDING' END,
                       CASE WHEN v = 1 THEN 'infinity'
                            ELSE now() - interval '2 hours' + v * interval '1 microsecond' END,
                       CASE WHEN v = 1 THEN 'INVALID_HEADERS' END,
                       CASE WHEN v = 1 THEN 1 ELSE 0 END
                FROM generate_series(1, %(b)s + 1) v""".format(t=s.table), {"b": behind})
            s.execute("VACUUM (ANALYZE) %s" % s.table)
            if not park:
                return {"behind": behind, "parked": 0}
            t0 = time.monotonic()
            env = {**os.environ, **s.env(), "OUTBOX_HTTP_ADDR": "off",
                   "OUTBOX_RETENTION_S": "0", "OUTBOX_LOG_LEVEL": "warn"}
            r = subprocess.run([self.sweeper_bin, "--once"], env=env, capture_output=True,
                               text=True, timeout=600)
            if r.returncode:
                raise RuntimeError("sweeper: %s" % r.stderr[-2000:])
            parked = s.execute("SELECT count(*) AS n FROM %s WHERE last_error_code = 'BLOCKED'"
                               % s.table)[0]["n"]
            return {"behind": behind, "parked": parked, "sweep_s": time.monotonic() - t0}
        return self.relay_drain(1, name="blocked", n=n, time_box=300, prepare=prepare,
                                rep=1 if park else 0)

    # 3
    def backlog(self, rows):
        s = self.db.new_table("backlog%d" % rows)
        self.db.load(s, rows, self.args.aggregates)
        load = loadavg()
        r = subprocess.run([self.sqlcycle, "lock", self.pg.url, s.table, str(self.batch),
                            str(self.args.lock_reps)], capture_output=True, text=True,
                           timeout=600)
        if r.returncode:
            raise RuntimeError("sqlcycle: %s" % r.stderr)
        kv = {k: float(v) for k, v in (x.split("=", 1) for x in r.stdout.split())}
        s.drop()
        return self.record(row="backlog", pending=rows, load_before=load, **kv)

    # 4
    def latency(self, rate, seconds, broker="mock"):
        s = self.db.new_table("latency")
        with self.broker(self.args.partitions, broker) as kafka:
            rel = Relays(self, s, 1, kafka, "latency", kafka.env)
            try:
                time.sleep(1.0)  # producer connected, relay idle in its NOTIFY wait
                load = loadavg()
                commits = self.insert_steady(s, rate, seconds)
                total = len(commits)
                ok = rel.wait_published(total, 60)
                text = scrape(rel.ports[0])
            finally:
                mem = rel.stop()
        rows = s.execute("SELECT outbox_id::text AS id,"
                         " extract(epoch FROM published_at)::float8 AS pub,"
                         " extract(epoch FROM occurred_at)::float8 AS occ FROM %s"
                         " WHERE status = 'PUBLISHED'" % s.table)
        s.drop()
        commit_lat = sorted((r["pub"] - commits[r["id"]]) * 1e3 for r in rows if r["id"] in commits)
        occ_lat = sorted((r["pub"] - r["occ"]) * 1e3 for r in rows)
        h = histogram(text, "outbox_publish_latency_seconds")
        span = max(commits.values()) - min(commits.values())
        return self.record(row="latency", broker=broker, offered_per_s=rate, events=total,
                           achieved_per_s=total / span if span else 0, complete=ok,
                           p50_ms=pct(commit_lat, 50), p99_ms=pct(commit_lat, 99),
                           max_ms=commit_lat[-1] if commit_lat else None,
                           occ_p50_ms=pct(occ_lat, 50), occ_p99_ms=pct(occ_lat, 99),
                           hist_p50_ms=hist_quantile(h, 0.5) * 1e3,
                           hist_p99_ms=hist_quantile(h, 0.99) * 1e3,
                           load_before=load, **mem)

    def insert_steady(self, s, rate, seconds):
        """Single-row insert transactions at `rate`/s for `seconds`; returns
        {outbox_id: wall time when COMMIT returned}."""
        conn = psycopg2.connect(self.pg.url)
        commits = {}
        sql = ("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
               " payload_json) VALUES ('Order', %%s, %%s, 'OrderChanged', %%s::jsonb)"
               " RETURNING outbox_id::text" % s.table)
        payload = json.dumps({"status": "CONFIRMED", "note": "x" * (PAYLOAD_BYTES - 40)})
        n = int(rate * seconds)
        aggs = self.args.aggregates
        t0 = time.monotonic()
        with conn.cursor() as cur:
            for i in range(n):
                due = t0 + i / rate
                d = due - time.monotonic()
                if d > 0:
                    time.sleep(d)
                cur.execute(sql, ("order-%d" % (i % aggs), i // aggs + 1, payload))
                oid = cur.fetchone()[0]
                conn.commit()
                commits[oid] = time.time()
        conn.close()
        return commits

    def close(self):
        self.db.drop_all()
        self.pg.close()
        if self.apache is not None:
            self.apache.stop()


def find_bin(build, *rels):
    """A program of the standalone bench build (top level under outbox/) or of
    a top-level build."""
    for rel in rels:
        for base in (build, os.path.join(build, "outbox")):
            p = os.path.join(base, rel)
            if os.access(p, os.X_OK):
                return p
    raise RuntimeError("%s not built under %s" % (rels[0], build))


def machine():
    info = {"nproc": os.cpu_count(), "kernel": os.uname().release}
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            info["cpu"] = m.group(1) if m else "?"
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 1048576, 1)
    except OSError:
        pass
    return info


# ---------------------------------------------------------------- table

def add_ratios(runs):
    """Each relay run of row 2 against the ceiling run just before it (same
    rep, clients = instances, same fsync): r["ratio"]."""
    for r in runs:
        if r.get("row") != "relay":
            continue
        c = [x for x in runs if x.get("row") == "ceiling" and x["clients"] == r["instances"]
             and x["fsync"] == r["fsync"] and x.get("rep", 0) == r.get("rep", 0)]
        r["ratio"] = r["rows_per_s"] / c[-1]["rows_per_s"] if c else float("nan")


def table(res):
    runs = res["runs"]
    out = []

    def find(**kw):
        return [r for r in runs if all(r.get(k) == v for k, v in kw.items())]

    def one(**kw):
        f = find(**kw)
        return f[-1] if f else None

    out.append("| # | measurement | fsync | result | target | load (1/5/15 min) |")
    out.append("|---|---|---|---|---|---|")
    def med(rs, key):
        v = sorted(r[key] for r in rs)
        return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2

    def each(rs, fmt, key):
        return "" if len(rs) < 2 else " (runs: %s)" % ", ".join(fmt % r[key] for r in rs)

    def other(rs):
        """Other processes' CPU beside the runs, in cores (min-max)."""
        v = [r["other_cpu_s"] / r["cpu_window_s"] for r in rs if r.get("cpu_window_s")]
        if not v:
            return ""
        return "; other processes %.2f%s cores" % (
            min(v), "" if len(v) < 2 else "-%.2f" % max(v))

    for fs in ("off", "on"):
        for c in (1, 2):
            cs = find(row="ceiling", clients=c, fsync=fs)
            if cs:
                out.append("| 1 | SQL ceiling, %d client%s | %s | %s%.0f rows/s%s (lock %.1f ms, mark %.1f ms per batch%s) | | %s |"
                           % (c, "s" if c > 1 else "", fs, "median " if len(cs) > 1 else "",
                              med(cs, "rows_per_s"), each(cs, "%.0f", "rows_per_s"),
                              med(cs, "lock_ms_avg"), med(cs, "mark_ms_avg"), other(cs),
                              cs[-1]["load"]))
    add_ratios(runs)

    def on(kind):
        return ("mock cluster" if kind == "mock"
                else "Apache Kafka %s" % res.get("kafka_version", ""))

    for fs, kind, i in itertools.product(("off", "on"), ("mock", "apache"), (1, 2)):
        rs = find(row="relay", instances=i, fsync=fs, broker=kind)
        if not rs:
            continue
        # the issue sets the targets with fsync off against the mock cluster
        # and asks for fsync on (and, later, Apache Kafka) to be reported
        tgt = ("" if i == 1 else ">= 0.8 and >= 25k/s" if fs == "off" and kind == "mock"
               else "(reported)")
        cpu = ""
        if all(r.get("relay_cpu_s") for r in rs):
            per = lambda k: sum(r[k] for r in rs) * 1e6 / sum(r["rows"] for r in rs)
            cpu = ", CPU us/row: relays %.0f, broker %.0f" % (per("relay_cpu_s"),
                                                             per("broker_cpu_s"))
            if all(r.get("pg_cpu_s") for r in rs):
                cpu += ", their PG backends %.0f" % per("pg_cpu_s")
        m = "median " if len(rs) > 1 else ""
        ratio = ("" if all(r["ratio"] != r["ratio"] for r in rs)  # nan: no ceiling run
                 else ", %sratio %.2f%s" % (m, med(rs, "ratio"), each(rs, "%.2f", "ratio")))
        out.append("| 2 | relay, %d instance%s, %dk events / %d aggregates, %s | %s | %s%.0f rows/s%s%s (avg batch %.0f%s) | %s | %s |"
                   % (i, "s" if i > 1 else "", rs[0]["events"] // 1000, rs[0]["aggregates"],
                      on(kind), fs,
                      m, med(rs, "rows_per_s"), each(rs, "%.0f", "rows_per_s"), ratio,
                      med(rs, "avg_batch"), cpu + other(rs), tgt, rs[-1]["load"]))
    a, b = one(row="backlog", pending=10000), one(row="backlog", pending=res.get("big_backlog", 1000000))
    if a and b:
        out.append("| 3 | lock one batch: 10k vs %dk pending (median of %d) | off | %.1f ms vs %.1f ms: %.2fx (first lock %.1f vs %.1f ms) | within 2x | %s |"
                   % (b["pending"] // 1000, b["reps"], a["lock_median_ms"], b["lock_median_ms"],
                      b["lock_median_ms"] / a["lock_median_ms"], a["lock_first_ms"],
                      b["lock_first_ms"], b["load"]))
    for fs, kind in itertools.product(("off", "on"), ("mock", "apache")):
        r = one(row="latency", fsync=fs, broker=kind)
        if r:
            out.append("| 4 | latency at %d/s single-row tx, commit -> ack (published_at), %s | %s | p50 %.1f ms, p99 %.1f ms (histogram p50 %.1f / p99 %.1f) | %s | %s |"
                       % (r["offered_per_s"], on(kind), fs, r["p50_ms"], r["p99_ms"],
                          r["hist_p50_ms"], r["hist_p99_ms"],
                          "p99 < 50 ms" if kind == "mock" else "(reported)", r["load"]))
    rs = find(row="relay")
    if rs:
        worst = max(rs, key=lambda r: r["hwm_mib"])
        out.append("| 5 | relay RSS during the %dk runs (batch %d) | all | VmHWM %.1f MiB max (VmRSS sampled max %.1f) | < 64 MiB | %s |"
                   % (worst["events"] // 1000, res["batch"], worst["hwm_mib"],
                      max(r["rss_max_mib"] for r in rs), worst["load"]))
    for r in find(row="blocked"):
        how = ("after one `outbox-sweeper --once` parked %d of them in %.1f s"
               % (r["parked"], r["sweep_s"]) if r["parked"] else "no sweeper: nothing parked")
        out.append("| 7 | %dk events / %d aggregates, 1 instance, %dk versions behind one DEAD row, %s | %s | %.0f rows/s (avg batch %.0f)%s | (document) | %s |"
                   % (r["events"] // 1000, r["aggregates"], r["behind"] // 1000, how, r["fsync"],
                      r["rows_per_s"], r["avg_batch"],
                      "" if r["complete"] else ", time-boxed %.0f s" % r["wall_s"], r["load"]))
    for r in find(row="hot"):
        g2 = ("G2 ok over all %d msgs" % r["read"] if r.get("order_ok")
              else "G2 VIOLATED (%s)" % r.get("order_violations") if "order_ok" in r
              else "%d appended (watermarks), %d retained" % (r["broker_appended"],
                                                              r["broker_retained"]))
        out.append("| 6 | hot: %dk events / %d aggregates, %d instance%s%s | %s | %.0f rows/s (avg batch %.1f), %s | (document) | %s |"
                   % (r["events"] // 1000, r["aggregates"], r["instances"],
                      "s" if r["instances"] > 1 else "",
                      "" if r["complete"] else ", time-boxed %.0f s" % r["wall_s"],
                      r["fsync"], r["rows_per_s"], r["avg_batch"], g2, r["load"]))
    for r in find(row="stale"):
        out.append("| 9 | %dk events / %d aggregates after statistics of an all-published table, 1 instance, mock | %s | %.0f rows/s (avg batch %.0f), PostgreSQL %.0f us/row | (document) | %s |"
                   % (r["events"] // 1000, r["aggregates"], r["fsync"], r["rows_per_s"],
                      r["avg_batch"], r["pg_cpu_s"] / r["rows"] * 1e6 if r["rows"] else 0,
                      r["load"]))
    for r in find(row="big"):
        out.append("| 8 | %d events of ~%.0f kB, 1 instance, Apache Kafka, message.max.bytes 2000000 | %s | VmHWM %.1f MiB, %.1f rows/s (avg batch %.1f)%s | < 128 MiB | %s |"
                   % (r["events"], r.get("payload_kb", 900), r["fsync"], r["hwm_mib"],
                      r["rows_per_s"], r["avg_batch"],
                      "" if r["complete"] else ", time-boxed %.0f s" % r["wall_s"], r["load"]))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--relay", help="outbox-relay binary (default: BUILD/relay/outbox-relay)")
    ap.add_argument("--out", default=None, help="directory for logs and results.json")
    ap.add_argument("--events", type=int, default=200000)
    ap.add_argument("--aggregates", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--partitions", type=int, default=64)
    ap.add_argument("--big-backlog", type=int, default=1000000)
    ap.add_argument("--lock-reps", type=int, default=20)
    ap.add_argument("--latency-rate", type=int, default=1000)
    ap.add_argument("--latency-seconds", type=float, default=20)
    ap.add_argument("--hot-aggregates", type=int, default=10)
    ap.add_argument("--check-order", action="store_true",
                    help="read every relay run's topic back and check G2 (always for row 6)")
    ap.add_argument("--hot-check-events", type=int, default=40000,
                    help="size of the extra hot run whose messages are read back for G2 (0: none)")
    ap.add_argument("--hot-seconds", type=float, default=60,
                    help="time box of the hot-aggregate run")
    ap.add_argument("--only", default="1,2,3,4,5,6,7,8,9,D", help="rows to measure, e.g. 2,6")
    ap.add_argument("--no-fsync-on", action="store_true", help="skip the fsync=on pass")
    ap.add_argument("--brokers", default="mock,apache",
                    help="brokers for rows 2 and 4: mock (librdkafka's mock cluster), apache "
                         "(Apache Kafka, one node; KAFKA_HEAP / KAFKA_JVM_OPTS set its JVM), "
                         "or both (default); the other rows use the mock")
    ap.add_argument("--repeat", type=int, default=5,
                    help="pairs of (ceiling 2 clients, relay 2 instances) per fsync setting; "
                         "the table gives their medians")
    ap.add_argument("--relay-env", action="append", default=[], metavar="NAME=VALUE",
                    help="extra environment for every relay (repeatable), e.g. "
                         "OUTBOX_KAFKA_COMPRESSION_TYPE=lz4")
    sys.path.insert(0, os.path.join(HERE, "debezium"))
    import compare as debezium_rows
    debezium_rows.add_args(ap, prefix="dbz-")
    args = ap.parse_args()
    args.out = args.out or os.path.join(args.build, "bench-results",
                                        time.strftime("%Y%m%d-%H%M%S"))
    only = set(args.only.split(","))
    brokers = [k for k in args.brokers.split(",") if k]
    if not brokers or set(brokers) - {"mock", "apache"}:
        ap.error("--brokers takes mock, apache or mock,apache")
    b = Bench(args)
    b.results["big_backlog"] = args.big_backlog
    try:
        for fsync_on in ((False,) if args.no_fsync_on else (False, True)):
            if fsync_on:
                b.set_fsync(True)
            if "1" in only or "2" in only:
                b.ceiling(1)
            if "2" in only or "5" in only:
                for kind in brokers:
                    b.relay_drain(1, broker=kind)
            # The targets' pair, 2 clients against 2 instances, alternated
            # --repeat times: on a shared machine one pair can be 20 % off.
            # Each broker's relay run is compared with the same ceiling run.
            # (Row 5 alone needs one relay run, not a series.)
            for rep in range(args.repeat if "1" in only or "2" in only else 1):
                if "1" in only or "2" in only:
                    b.ceiling(2, rep=rep)
                if "2" in only or "5" in only:
                    for kind in brokers:
                        b.relay_drain(2, rep=rep, broker=kind)
            if not fsync_on and "3" in only:
                b.backlog(10000)
                b.backlog(args.big_backlog)
            if "4" in only:
                for kind in brokers:
                    b.latency(args.latency_rate, args.latency_seconds, broker=kind)
            if not fsync_on and "7" in only:
                for park in (False, True):
                    b.blocked(park)
            if not fsync_on and "6" in only:
                # 10 keys use at most 10 partitions: 200k events exceed the mock's
                # ~5 MiB per partition, so the rate is counted with watermarks and
                # G2 is checked on a run that fits (--hot-check-events).
                for i in (1, 2):
                    b.relay_drain(i, aggregates=args.hot_aggregates, name="hot",
                                  time_box=args.hot_seconds)
                if args.hot_check_events:
                    b.relay_drain(1, aggregates=args.hot_aggregates, name="hot",
                                  time_box=args.hot_seconds, n=args.hot_check_events,
                                  check_order=True)
        if "9" in only:
            b.relay_drain(1, name="stale", n=min(args.events, 100000), stale=True, time_box=600)
        if "8" in only:
            # The workload that took a relay to 873 MiB when batches were
            # bounded by rows only.
            b.relay_drain(1, name="big", n=1500, aggregates=1500, payload_bytes=900000,
                          broker="apache", time_box=600,
                          env={"OUTBOX_KAFKA_MESSAGE_MAX_BYTES": "2000000"},
                          topic_config={"max.message.bytes": "3000000"})
        if "D" in only:
            b.results["debezium"] = debezium_rows.run(debezium_rows.options(
                args, os.path.join(b.out_dir, "debezium"), b.relay_bin, b.relay_env,
                prefix="dbz-"))
    finally:
        add_ratios(b.results["runs"])
        with open(os.path.join(b.out_dir, "results.json"), "w") as f:
            json.dump(b.results, f, indent=1)
        b.close()
    m = b.results["machine"]
    print("machine: %s, %s cores, %s GiB, kernel %s; relay %s"
          % (m.get("cpu"), m["nproc"], m.get("mem_gib"), m["kernel"], b.relay_bin))
    if "kafka_version" in b.results:
        print("Apache Kafka %s, one KRaft node, JVM %s"
              % (b.results["kafka_version"], b.results["kafka_jvm"]))
    print(table(b.results))
    if "debezium" in b.results:
        d = b.results["debezium"]
        print("\noutbox-relay against Debezium:")
        debezium_rows.print_tables(d)
    print("raw results and logs: %s" % b.out_dir)


if __name__ == "__main__":
    main()
