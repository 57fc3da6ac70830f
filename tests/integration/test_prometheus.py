"""Live check of the Grafana dashboard and the alert rules against a real
Prometheus server scraping a real relay and sweeper on 127.0.0.1.

One scenario per module (the `live` fixture), then one test per dashboard query
and per alert:

  * PostgreSQL schema and the local Kafka-protocol broker from the harness;
    outbox-relay and outbox-sweeper with OUTBOX_HTTP_ADDR=127.0.0.1:<free port>.
  * /usr/bin/prometheus with a generated config in a temporary directory:
    scrape and rule evaluation every 1 s, static targets for the relay and the
    sweeper carrying the target labels the Prometheus Operator's ServiceMonitor
    adds in Kubernetes (namespace, service, pod, container, endpoint), and
    rule_files = the alert rules rendered from helm/outbox-relay exactly as
    tests/helm/run renders them (release outbox-relay, namespace outbox,
    ci/prometheusrule-values.yaml), so the live rules are the ones promtool
    checks there. The target labels namespace="outbox", service="outbox-relay"
    are what that render's series selector matches, and the values substituted
    for the dashboard's $namespace / $service.
  * Load, started once Prometheus has scraped both daemons (so every counter is
    first seen at 0, or is seen again after its first sample, and rate() /
    increase() have something to show):
      - events on two topics (<schema>.Order, <schema>.Invoice), twice;
      - a DEAD row (headers_json '[1]': INVALID_HEADERS), twice;
      - a PENDING row with created_at 400 s ago blocked behind the first DEAD
        row of its aggregate (oldest pending age > 300 s);
      - a row inserted straight into PUBLISHING with locked_at an hour ago
        (the sweeper resets it: stale_locks_reset);
      - PUBLISHED rows with published_at two hours ago, OUTBOX_RETENTION_S=3600
        (the sweeper deletes them: rows_deleted);
      - the table locked (ACCESS EXCLUSIVE) past OUTBOX_DB_LOCK_TIMEOUT_MS: the
        relay's statements fail with 55P03 (outbox_statement_errors_total);
      - the broker down for a few seconds with OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS
        small: batches fail with _MSG_TIMED_OUT (failed_total), the relay's
        /readyz answers 503, and, with OUTBOX_LOCK_TIMEOUT_S=1, the sweeper
        takes back the locks of the batch waiting on the broker, so the relay
        counts outbox_lock_lost_total when it marks.
    Each step waits (wait_until, with deadlines) for Prometheus itself to have
    seen the effect, never a fixed sleep.

Dashboard (test_dashboard_query): every panel target's expr and every query
variable (label_values) of helm/outbox-relay/dashboards/outbox-relay.json.
$namespace / $service become the target label values above ($datasource is
not in any expr; any other variable fails the test until mapped here);
$__rate_interval -> 4s (Grafana's 4 x scrape interval for 1 s scrapes),
$__interval -> 1s, $__range -> 1m. Range selectors written in the dashboard
([5m]) are kept as they are: the scenario runs for well under 5 minutes, so
the window holds every sample scraped, and rate()/increase() need two. A query
passes when /api/v1/query returns a non-empty result with a finite value,
with every label its legendFormat names on every series; rate/increase/
histogram queries must also have a series > 0 (the load made those counters
move while scraped), and the publish rate must be > 0 for both topics.

Alerts (test_alert_*): for each rule of the rendered file,
  1. Prometheus itself evaluated it without error (/api/v1/rules health ok);
  2. every vector selector in its expr (range stripped) returns series now;
  3. the expr with its final comparison against a constant removed
     (`... > 300` -> `...`), or the argument of absent(), returns a non-empty,
     finite result carrying the labels the annotations use (namespace,
     service); an alert's full expr is legitimately empty while healthy, so
     this is what shows the selectors, aggregations and vector matching of
     the expression line up with what the daemons export;
  4. the alerts the load provokes are pending or firing in Prometheus
     (/api/v1/alerts): DEAD rows, stale locks, failure rate, held aggregates,
     statement errors; the
     heartbeat alert after the relay is stopped (the last test); and the
     reconcile alert on the Job series a static kube-state-metrics stand-in
     serves (an earlier run succeeded, the newest failed), scraped with
     honor_labels as kube-prometheus-stack does.
Plus /healthz and /readyz of both daemons (200), and the relay's /readyz 503
while the broker is down.
"""
import http.server
import json
import math
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from conftest import relay_env
from harness import Relay, TestSchema, bin_path, free_port, have_binary, make_events, \
    repo_root, wait_until

NAMESPACE = "outbox"
SERVICE = "outbox-relay"  # helm template outbox-relay ... -> fullname outbox-relay
RELAY_POD = "outbox-relay-relay-0"
SWEEPER_POD = "outbox-relay-sweeper-0"
CHART = os.path.join(repo_root(), "helm", "outbox-relay")
DASHBOARD = os.path.join(CHART, "dashboards", "outbox-relay.json")
PROMETHEUS = os.environ.get("OUTBOX_PROMETHEUS", "/usr/bin/prometheus")

# Grafana's built-in interval variables, for 1 s scrapes.
GRAFANA_BUILTINS = {"__rate_interval": "4s", "__interval": "1s", "__range": "1m"}
DASHBOARD_VARS = {"namespace": NAMESPACE, "service": SERVICE}

DELIVERY_TIMEOUT_MS = 2000  # a batch waits this long on a down broker
LOCK_TIMEOUT_S = 1          # sweeper: shorter than the batch above -> lock lost
DB_LOCK_TIMEOUT_MS = 200    # the relay's lock_timeout: a table lock held longer fails statements


# ---------------------------------------------------------------- Prometheus

class Prometheus:
    """/usr/bin/prometheus on 127.0.0.1 with its config and TSDB in `workdir`."""

    def __init__(self, workdir, targets, rule_file, kube_state_metrics=None):
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self.workdir = workdir
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [rule_file],
            "scrape_configs": [{
                "job_name": SERVICE,
                "static_configs": [{"targets": [addr], "labels": labels}
                                   for addr, labels in targets],
            }],
        }
        if kube_state_metrics:
            # as kube-prometheus-stack scrapes it: the series' own namespace wins
            config["scrape_configs"].append({
                "job_name": "kube-state-metrics", "honor_labels": True,
                "static_configs": [{"targets": [kube_state_metrics]}]})
        self.config_path = os.path.join(workdir, "prometheus.yml")
        with open(self.config_path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=1)  # JSON is YAML: no PyYAML needed
        self.log_path = os.path.join(workdir, "prometheus.log")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, "--config.file=" + self.config_path,
                 "--storage.tsdb.path=" + os.path.join(workdir, "data"),
                 "--web.listen-address=127.0.0.1:%d" % self.port, "--log.level=warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def log_text(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def get(self, path, **params):
        url = self.base + path
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body.get("status") == "success", body
        return body["data"]

    def query(self, expr):
        """Instant query now: list of (labels, value) samples (a scalar result
        is one sample with no labels)."""
        try:
            data = self.get("/api/v1/query", query=expr)
        except urllib.error.HTTPError as e:
            raise AssertionError("query %r: HTTP %d %s" % (expr, e.code, e.read()[:500]))
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        assert data["resultType"] == "vector", data
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]

    def targets_up(self):
        active = self.get("/api/v1/targets")["activeTargets"]
        return len(active) >= 3 and all(t["health"] == "up" for t in active)

    def alert_states(self):
        """{alertname: set of states} of pending/firing alerts."""
        states = {}
        for a in self.get("/api/v1/alerts")["alerts"]:
            states.setdefault(a["labels"]["alertname"], set()).add(a["state"])
        return states

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# kube-state-metrics' Job series as the reconcile CronJob of this release
# leaves them after an earlier run succeeded and the newest failed.
KUBE_STATE_METRICS = """\
kube_job_status_start_time{namespace="%(ns)s",job_name="%(svc)s-reconcile-100"} 1000
kube_job_status_failed{namespace="%(ns)s",job_name="%(svc)s-reconcile-100"} 0
kube_job_status_start_time{namespace="%(ns)s",job_name="%(svc)s-reconcile-200"} 2000
kube_job_status_failed{namespace="%(ns)s",job_name="%(svc)s-reconcile-200",reason="BackoffLimitExceeded"} 1
""" % {"ns": NAMESPACE, "svc": SERVICE}


class KubeStateMetrics:
    """A static /metrics target standing in for kube-state-metrics."""

    def __init__(self):
        body = KUBE_STATE_METRICS.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.addr = "127.0.0.1:%d" % self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def http_status(addr, path):
    try:
        with urllib.request.urlopen("http://%s%s" % (addr, path), timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


# ---------------------------------------------------------------- chart files

def render_alert_rules(out_path):
    """Writes the PrometheusRule of `helm template`, rendered as tests/helm/run
    renders it, as a plain Prometheus rule file: its `spec:` block, dedented
    (the chart renders it with toYaml | nindent 2)."""
    helm = subprocess.run([os.path.join(repo_root(), "tests", "support", "get-helm")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=300)
    assert helm.returncode == 0, "tests/support/get-helm failed: %s" % helm.stderr
    r = subprocess.run([helm.stdout.strip(), "template", SERVICE, CHART, "--namespace",
                        NAMESPACE, "-f", os.path.join(CHART, "ci", "prometheusrule-values.yaml"),
                        "--show-only", "templates/prometheusrule.yaml"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 0, "helm template failed: %s" % r.stderr
    lines = r.stdout.splitlines()
    assert "kind: PrometheusRule" in lines and "spec:" in lines, r.stdout[:2000]
    spec = lines[lines.index("spec:") + 1:]
    assert spec and spec[0] == "  groups:" and all(not l or l.startswith("  ") for l in spec), \
        "unexpected PrometheusRule layout:\n%s" % r.stdout[:2000]
    with open(out_path, "w", encoding="utf-8") as f:
        f.write("\n".join(l[2:] for l in spec) + "\n")


def expand_grafana(expr):
    """Dashboard expr -> PromQL with this test's variable values."""
    def sub(m):
        name = m.group(1) or m.group(2)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        if name in DASHBOARD_VARS:
            return DASHBOARD_VARS[name]
        raise AssertionError("dashboard variable $%s has no value in test_prometheus.py" % name)
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", sub, expr)


def dashboard_queries():
    """[(id, kind, query, legendFormat)]: kind 'panel' (an expr) or 'variable'
    (label_values(selector, label))."""
    with open(DASHBOARD, encoding="utf-8") as f:
        dash = json.load(f)
    out = []

    def walk(panels):
        for p in panels or ():
            for t in p.get("targets") or ():
                if t.get("expr"):
                    out.append(("panel %d %s/%s" % (p["id"], p["title"], t.get("refId", "?")),
                                "panel", t["expr"], t.get("legendFormat", "")))
            walk(p.get("panels"))
    walk(dash.get("panels"))
    for v in dash.get("templating", {}).get("list", ()):
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if v.get("type") == "query" and q:
            out.append(("variable %s" % v["name"], "variable", q, ""))
    return out


def strip_comparison(expr):
    """The expression an alert compares with a constant, or absent()'s argument.
    `X > 300` -> `X` (a trailing comparison against a number binds to the whole
    arithmetic expression before it: comparison operators have lower precedence
    than + - * /); `absent(X)` -> `X`. Anything else is returned unchanged."""
    e = expr.strip()
    m = re.fullmatch(r"absent\((.*)\)", e, re.S)
    if m:
        return m.group(1).strip()
    m = re.fullmatch(r"(.*?)\s*(?:>|>=|<|<=|==|!=)\s*(?:bool\s+)?[-+]?[0-9.]+(?:e[-+]?\d+)?",
                     e, re.S)
    return m.group(1).strip() if m else e


def vector_selectors(expr):
    """Every outbox_* vector selector in expr, with its {matchers} and without
    any [range]."""
    return sorted(set(m.group(0) for m in re.finditer(r"\boutbox_\w+(?:\{[^}]*\})?", expr)))


def finite(samples):
    return [v for _, v in samples if not math.isnan(v) and not math.isinf(v)]


# ---------------------------------------------------------------- the scenario

def _wait_seen(prom, expr, timeout, what):
    return wait_until(lambda: prom.query(expr), timeout, interval=0.25, what=what)


@pytest.fixture(scope="module")
def live(pg, mock_kafka, tmp_path_factory):
    # The mock cluster: the scenario takes the broker down and up on command.
    kafka = mock_kafka
    assert os.access(PROMETHEUS, os.X_OK), "%s not found (apt-get install prometheus)" % PROMETHEUS
    assert have_binary("outbox-sweeper"), "%s not built" % bin_path("outbox-sweeper")
    work = str(tmp_path_factory.mktemp("prometheus"))
    rules_path = os.path.join(work, "alerts.rules.yaml")
    render_alert_rules(rules_path)

    started = time.monotonic()
    db = TestSchema(pg, "prometheus")
    procs = []
    prom = None
    ksm = KubeStateMetrics()
    try:
        relay_addr = "127.0.0.1:%d" % free_port()
        sweeper_addr = "127.0.0.1:%d" % free_port()
        renv = relay_env(db, kafka, OUTBOX_HTTP_ADDR=relay_addr, OUTBOX_RELAY_ID="prom-relay",
                         OUTBOX_BATCH_SIZE=20, OUTBOX_BACKOFF_INITIAL_MS=200,
                         OUTBOX_BACKOFF_MAX_MS=1000,
                         OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=DELIVERY_TIMEOUT_MS,
                         OUTBOX_KAFKA_STATISTICS_INTERVAL_MS=1000,
                         OUTBOX_DB_LOCK_TIMEOUT_MS=DB_LOCK_TIMEOUT_MS)
        relay = Relay("outbox-relay", env=renv, log_dir=work, name="relay")
        procs.append(relay)
        senv = {**db.env(), "OUTBOX_HTTP_ADDR": sweeper_addr, "OUTBOX_LOG_FORMAT": "text",
                "OUTBOX_LOCK_TIMEOUT_S": LOCK_TIMEOUT_S, "OUTBOX_SWEEP_INTERVAL_S": 1,
                "OUTBOX_RETENTION_S": 3600}
        sweeper = Relay("outbox-sweeper", env=senv, log_dir=work, name="sweeper")
        procs.append(sweeper)

        op_labels = {"namespace": NAMESPACE, "service": SERVICE, "endpoint": "http"}
        prom = Prometheus(work, [
            (relay_addr, {**op_labels, "pod": RELAY_POD, "container": "relay"}),
            (sweeper_addr, {**op_labels, "pod": SWEEPER_POD, "container": "sweeper"}),
        ], rules_path, kube_state_metrics=ksm.addr)

        for name, addr, proc in (("relay", relay_addr, relay), ("sweeper", sweeper_addr, sweeper)):
            for path in ("/healthz", "/readyz"):
                wait_until(lambda: proc.running() and http_status(addr, path) == 200, 20,
                           what="%s %s 200 (log: %s)" % (name, path, proc.log_text()[-1500:]))
        wait_until(lambda: prom.proc.poll() is None and prom.targets_up(), 30, interval=0.25,
                   what="Prometheus scraping relay and sweeper (log: %s)" % prom.log_text()[-1500:])
        # The alerting rules as Prometheus loaded them: {name: expr}.
        alerts = {r["name"]: r["query"]
                  for g in prom.get("/api/v1/rules", type="alert")["groups"] for r in g["rules"]}
        assert sorted(alerts) == sorted(ALERTS), (sorted(alerts), ALERTS)
        sel = '{namespace="%s",service="%s"}' % (NAMESPACE, SERVICE)
        # Both targets scraped once: what the load does from now on moves counters
        # Prometheus has already seen.
        _wait_seen(prom, "count(outbox_build_info%s) == 2" % sel, 15, "both targets' samples")

        # --- wave 1: two topics, a DEAD row, a blocked old row, a stale lock, old rows
        s = db.schema
        wave1 = make_events(aggregates=10, aggregate_type="Order", id_prefix="o") + \
            make_events(aggregates=10, aggregate_type="Invoice", id_prefix="i")
        db.insert_events(wave1)
        db.insert_events([{"aggregate_type": "Order", "aggregate_id": "dead-1",
                           "aggregate_version": 1, "event_type": "E", "payload_json": {},
                           "headers_json": "[1]"}])
        db.execute("INSERT INTO %s.outbox_event (aggregate_type, aggregate_id, aggregate_version,"
                   " event_type, payload_json, created_at, occurred_at) VALUES ('Order', 'dead-1',"
                   " 2, 'E', '{}', now() - interval '400 s', now() - interval '400 s')" % s)
        db.execute("INSERT INTO %s.outbox_event (aggregate_type, aggregate_id, aggregate_version,"
                   " event_type, payload_json, status, attempt_count, locked_by, locked_at,"
                   " last_attempt_at) VALUES ('Order', 'stale-1', 1, 'E', '{}', 'PUBLISHING', 1,"
                   " 'crashed-relay', now() - interval '1 hour', now() - interval '1 hour')" % s)
        db.execute("INSERT INTO %s.outbox_event (aggregate_type, aggregate_id, aggregate_version,"
                   " event_type, payload_json, status, published_at, created_at, occurred_at)"
                   " SELECT 'Order', 'old-' || g, 1, 'E', '{}', 'PUBLISHED',"
                   " now() - interval '2 hours', now() - interval '3 hours',"
                   " now() - interval '3 hours' FROM generate_series(1, 5) g" % s)
        wait_until(lambda: db.count("status = 'PUBLISHED' AND aggregate_id NOT LIKE 'old-%%'")
                   == 21 and db.count("aggregate_id LIKE 'old-%%'") == 0, 30,
                   what="wave 1 + the stale-lock row PUBLISHED, old rows deleted")
        _wait_seen(prom, 'count(outbox_events_published_total%s) >= 2' % sel, 15,
                   "both topics' counters scraped")
        _wait_seen(prom, 'outbox_events_dead_total%s' % sel, 15, "DEAD counter scraped")

        # --- broker down: timeouts, 503, locks taken back by the sweeper
        kafka.down()
        saw_503 = []
        try:
            db.insert_events(make_events(aggregates=10, aggregate_type="Order", id_prefix="d"))

            def failing():
                if http_status(relay_addr, "/readyz") == 503:
                    saw_503.append(True)
                return (saw_503 and
                        prom.query('increase(outbox_events_failed_total%s[1m]) > 0' % sel) and
                        prom.query('increase(outbox_lock_lost_total%s[1m]) > 0' % sel))
            wait_until(failing, 30, interval=0.2,
                       what="relay /readyz 503 and failures and lost locks scraped (503 seen: %s)"
                       % saw_503)
        finally:
            kafka.up()
        wait_until(lambda: http_status(relay_addr, "/readyz") == 200, 20,
                   what="relay /readyz 200 after the broker is back")

        # --- a table lock held past the relay's lock_timeout: its statements
        # fail (55P03 lock_not_available), counted by statement and SQLSTATE
        blocker = pg.connect()
        try:
            with blocker.cursor() as cur:
                cur.execute("BEGIN; LOCK TABLE %s.outbox_event IN ACCESS EXCLUSIVE MODE" % s)
                _wait_seen(prom, 'increase(outbox_statement_errors_total{sqlstate="55P03",'
                           'namespace="%s",service="%s"}[1m]) > 0' % (NAMESPACE, SERVICE), 20,
                           "statement errors 55P03 scraped while the table is locked")
                cur.execute("ROLLBACK")
        finally:
            blocker.close()

        # --- wave 2: more of both topics, a second DEAD row; its first produce
        # requests fail with a retriable error, so librdkafka sends their
        # messages again (in new requests: not in outbox_kafka_retries_total)
        kafka.produce_errors(3, "NOT_ENOUGH_REPLICAS")
        db.insert_events(make_events(aggregates=10, aggregate_type="Order", id_prefix="o2") +
                         make_events(aggregates=10, aggregate_type="Invoice", id_prefix="i2"))
        db.insert_events([{"aggregate_type": "Order", "aggregate_id": "dead-2",
                           "aggregate_version": 1, "event_type": "E", "payload_json": {},
                           "headers_json": "[1]"}])
        wait_until(lambda: db.count("status = 'PUBLISHED'") == 51 and
                   db.count("status = 'DEAD'") == 2, 45,
                   what="wave 2 and the broker-down rows PUBLISHED, 2 DEAD (counts %s)"
                   % db.status_counts())
        # Prometheus has the end state: every publish scraped, and a table sample
        # (the relay takes one every 10 s) taken after the second DEAD row.
        _wait_seen(prom, "sum(outbox_events_published_total%s) >= 51" % sel, 15,
                   "all 51 publishes scraped")
        _wait_seen(prom, 'outbox_events{status="DEAD",namespace="%s",service="%s"} == 2'
                   % (NAMESPACE, SERVICE), 25, "outbox_events{status=DEAD} sampled at 2")
        yield {"prom": prom, "relay": relay, "sweeper": sweeper, "alerts": alerts, "db": db,
               "relay_addr": relay_addr, "sweeper_addr": sweeper_addr, "started": started,
               "saw_503": bool(saw_503)}
    finally:
        for p in procs:
            if p.running():
                p.stop()
        if prom:
            prom.stop()
        ksm.stop()
        db.drop()


# ---------------------------------------------------------------- tests

def test_daemons_healthy_and_readiness_follows_the_broker(live):
    for addr in (live["relay_addr"], live["sweeper_addr"]):
        assert http_status(addr, "/healthz") == 200
        assert http_status(addr, "/readyz") == 200
    assert live["saw_503"], "relay /readyz never answered 503 while the broker was down"


QUERIES = dashboard_queries()


@pytest.mark.parametrize("qid,kind,query,legend", QUERIES, ids=[q[0] for q in QUERIES])
def test_dashboard_query(live, qid, kind, query, legend):
    prom = live["prom"]
    if kind == "variable":
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query.strip(), re.S)
        assert m, "%s: not label_values(selector, label): %s" % (qid, query)
        selector, label = expand_grafana(m.group(1)), m.group(2)
        # What Grafana asks Prometheus for label_values(selector, label).
        values = wait_until(lambda: prom.get("/api/v1/label/%s/values" % label,
                                             **{"match[]": selector}), 20,
                            what="%s: values of %s" % (qid, label))
        assert DASHBOARD_VARS[label] in values, (qid, values)
        return

    expr = expand_grafana(query)
    moving = bool(re.search(r"\b(rate|increase|irate|histogram_quantile)\(", expr))
    # librdkafka counts a retry (txretries) only for a request it sends again,
    # such as a metadata request cut off by a broker going down; nothing the
    # fixture does is certain to make one. The counter is exported from the
    # start, so the panel's query still has to return a (zero) series.
    if "outbox_kafka_retries_total" in expr:
        moving = False

    def ok():
        samples = prom.query(expr)
        vals = finite(samples)
        if not vals or (moving and not any(v > 0 for v in vals)):
            return None
        return samples
    samples = wait_until(ok, 30, interval=0.5,
                         what="%s: non-empty finite result%s for %s"
                         % (qid, " > 0" if moving else "", expr))
    print("%s: %s -> %s" % (qid, expr, samples))
    for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
        assert all(lbls.get(label) for lbls, _ in samples), \
            "%s: legend {{%s}} but a series lacks the label: %s" % (qid, label, samples)


def test_publish_rate_panel_shows_both_topics(live):
    expr = ('sum by (topic) (rate(outbox_events_published_total'
            '{namespace="%s", service="%s"}[5m]))' % (NAMESPACE, SERVICE))
    rates = {lbls["topic"]: v for lbls, v in live["prom"].query(expr)}
    s = live["db"].schema
    assert set(rates) == {s + ".Order", s + ".Invoice"}, rates
    assert all(v > 0 for v in rates.values()), rates


def test_heartbeat_panels_show_only_relays(live):
    """The sweeper exports the relay heartbeat gauge unset (0): the panels'
    `> 0` keeps it off the heartbeat age."""
    expr = ('time() - max by (pod) (outbox_relay_last_batch_timestamp_seconds'
            '{namespace="%s", service="%s"} > 0)' % (NAMESPACE, SERVICE))
    pods = {lbls.get("pod") for lbls, _ in live["prom"].query(expr)}
    assert pods == {RELAY_POD}, pods


def _alert_ids():
    # Names only (rendering needs helm): read them from the chart file.
    with open(os.path.join(CHART, "files", "alerts.yaml"), encoding="utf-8") as f:
        return re.findall(r"^\s*- alert:\s*(\w+)", f.read(), re.M)


ALERTS = _alert_ids()


@pytest.mark.parametrize("name", ALERTS)
def test_alert_expression_has_data(live, name):
    prom = live["prom"]
    expr = live["alerts"][name]

    # 1. Prometheus evaluates the rendered rule without error.
    def health():
        for g in prom.get("/api/v1/rules", type="alert")["groups"]:
            for r in g["rules"]:
                if r["name"] == name and r.get("lastEvaluation", "").startswith("0001"):
                    return None  # not evaluated yet
                if r["name"] == name:
                    return r
        return None
    r = wait_until(health, 15, what="rule %s evaluated" % name)
    assert r["health"] == "ok", (name, r.get("lastError"))

    # 2. Each vector selector of the expression matches series.
    for selector in vector_selectors(expr):
        assert prom.query(selector), "%s: selector %s returns no series" % (name, selector)

    # 3. The compared expression (or absent()'s argument) returns finite values
    #    with the labels the annotations use.
    inner = strip_comparison(expr)
    assert inner != expr.strip(), \
        "%s: no trailing comparison or absent() to strip: %s" % (name, expr)
    samples = wait_until(lambda: finite(prom.query(inner)) and prom.query(inner), 20,
                         what="%s: %s returns finite values" % (name, inner))
    print("%s: %s -> %s" % (name, inner, samples))
    if not expr.strip().startswith("absent("):
        for lbls, _ in samples:
            assert lbls.get("namespace") == NAMESPACE and lbls.get("service") == SERVICE, \
                (name, samples)


# The alerts the load provokes: pending (they have a `for:`) or firing.
PROVOKED = ["OutboxDeadRows", "OutboxStaleLocksReset", "OutboxFailureRateHigh",
            "OutboxAggregatesHeld", "OutboxStatementErrors", "OutboxReconcileFailed"]


@pytest.mark.parametrize("name", PROVOKED)
def test_provoked_alert_is_active(live, name):
    assert name in ALERTS, "%s is not a rule of files/alerts.yaml any more" % name
    prom = live["prom"]
    wait_until(lambda: name in prom.alert_states(), 20,
               what="%s pending or firing (active: %s)" % (name, prom.alert_states()))


def test_absent_alert_quiet_while_relay_scraped(live):
    assert "OutboxRelayMetricsAbsent" not in live["prom"].alert_states()


def test_zz_relay_gone_raises_heartbeat_alert(live):
    """Last (it stops the relay): with no relay scraped, the heartbeat alert
    (or the absent() one, when nothing exports the gauge) becomes active."""
    prom = live["prom"]
    assert live["relay"].stop() == 0
    wait_until(lambda: {"OutboxRelayHeartbeatStale", "OutboxRelayMetricsAbsent"}
               & set(prom.alert_states()), 20,
               what="heartbeat alert active after the relay stopped (active: %s)"
               % prom.alert_states())
    assert live["sweeper"].stop() == 0
    print("scenario runtime %.1f s" % (time.monotonic() - live["started"]))


def test_runbook_anchors_exist():
    """Every alert's runbook_url anchor is a heading of the operations guide,
    docs/operations.md."""
    with open(os.path.join(CHART, "files", "alerts.yaml"), encoding="utf-8") as f:
        anchors = set(re.findall(r"#(runbook-[a-z0-9-]+)", f.read()))
    slugs = set()
    guide = os.path.join(repo_root(), "docs", "operations.md")
    with open(guide, encoding="utf-8") as f:
        for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", f.read(), re.M):
            slugs.add(re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-"))
    assert len(anchors) >= 5 and anchors <= slugs, sorted(anchors - slugs)
