"""Row data cannot forge log lines. Rows with arbitrary characters in every
text column (and in headers_json's member names and values, and in the
payload) go through a real relay, in both log formats; most are made to go
DEAD, so the relay logs their topics and librdkafka's messages about them.
Every line of its stderr must then be one well-formed record, escaped
(no control character, no line separator, valid UTF-8), with only keys the
code writes, each once."""
import glob
import json
import os
import random
import re

import pytest

from conftest import relay_env
from harness import Relay, repo_root, wait_until

# Characters that break log formats, then some that are merely unusual.
HOSTILE = ["\n", "\r", "\t", "\x0b", "\x0c", "\x1b", "\x7f", "\x85", "\u2028", "\u2029", '"',
           "\\", "=", " ", "{", "}", ",", ":", "'", "\ufffd", "\U0001F600", "\u00e9", "%s", "%n"]
INJECTIONS = [" level=error err=FORGED forged_key=1",
              "\nts=2024-01-01T00:00:00.000Z level=error mod=relay msg=\"FORGED\"",
              "\"} {\"level\":\"error\",\"forged_key\":\"1",
              "\r\n{\"ts\":\"t\",\"level\":\"error\",\"msg\":\"FORGED\"}",
              "\\\" err=FORGED \\\\"]
TEXT_COLUMNS = ["tenant_id", "aggregate_type", "aggregate_id", "event_type", "topic_name",
                "partition_key", "event_key", "correlation_id", "causation_id", "trace_id"]


def hostile(rng, long=False):
    """A random string of arbitrary characters (no NUL: PostgreSQL text has
    none), biased towards the ones that matter, sometimes with an injection."""
    n = rng.randrange(4000, 6000) if long else rng.randrange(1, 40)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.3:
            out.append(rng.choice(HOSTILE))
        elif r < 0.5:
            out.append(chr(rng.randrange(1, 0x80)))
        else:  # any code point but the surrogates
            cp = rng.randrange(1, 0x110000)
            out.append(chr(cp) if not 0xD800 <= cp <= 0xDFFF else "x")
    if rng.random() < 0.5:
        out.insert(rng.randrange(len(out) + 1), rng.choice(INJECTIONS))
    return "".join(out)


def rows(rng, n):
    out = []
    for i in range(n):
        # long: topic_name (the indexed columns must fit a btree entry)
        row = {c: hostile(rng, long=(i % 10 == 0 and c == "topic_name")) for c in TEXT_COLUMNS}
        row["aggregate_version"] = 1
        row["payload_json"] = {hostile(rng): hostile(rng)}
        row["headers_json"] = {hostile(rng): hostile(rng) for _ in range(rng.randrange(0, 4))}
        if i % 3 == 1:
            row["topic_name"] = None  # the topic comes from the template: hostile aggregate_type
        if i % 7 == 0:  # refused as INVALID_HEADERS, with a reason in the log
            row["headers_json"] = {"h%d" % k: hostile(rng) for k in range(80)}
        out.append(row)
    return out


def code_keys():
    """Every key the C sources write: a name right before '=%' or '=<digit>'
    in a string literal of common/, relay/ or sweeper/, plus the line head."""
    keys = {"ts", "level", "mod", "msg"}
    for path in glob.glob(os.path.join(repo_root(), "*", "*.c")):
        if os.path.basename(os.path.dirname(path)) not in ("common", "relay", "sweeper"):
            continue
        with open(path) as f:
            for lit in re.findall(r'"((?:[^"\\\n]|\\.)*)"', f.read()):
                keys.update(re.findall(r"(?:^| )([a-z_]+)=(?:%|[0-9])", lit))
    return keys


def no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), "duplicate key in %r" % keys
    return dict(pairs)


LOGFMT = re.compile(r'([A-Za-z0-9_.-]+)=("(?:[^"\\]|\\(?:["\\/bfnrt]|u[0-9a-f]{4}))*"|[^ "=\\]+)')


def parse_text(line):
    pairs, pos = [], 0
    while True:
        m = LOGFMT.match(line, pos)
        assert m, "not logfmt at %d: %r" % (pos, line)
        value = m.group(2)
        pairs.append((m.group(1), json.loads(value) if value.startswith('"') else value))
        pos = m.end()
        if pos == len(line):
            return no_duplicates(pairs)
        assert line[pos] == " ", "not logfmt at %d: %r" % (pos, line)
        pos += 1


def check_log(raw, json_format, allowed):
    """Every line of raw (bytes) is one well-formed record with allowed keys;
    returns the records."""
    assert raw.endswith(b"\n")
    records = []
    for line in raw[:-1].split(b"\n"):
        bad = [b for b in line if b < 0x20 or b == 0x7F]
        assert not bad, "raw control bytes %r in %r" % (bad, line)
        text = line.decode("utf-8")  # strict: raises on invalid UTF-8
        assert not re.search("[\u0080-\u009f\u2028\u2029]", text), repr(text)
        rec = (json.loads(text, object_pairs_hook=no_duplicates) if json_format
               else parse_text(text))
        assert list(rec)[:4] == ["ts", "level", "mod", "msg"], rec
        assert set(rec) <= allowed, "keys the code does not write: %s" % (set(rec) - allowed)
        assert all(isinstance(v, str) for v in rec.values()), rec
        for k in ("ts", "level", "mod", "msg"):
            assert "FORGED" not in rec[k], rec
        records.append(rec)
    return records


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_row_data_cannot_forge_log_lines(db, kafka, tmp_path, fmt):
    rng = random.Random(16 if fmt == "json" else 17)
    n = 60
    db.insert_events(rows(rng, n))
    env = relay_env(db, kafka, OUTBOX_LOG_FORMAT=fmt, OUTBOX_LOG_LEVEL="debug",
                    OUTBOX_MAX_ATTEMPTS=1, OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=5000,
                    OUTBOX_ORDERING="none")
    with Relay("outbox-relay", env=env, log_dir=tmp_path, name="relay-" + fmt) as relay:
        wait_until(lambda: sum(db.status_counts()[s] for s in ("PUBLISHED", "DEAD")) == n, 90,
                   what="every row PUBLISHED or DEAD")
        assert relay.stop() == 0
    with open(relay.log_path, "rb") as f:
        raw = f.read()
    records = check_log(raw, fmt == "json", code_keys())
    dead = [r for r in records if r["msg"] == "event dead"]
    assert len(dead) == db.status_counts()["DEAD"] > 0
    # the hostile values did reach the log, escaped, as values of their own fields
    assert any(set(r.get("topic", "")) & set("\n\r\t\"\\= ") for r in dead), dead[:3]
    assert any(r["reason"] for r in dead)
    assert any(len(r.get("topic", "")) > 100 and r["topic"].endswith("...") for r in dead), \
        "a 4000-6000 character topic is cut, its fields after it kept"
    assert all("err" in r and "reason" in r for r in dead)
