"""A fake Confluent schema registry for tests (standard library only).

Speaks the part of the REST API the relay and Avro consumers use:

    POST /subjects/{subject}/versions   {"schema": "..."} -> {"id": N}
                                        (the same schema under any subject keeps its id;
                                        registering it again is idempotent)
    POST /subjects/{subject}            {"schema": "..."} -> {"subject", "version", "id",
                                        "schema"} when the subject holds it, else 404
                                        (40401 subject, 40403 schema not found)
    GET  /schemas/ids/{id}              -> {"schema": "..."}
    GET  /subjects/{subject}/versions/latest -> {"subject", "version", "id", "schema"}
    GET  /subjects                      -> ["subject", ...]

Usage:

    with FakeRegistry() as reg:          # 127.0.0.1, a free port
        env["OUTBOX_SCHEMA_REGISTRY_URL"] = reg.url
        reg.fail_with = 503              # "down": every request answers 503
        reg.fail_with = "close"          # ... or the connection is dropped unanswered
        reg.fail_with = None             # up again
        reg.refuse_register = True       # registering answers 403 (lookups still work)
        reg.requests                     # [(method, path, parsed JSON body or None)]

Run as a program (python3 fake_registry.py [PORT]) it serves until killed and
prints URL=http://127.0.0.1:PORT.
"""

import http.server
import json
import re
import sys
import threading

__all__ = ["FakeRegistry"]

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet
        pass

    def _send(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status, code, message):
        self._send(status, {"error_code": code, "message": message})

    def _handle(self, method):
        reg = self.server.registry
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        path = self.path.split("?", 1)[0]
        with reg.lock:
            reg.requests.append((method, path, body))
            fail = reg.fail_with
        if fail == "close":
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if fail is not None:
            return self._error(int(fail), 50001, "fake registry is failing on purpose")

        from urllib.parse import unquote
        m = re.fullmatch(r"/subjects/([^/]+)/versions", path)
        if m and method == "POST":
            if not isinstance(body, dict) or not isinstance(body.get("schema"), str):
                return self._error(422, 42201, "Invalid schema")
            try:
                json.loads(body["schema"])
            except ValueError:
                return self._error(422, 42201, "Invalid schema: not JSON")
            if reg.refuse_register:
                return self._error(403, 40301, "User is denied operation Write on subject")
            return self._send(200, {"id": reg.register(unquote(m.group(1)), body["schema"])})
        m = re.fullmatch(r"/subjects/([^/]+)", path)
        if m and method == "POST":
            if not isinstance(body, dict) or not isinstance(body.get("schema"), str):
                return self._error(422, 42201, "Invalid schema")
            found = reg.find(unquote(m.group(1)), body["schema"])
            if found is None:
                return self._error(404, 40403, "Schema not found")
            return self._send(200, found)
        m = re.fullmatch(r"/schemas/ids/(\d+)", path)
        if m and method == "GET":
            schema = reg.schema_by_id(int(m.group(1)))
            if schema is None:
                return self._error(404, 40403, "Schema not found")
            return self._send(200, {"schema": schema})
        m = re.fullmatch(r"/subjects/([^/]+)/versions/latest", path)
        if m and method == "GET":
            latest = reg.latest(unquote(m.group(1)))
            if latest is None:
                return self._error(404, 40401, "Subject not found")
            return self._send(200, latest)
        if path == "/subjects" and method == "GET":
            with reg.lock:
                return self._send(200, sorted(reg.subjects))
        return self._error(404, 404, "Not found")

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")


class FakeRegistry:
    """The fake registry on its own thread; .url once constructed."""

    def __init__(self, host="127.0.0.1", port=0):
        self.lock = threading.Lock()
        self.requests = []
        self.fail_with = None
        self.refuse_register = False
        self.schemas = []        # id - 1 -> schema text
        self.subjects = {}       # subject -> [id per version]
        self.server = http.server.ThreadingHTTPServer((host, port), _Handler)
        self.server.daemon_threads = True
        self.server.registry = self
        self.url = "http://%s:%d" % self.server.server_address[:2]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def register(self, subject, schema):
        with self.lock:
            canon = json.dumps(json.loads(schema), sort_keys=True)
            ids = [i for i, s in enumerate(self.schemas, 1)
                   if json.dumps(json.loads(s), sort_keys=True) == canon]
            if ids:
                sid = ids[0]
            else:
                self.schemas.append(schema)
                sid = len(self.schemas)
            versions = self.subjects.setdefault(subject, [])
            if sid not in versions:
                versions.append(sid)
            return sid

    def find(self, subject, schema):
        """The subject's version holding `schema` (as the lookup answers), or None."""
        with self.lock:
            canon = json.dumps(json.loads(schema), sort_keys=True)
            for version, sid in enumerate(self.subjects.get(subject, []), 1):
                if json.dumps(json.loads(self.schemas[sid - 1]), sort_keys=True) == canon:
                    return {"subject": subject, "version": version, "id": sid,
                            "schema": self.schemas[sid - 1]}
            return None

    def schema_by_id(self, sid):
        with self.lock:
            return self.schemas[sid - 1] if 1 <= sid <= len(self.schemas) else None

    def latest(self, subject):
        with self.lock:
            versions = self.subjects.get(subject)
            if not versions:
                return None
            sid = versions[-1]
            return {"subject": subject, "version": len(versions), "id": sid,
                    "schema": self.schemas[sid - 1]}

    def posts(self):
        """The POST requests so far: [(path, body)]."""
        with self.lock:
            return [(p, b) for m, p, b in self.requests if m == "POST"]

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    reg = FakeRegistry(port=int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    print("URL=%s" % reg.url, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        reg.close()
