"""The planner's picture of the backlog: statistics taken while everything
was published make the guard's probes scan the wrong partial index whole
(a 500-row lock took 440 ms instead of 25 ms in a 100k backlog). The relay
compares the planner's estimate of the unpublished rows with the exact count
of its table sample and analyzes the table when they are far apart."""
import json

from conftest import relay_env
from harness import Relay, make_events, wait_until


def planned_unpublished(db):
    plan = db.execute("EXPLAIN (FORMAT JSON) SELECT 1 FROM %s WHERE published_at IS NULL"
                      % db.table)[0]["QUERY PLAN"]
    plan = plan if isinstance(plan, list) else json.loads(plan)
    return plan[0]["Plan"]["Plan Rows"]


def test_stale_statistics_are_refreshed(db, kafka, tmp_path):
    # statistics taken while the outbox was empty (all published) ...
    db.insert_events(make_events(aggregates=100, versions=5))
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now()" % db.table)
    db.execute("VACUUM ANALYZE %s" % db.table)
    # ... then a burst
    db.insert_events(make_events(aggregates=2000, versions=10, id_prefix="burst"))
    assert planned_unpublished(db) < 100
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path) as relay:
        line = relay.wait_log(r"planner statistics out of date: analyzed the table\""
                              r" planned_unpublished=(\d+) unpublished=(\d+)", 30)
        assert int(line.group(1)) < 100 and int(line.group(2)) >= 10000
        wait_until(lambda: db.status_counts()["PUBLISHED"] == 20500, 120, what="burst published")
        assert relay.stop() == 0
        log = relay.log_text()
    assert log.count("planner statistics out of date") == 1  # not again within a minute
