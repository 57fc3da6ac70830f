/* db_admin.c - the operator's statements (outboxctl): stats, DEAD rows,
 * requeue, gaps, replay, and the table's side of reconciling with Kafka.
 *
 * Prepared on admin connections only (db_set_admin()): those that need no
 * temp table at connect, replay's and reconcile's once their temp tables
 * exist. Every statement that changes rows is one statement (its own
 * transaction). Timestamps come out as RFC 3339 in UTC (RFC3339 below). */
#include "db_admin.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db_internal.h"
#include "errstr.h"

/* ---- statements prepared at connect ---- */

enum {
        A_STATS_COUNTS,
        A_STATS_OLDEST,
        A_DEAD,
        A_DEAD_JSON,
        A_GAPS,
        A_GAPS_JSON,
        A_REQUEUE,
        A_REQUEUE_PLAN,
        A_REQUEUE_PLAN_ROWS,
        A_REQUEUE_PLAN_FREED,
        A_RELEASE_GAP,
        A_COUNT
};

#define STATUSES "ARRAY['PENDING','PUBLISHING','PUBLISHED','FAILED','DEAD']"

/* A timestamptz as RFC 3339 in UTC with microseconds
 * (2024-05-01T10:00:00.123456Z); NULL for NULL and the infinities. */
#define RFC3339(ts)       "to_char(" ts " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
#define CREATED_AT        RFC3339("created_at")
#define UPDATED_AT        RFC3339("updated_at")
#define OLDEST_CREATED_AT RFC3339("min(created_at)")

/* The DEAD rows a requeue moves ($1 one id; $2-$4 one aggregate; $5 all, $6
 * with this code), over unqualified columns. */
#define REQUEUE_MATCH                                                                              \
        "(($1::uuid IS NOT NULL AND outbox_id = $1::uuid)"                                         \
        " OR ($4::text IS NOT NULL AND tenant_id = $2 AND aggregate_type = $3"                     \
        "  AND aggregate_id = $4)"                                                                 \
        " OR ($5::boolean AND ($6::text IS NULL OR last_error_code = $6)))"
#define REQUEUE_DEAD "published_at IS NULL AND status = 'DEAD' AND " REQUEUE_MATCH

/* Row `a` has a place in its aggregate's order: every row but a LATE_VERSION
 * one, DEAD or locked to go DEAD, which committed after a later version
 * reached Kafka. Such a row holds nothing: the versions after it follow the
 * version below it (docs/DESIGN.md, "Per-aggregate order"), as in
 * relay/sql/lock.sql. */
#define IN_ORDER(a)                                                                                \
        "(" a ".status NOT IN ('DEAD', 'PUBLISHING') OR " a                                        \
        ".last_error_code IS DISTINCT FROM 'LATE_VERSION')"
#define D_IN_ORDER IN_ORDER("d")
#define H_IN_ORDER IN_ORDER("h")
#define P_IN_ORDER IN_ORDER("p")

/* After `moved` (the requeued rows, or those a requeue would move), `free`:
 * the aggregates whose parked versions are due again, those with no DEAD
 * version left. `still` sees the statement's snapshot (moved rows still
 * DEAD), so it keeps the DEAD rows the filter does not match. */
#define REQUEUE_FREE                                                                               \
        " aggs AS (SELECT DISTINCT tenant_id, aggregate_type, aggregate_id FROM moved),"           \
        " still AS (SELECT DISTINCT tenant_id, aggregate_type, aggregate_id"                       \
        "  FROM %1$s d JOIN aggs a USING (tenant_id, aggregate_type, aggregate_id)"                \
        "  WHERE d.published_at IS NULL AND d.status = 'DEAD' AND " D_IN_ORDER                     \
        " AND " REQUEUE_MATCH " IS NOT TRUE),"                                                     \
        " free AS (SELECT * FROM aggs EXCEPT SELECT * FROM still)"
/* Row o is a version the sweeper parked behind a DEAD one, of an aggregate
 * in `free` (as f). */
#define PARKED_FREED                                                                               \
        " o.tenant_id = f.tenant_id AND o.aggregate_type = f.aggregate_type"                       \
        " AND o.aggregate_id = f.aggregate_id AND o.published_at IS NULL"                          \
        " AND o.available_at = 'infinity' AND o.status IN ('PENDING', 'FAILED')"                   \
        " AND o.last_error_code = 'BLOCKED'"

/* The previous version of head `h`'s aggregate in the table, of any status
 * but a late one (IN_ORDER). */
#define HEAD_PREV                                                                                  \
        "(SELECT p.aggregate_version FROM %1$s p WHERE p.tenant_id = h.tenant_id"                  \
        " AND p.aggregate_type = h.aggregate_type AND p.aggregate_id = h.aggregate_id"             \
        " AND p.aggregate_version < h.aggregate_version AND " P_IN_ORDER                           \
        " ORDER BY p.aggregate_version DESC LIMIT 1)"

/* Version gaps, oldest first, at most $1: heads (lowest unpublished version
 * of their aggregate) whose previous version in the table is not the one just
 * below. The held version waits for prev + 1 .. aggregate_version - 1. */
#define GAPS(columns)                                                                              \
        "SELECT " columns " FROM (SELECT DISTINCT ON (h.tenant_id, h.aggregate_type,"              \
        "  h.aggregate_id) h.*, " HEAD_PREV " AS prev FROM %1$s h"                                 \
        "  WHERE h.published_at IS NULL AND h.status IN ('PENDING', 'FAILED')"                     \
        "  AND NOT EXISTS (SELECT 1 FROM %1$s p WHERE p.tenant_id = h.tenant_id"                   \
        "   AND p.aggregate_type = h.aggregate_type AND p.aggregate_id = h.aggregate_id"           \
        "   AND p.published_at IS NULL AND p.aggregate_version < h.aggregate_version"              \
        "   AND " P_IN_ORDER ")"                                                                   \
        "  ORDER BY h.tenant_id, h.aggregate_type, h.aggregate_id, h.aggregate_version) x"         \
        " WHERE prev < aggregate_version - 1 ORDER BY created_at LIMIT $1"

const struct db_stmt db_admin_stmts[A_COUNT] = {
        /* Every status, exact: an operator's question, not a sample. */
        [A_STATS_COUNTS] = {"admin_stats", "stats", 0,
                            "SELECT s.status, count(o.status) AS rows"
                            " FROM unnest(" STATUSES ") AS s(status)"
                            " LEFT JOIN %1$s o ON o.status = s.status GROUP BY s.status"
                            " ORDER BY array_position(" STATUSES ", s.status)"},
        [A_STATS_OLDEST] = {"admin_oldest", "stats", 0,
                            "SELECT round(extract(epoch FROM now() - min(created_at)))::bigint"
                            " AS oldest_due_age_s, " OLDEST_CREATED_AT " AS oldest_due_created_at"
                            " FROM %1$s"
                            " WHERE published_at IS NULL AND status IN ('PENDING','FAILED')"},
        [A_DEAD] = {"admin_dead", "dead", 1,
                    "SELECT outbox_id, tenant_id, aggregate_type || '/' || aggregate_id AS"
                    " aggregate, aggregate_version AS version, attempt_count AS attempts,"
                    " last_error_code AS code, left(last_error_message, 80) AS message,"
                    " " UPDATED_AT " AS updated_at FROM %1$s"
                    " WHERE published_at IS NULL AND status = 'DEAD'"
                    " ORDER BY tenant_id, aggregate_type, aggregate_id, aggregate_version"
                    " LIMIT $1"},
        [A_DEAD_JSON] = {"admin_dead_json", "dead", 1,
                         "SELECT outbox_id, tenant_id, aggregate_type, aggregate_id,"
                         " aggregate_version, event_type, attempt_count, last_error_code,"
                         " last_error_message, " CREATED_AT " AS created_at,"
                         " " UPDATED_AT " AS updated_at FROM %1$s"
                         " WHERE published_at IS NULL AND status = 'DEAD'"
                         " ORDER BY tenant_id, aggregate_type, aggregate_id, aggregate_version"
                         " LIMIT $1"},
        [A_GAPS] = {"admin_gaps", "gaps", 1,
                    GAPS("tenant_id, aggregate_type || '/' || aggregate_id AS aggregate,"
                         " aggregate_version AS held_version, CASE"
                         "  WHEN prev + 1 = aggregate_version - 1 THEN (prev + 1)::text"
                         "  ELSE (prev + 1)::text || '-' || (aggregate_version - 1)::text END"
                         " AS missing, date_trunc('second', now() - created_at) AS held_for")},
        [A_GAPS_JSON] = {"admin_gaps_json", "gaps", 1,
                         GAPS("tenant_id, aggregate_type, aggregate_id, aggregate_version AS"
                              " held_version, prev + 1 AS missing_from, aggregate_version - 1"
                              " AS missing_to, " CREATED_AT " AS held_since,"
                              " floor(extract(epoch FROM now() - created_at))::bigint"
                              " AS held_for_s")},
        /* DEAD rows only, so a row a relay holds is never touched. The
         * versions the sweeper parked behind them (BLOCKED) are due again at
         * once where their aggregate has no other DEAD version. */
        [A_REQUEUE] =
                {"admin_requeue", "requeue", 6,
                 "WITH moved AS (UPDATE %1$s SET status = 'PENDING', attempt_count = 0,"
                 "  available_at = now(), locked_by = NULL, locked_at = NULL,"
                 "  updated_at = clock_timestamp() WHERE " REQUEUE_DEAD
                 "  RETURNING outbox_id, tenant_id, aggregate_type, aggregate_id)," REQUEUE_FREE
                 ", freed AS (UPDATE %1$s o SET available_at = now(),"
                 "  last_error_code = NULL, last_error_message = NULL,"
                 "  updated_at = clock_timestamp() FROM free f WHERE" PARKED_FREED "  RETURNING 1)"
                 " SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM freed)"},
        /* What A_REQUEUE would do, changing nothing: its two counts; the
         * rows (at most $7); the parked versions, by aggregate (at most $7). */
        [A_REQUEUE_PLAN] = {"admin_requeue_plan", "requeue", 6,
                            "WITH moved AS (SELECT * FROM %1$s WHERE " REQUEUE_DEAD
                            ")," REQUEUE_FREE " SELECT (SELECT count(*) FROM moved),"
                            " (SELECT count(*) FROM %1$s o JOIN free f ON" PARKED_FREED ")"},
        [A_REQUEUE_PLAN_ROWS] = {"admin_requeue_plan_rows", "requeue", 7,
                                 "SELECT outbox_id, tenant_id, aggregate_type, aggregate_id,"
                                 " aggregate_version, attempt_count, last_error_code,"
                                 " last_error_message, " UPDATED_AT " AS updated_at"
                                 " FROM %1$s WHERE " REQUEUE_DEAD
                                 " ORDER BY tenant_id, aggregate_type, aggregate_id,"
                                 " aggregate_version LIMIT $7"},
        [A_REQUEUE_PLAN_FREED] = {"admin_requeue_plan_freed", "requeue", 7,
                                  "WITH moved AS (SELECT * FROM %1$s WHERE " REQUEUE_DEAD
                                  ")," REQUEUE_FREE
                                  " SELECT o.tenant_id, o.aggregate_type, o.aggregate_id,"
                                  " count(*) AS parked, min(o.aggregate_version) AS"
                                  " from_version, max(o.aggregate_version) AS to_version"
                                  " FROM %1$s o JOIN free f ON" PARKED_FREED
                                  " GROUP BY 1, 2, 3 ORDER BY 1, 2, 3 LIMIT $7"},
        /* The held version is the aggregate's lowest unpublished one; the
         * missing versions are recorded by one PUBLISHED row at the version
         * just below it, which the guard then takes as the predecessor.
         * Should a missing version still come, it goes DEAD (LATE_VERSION)
         * instead of out of order. */
        [A_RELEASE_GAP] = {"admin_release_gap", "release-gap", 3,
                           "WITH head AS (SELECT h.tenant_id, h.aggregate_type, h.aggregate_id,"
                           "  h.aggregate_version AS v, " HEAD_PREV " AS prev FROM %1$s h"
                           "  WHERE h.tenant_id = $1 AND h.aggregate_type = $2"
                           "  AND h.aggregate_id = $3 AND h.published_at IS NULL"
                           "  AND " H_IN_ORDER " ORDER BY h.aggregate_version LIMIT 1),"
                           " ins AS (INSERT INTO %1$s (tenant_id, aggregate_type, aggregate_id,"
                           "  aggregate_version, event_type, status, published_at, attempt_count,"
                           "  last_error_code, last_error_message)"
                           "  SELECT tenant_id, aggregate_type, aggregate_id, v - 1,"
                           "  'outbox.gap-released', 'PUBLISHED', now(), 0, 'GAP_RELEASED',"
                           "  'versions ' || (prev + 1) || '-' || (v - 1) || ' missing"
                           " (never committed, or late); released by an operator, not sent'"
                           "  FROM head WHERE prev < v - 1 RETURNING aggregate_version)"
                           " SELECT h.prev + 1, h.v - 1 FROM head h, ins"},
};
const size_t db_admin_stmt_count = A_COUNT;

/* ---- replay: a temp table of the aggregates, then steps over it ---- */

#define TEMP_REPLAY    1
#define TEMP_RECONCILE 2

/* ctl_replay: one row per aggregate a replay touches, numbered so the steps
 * can take them in ranges, with the version it replays from. ctl_held: the
 * rows a step holds (docs/DESIGN.md, "Replaying"), with what an undo
 * restores. */
static const char replay_ddl[] =
        "CREATE TEMP TABLE ctl_replay (n bigint PRIMARY KEY, tenant_id text NOT NULL,"
        " aggregate_type text NOT NULL, aggregate_id text NOT NULL, lo bigint NOT NULL);"
        "CREATE TEMP TABLE ctl_held (outbox_id uuid PRIMARY KEY, n bigint NOT NULL,"
        " published_at timestamptz, available_at timestamptz, attempt_count int,"
        " last_error_code text, last_error_message text)";

enum { R_SELECT_AGG, R_SELECT_WINDOW, R_PLAN, R_EXAMPLES, R_HOLD, R_RELEASE, R_UNDO, R_COUNT };

/* `rng`: the rows of the aggregates of ctl_replay that `which` selects (as
 * r), from their start version up, every status, read on the unique key
 * (aggregate, version); `lock` is "" or " FOR UPDATE". Rows another
 * transaction holds are waited for (the session's lock_timeout), and
 * FOR UPDATE then returns their newest version. */
#define REPLAY_RANGE(which, lock)                                                                  \
        " rng AS MATERIALIZED (SELECT r.n, o.outbox_id, o.tenant_id, o.aggregate_type,"            \
        "  o.aggregate_id, o.aggregate_version, o.status, o.last_error_code,"                      \
        "  o.last_error_message, o.published_at, o.available_at, o.attempt_count,"                 \
        "  %2$s AS topic FROM pg_temp.ctl_replay r CROSS JOIN LATERAL (SELECT o.* FROM %1$s o"     \
        "   WHERE o.tenant_id = r.tenant_id AND o.aggregate_type = r.aggregate_type"               \
        "   AND o.aggregate_id = r.aggregate_id AND o.aggregate_version >= r.lo" lock ") o"        \
        "  WHERE " which "),"

/* Each row of `rng` classed (`held`: "" or HELD_CLASS; `busy`: the rows
 * that make their aggregate busy):
 *   held:          a row this replay's first step holds (its second step
 *                  makes it due);
 *   released:      a GAP_RELEASED record, never sent, never replayed;
 *   unpublished:   not PUBLISHED, left as it is (it goes after the replayed
 *                  versions, by the guard);
 *   busy:          PUBLISHED, but a version of its aggregate is PUBLISHING
 *                  now (held by a relay, or by another replay): once that
 *                  one is marked, the replayed versions below it would be
 *                  late (LATE_VERSION), so none move;
 *   below_release: PUBLISHED below a released gap: replayed, it would be late
 *                  behind the release record (published), so it stays;
 *   move:          PUBLISHED -> PENDING.
 * A replay runs to each aggregate's latest version, so no later version stays
 * published ahead of the replayed ones (which would make them late too). */
#define REPLAY_CLASSES(held, busy)                                                                 \
        " agg AS (SELECT n, bool_or(" busy ") AS busy,"                                            \
        "  max(aggregate_version) FILTER (WHERE status = 'PUBLISHED'"                              \
        "   AND last_error_code = 'GAP_RELEASED') AS released FROM rng GROUP BY n),"               \
        " cls AS (SELECT g.*, a.busy, CASE" held                                                   \
        "  WHEN g.status = 'PUBLISHED' AND g.last_error_code = 'GAP_RELEASED' THEN 'released'"     \
        "  WHEN g.status <> 'PUBLISHED' THEN 'unpublished'"                                        \
        "  WHEN a.busy THEN 'busy'"                                                                \
        "  WHEN g.aggregate_version < a.released THEN 'below_release'"                             \
        "  ELSE 'move' END AS what FROM rng g JOIN agg a USING (n))"
#define HELD_CLASS " WHEN g.outbox_id IN (SELECT outbox_id FROM pg_temp.ctl_held) THEN 'held'"

/* The counts of struct db_replay_counts after `moved` and `moved_aggs`. */
#define REPLAY_COUNTS(moved, moved_aggs)                                                           \
        "SELECT " moved ", " moved_aggs ","                                                        \
        " count(*) FILTER (WHERE what = 'busy'), count(DISTINCT n) FILTER (WHERE what = 'busy'),"  \
        " count(*) FILTER (WHERE what = 'below_release'),"                                         \
        " count(*) FILTER (WHERE what = 'released'),"                                              \
        " count(*) FILTER (WHERE what = 'unpublished'),"                                           \
        " count(*) FILTER (WHERE status = 'PENDING'),"                                             \
        " count(*) FILTER (WHERE status = 'FAILED'),"                                              \
        " count(*) FILTER (WHERE status = 'DEAD'),"                                                \
        " count(*) FILTER (WHERE status = 'PUBLISHING') FROM cls"
#define REPLAY_NCOUNTS 11

/* The lock holder a replay's held rows name (locked_by). */
#define REPLAY_HOLDER "'outboxctl replay'"

/* A held row carries no LATE_VERSION code, as a row a relay sends: the guard
 * takes a PUBLISHING row with that code for one locked to go DEAD unsent, out
 * of the order (relay/sql/lock.sql), and a held row must count as
 * unpublished. A PUBLISHED row can carry the code (published by hand);
 * ctl_held keeps it for the undo. */
#define NOT_LATE_NOW                                                                               \
        " last_error_code = NULLIF(o.last_error_code, 'LATE_VERSION'),"                            \
        " last_error_message = CASE WHEN o.last_error_code = 'LATE_VERSION' THEN NULL"             \
        "  ELSE o.last_error_message END"

/* The moves of a replay's steps, by primary key (an array, not a join a
 * misestimate could turn into a table scan), each `rows` of cls:
 *   held:    PUBLISHED -> PUBLISHING, held by REPLAY_HOLDER (no relay locks
 *            it; to the guard it is unpublished: NOT_LATE_NOW), attempts reset,
 *            published_at NULL as the table's CHECK wants for a row not
 *            PUBLISHED, due now (a real time, as the CHECK wants for
 *            PUBLISHING);
 *   due:     held -> PENDING: only columns no index holds change (a HOT
 *            update, as the relay's lock);
 *   late:    PUBLISHED -> PENDING, due now, attempts reset;
 *   touched: a new row version, nothing changed (a lock statement older than
 *            it passes the row by). */
#define REPLAY_HOLD_ROWS(rows)                                                                     \
        " held AS (UPDATE %1$s o SET status = 'PUBLISHING', published_at = NULL,"                  \
        "  available_at = now(), attempt_count = 0, locked_by = " REPLAY_HOLDER ","                \
        "  locked_at = now(), updated_at = clock_timestamp()," NOT_LATE_NOW                        \
        "  WHERE o.outbox_id = ANY (ARRAY("                                                        \
        "  SELECT outbox_id FROM cls WHERE " rows ")) AND o.status = 'PUBLISHED'"                  \
        "  RETURNING o.outbox_id),"
#define REPLAY_DUE_ROWS(rows)                                                                      \
        " due AS (UPDATE %1$s o SET status = 'PENDING', locked_by = NULL, locked_at = NULL,"       \
        "  updated_at = clock_timestamp() WHERE o.outbox_id = ANY (ARRAY(SELECT outbox_id"         \
        "  FROM cls WHERE " rows ")) AND o.status = 'PUBLISHING'"                                  \
        "  AND o.locked_by = " REPLAY_HOLDER " RETURNING 1),"
#define REPLAY_LATE_ROWS(rows)                                                                     \
        " late AS (UPDATE %1$s o SET status = 'PENDING', published_at = NULL,"                     \
        "  available_at = now(), attempt_count = 0, locked_by = NULL, locked_at = NULL,"           \
        "  updated_at = clock_timestamp() WHERE o.outbox_id = ANY (ARRAY(SELECT outbox_id"         \
        "  FROM cls WHERE " rows ")) AND o.status = 'PUBLISHED' RETURNING 1),"
#define REPLAY_TOUCH(rows)                                                                         \
        " touched AS (UPDATE %1$s o SET updated_at = o.updated_at"                                 \
        "  WHERE o.outbox_id = ANY (ARRAY(SELECT outbox_id FROM cls WHERE what = 'unpublished'"    \
        "  AND status IN ('PENDING', 'FAILED') AND " rows ")) RETURNING 1),"

/* The pieces of the step statements below. */
#define RANGE_STEP        REPLAY_RANGE("r.n BETWEEN $1 AND $2", "")
#define RANGE_STEP_LOCKED REPLAY_RANGE("r.n BETWEEN $1 AND $2", " FOR UPDATE")
#define RANGE_HELD_LOCKED REPLAY_RANGE("r.n IN (SELECT n FROM hn)", " FOR UPDATE")
#define CLASSES           REPLAY_CLASSES("", "status = 'PUBLISHING'")
/* Our held rows are PUBLISHING too, but they do not make their aggregate
 * busy. */
#define CLASSES_HELD                                                                               \
        REPLAY_CLASSES(HELD_CLASS, "status = 'PUBLISHING' AND outbox_id NOT IN"                    \
                                   " (SELECT outbox_id FROM pg_temp.ctl_held)")
#define HOLD_MOVED     REPLAY_HOLD_ROWS("what = 'move'")
#define TOUCH_MOVED    REPLAY_TOUCH("n IN (SELECT n FROM cls WHERE what = 'move')")
#define DUE_HELD       REPLAY_DUE_ROWS("what = 'held' AND NOT busy")
#define LATE_MOVED     REPLAY_LATE_ROWS("what = 'move'")
#define TOUCH_NOT_BUSY REPLAY_TOUCH("NOT busy")
#define HELD_AGGREGATES                                                                            \
        " hn AS MATERIALIZED (SELECT DISTINCT n FROM pg_temp.ctl_held"                             \
        "  WHERE n BETWEEN $1 AND $2),"
#define SAVE_HELD                                                                                  \
        " saved AS (INSERT INTO pg_temp.ctl_held SELECT c.outbox_id, c.n, c.published_at,"         \
        "  c.available_at, c.attempt_count, c.last_error_code, c.last_error_message"               \
        "  FROM cls c JOIN held h USING (outbox_id) RETURNING n) "
#define FORGET_RELEASED                                                                            \
        " done AS (DELETE FROM pg_temp.ctl_held h"                                                 \
        "  WHERE h.n IN (SELECT n FROM agg WHERE NOT busy) RETURNING 1)"
#define PLAN_COUNTS                                                                                \
        REPLAY_COUNTS("count(*) FILTER (WHERE what = 'move')",                                     \
                      "count(DISTINCT n) FILTER (WHERE what = 'move')")
#define HOLD_COUNTS                                                                                \
        REPLAY_COUNTS("(SELECT count(*) FROM saved)", "(SELECT count(DISTINCT n) FROM saved)")
#define EXAMPLES_PUBLISHED_AT RFC3339("published_at")
#define EXAMPLES                                                                                   \
        " SELECT outbox_id, tenant_id, aggregate_type || '/' || aggregate_id AS aggregate,"        \
        " aggregate_version AS version, topic, " EXAMPLES_PUBLISHED_AT " AS published_at"          \
        " FROM cls WHERE what = 'move' ORDER BY n, aggregate_version LIMIT $3"
#define RELEASE_COUNTS                                                                             \
        " SELECT (SELECT count(*) FROM due), (SELECT count(*) FROM late),"                         \
        " (SELECT count(DISTINCT n) FROM cls WHERE what = 'move'),"                                \
        " (SELECT count(*) FROM agg WHERE busy)"

static const struct db_stmt replay_stmts[R_COUNT] = {
        /* One aggregate: its rows from $4 up (all when NULL), any status. */
        [R_SELECT_AGG] = {"replay_select_agg", "replay: select", 4,
                          "WITH sel AS MATERIALIZED (SELECT o.aggregate_version FROM %1$s o"
                          "  WHERE o.tenant_id = $1 AND o.aggregate_type = $2"
                          "  AND o.aggregate_id = $3"
                          "  AND ($4::bigint IS NULL OR o.aggregate_version >= $4::bigint)),"
                          " ins AS (INSERT INTO pg_temp.ctl_replay SELECT 1, $1, $2, $3,"
                          "  min(aggregate_version) FROM sel HAVING count(*) > 0 RETURNING 1)"
                          " SELECT (SELECT count(*) FROM ins), (SELECT count(*) FROM sel)"},
        /* The rows published in [$1, $2) (of the topics $3, all when NULL),
         * GAP_RELEASED records aside; each aggregate from its lowest one. */
        [R_SELECT_WINDOW] = {"replay_select_window", "replay: select", 3,
                             "WITH sel AS MATERIALIZED (SELECT o.tenant_id, o.aggregate_type,"
                             "  o.aggregate_id, o.aggregate_version FROM %1$s o"
                             "  WHERE o.published_at >= $1::timestamptz"
                             "  AND o.published_at < $2::timestamptz"
                             "  AND o.last_error_code IS DISTINCT FROM 'GAP_RELEASED'"
                             "  AND ($3::text[] IS NULL OR %2$s = ANY ($3::text[]))),"
                             " ins AS (INSERT INTO pg_temp.ctl_replay SELECT row_number() OVER ("
                             "   ORDER BY tenant_id, aggregate_type, aggregate_id),"
                             "  tenant_id, aggregate_type, aggregate_id, min(aggregate_version)"
                             "  FROM sel GROUP BY tenant_id, aggregate_type, aggregate_id"
                             "  RETURNING 1)"
                             " SELECT (SELECT count(*) FROM ins), (SELECT count(*) FROM sel)"},
        [R_PLAN] = {"replay_plan", "replay: plan", 2, "WITH" RANGE_STEP CLASSES " " PLAN_COUNTS},
        [R_EXAMPLES] = {"replay_examples", "replay: plan", 3, "WITH" RANGE_STEP CLASSES EXAMPLES},
        /* A step's first half, for aggregates $1..$2: every row from the
         * start version up locked, the PUBLISHED ones held, the unpublished
         * ones touched; ctl_held keeps what the held rows were. */
        [R_HOLD] = {"replay_hold", "replay", 2,
                    "WITH" RANGE_STEP_LOCKED CLASSES
                    "," HOLD_MOVED TOUCH_MOVED SAVE_HELD HOLD_COUNTS},
        /* The second half, for the aggregates of $1..$2 with held rows:
         * every row from the start version up locked again; where none is
         * PUBLISHING but the held ones, the held rows become PENDING, rows
         * published since the first half are replayed with them, the
         * unpublished ones touched. Counts: rows made due, rows published
         * since and replayed, their aggregates, aggregates still busy (their
         * rows stay held). */
        [R_RELEASE] = {"replay_release", "replay", 2,
                       "WITH" HELD_AGGREGATES RANGE_HELD_LOCKED CLASSES_HELD
                       "," DUE_HELD LATE_MOVED TOUCH_NOT_BUSY FORGET_RELEASED RELEASE_COUNTS},
        /* Gives the held rows of $1..$2 back as they were: PUBLISHED, with
         * their published_at, due time, attempts and error columns. */
        [R_UNDO] = {"replay_undo", "replay: undo", 2,
                    "WITH und AS (UPDATE %1$s o SET status = 'PUBLISHED',"
                    "  published_at = h.published_at, available_at = h.available_at,"
                    "  attempt_count = h.attempt_count, last_error_code = h.last_error_code,"
                    "  last_error_message = h.last_error_message, locked_by = NULL,"
                    "  locked_at = NULL, updated_at = clock_timestamp()"
                    "  FROM pg_temp.ctl_held h WHERE o.outbox_id = h.outbox_id"
                    "  AND h.n BETWEEN $1 AND $2 AND o.status = 'PUBLISHING'"
                    "  AND o.locked_by = " REPLAY_HOLDER " RETURNING h.n),"
                    " gone AS (DELETE FROM pg_temp.ctl_held WHERE n BETWEEN $1 AND $2)"
                    " SELECT count(*), count(DISTINCT n) FROM und"},
};

/* ---- reconcile: the window's rows and Kafka's messages, compared ---- */

static const char reconcile_ddl[] =
        "CREATE TEMP TABLE ctl_rows (outbox_id uuid PRIMARY KEY, tenant_id text NOT NULL,"
        " aggregate_type text NOT NULL, aggregate_id text NOT NULL,"
        " aggregate_version bigint NOT NULL, topic text NOT NULL,"
        " published_at timestamptz NOT NULL);"
        "CREATE TEMP TABLE ctl_msgs (topic text NOT NULL, part int NOT NULL, off bigint NOT NULL,"
        " ts_ms bigint, event_id uuid, tenant_id text, aggregate_type text, aggregate_id text,"
        " aggregate_version text)";

enum { C_ROWS, C_TOPICS, C_COUNTS, C_MISSING, C_REORDERS, C_DUPLICATES, C_UNKNOWN, C_COUNT };

/* The window's rows ($1, $2: published_at; $3 topics, all when NULL). */
#define RC_WINDOW                                                                                  \
        " o.published_at >= $1::timestamptz AND o.published_at < $2::timestamptz"                  \
        " AND ($3::text[] IS NULL OR %2$s = ANY ($3::text[]))"

/* Messages of the window's rows, first copies: per partition and aggregate,
 * the lowest offset of each version; `above` is the highest version whose
 * first copy came before. A first copy below `above` is a reorder: version
 * n+1's first copy before n's. Only the window's own rows count: their
 * acknowledged copy lies within the margin, so an earlier first copy
 * outside what was read cannot make a later copy look like a first one.
 * The same rule holds for consecutive and for increasing versions. */
#define RC_FIRSTS                                                                                  \
        "WITH firsts AS (SELECT m.topic, m.part, r.tenant_id, r.aggregate_type,"                   \
        "  r.aggregate_id, r.aggregate_version AS v, min(m.off) AS off"                            \
        "  FROM pg_temp.ctl_msgs m JOIN pg_temp.ctl_rows r ON r.outbox_id = m.event_id"            \
        "  GROUP BY 1, 2, 3, 4, 5, 6),"                                                            \
        " seq AS (SELECT f.*, max(f.v) OVER (PARTITION BY f.topic, f.part, f.tenant_id,"           \
        "  f.aggregate_type, f.aggregate_id ORDER BY f.off"                                        \
        "  ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS above FROM firsts f)"

#define MISSING_PUBLISHED_AT RFC3339("r.published_at")
#define RC_NO_MESSAGE        "NOT EXISTS (SELECT 1 FROM pg_temp.ctl_msgs m WHERE m.event_id = r.outbox_id)"
#define RC_NOT_IN_TABLE                                                                            \
        "(m.event_id IS NULL OR NOT EXISTS (SELECT 1 FROM %1$s o WHERE o.outbox_id = m.event_id))"
#define RC_DUPS                                                                                    \
        "SELECT event_id, count(*) AS copies FROM pg_temp.ctl_msgs WHERE event_id IS NOT NULL"     \
        " GROUP BY event_id HAVING count(*) > 1"

static const struct db_stmt reconcile_stmts[C_COUNT] = {
        /* GAP_RELEASED records were never meant to reach Kafka: counted
         * apart, never missing. */
        [C_ROWS] = {"reconcile_rows", "reconcile: rows", 3,
                    "WITH ins AS (INSERT INTO pg_temp.ctl_rows SELECT o.outbox_id, o.tenant_id,"
                    "  o.aggregate_type, o.aggregate_id, o.aggregate_version, %2$s,"
                    "  o.published_at FROM %1$s o WHERE" RC_WINDOW
                    "  AND o.last_error_code IS DISTINCT FROM 'GAP_RELEASED' RETURNING 1)"
                    " SELECT (SELECT count(*) FROM ins), (SELECT count(*) FROM %1$s o"
                    "  WHERE" RC_WINDOW " AND o.last_error_code = 'GAP_RELEASED')"},
        [C_TOPICS] = {"reconcile_topics", "reconcile: topics", 0,
                      "SELECT topic, count(*) AS rows FROM pg_temp.ctl_rows GROUP BY topic"
                      " ORDER BY topic"},
        [C_COUNTS] = {"reconcile_counts", "reconcile: compare", 0,
                      RC_FIRSTS
                      ", dup AS (" RC_DUPS ")"
                      " SELECT (SELECT count(*) FROM pg_temp.ctl_rows),"
                      " (SELECT count(*) FROM pg_temp.ctl_msgs),"
                      " (SELECT count(*) FROM pg_temp.ctl_rows r WHERE " RC_NO_MESSAGE "),"
                      " (SELECT count(*) FROM seq WHERE above > v),"
                      " (SELECT count(*) FROM dup),"
                      " (SELECT coalesce(sum(copies - 1), 0) FROM dup),"
                      " (SELECT count(*) FROM pg_temp.ctl_msgs m WHERE " RC_NOT_IN_TABLE ")"},
        [C_MISSING] = {"reconcile_missing", "reconcile: missing", 1,
                       "SELECT r.outbox_id, r.tenant_id, r.aggregate_type || '/' ||"
                       " r.aggregate_id AS aggregate, r.aggregate_version AS version, r.topic,"
                       " " MISSING_PUBLISHED_AT " AS published_at FROM pg_temp.ctl_rows r"
                       " WHERE " RC_NO_MESSAGE " ORDER BY r.published_at, r.outbox_id LIMIT $1"},
        [C_REORDERS] = {"reconcile_reorders", "reconcile: reorders", 1,
                        RC_FIRSTS " SELECT topic, part AS partition, off AS \"offset\", tenant_id,"
                                  " aggregate_type || '/' || aggregate_id AS aggregate,"
                                  " v AS version, above AS after_version FROM seq"
                                  " WHERE above > v ORDER BY topic, part, off LIMIT $1"},
        [C_DUPLICATES] = {"reconcile_duplicates", "reconcile: duplicates", 1,
                          "SELECT d.event_id, d.copies, (SELECT string_agg(m.topic || '['"
                          "  || m.part || ']@' || m.off, ' ' ORDER BY m.topic, m.part, m.off)"
                          "  FROM pg_temp.ctl_msgs m WHERE m.event_id = d.event_id) AS \"where\""
                          " FROM (" RC_DUPS ") d ORDER BY d.event_id LIMIT $1"},
        [C_UNKNOWN] = {"reconcile_unknown", "reconcile: unknown", 1,
                       "SELECT m.topic, m.part AS partition, m.off AS \"offset\", m.event_id,"
                       " m.aggregate_type || '/' || m.aggregate_id AS aggregate,"
                       " m.aggregate_version AS version FROM pg_temp.ctl_msgs m"
                       " WHERE " RC_NOT_IN_TABLE " ORDER BY m.topic, m.part, m.off LIMIT $1"},
};

/* COPY data is sent in pieces of about this size. */
#define COPY_CHUNK (64 * 1024)
/* Header values longer than this are cut (they are only shown). */
#define HEADER_MAX 256

/* ---- helpers ---- */

/* A literal piece of the topic template, quoted for SQL, appended to b. */
static int append_literal(struct db *db, struct buf *b, const char *s, size_t n) {
        char *q = PQescapeLiteral(db->conn, s, n);
        if (!q)
                return -1;
        int rc = buf_appendf(b, " || %s", q);
        PQfreemem(q);
        return rc;
}

/* The SQL expression of row o's topic, as encode_topic() makes it:
 * topic_name unless NULL or empty, else the template with its placeholders
 * filled in (the values are not scanned again). */
static int build_topic_expr(struct db *db, char *errstr, size_t size) {
        static const struct {
                const char *name, *column;
        } ph[] = {{"{aggregate_type}", "o.aggregate_type"},
                  {"{event_type}", "o.event_type"},
                  {"{tenant_id}", "o.tenant_id"}};
        struct buf b = {0};
        int rc = buf_appendf(&b, "coalesce(nullif(o.topic_name, ''), ''");
        for (const char *p = db->topic_template; *p && rc == 0;) {
                size_t i = sizeof ph / sizeof ph[0];
                if (*p == '{')
                        for (i = 0; i < sizeof ph / sizeof ph[0]; i++)
                                if (!strncmp(p, ph[i].name, strlen(ph[i].name)))
                                        break;
                if (i < sizeof ph / sizeof ph[0]) {
                        rc = buf_appendf(&b, " || %s", ph[i].column);
                        p += strlen(ph[i].name);
                } else {
                        size_t run = strcspn(p + 1, "{") + 1;
                        rc = append_literal(db, &b, p, run);
                        p += run;
                }
        }
        if (rc == 0)
                rc = buf_appendf(&b, ")");
        if (rc != 0) {
                buf_free(&b);
                return errstr_set(errstr, size, "out of memory");
        }
        free(db->topic_expr);
        db->topic_expr = b.data;
        return 0;
}

int db_admin_prepare(struct db *db, char *errstr, size_t size) {
        if (build_topic_expr(db, errstr, size) != 0)
                return -1;
        return db_prepare(db, db_admin_stmts, db_admin_stmt_count, db->topic_expr, errstr, size);
}

/* Creates a group of temp tables and prepares its statements, once per
 * connection. */
static int ensure_temp(struct db *db, int which, const char *ddl, const struct db_stmt *stmts,
                       size_t n, char *errstr, size_t size) {
        if (!db_connected(db))
                return errstr_set(errstr, size, "not connected");
        if (db->admin_temp & which)
                return 0;
        if (db_exec_simple(db, ddl, errstr, size) != 0 ||
            db_prepare(db, stmts, n, db->topic_expr, errstr, size) != 0)
                return -1;
        db->admin_temp |= which;
        return 0;
}

/* PostgreSQL type OIDs (catalog/pg_type.dat; fixed) of numbers. */
static int is_numeric_type(Oid t) {
        return t == 20 || t == 21 || t == 23 || t == 26 || t == 700 || t == 701 || t == 1700;
}

void db_rows_free(struct db_rows *r) {
        if (!r)
                return;
        for (int i = 0; r->names && i < r->ncols; i++)
                free(r->names[i]);
        for (long i = 0; r->cells && i < (long)r->nrows * r->ncols; i++)
                free(r->cells[i]);
        free(r->names);
        free(r->cells);
        free(r->numeric);
        free(r);
}

void db_rows_truncate(struct db_rows *r, int n) {
        if (!r || n < 0 || n >= r->nrows)
                return;
        for (long i = (long)n * r->ncols; i < (long)r->nrows * r->ncols; i++) {
                free(r->cells[i]);
                r->cells[i] = NULL;
        }
        r->nrows = n;
}

/* Copies a result out of libpq; NULL on allocation failure. */
static struct db_rows *rows_of(const PGresult *res) {
        struct db_rows *r = calloc(1, sizeof *r);
        if (!r)
                return NULL;
        r->nrows = PQntuples(res);
        r->ncols = PQnfields(res);
        size_t cells = (size_t)r->nrows * (size_t)r->ncols;
        r->names = calloc((size_t)r->ncols + 1, sizeof *r->names);
        r->numeric = calloc((size_t)r->ncols + 1, sizeof *r->numeric);
        r->cells = calloc(cells + 1, sizeof *r->cells);
        if (!r->names || !r->numeric || !r->cells)
                goto fail;
        for (int c = 0; c < r->ncols; c++) {
                r->numeric[c] = is_numeric_type(PQftype(res, c));
                if (!(r->names[c] = strdup(PQfname(res, c))))
                        goto fail;
        }
        for (int i = 0; i < r->nrows; i++)
                for (int c = 0; c < r->ncols; c++) {
                        if (PQgetisnull(res, i, c))
                                continue;
                        char **cell = &r->cells[(size_t)i * (size_t)r->ncols + (size_t)c];
                        if (!(*cell = strdup(PQgetvalue(res, i, c))))
                                goto fail;
                }
        return r;
fail:
        db_rows_free(r);
        return NULL;
}

/* Runs statement s of a group and copies its rows out. */
static int query_rows(struct db *db, const struct db_stmt *s, const char *const *params,
                      struct db_rows **out, char *errstr, size_t size) {
        *out = NULL;
        if (!db_connected(db))
                return errstr_set(errstr, size, "not connected");
        PGresult *r = db_run(db, s, params, PGRES_TUPLES_OK, errstr, size);
        if (!r)
                return -1;
        *out = rows_of(r);
        PQclear(r);
        return *out ? 0 : errstr_set(errstr, size, "%s: out of memory", s->what);
}

/* Runs statement s and reads its one row of `n` counts. */
static int query_counts(struct db *db, const struct db_stmt *s, const char *const *params,
                        long long *counts, int n, char *errstr, size_t size) {
        if (!db_connected(db))
                return errstr_set(errstr, size, "not connected");
        PGresult *r = db_run(db, s, params, PGRES_TUPLES_OK, errstr, size);
        if (!r)
                return -1;
        if (PQntuples(r) != 1 || PQnfields(r) != n) {
                PQclear(r);
                return errstr_set(errstr, size, "%s: unexpected result", s->what);
        }
        for (int i = 0; i < n; i++)
                counts[i] = strtoll(PQgetvalue(r, 0, i), NULL, 10);
        PQclear(r);
        return 0;
}

/* A text[] parameter: {"a","b"} with the elements quoted; NULL for none. */
static int text_array(const char *const *items, size_t n, struct buf *out) {
        buf_reset(out);
        if (n == 0)
                return 0;
        if (buf_append(out, "{", 1) != 0)
                return -1;
        for (size_t i = 0; i < n; i++) {
                if ((i && buf_append(out, ",", 1) != 0) || buf_append(out, "\"", 1) != 0)
                        return -1;
                for (const char *p = items[i]; *p; p++)
                        if ((*p == '"' || *p == '\\') && buf_append(out, "\\", 1) != 0)
                                return -1;
                        else if (buf_append(out, p, 1) != 0)
                                return -1;
                if (buf_append(out, "\"", 1) != 0)
                        return -1;
        }
        return buf_append(out, "}", 1);
}

/* ---- the commands ---- */

int db_admin_stats(struct db *db, struct db_rows **counts, struct db_rows **oldest, char *errstr,
                   size_t errstr_size) {
        *oldest = NULL;
        if (query_rows(db, &db_admin_stmts[A_STATS_COUNTS], NULL, counts, errstr, errstr_size))
                return -1;
        return query_rows(db, &db_admin_stmts[A_STATS_OLDEST], NULL, oldest, errstr, errstr_size);
}

/* query_rows() of a statement whose one parameter is a row limit. */
static int limited_rows(struct db *db, const struct db_stmt *s, long long limit,
                        struct db_rows **out, char *errstr, size_t size) {
        char lim[24];
        const char *params[1] = {lim};
        snprintf(lim, sizeof lim, "%lld", limit);
        return query_rows(db, s, params, out, errstr, size);
}

int db_admin_dead(struct db *db, long long limit, int json, struct db_rows **out, char *errstr,
                  size_t errstr_size) {
        return limited_rows(db, &db_admin_stmts[json ? A_DEAD_JSON : A_DEAD], limit, out, errstr,
                            errstr_size);
}

int db_admin_gaps(struct db *db, long long limit, int json, struct db_rows **out, char *errstr,
                  size_t errstr_size) {
        return limited_rows(db, &db_admin_stmts[json ? A_GAPS_JSON : A_GAPS], limit, out, errstr,
                            errstr_size);
}

/* The requeue statements' parameters $1..$6 (and $7, the limit, when lim). */
static void requeue_params(const struct db_requeue *q, const char *lim, const char *params[7]) {
        params[0] = q->outbox_id;
        params[1] = q->aggregate_id ? q->tenant_id : NULL;
        params[2] = q->aggregate_type;
        params[3] = q->aggregate_id;
        params[4] = q->all_dead ? "true" : "false";
        params[5] = q->code;
        params[6] = lim;
}

int db_admin_requeue(struct db *db, const struct db_requeue *q, long long *moved, long long *freed,
                     char *errstr, size_t errstr_size) {
        const char *params[7];
        long long c[2] = {0, 0};
        requeue_params(q, NULL, params);
        int rc = query_counts(db, &db_admin_stmts[A_REQUEUE], params, c, 2, errstr, errstr_size);
        *moved = c[0];
        *freed = c[1];
        return rc;
}

int db_admin_requeue_plan(struct db *db, const struct db_requeue *q, long long limit,
                          long long *moved, long long *freed, struct db_rows **rows,
                          struct db_rows **freed_aggs, char *errstr, size_t errstr_size) {
        const char *params[7];
        char lim[24];
        long long c[2] = {0, 0};
        *rows = *freed_aggs = NULL;
        snprintf(lim, sizeof lim, "%lld", limit);
        requeue_params(q, lim, params);
        int rc = query_counts(db, &db_admin_stmts[A_REQUEUE_PLAN], params, c, 2, errstr,
                              errstr_size);
        *moved = c[0];
        *freed = c[1];
        if (rc == 0)
                rc = query_rows(db, &db_admin_stmts[A_REQUEUE_PLAN_ROWS], params, rows, errstr,
                                errstr_size);
        if (rc == 0)
                rc = query_rows(db, &db_admin_stmts[A_REQUEUE_PLAN_FREED], params, freed_aggs,
                                errstr, errstr_size);
        return rc;
}

int db_admin_release_gap(struct db *db, const char *tenant_id, const char *aggregate_type,
                         const char *aggregate_id, int *released, long long *from, long long *to,
                         char *errstr, size_t errstr_size) {
        const char *params[3] = {tenant_id, aggregate_type, aggregate_id};
        struct db_rows *r = NULL;
        *released = 0;
        *from = *to = 0;
        if (query_rows(db, &db_admin_stmts[A_RELEASE_GAP], params, &r, errstr, errstr_size))
                return -1;
        if (r->nrows == 1 && r->ncols == 2 && r->cells[0] && r->cells[1]) {
                *released = 1;
                *from = strtoll(r->cells[0], NULL, 10);
                *to = strtoll(r->cells[1], NULL, 10);
        }
        db_rows_free(r);
        return 0;
}

int db_replay_select(struct db *db, const struct db_replay_select *s, long long *aggregates,
                     long long *rows, char *errstr, size_t errstr_size) {
        char from[24];
        struct buf topics = {0};
        long long c[2] = {0, 0};
        int rc = -1;
        *aggregates = *rows = 0;
        if (ensure_temp(db, TEMP_REPLAY, replay_ddl, replay_stmts, R_COUNT, errstr, errstr_size))
                return -1;
        if (db_exec_simple(db, "TRUNCATE pg_temp.ctl_replay, pg_temp.ctl_held", errstr,
                           errstr_size))
                return -1;
        if (s->aggregate_id) {
                snprintf(from, sizeof from, "%lld", s->from_version);
                const char *params[4] = {s->tenant_id, s->aggregate_type, s->aggregate_id,
                                         s->has_from ? from : NULL};
                rc = query_counts(db, &replay_stmts[R_SELECT_AGG], params, c, 2, errstr,
                                  errstr_size);
        } else {
                if (text_array(s->topics, s->ntopics, &topics) != 0) {
                        errstr_set(errstr, errstr_size, "out of memory");
                        goto out;
                }
                const char *params[3] = {s->since, s->until, s->ntopics ? topics.data : NULL};
                rc = query_counts(db, &replay_stmts[R_SELECT_WINDOW], params, c, 2, errstr,
                                  errstr_size);
        }
        *aggregates = c[0];
        *rows = c[1];
out:
        buf_free(&topics);
        return rc;
}

/* struct db_replay_counts from one REPLAY_COUNTS row, added to *c. */
static void add_counts(struct db_replay_counts *c, const long long v[REPLAY_NCOUNTS]) {
        c->moved += v[0];
        c->moved_aggregates += v[1];
        c->busy += v[2];
        c->busy_aggregates += v[3];
        c->below_release += v[4];
        c->released += v[5];
        c->unpublished += v[6];
        c->pending += v[7];
        c->failed += v[8];
        c->dead += v[9];
        c->publishing += v[10];
}

int db_replay_plan(struct db *db, long long first, long long last, long long examples,
                   struct db_replay_counts *c, struct db_rows **ex, char *errstr,
                   size_t errstr_size) {
        char a[24], b[24], lim[24];
        const char *params[3] = {a, b, lim};
        long long v[REPLAY_NCOUNTS];
        *ex = NULL;
        if (ensure_temp(db, TEMP_REPLAY, replay_ddl, replay_stmts, R_COUNT, errstr, errstr_size))
                return -1;
        snprintf(a, sizeof a, "%lld", first);
        snprintf(b, sizeof b, "%lld", last);
        snprintf(lim, sizeof lim, "%lld", examples);
        if (query_counts(db, &replay_stmts[R_PLAN], params, v, REPLAY_NCOUNTS, errstr, errstr_size))
                return -1;
        add_counts(c, v);
        if (examples <= 0)
                return 0;
        return query_rows(db, &replay_stmts[R_EXAMPLES], params, ex, errstr, errstr_size);
}

/* query_counts() that tells a lock not granted in time (lock_timeout, or a
 * deadlock the server broke by cancelling this statement) apart: *busy is
 * set and 0 returned. */
static int query_counts_busy(struct db *db, const struct db_stmt *s, const char *const *params,
                             long long *counts, int n, int *busy, char *errstr, size_t size) {
        *busy = 0;
        if (!db_connected(db))
                return errstr_set(errstr, size, "not connected");
        PGresult *r = PQexecPrepared(db->conn, s->name, s->nparams, params, NULL, NULL, 0);
        int rc = 0;
        if (PQresultStatus(r) != PGRES_TUPLES_OK) {
                const char *state = PQresultErrorField(r, PG_DIAG_SQLSTATE);
                if (state && (!strcmp(state, "55P03") || !strcmp(state, "40P01"))) {
                        *busy = 1;
                } else {
                        rc = errstr_set(errstr, size, "%s: %s", s->what, PQerrorMessage(db->conn));
                        db_check_result(db, r);
                }
        } else if (PQntuples(r) != 1 || PQnfields(r) != n) {
                rc = errstr_set(errstr, size, "%s: unexpected result", s->what);
        } else {
                for (int i = 0; i < n; i++)
                        counts[i] = strtoll(PQgetvalue(r, 0, i), NULL, 10);
        }
        PQclear(r);
        return rc;
}

int db_replay_hold(struct db *db, long long first, long long last, int lock_timeout_ms, int *busy,
                   struct db_replay_counts *c, char *errstr, size_t errstr_size) {
        char a[24], b[24], sql[64];
        const char *params[2] = {a, b};
        long long v[REPLAY_NCOUNTS];
        *busy = 0;
        if (ensure_temp(db, TEMP_REPLAY, replay_ddl, replay_stmts, R_COUNT, errstr, errstr_size))
                return -1;
        snprintf(sql, sizeof sql, "SET lock_timeout = %d", lock_timeout_ms);
        if (db_exec_simple(db, sql, errstr, errstr_size))
                return -1;
        snprintf(a, sizeof a, "%lld", first);
        snprintf(b, sizeof b, "%lld", last);
        if (query_counts_busy(db, &replay_stmts[R_HOLD], params, v, REPLAY_NCOUNTS, busy, errstr,
                              errstr_size))
                return -1;
        if (!*busy)
                add_counts(c, v);
        return 0;
}

int db_replay_release(struct db *db, long long first, long long last, int *busy,
                      struct db_replay_release *out, char *errstr, size_t errstr_size) {
        char a[24], b[24];
        const char *params[2] = {a, b};
        long long v[4] = {0, 0, 0, 0};
        memset(out, 0, sizeof *out);
        if (ensure_temp(db, TEMP_REPLAY, replay_ddl, replay_stmts, R_COUNT, errstr, errstr_size))
                return -1;
        snprintf(a, sizeof a, "%lld", first);
        snprintf(b, sizeof b, "%lld", last);
        if (query_counts_busy(db, &replay_stmts[R_RELEASE], params, v, 4, busy, errstr,
                              errstr_size))
                return -1;
        out->due = v[0];
        out->late = v[1];
        out->late_aggregates = v[2];
        out->busy_aggregates = v[3];
        return 0;
}

int db_replay_undo(struct db *db, long long first, long long last, long long *rows,
                   long long *aggregates, char *errstr, size_t errstr_size) {
        char a[24], b[24];
        const char *params[2] = {a, b};
        long long v[2] = {0, 0};
        *rows = *aggregates = 0;
        if (ensure_temp(db, TEMP_REPLAY, replay_ddl, replay_stmts, R_COUNT, errstr, errstr_size))
                return -1;
        snprintf(a, sizeof a, "%lld", first);
        snprintf(b, sizeof b, "%lld", last);
        if (query_counts(db, &replay_stmts[R_UNDO], params, v, 2, errstr, errstr_size))
                return -1;
        *rows = v[0];
        *aggregates = v[1];
        return 0;
}

int db_reconcile_rows(struct db *db, const char *since, const char *until,
                      const char *const *topics, size_t ntopics, long long *rows,
                      long long *released, struct db_rows **topics_out, char *errstr,
                      size_t errstr_size) {
        struct buf arr = {0};
        long long c[2] = {0, 0};
        int rc = -1;
        *rows = *released = 0;
        *topics_out = NULL;
        if (ensure_temp(db, TEMP_RECONCILE, reconcile_ddl, reconcile_stmts, C_COUNT, errstr,
                        errstr_size))
                return -1;
        if (db_exec_simple(db, "TRUNCATE pg_temp.ctl_rows, pg_temp.ctl_msgs", errstr, errstr_size))
                return -1;
        if (text_array(topics, ntopics, &arr) != 0) {
                errstr_set(errstr, errstr_size, "out of memory");
                goto out;
        }
        const char *params[3] = {since, until, ntopics ? arr.data : NULL};
        if (query_counts(db, &reconcile_stmts[C_ROWS], params, c, 2, errstr, errstr_size))
                goto out;
        *rows = c[0];
        *released = c[1];
        rc = query_rows(db, &reconcile_stmts[C_TOPICS], NULL, topics_out, errstr, errstr_size);
out:
        buf_free(&arr);
        return rc;
}

int db_reconcile_begin(struct db *db, char *errstr, size_t errstr_size) {
        if (ensure_temp(db, TEMP_RECONCILE, reconcile_ddl, reconcile_stmts, C_COUNT, errstr,
                        errstr_size))
                return -1;
        PGresult *r = PQexec(db->conn, "COPY pg_temp.ctl_msgs (topic, part, off, ts_ms, event_id,"
                                       " tenant_id, aggregate_type, aggregate_id,"
                                       " aggregate_version) FROM STDIN");
        int ok = PQresultStatus(r) == PGRES_COPY_IN;
        if (!ok)
                errstr_set(errstr, errstr_size, "reconcile: copy: %s", PQerrorMessage(db->conn));
        PQclear(r);
        buf_reset(&db->copy);
        return ok ? 0 : -1;
}

/* Appends s (n bytes, or NULL) as a COPY text field: \N for NULL, at most
 * HEADER_MAX bytes, valid UTF-8, backslash and control characters escaped. */
static int copy_field(struct buf *b, const char *s, size_t n, int last) {
        int rc = 0;
        if (!s) {
                rc = buf_append(b, "\\N", 2);
        } else {
                char v[HEADER_MAX + 1];
                if (n > HEADER_MAX)
                        n = HEADER_MAX;
                memcpy(v, s, n);
                v[n] = '\0';
                encode_utf8_clean(v); /* also ends the value at a NUL byte */
                for (const char *p = v; *p && rc == 0; p++) {
                        unsigned char ch = (unsigned char)*p;
                        if (ch == '\\')
                                rc = buf_append(b, "\\\\", 2);
                        else if (ch < 0x20 || ch == 0x7f)
                                rc = buf_appendf(b, "\\%03o", ch);
                        else
                                rc = buf_append(b, p, 1);
                }
        }
        if (rc == 0)
                rc = buf_append(b, last ? "\n" : "\t", 1);
        return rc;
}

/* Sends what is buffered. */
static int copy_flush(struct db *db, char *errstr, size_t size) {
        if (!db->copy.len)
                return 0;
        if (PQputCopyData(db->conn, db->copy.data, (int)db->copy.len) != 1)
                return errstr_set(errstr, size, "reconcile: copy: %s", PQerrorMessage(db->conn));
        buf_reset(&db->copy);
        return 0;
}

int db_reconcile_put(struct db *db, const struct db_reconcile_msg *m, char *errstr,
                     size_t errstr_size) {
        struct buf *b = &db->copy;
        char num[80];
        snprintf(num, sizeof num, "%d\t%lld\t%lld\t", m->partition, m->offset, m->timestamp_ms);
        if (copy_field(b, m->topic, strlen(m->topic), 0) != 0 ||
            buf_append(b, num, strlen(num)) != 0 ||
            copy_field(b, m->event_id, m->event_id ? strlen(m->event_id) : 0, 0) != 0 ||
            copy_field(b, m->tenant_id, m->tenant_id_len, 0) != 0 ||
            copy_field(b, m->aggregate_type, m->aggregate_type_len, 0) != 0 ||
            copy_field(b, m->aggregate_id, m->aggregate_id_len, 0) != 0 ||
            copy_field(b, m->aggregate_version, m->aggregate_version_len, 1) != 0)
                return errstr_set(errstr, errstr_size, "out of memory");
        return b->len >= COPY_CHUNK ? copy_flush(db, errstr, errstr_size) : 0;
}

int db_reconcile_end(struct db *db, char *errstr, size_t errstr_size) {
        if (copy_flush(db, errstr, errstr_size) != 0)
                return -1;
        buf_free(&db->copy);
        if (PQputCopyEnd(db->conn, NULL) != 1)
                return errstr_set(errstr, errstr_size, "reconcile: copy: %s",
                                  PQerrorMessage(db->conn));
        int rc = 0;
        PGresult *r;
        while ((r = PQgetResult(db->conn)) != NULL) {
                if (PQresultStatus(r) != PGRES_COMMAND_OK && rc == 0)
                        rc = errstr_set(errstr, errstr_size, "reconcile: copy: %s",
                                        PQerrorMessage(db->conn));
                PQclear(r);
        }
        if (rc == 0)
                rc = db_exec_simple(db,
                                    "CREATE INDEX ON pg_temp.ctl_msgs (event_id);"
                                    " ANALYZE pg_temp.ctl_msgs; ANALYZE pg_temp.ctl_rows",
                                    errstr, errstr_size);
        db_check_conn(db);
        return rc;
}

int db_reconcile_counts(struct db *db, struct db_reconcile_counts *c, char *errstr,
                        size_t errstr_size) {
        long long v[7];
        memset(c, 0, sizeof *c);
        if (query_counts(db, &reconcile_stmts[C_COUNTS], NULL, v, 7, errstr, errstr_size))
                return -1;
        c->rows = v[0];
        c->messages = v[1];
        c->missing = v[2];
        c->reorders = v[3];
        c->duplicates = v[4];
        c->copies = v[5];
        c->unknown = v[6];
        return 0;
}

int db_reconcile_examples(struct db *db, enum db_reconcile_kind kind, long long limit,
                          struct db_rows **out, char *errstr, size_t errstr_size) {
        static const int stmt[] = {[DB_RC_MISSING] = C_MISSING,
                                   [DB_RC_REORDERS] = C_REORDERS,
                                   [DB_RC_DUPLICATES] = C_DUPLICATES,
                                   [DB_RC_UNKNOWN] = C_UNKNOWN};
        return limited_rows(db, &reconcile_stmts[stmt[kind]], limit, out, errstr, errstr_size);
}

int db_set_admin(struct db *db, const char *topic_template) {
        char *t = strdup(topic_template);
        if (!t)
                return -1;
        free(db->topic_template);
        db->topic_template = t;
        db->admin = 1;
        db->after_connect = db_admin_prepare;
        return 0;
}
