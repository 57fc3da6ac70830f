#!/usr/bin/python3
"""The table of tests/bench/compare: medians of each bench row for the base
and the head, from results.json files under DIR/base-N and DIR/head-N.

    compare.py [--base-label REF] DIR
"""

import argparse
import glob
import json
import os
import statistics

# What tells runs of one row apart, and the figures compared.
IDENTITY = ("row", "broker", "instances", "clients", "pending", "offered_per_s", "aggregates")
FIGURES = {
    "ceiling": ["rows_per_s"],
    "relay": ["rows_per_s", "pg_us_per_row", "relay_us_per_row", "hwm_mib"],
    "hot": ["rows_per_s", "hwm_mib"],
    "blocked": ["rows_per_s"],
    "big": ["rows_per_s", "hwm_mib"],
    "backlog": ["lock_median_ms", "lock_min_ms"],
    "latency": ["p50_ms", "p99_ms", "max_ms", "hwm_mib"],
}
LOWER_IS_BETTER = ("_ms", "_mib", "_us_per_row")


def runs(path):
    with open(path) as f:
        data = json.load(f)
    for r in data.get("runs", []):
        rows = r.get("rows") or 0
        if rows and r.get("pg_cpu_s") is not None:
            r["pg_us_per_row"] = r["pg_cpu_s"] / rows * 1e6
        if rows and r.get("relay_cpu_s") is not None:
            r["relay_us_per_row"] = r["relay_cpu_s"] / rows * 1e6
        yield r


def collect(directory, side):
    table = {}
    for path in sorted(glob.glob(os.path.join(directory, "%s-*" % side, "results.json"))):
        for r in runs(path):
            key = tuple((k, r[k]) for k in IDENTITY if r.get(k) is not None)
            for fig in FIGURES.get(r.get("row"), []):
                if isinstance(r.get(fig), (int, float)):
                    table.setdefault(key, {}).setdefault(fig, []).append(float(r[fig]))
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-label", default="base")
    ap.add_argument("--head-label", default="head")
    ap.add_argument("dir")
    args = ap.parse_args()
    base, head = collect(args.dir, "base"), collect(args.dir, "head")
    print("| row | figure | %s (median) | %s (median) | ratio | runs |"
          % (args.base_label, args.head_label))
    print("|---|---|---|---|---|---|")
    for key in sorted(set(base) | set(head), key=str):
        name = ", ".join("%s=%s" % (k, v) if k != "row" else str(v) for k, v in key)
        for fig in sorted(set(base.get(key, {})) | set(head.get(key, {}))):
            b, h = base.get(key, {}).get(fig, []), head.get(key, {}).get(fig, [])
            mb = statistics.median(b) if b else None
            mh = statistics.median(h) if h else None
            ratio = "%.2f" % (mh / mb) if mb and mh is not None else "-"
            better = "" if ratio == "-" else (
                " (lower is better)" if fig.endswith(LOWER_IS_BETTER) else "")
            print("| %s | %s%s | %s | %s | %s | %d/%d |"
                  % (name, fig, better, "-" if mb is None else "%.1f" % mb,
                     "-" if mh is None else "%.1f" % mh, ratio, len(b), len(h)))


if __name__ == "__main__":
    main()
