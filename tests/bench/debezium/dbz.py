"""Debezium's PostgreSQL connector with the outbox EventRouter, driven from Python
for the side-by-side test (tests/integration/test_debezium_side_by_side.py) and
the bench's Debezium rows (tests/bench/debezium/compare.py).

    prepare_database(pg, ["s1.outbox_event"], "dbz_pub")   # role, grants, publication
    props = connector_properties("outbox", pg.url, "dbz_slot", "dbz_pub",
                                 [("s1", router_settings("s1.${routedByValue}"))])
    with Connect(dir, kafka.bootstrap, props) as c:          # waits until RUNNING
        ...
        c.pid, c.log_text(), c.status()

The set-up is Debezium's documented least-privilege one: the table owner creates a
publication for the outbox tables (`publication.autocreate.mode=disabled`), with
`publish = 'insert'` since the EventRouter only routes inserts (the connector
option `skipped.operations=u,d,t` says the same); the connector logs in as a role
with LOGIN and REPLICATION that may read the tables, and creates its replication
slot itself. Values are schemaless JSON with `table.expand.json.payload=true`, as
the EventRouter's documentation pairs them; keys are plain strings.
"""

import json
import os
import re
import subprocess
import time
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "connect")

ROLE = "debezium"
PASSWORD = "debezium-secret"


def versions():
    """'debezium X, kafka-connect Y' as the connect script pins them."""
    return subprocess.run([SCRIPT, "version"], capture_output=True, text=True,
                          check=True).stdout.strip()


def prepare_database(pg, tables, publication):
    """The connector's role (LOGIN REPLICATION, reads `tables`) and a publication of
    the inserts into `tables` (schema-qualified names), created as the tables'
    owner (pg's role). Safe to call again with more tables: the publication is
    then set to exactly `tables`."""
    with pg.connect() as conn, conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (ROLE,))
        if not cur.fetchone():
            cur.execute("CREATE ROLE %s LOGIN REPLICATION PASSWORD '%s'" % (ROLE, PASSWORD))
        for t in tables:
            schema = t.split(".", 1)[0]
            cur.execute("GRANT USAGE ON SCHEMA %s TO %s" % (schema, ROLE))
            cur.execute("GRANT SELECT ON %s TO %s" % (t, ROLE))
        cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,))
        if cur.fetchone():
            cur.execute("ALTER PUBLICATION %s SET TABLE %s" % (publication, ", ".join(tables)))
        else:
            cur.execute("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert')"
                        % (publication, ", ".join(tables)))
    conn.close()


def drop_slot(pg, slot):
    """Drops a replication slot left behind (an inactive one); no error if absent."""
    with pg.connect() as conn, conn.cursor() as cur:
        cur.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                    " WHERE slot_name = %s AND NOT active", (slot,))
    conn.close()


def router_settings(topic_replacement, **overrides):
    """EventRouter options for our outbox_event table, value = payload only:
    the event id, key and payload columns, routing by aggregate_type, tombstones
    for a NULL payload, JSON payloads expanded (keeping null members and empty
    arrays), and our fixed header names for the columns placed as headers.
    `overrides` (dots as '__' in names) replace or add options."""
    s = {
        "table.field.event.id": "outbox_id",
        "table.field.event.key": "aggregate_id",
        "table.field.event.payload": "payload_json",
        "route.by.field": "aggregate_type",
        "route.topic.replacement": topic_replacement,
        "route.tombstone.on.empty.payload": "true",
        "table.expand.json.payload": "true",
        "table.json.payload.null.behavior": "optional_bytes",
        "table.json.payload.empty.array.behavior": "optional_string",
        "table.fields.additional.placement": ",".join([
            "event_type:header:event-type", "aggregate_type:header:aggregate-type",
            "aggregate_id:header:aggregate-id", "aggregate_version:header:aggregate-version",
            "tenant_id:header:tenant-id", "occurred_at:header:occurred-at",
            "headers_json:header:headers_json"]),
    }
    s.update({k.replace("__", "."): str(v) for k, v in overrides.items()})
    return s


def connector_properties(name, url, slot, publication, routes, extra=None):
    """Properties of one PostgreSQL connector (pgoutput, streaming only: no
    snapshot) on the tables of `routes`, a list of (schema, router settings):
    one EventRouter per table, applied to that table's records only (a
    TopicNameMatches predicate on the connector's own topic name for it)."""
    u = urllib.parse.urlsplit(url)
    tables = ["%s.outbox_event" % schema for schema, _ in routes]
    prefix = "dbz"
    p = {
        "name": name,
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "tasks.max": "1",
        "plugin.name": "pgoutput",
        "database.hostname": u.hostname,
        "database.port": str(u.port or 5432),
        "database.user": ROLE,
        "database.password": PASSWORD,
        "database.dbname": u.path.lstrip("/"),
        "topic.prefix": prefix,
        "slot.name": slot,
        "publication.name": publication,
        "publication.autocreate.mode": "disabled",
        "table.include.list": ",".join(re.escape(t) for t in tables),
        "skipped.operations": "u,d,t",
        "snapshot.mode": "no_data",
    }
    names = []
    for i, (schema, settings) in enumerate(routes):
        t = "outbox%d" % i
        names.append(t)
        p["transforms.%s.type" % t] = "io.debezium.transforms.outbox.EventRouter"
        for k, v in settings.items():
            p["transforms.%s.%s" % (t, k)] = v
        if len(routes) > 1:
            p["transforms.%s.predicate" % t] = "is%d" % i
            p["predicates.is%d.type" % i] = \
                "org.apache.kafka.connect.transforms.predicates.TopicNameMatches"
            p["predicates.is%d.pattern" % i] = re.escape("%s.%s.outbox_event" % (prefix, schema))
    p["transforms"] = ",".join(names)
    if len(routes) > 1:
        p["predicates"] = ",".join("is%d" % i for i in range(len(routes)))
    p.update({k: str(v) for k, v in (extra or {}).items()})
    return p


class Connect:
    """Kafka Connect standalone with one connector (tests/bench/debezium/connect).

    Connect(dir, bootstrap, props, worker={...}, env={...}) starts it and waits
    until the connector and its task are RUNNING (.start_s is how long that took).
    stop() ends it (SIGTERM) and keeps dir, so a new Connect on the same dir
    resumes from the stored offsets. env adds CONNECT_HEAP_OPTS, CONNECT_JVM_OPTS..."""

    def __init__(self, dir, bootstrap, props, worker=None, env=None, timeout=180):
        self.dir = os.path.abspath(dir)
        os.makedirs(self.dir, exist_ok=True)
        self.name = props["name"]
        path = os.path.join(self.dir, "connector.in.properties")
        with open(path, "w") as f:
            for k, v in props.items():
                f.write("%s=%s\n" % (k, v.replace("\\", "\\\\")))
        args = [SCRIPT, "start", self.dir, bootstrap, path]
        args += ["%s=%s" % kv for kv in (worker or {}).items()]
        t0 = time.monotonic()
        self.started_at = time.time()
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
        self.start_s = time.monotonic() - t0
        if r.returncode != 0:
            self.stop()
            raise RuntimeError("Connect did not start (%d): %s\n%s"
                               % (r.returncode, r.stderr[-3000:], self.log_text()[-3000:]))
        self.rest = r.stdout.strip().split("=", 1)[1]
        with open(os.path.join(self.dir, "pid")) as f:
            self.pid = int(f.read())

    def status(self):
        """The connector's REST status: {"connector": {"state"}, "tasks": [{"state"}...]}."""
        with urllib.request.urlopen("%s/connectors/%s/status" % (self.rest, self.name),
                                    timeout=5) as r:
            return json.loads(r.read())

    def task_state(self):
        tasks = self.status().get("tasks") or [{}]
        return tasks[0].get("state")

    def _states(self):
        s = self.status()
        return {s["connector"]["state"]} | {t["state"] for t in s.get("tasks") or [{}]}

    def _put(self, action, state, timeout):
        req = urllib.request.Request("%s/connectors/%s/%s" % (self.rest, self.name, action),
                                     method="PUT")
        with urllib.request.urlopen(req, timeout=5):
            pass
        deadline = time.monotonic() + timeout
        while self._states() != {state}:
            if time.monotonic() > deadline:
                raise RuntimeError("connector %s not %s after %.0f s: %s"
                                   % (self.name, state, timeout, self.status()))
            time.sleep(0.05)

    def pause(self, timeout=60):
        """Pauses the connector through Connect's REST API (PUT .../pause) and
        waits until it and its task are PAUSED. The task stops handing records
        to the producer; Debezium's streaming thread keeps filling its queue
        (max.queue.size records) from the replication slot meanwhile."""
        self._put("pause", "PAUSED", timeout)

    def resume(self, timeout=60):
        """PUT .../resume, then waits until the connector and its task are RUNNING."""
        self._put("resume", "RUNNING", timeout)

    def running(self):
        try:
            os.kill(self.pid, 0)
            return True
        except OSError:
            return False

    def log_text(self):
        try:
            with open(os.path.join(self.dir, "connect.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self):
        subprocess.run([SCRIPT, "stop", self.dir], capture_output=True, timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
