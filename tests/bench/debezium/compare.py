#!/usr/bin/python3
"""Row group D of tests/bench/run: outbox-relay against Debezium, measured in one run.

Both systems run alone, one after the other, on the same PostgreSQL (one server of
this group's own, wal_level=logical for both, fsync as PG_FSYNC) and the same
single-node Apache Kafka broker (deploy/local/kafka; Kafka's own JVM defaults:
1 GiB heap, G1). Every run has a fresh table and topics with
message.timestamp.type=LogAppendTime, so a record's timestamp is the broker's append
time on this machine's clock.

  D1 throughput   a writer commits N events (500-byte payloads, A aggregates, 100 rows
                  per transaction) as fast as it can while the system runs; the rate
                  is N / (last append - first commit). outbox-relay with 1 and 2
                  instances, Debezium with its one task. Each run first drains N/10
                  warm-up events outside the figures (the JVMs compile their hot
                  paths), then ANALYZE of the table, as autovacuum gives a table in
                  service (--dbz-no-analyze: none; the relay's lock statement is
                  planned much worse without statistics). Also recorded: WAL bytes
                  per event, CPU per thread. The latency rows ANALYZE at the end of
                  their warm-up.
  D2 latency      steady R events/s offered (R/1000 rows per transaction, 1000
                  transactions/s) for S seconds after a warm-up; commit (when COMMIT
                  returned to the writer) -> broker append: p50 / p99 / max. The
                  append time has millisecond resolution.
  D3 CPU          CPU seconds per 10k events in the D1 runs (and at 1000/s): the relay
                  or Connect process, its PostgreSQL backends, the WAL sender
                  (Debezium's logical decoding runs there).
  D4 RSS          peak RSS (VmHWM) of the relay or the Connect JVM in the D1 runs.
  D5 start-up     process start -> first event appended, with 1000 events waiting
                  (Debezium: a restart on a slot and offsets of a previous run).

Debezium runs as tests/bench/debezium/connect starts it (Kafka Connect standalone, the
distribution's JVM defaults: -Xms256M -Xmx2G, G1) with the throughput settings in
DBZ_CONNECTOR / DBZ_WORKER below (--dbz-set / --dbz-worker change them); both are
recorded in results.json.

    compare.py --relay build-bench/relay/outbox-relay [--events 10000 --latency-seconds 5]
"""

import argparse
import json
import os
import shutil
import subprocess
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


def log(msg):
    print("bench D: %s" % msg, file=sys.stderr, flush=True)


def pct(values, q):
    """Nearest-rank percentile of a sorted list."""
    if not values:
        return float("nan")
    k = max(0, min(len(values) - 1, int(round(q / 100.0 * len(values) + 0.5)) - 1))
    return values[k]


def cpu_s(pid):
    """utime + stime of a process in seconds (0 when it is gone)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    except (OSError, IndexError):
        return 0.0


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


class CpuMeter:
    """CPU seconds of groups of processes between start() and stop(); a process
    that appears in between counts from zero. groups(): {name: [pids]} now."""

    def __init__(self, groups):
        self.groups = groups
        self.t0 = {}

    def start(self):
        self.t0 = {pid: cpu_s(pid) for pids in self.groups().values() for pid in pids}

    def stop(self):
        out = {}
        for name, pids in self.groups().items():
            out[name] = sum(cpu_s(p) - self.t0.get(p, 0.0) for p in pids)
        return out


class Group:
    def __init__(self, opts):
        self.o = opts
        self.out = opts.out
        os.makedirs(self.out, exist_ok=True)
        self.pg = harness.Postgres(settings={"PG_WAL_LEVEL": "logical",
                                             "PG_FSYNC": opts.fsync})
        heap = os.environ.get("KAFKA_HEAP")
        jvm = os.environ.get("KAFKA_JVM_OPTS")
        os.environ["KAFKA_HEAP"] = "1g"
        os.environ["KAFKA_JVM_OPTS"] = "-XX:+UseG1GC -XX:MaxGCPauseMillis=20"
        try:
            self.kafka = harness.KafkaCluster()
        finally:
            for k, v in (("KAFKA_HEAP", heap), ("KAFKA_JVM_OPTS", jvm)):
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.runs = 0
        self.wm = None  # the consumer that reads watermarks
        self.results = {"versions": dbz.versions(), "dbz_connector": dict(DBZ_CONNECTOR),
                        "analyze": opts.analyze,
                        "dbz_worker": dict(DBZ_WORKER), "events": opts.events,
                        "aggregates": opts.aggregates, "partitions": opts.partitions,
                        "fsync": opts.fsync, "batch": opts.batch, "runs": []}

    def close(self):
        if self.wm is not None:
            self.wm.close()
        self.kafka.stop()
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

    def pg_pids(self, where):
        with self.pg.connect() as c, c.cursor() as cur:
            cur.execute("SELECT pid FROM pg_stat_activity WHERE " + where)
            pids = [r[0] for r in cur.fetchall()]
        c.close()
        return pids

    def wal_lsn(self):
        """The server's current WAL position, in bytes."""
        with self.pg.connect() as c, c.cursor() as cur:
            cur.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
            v = int(cur.fetchone()[0])
        c.close()
        return v

    def start_relays(self, s, n, name):
        procs = []
        for i in range(n):
            port = harness.free_port()
            env = {**s.env(), "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": self.kafka.bootstrap,
                   "OUTBOX_HTTP_ADDR": "127.0.0.1:%d" % port, "OUTBOX_LOG_LEVEL": "warn",
                   "OUTBOX_LOG_FORMAT": "text", "OUTBOX_RELAY_ID": "%s-%d" % (name, i),
                   "OUTBOX_BATCH_SIZE": str(self.o.batch), "OUTBOX_VALUE_FORMAT": "payload",
                   "OUTBOX_TOPIC_TEMPLATE": "%s.{aggregate_type}" % s.schema,
                   **self.o.relay_env}
            p = harness.Relay(self.o.relay, env=env, log_dir=self.out, name="%s-%d" % (name, i))
            procs.append(p)
            harness.wait_until(lambda: p.running() and _http_ok(port), 15,
                               what="relay /metrics on %d" % port)
        return procs

    def relay_groups(self, procs):
        pids = [p.pid for p in procs]
        return lambda: {"process": pids,
                        "pg_backends": self.pg_pids("application_name = 'outbox-relay'"),
                        "wal_sender": [],
                        "broker": [self.kafka.pid(1)]}

    def start_debezium(self, s, name, cdir=None, slot=None):
        slot = slot or "dbz_%s" % s.schema
        dbz.prepare_database(self.pg, [s.table], "pub_%s" % s.schema)
        # value = the payload, key = the aggregate id, the `id` header only
        settings = dbz.router_settings("%s.${routedByValue}" % s.schema)
        del settings["table.fields.additional.placement"]
        props = dbz.connector_properties(name, self.pg.url, slot, "pub_%s" % s.schema,
                                         [(s.schema, settings)], extra=DBZ_CONNECTOR)
        cdir = cdir or os.path.join(self.out, "connect-%s" % s.schema)
        c = dbz.Connect(cdir, self.kafka.bootstrap, props, worker=DBZ_WORKER)
        # Streaming has started once the slot is in use.
        harness.wait_until(lambda: self.pg_pids("backend_type = 'walsender' AND usename = '%s'"
                                                % dbz.ROLE), 60, what="WAL sender")
        return c

    def dbz_groups(self, c):
        return lambda: {"process": [c.pid],
                        "pg_backends": self.pg_pids("backend_type = 'client backend'"
                                                    " AND usename = '%s'" % dbz.ROLE),
                        "wal_sender": self.pg_pids("backend_type = 'walsender'"),
                        "broker": [self.kafka.pid(1)]}

    def stop_debezium(self, c, s, drop=True):
        c.stop()
        if drop:
            harness.wait_until(lambda: not self.pg_pids("backend_type = 'walsender'"), 30,
                               what="WAL sender gone")
            dbz.drop_slot(self.pg, "dbz_%s" % s.schema)

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
            time.sleep(0.5)
        return False

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

    # ------------------------------------------------------------ writers

    def write_fast(self, s, n, start=0):
        """n events (numbers start.. start+n-1, which give the versions), 100 per
        transaction, as fast as one connection commits them; returns (first
        commit, last commit) wall times."""
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

    # ------------------------------------------------------------ D1, D3, D4

    def throughput(self, system, instances=1):
        s, topic = self.new_table("tput")
        n = self.o.events
        if system == "relay":
            procs = self.start_relays(s, instances, "tput")
            groups, pids = self.relay_groups(procs), [p.pid for p in procs]
        else:
            c = self.start_debezium(s, "tput-%d" % self.runs)
            groups, pids = self.dbz_groups(c), [c.pid]
        meter = CpuMeter(groups)
        rss = RssWatch(pids)
        warm = self.o.warm_events
        try:
            # A warm-up drain first, outside the figures: the JVMs (Connect's and
            # the broker's) compile their hot paths, the relay's pages are cached.
            if warm:
                self.write_fast(s, warm)
                if not self.wait_appended(topic, warm, self.o.timeout):
                    raise RuntimeError("warm-up events did not arrive")
            if self.o.analyze:
                s.execute("ANALYZE %s" % s.table)
            meter.start()
            threads0, wal0 = threads_cpu(pids), self.wal_lsn()
            first, last_commit = self.write_fast(s, n, start=warm)
            ok = self.wait_appended(topic, warm + n, self.o.timeout)
            cpu = meter.stop()
            threads = {k: v - threads0.get(k, 0.0) for k, v in threads_cpu(pids).items()}
            wal_bytes = self.wal_lsn() - wal0
            rss_mib = rss.stop()
        finally:
            if system == "relay":
                codes = [p.stop(timeout=60) for p in procs]
                if any(codes):
                    raise RuntimeError("relay exit codes %s" % codes)
            else:
                self.stop_debezium(c, s)
        last_append = max(t for t, _ in self.read(topic, last_only=True)) / 1000.0
        s.drop()
        secs = last_append - first
        return self.record(row="throughput", system=system, instances=instances, events=n,
                           warm_events=warm, analyzed=self.o.analyze, complete=ok,
                           seconds=secs, events_per_s=n / secs,
                           writer_events_per_s=n / (last_commit - first)
                           if last_commit > first else None,
                           cpu_s=cpu, cpu_per_10k={k: v * 1e4 / n for k, v in cpu.items()},
                           threads_per_10k={k: round(v * 1e4 / n, 3) for k, v in
                                            sorted(threads.items(), key=lambda kv: -kv[1])
                                            if v > 0},
                           wal_bytes_per_event=wal_bytes / n, rss_mib=rss_mib)

    # ------------------------------------------------------------ D2

    def latency(self, system, rate):
        s, topic = self.new_table("lat%d" % rate)
        if system == "relay":
            procs = self.start_relays(s, 1, "lat")
            groups = self.relay_groups(procs)
        else:
            c = self.start_debezium(s, "lat-%d" % self.runs)
            groups = self.dbz_groups(c)
        meter = CpuMeter(groups)
        try:
            meter.start()
            commits, achieved = self.write_steady(s, rate, self.o.latency_seconds,
                                                  self.o.warmup)
            total = s.count()
            ok = self.wait_appended(topic, total, 120)
            cpu = meter.stop()
        finally:
            if system == "relay":
                for p in procs:
                    p.stop(timeout=60)
            else:
                self.stop_debezium(c, s)
        lat = sorted(t / 1000.0 - commits[eid] for t, eid in self.read(topic) if eid in commits)
        s.drop()
        n = len(commits)
        return self.record(row="latency", system=system, offered_per_s=rate,
                           achieved_per_s=achieved, events=n, seen=len(lat), complete=ok,
                           p50_ms=pct(lat, 50) * 1e3, p99_ms=pct(lat, 99) * 1e3,
                           max_ms=lat[-1] * 1e3 if lat else None,
                           cpu_per_10k={k: v * 1e4 / total for k, v in cpu.items()})

    # ------------------------------------------------------------ D5

    def startup(self, system, waiting=1000):
        s, topic = self.new_table("start")
        if system == "relay":
            self.write_fast(s, waiting)
            t0 = time.time()
            procs = self.start_relays(s, 1, "start")
            ok = self.wait_appended(topic, waiting, 60)
            for p in procs:
                p.stop(timeout=60)
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

    def run(self, only=("throughput", "latency", "startup")):
        if "throughput" in only:
            for system, inst in (("relay", 1), ("relay", 2), ("debezium", 1)):
                self.throughput(system, inst)
        if "latency" in only:
            for rate in self.o.rates:
                for system in ("relay", "debezium"):
                    self.latency(system, rate)
        if "startup" in only:
            for system in ("relay", "debezium"):
                self.startup(system)
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


# ---------------------------------------------------------------- table

def _ratio(a, b):
    return "%.2f" % (a / b) if a is not None and b else "-"


def table(res):
    """Markdown rows of group D: figure, outbox-relay, Debezium, ratio, target."""
    runs = res["runs"]

    def one(**kw):
        f = [r for r in runs if all(r.get(k) == v for k, v in kw.items())]
        return f[-1] if f else None

    out = ["| # | measurement | outbox-relay | Debezium | outbox-relay / Debezium | target |",
           "|---|---|---|---|---|---|"]
    d = one(row="throughput", system="debezium")
    for i in (1, 2):
        r = one(row="throughput", system="relay", instances=i)
        if r and d:
            out.append("| D1 | throughput, %dk events, %d relay%s vs 1 Debezium task (events/s;"
                       " writer alone reached %.0f / %.0f) | %.0f | %.0f | %s | >= 2 |"
                       % (r["events"] // 1000, i, "s" if i > 1 else "",
                          r["writer_events_per_s"] or 0, d["writer_events_per_s"] or 0,
                          r["events_per_s"], d["events_per_s"],
                          _ratio(r["events_per_s"], d["events_per_s"])))
    for rate in sorted({r["offered_per_s"] for r in runs if r["row"] == "latency"}):
        r, d2 = one(row="latency", system="relay", offered_per_s=rate), \
            one(row="latency", system="debezium", offered_per_s=rate)
        if r and d2:
            for q in ("p50", "p99", "max"):
                out.append("| D2 | latency at %d/s offered, commit -> append, %s (ms) | %.1f | %.1f"
                           " | %s | %s |" % (rate, q, r[q + "_ms"], d2[q + "_ms"],
                                             _ratio(r[q + "_ms"], d2[q + "_ms"]),
                                             "<= 0.5" if q == "p99" else ""))
    r = one(row="throughput", system="relay", instances=1)
    if r and d:
        for part in ("process", "pg_backends", "wal_sender"):
            a, b = r["cpu_per_10k"][part], d["cpu_per_10k"][part]
            out.append("| D3 | CPU s per 10k events in D1 (1 relay), %s | %.2f | %.2f | %s | |"
                       % (part.replace("_", " "), a, b, _ratio(a, b)))
        a = sum(r["cpu_per_10k"][k] for k in ("process", "pg_backends", "wal_sender"))
        b = sum(d["cpu_per_10k"][k] for k in ("process", "pg_backends", "wal_sender"))
        out.append("| D3 | CPU s per 10k events in D1 (1 relay), all three | %.2f | %.2f | %s | |"
                   % (a, b, _ratio(a, b)))
        a, b = r["cpu_per_10k"]["broker"], d["cpu_per_10k"]["broker"]
        out.append("| D3 | (broker CPU s per 10k events in D1) | %.2f | %.2f | %s | |"
                   % (a, b, _ratio(a, b)))
    r1, d1 = one(row="latency", system="relay", offered_per_s=1000), \
        one(row="latency", system="debezium", offered_per_s=1000)
    if r1 and d1:
        a = sum(r1["cpu_per_10k"][k] for k in ("process", "pg_backends", "wal_sender"))
        b = sum(d1["cpu_per_10k"][k] for k in ("process", "pg_backends", "wal_sender"))
        out.append("| D3 | CPU s per 10k events at 1000/s, all three | %.2f | %.2f | %s | |"
                   % (a, b, _ratio(a, b)))
    rs = [x for x in runs if x["row"] == "throughput" and x["system"] == "relay"]
    if rs and d:
        a = max(x["rss_mib"] for x in rs)
        out.append("| D4 | peak RSS in D1 (MiB; relay: largest instance) | %.1f | %.1f | %s |"
                   " <= 0.05 |" % (a, d["rss_mib"], _ratio(a, d["rss_mib"])))
    r, d5 = one(row="startup", system="relay"), one(row="startup", system="debezium")
    if r and d5:
        out.append("| D5 | process start -> first event appended, %d waiting (s; Connect"
                   " RUNNING after %.1f s) | %.2f | %.2f | %s | |"
                   % (r["waiting"], d5["running_s"] or 0, r["first_event_s"],
                      d5["first_event_s"], _ratio(r["first_event_s"], d5["first_event_s"])))
    return "\n".join(out)


def add_args(ap, prefix=""):
    """Options of this group (prefix "dbz-" inside bench.py)."""
    ap.add_argument("--%srates" % prefix, default="1000,5000",
                    help="offered rates of the latency rows, events/s")
    ap.add_argument("--%swarmup" % prefix, type=float, default=10.0,
                    help="seconds of steady load before the latency window")
    ap.add_argument("--%swarm-events" % prefix, type=int, default=None,
                    help="events drained before a throughput run's measured part"
                         " (default: a tenth of --events)")
    ap.add_argument("--%sno-analyze" % prefix, action="store_true",
                    help="no ANALYZE of the table after the warm-up (a table the planner"
                         " has no statistics for)")
    ap.add_argument("--%stimeout" % prefix, type=float, default=900.0,
                    help="longest wait for a throughput run's last event")
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
    return argparse.Namespace(out=out, relay=relay, relay_env=relay_env,
                              events=args.events, aggregates=args.aggregates,
                              partitions=args.partitions, batch=args.batch,
                              latency_seconds=args.latency_seconds,
                              rates=[int(x) for x in g("rates").split(",")],
                              warmup=g("warmup"), timeout=g("timeout"), fsync=g("fsync"),
                              analyze=not g("no-analyze"),
                              warm_events=args.events // 10 if g("warm-events") is None
                              else g("warm-events"))


def run(opts, only=("throughput", "latency", "startup")):
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
    ap.add_argument("--events", type=int, default=200000)
    ap.add_argument("--aggregates", type=int, default=2000)
    ap.add_argument("--partitions", type=int, default=64)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--latency-seconds", type=float, default=20)
    ap.add_argument("--only", default="throughput,latency,startup")
    ap.add_argument("--relay-env", action="append", default=[], metavar="NAME=VALUE")
    add_args(ap)
    args = ap.parse_args()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.relay)), "..",
                                   "bench-results", "debezium-" + time.strftime("%Y%m%d-%H%M%S"))
    opts = options(args, os.path.abspath(out), os.path.abspath(args.relay),
                   dict(kv.split("=", 1) for kv in args.relay_env))
    res = run(opts, args.only.split(","))
    print("versions: %s; Debezium connector %s; worker %s" % (res["versions"], json.dumps(
        res["dbz_connector"]), json.dumps(res["dbz_worker"])))
    print(table(res))
    print("raw results and logs: %s" % opts.out)


if __name__ == "__main__":
    main()
