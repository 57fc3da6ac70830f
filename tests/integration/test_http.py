"""The relay's /metrics, /healthz and /readyz under clients that misbehave:
100 idle connections (reopened whenever the server drops them), 10 slow-loris
requests that never end, scrapers that never read their answer, and rounds
of 200 concurrent scrapes. Meanwhile every probe answers within 100 ms and
the relay publishes its backlog as it would alone."""
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from conftest import relay_env
from harness import Relay, free_port, make_events, wait_until


def probe(port, path, method="GET", version="1.1"):
    """(status, seconds) of one request on a fresh connection."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(("%s %s HTTP/%s\r\nHost: x\r\n\r\n" % (method, path, version)).encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    took = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.") else 0
    return status, took, head.decode("latin1"), body


class Abuse:
    """Idle, slow-loris and non-reading clients, kept up by a thread."""

    def __init__(self, port, idle=100, slow=10, stuck=10):
        self.port, self.stop, self.reopened = port, threading.Event(), 0
        self.idle = [self._connect() for _ in range(idle)]
        self.slow = [self._connect() for _ in range(slow)]
        self.stuck = [self._connect() for _ in range(stuck)]
        for s in self.stuck:  # asks for /metrics, never reads the answer
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _connect(self):
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        return s

    def _run(self):
        line = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        sent = 0
        while not self.stop.is_set():
            for i, s in enumerate(self.idle):
                s.setblocking(False)
                try:
                    if s.recv(1) == b"":
                        s.close()
                        self.idle[i] = self._connect()
                        self.reopened += 1
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    self.idle[i] = self._connect()
                    self.reopened += 1
            for s in self.slow:
                try:
                    s.send(line[sent % len(line):sent % len(line) + 1])
                except OSError:
                    pass
            sent += 1
            self.stop.wait(0.2)

    def close(self):
        self.stop.set()
        self.thread.join()
        for s in self.idle + self.slow + self.stuck:
            s.close()


def test_probes_and_publishing_beside_misbehaving_clients(db, kafka, tmp_path, capsys):
    n = 20000
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    port = free_port()
    env = relay_env(db, kafka, OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        wait_until(lambda: probe(port, "/readyz")[0] == 200, 30, what="relay ready")
        abuse = Abuse(port)
        try:
            db.insert_events(make_events(aggregates=100, versions=n // 100, payload_size=100))
            t0 = time.monotonic()
            worst, probes, scrapes = 0.0, 0, 0
            with ThreadPoolExecutor(max_workers=200) as pool:
                while db.status_counts()["PUBLISHED"] < n:
                    assert time.monotonic() - t0 < 120, "backlog not published in 120 s"
                    for path in ("/healthz", "/readyz"):
                        status, took, _, _ = probe(port, path)
                        assert status == 200, (path, status)
                        worst = max(worst, took)
                        probes += 1
                    # a round of 200 concurrent scrapes, every other probe round
                    if probes % 4 == 0:
                        got = list(pool.map(lambda _: probe(port, "/metrics")[0], range(200)))
                        assert got.count(200) == 200, got
                        scrapes += 200
                    time.sleep(0.05)
            took_all = time.monotonic() - t0
            # the idle clients were dropped at the idle timeout and came back
            wait_until(lambda: abuse.reopened > 0, 10, what="idle clients dropped")
            status, took, _, _ = probe(port, "/healthz")
            assert status == 200 and took < 0.1, took
        finally:
            abuse.close()
        assert worst < 0.1, "slowest probe %.3f s" % worst
        assert relay.running(), relay.log_text()[-2000:]
        assert relay.stop() == 0
    with capsys.disabled():
        print("\n[http] %d events published in %.1f s beside 100 idle, 10 slow-loris and 10 "
              "non-reading clients and %d concurrent scrapes; %d probes, slowest %.1f ms"
              % (n, took_all, scrapes, probes, worst * 1000))


def test_versions_methods_and_garbage(db, kafka, tmp_path):
    port = free_port()
    env = relay_env(db, kafka, OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)
    with Relay("outbox-relay", env=env, log_dir=tmp_path):
        wait_until(lambda: probe(port, "/readyz")[0] == 200, 30, what="relay ready")
        for version in ("1.0", "1.1"):
            status, _, head, body = probe(port, "/metrics", version=version)
            assert status == 200 and head.startswith("HTTP/%s 200" % version), head
            assert b"\noutbox_build_info{" in body and b'",schema="' in body, body
            status, _, head, body = probe(port, "/metrics", method="HEAD", version=version)
            assert status == 200 and body == b"" and "Content-Length: " in head, head
        assert probe(port, "/nope")[0] == 404
        status, _, head, _ = probe(port, "/metrics", method="POST")
        assert status == 405 and "Allow: GET, HEAD" in head, head
        # urllib (HTTP/1.1 with keep-alive asked) as a scraper would
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
            assert r.status == 200 and b"outbox_batches_total" in r.read()
        for garbage in (b"GARBAGE\r\n\r\n", b"GET /healthz\r\n", b"\x16\x03\x01\x02\x00\x01"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(garbage)
                s.shutdown(socket.SHUT_WR)
                answer = s.recv(4096)
                assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer
        assert probe(port, "/healthz")[0] == 200
