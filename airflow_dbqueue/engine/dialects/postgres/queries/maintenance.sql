-- Named queries of the PostgreSQL dialect: maintenance: its lock, timeouts, archiving, VACUUM and statistics, index and table health, rebuilds.
-- The conventions of every file of this folder are in queues.sql's opening lines.

-- name: maintenance_try_lock
-- Maintenance (engine/maintenance/, and this dialect's maintenance.py) from here on.
-- One maintenance run a schema at a time: a session-level advisory lock on the run's own connection.
SELECT pg_try_advisory_lock(hashtext('dbqueue.maintenance'), hashtext(%(schema)s))

-- name: maintenance_unlock
SELECT pg_advisory_unlock(hashtext('dbqueue.maintenance'), hashtext(%(schema)s))

-- name: maintenance_lock_holder
-- Who holds a schema's maintenance lock (for the log line of a run that skips or waits).
SELECT a.pid, a.application_name, a.client_addr::text,
       extract(epoch FROM now() - a.backend_start)::float8 AS connected_s, a.state
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = hashtext('dbqueue.maintenance')::oid AND l.objid = hashtext(%(schema)s)::oid

-- name: set_timeouts
-- statement_timeout and lock_timeout in milliseconds (as text); local = true: for this transaction only.
SELECT set_config('statement_timeout', %(statement_ms)s, %(local)s),
       set_config('lock_timeout', %(lock_ms)s, %(local)s)

-- name: reset_timeouts
-- Back to the session's defaults after set_timeouts with local = false.
SELECT set_config(name, reset_val, false) FROM pg_settings WHERE name IN ('statement_timeout', 'lock_timeout')

-- name: archive_batch
-- Continuous archiving, one bounded batch a statement: up to n finished messages older than
-- older_than_s move from done (their payloads from data) into archive. Rows another session holds are
-- skipped, so the statement never waits on a row, and it touches no row that push, pop or ack use.
-- Payloads are matched by id = ANY (ARRAY(...)), not a join (see drop_queue); a done row whose payload
-- is missing is archived with an empty payload rather than lost. A done row of a queue that no longer
-- exists is deleted with its payload, not archived: nothing is archived for a dropped queue. (drop_queue
-- waits for a batch holding its queue's rows, and deletes its archive rows after; such rows come only
-- from older versions.) Returns (rows taken, rows archived).
-- done is partitioned (schema.sql): rows are named by (gen, ctid), as in reclaim_expired.
WITH picked AS (
    SELECT gen, ctid AS tid FROM {schema}.done
    WHERE finished_at < now() - make_interval(secs => %(older_than_s)s)
      AND (%(all_queues)s OR queue_id = ANY (%(queue_ids)s::integer[]))
    LIMIT %(n)s
    FOR UPDATE SKIP LOCKED
), batch AS (
    DELETE FROM {schema}.done d
    WHERE d.ctid = ANY (ARRAY(SELECT tid FROM picked))
      AND ((d.gen, d.ctid) IN (SELECT gen, tid FROM picked)) IS TRUE
    RETURNING d.id, d.queue_id, d.priority, d.attempts, d.enqueued_at, d.finished_at, d.outcome, d.payload
), payloads AS (
    DELETE FROM {schema}.data x WHERE x.id = ANY (ARRAY(SELECT id FROM batch WHERE payload IS NULL))
    RETURNING x.id, x.payload
), moved AS (
    INSERT INTO {schema}.archive (id, queue_id, priority, attempts, enqueued_at, finished_at, outcome, payload)
    SELECT b.id, b.queue_id, b.priority, b.attempts, b.enqueued_at, b.finished_at, b.outcome,
           coalesce(b.payload, p.payload, '\x'::bytea)
    FROM batch b LEFT JOIN payloads p ON p.id = b.id
    WHERE EXISTS (SELECT 1 FROM {schema}.queues q WHERE q.queue_id = b.queue_id)
    RETURNING id
)
SELECT (SELECT count(*) FROM batch), (SELECT count(*) FROM moved)

-- name: purge_archive_batch
-- Archive retention, one bounded batch a statement: delete up to n archived messages older than
-- older_than_s (by archived_at, which the BRIN index archive_archived_brin covers).
WITH gone AS (
    DELETE FROM {schema}.archive a
    WHERE a.ctid = ANY (ARRAY(
        SELECT ctid FROM {schema}.archive
        WHERE archived_at < now() - make_interval(secs => %(older_than_s)s)
          AND (%(all_queues)s OR queue_id = ANY (%(queue_ids)s::integer[]))
        LIMIT %(n)s
        FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT count(*) FROM gone

-- name: vacuum_table
-- This and the next three take a table or index name as an identifier placeholder, composed and quoted
-- like the schema's (after validation): utility statements take no bound parameters.
VACUUM (ANALYZE, SKIP_LOCKED) {schema}.{table}

-- name: analyze_table
ANALYZE (SKIP_LOCKED) {schema}.{table}

-- name: vacuum_full_table
-- A rewrite of the table into new files holding only its live rows, under an ACCESS EXCLUSIVE lock
-- for its whole run (Maintenance.compact_rings).
VACUUM (FULL, ANALYZE) {schema}.{table}

-- name: compact_relation_size
SELECT pg_relation_size(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relname = %(table)s

-- name: compact_ring_layouts
-- Each ring's capacity and the payload size its slots were laid out for (its queue's max_payload_bytes).
SELECT r.queue_id, r.capacity, q.max_payload_bytes
FROM {schema}.rings r JOIN {schema}.queues q ON q.queue_id = r.queue_id

-- name: compact_ring_tables
-- The heap size, fillfactor and live bytes (each live row's size plus its page line pointer and header
-- overhead) of the ring's tables.
SELECT t.name, pg_relation_size(c.oid),
       coalesce((SELECT substring(o from 'fillfactor=([0-9]+)')::integer FROM unnest(c.reloptions) AS o
                 WHERE o LIKE 'fillfactor=%%'), 100),
       t.live
FROM (SELECT 'ring_slots' AS name, NULL::bigint AS live
      UNION ALL SELECT 'ring_lanes', (SELECT coalesce(sum(pg_column_size(x.*) + 28), 0) FROM {schema}.ring_lanes x)
      UNION ALL SELECT 'ring_leases', (SELECT coalesce(sum(pg_column_size(x.*) + 28), 0) FROM {schema}.ring_leases x)
      UNION ALL SELECT 'ring_retry', (SELECT coalesce(sum(pg_column_size(x.*) + 28), 0) FROM {schema}.ring_retry x)) t
JOIN pg_class c ON c.relname = t.name AND c.relkind = 'r'
JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = %(schema)s

-- name: reindex_concurrently
REINDEX INDEX CONCURRENTLY {schema}.{index}

-- name: drop_index_concurrently
DROP INDEX CONCURRENTLY IF EXISTS {schema}.{index}

-- name: index_health
-- Every index of the schema with what a bloat estimate needs: its size, entries (reltuples, from the
-- last VACUUM or ANALYZE; -1 when never counted), the summed width of its key columns (fixed-width types
-- by their length, others by the column statistics' average width), its fillfactor and the page size;
-- and whether an index build is running on its table right now (never touch a build in progress).
-- A partition's index that is part of a partitioned index (meta_ready_idx_3 of meta_ready_idx) names
-- that one as part_of; the partitioned index itself holds nothing and is not listed.
SELECT ic.relname, t.relname, am.amname, i.indisvalid, pg_relation_size(ic.oid), ic.reltuples::float8,
       (SELECT coalesce(sum(coalesce(nullif(a.attlen, -1)::integer, s.avg_width, 32)), 0)::integer
          FROM unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) AS k(attnum)
          JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
          LEFT JOIN pg_stats s ON s.schemaname = n.nspname AND s.tablename = t.relname
                              AND s.attname = a.attname) AS key_width,
       coalesce((SELECT split_part(o, '=', 2)::integer FROM unnest(ic.reloptions) AS o
                  WHERE o LIKE 'fillfactor=%%'), 90) AS fillfactor,
       current_setting('block_size')::integer,
       EXISTS (SELECT 1 FROM pg_stat_progress_create_index p WHERE p.relid = t.oid) AS build_running,
       pi.relname AS part_of
FROM pg_index i
JOIN pg_class ic ON ic.oid = i.indexrelid
JOIN pg_class t ON t.oid = i.indrelid
JOIN pg_namespace n ON n.oid = t.relnamespace
JOIN pg_am am ON am.oid = ic.relam
LEFT JOIN pg_inherits ii ON ii.inhrelid = ic.oid
LEFT JOIN pg_class pi ON pi.oid = ii.inhparent
WHERE n.nspname = %(schema)s AND ic.relkind = 'i'
ORDER BY t.relname, ic.relname

-- name: table_health
-- Size and vacuum state of every table of the schema; a partitioned table (the table design's meta,
-- data and done) as the sum over its partitions.
SELECT coalesce(p.relname, c.relname) AS name, sum(pg_relation_size(c.oid))::bigint,
       sum(pg_indexes_size(c.oid))::bigint, sum(pg_total_relation_size(c.oid))::bigint,
       sum(coalesce(s.n_live_tup, 0))::bigint, sum(coalesce(s.n_dead_tup, 0))::bigint,
       max(greatest(s.last_vacuum, s.last_autovacuum)), max(greatest(s.last_analyze, s.last_autoanalyze)),
       sum(coalesce(s.autovacuum_count, 0))::bigint, sum(coalesce(s.vacuum_count, 0))::bigint
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
LEFT JOIN pg_class p ON p.oid = i.inhparent
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE n.nspname = %(schema)s AND c.relkind = 'r'
GROUP BY 1
ORDER BY 1

-- name: xmin_holders
-- What holds back the xmin horizon (so VACUUM cannot remove dead rows anywhere in the database): open
-- transactions older than min_age_s, replication slots holding an xmin more than min_xid_age
-- transactions old, and prepared transactions older than min_age_s; the oldest (in transaction ids) first.
-- backend_age_s: how long a transaction's session has been connected. Autovacuum workers are left out:
-- the server ignores a lazy VACUUM's snapshot when it computes the horizon, and their ANALYZE holds
-- one for the moment it samples a table; they end by themselves, and no operator has to act on them.
SELECT 'transaction' AS kind, a.pid, coalesce(a.application_name, '') AS name, a.usename::text,
       a.state, extract(epoch FROM now() - a.xact_start)::float8 AS age_s,
       greatest(age(a.backend_xmin), age(a.backend_xid)) AS xid_age,
       a.xact_start, a.query_start, left(a.query, 200) AS query,
       extract(epoch FROM now() - a.backend_start)::float8 AS backend_age_s
FROM pg_stat_activity a
WHERE a.pid <> pg_backend_pid() AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
  AND a.backend_type <> 'autovacuum worker' AND a.xact_start < now() - make_interval(secs => %(min_age_s)s)
UNION ALL
SELECT 'replication slot', r.active_pid, r.slot_name::text, NULL, CASE WHEN r.active THEN 'active' ELSE 'inactive' END,
       NULL, greatest(age(r.xmin), age(r.catalog_xmin)), NULL, NULL, r.slot_type, NULL
FROM pg_replication_slots r
WHERE greatest(age(r.xmin), age(r.catalog_xmin)) > %(min_xid_age)s
UNION ALL
SELECT 'prepared transaction', NULL, p.gid, p.owner::text, p.database::text,
       extract(epoch FROM now() - p.prepared)::float8, age(p.transaction), p.prepared, NULL, NULL, NULL
FROM pg_prepared_xacts p
WHERE p.prepared < now() - make_interval(secs => %(min_age_s)s)
ORDER BY 7 DESC NULLS LAST

-- name: queue_rates
-- Messages pushed and finished in the last window_s seconds, counted from the tables: a message
-- pushed in the window is in meta, done or archive with a recent enqueued_at (finished_at and
-- archived_at are later still, which lets the BRIN indexes of done and archive narrow the scans).
-- Queues that do not archive delete finished messages, so only their pushes still waiting are seen.
WITH w AS (SELECT now() - make_interval(secs => %(window_s)s) AS since)
SELECT
    (SELECT count(*) FROM {schema}.meta, w WHERE queue_id = %(queue_id)s AND enqueued_at > w.since)
    + (SELECT count(*) FROM {schema}.done, w
        WHERE queue_id = %(queue_id)s AND finished_at > w.since AND enqueued_at > w.since)
    + (SELECT count(*) FROM {schema}.archive, w
        WHERE queue_id = %(queue_id)s AND archived_at > w.since AND enqueued_at > w.since) AS pushed,
    (SELECT count(*) FROM {schema}.done, w
      WHERE queue_id = %(queue_id)s AND finished_at > w.since AND outcome = 1)
    + (SELECT count(*) FROM {schema}.archive, w
        WHERE queue_id = %(queue_id)s AND archived_at > w.since AND finished_at > w.since AND outcome = 1)
      AS finished

-- name: table_move_stragglers
-- The table design's generations (schema.sql): move up to n delayed or failed messages out of old
-- generations into the one pushes write now (functions.sql's table_move_stragglers). Returns how many.
SELECT {schema}.table_move_stragglers(%(n)s::integer)

-- name: table_raise_floors
-- Raise the floor of each table-design queue whose push lock is free now (functions.sql's
-- table_raise_floors): the least process-at time of its ready, delayed and leased messages, below which
-- the claims do not look. Returns how many were raised. In a transaction of its own.
SELECT {schema}.table_raise_floors()

-- name: table_partitions
-- The partitions of the table design's meta, data and done with their sizes (heap and indexes), and
-- whether pushes write that generation now.
SELECT t.name, g, pg_total_relation_size(('{schema}.' || quote_ident(t.name || '_' || g))::regclass),
       g = {schema}.table_generation()
FROM unnest(ARRAY['meta', 'data', 'done']) AS t(name)
CROSS JOIN generate_series(0, 7) AS g
ORDER BY 1, 2

-- name: table_empty_partition
-- TRUNCATE one partition of the table design's tables when it holds no row (functions.sql's
-- table_empty_partition): the milliseconds its lock was held until the TRUNCATE ended when emptied, -1
-- when it holds a row, NULL when its lock was not granted within lock_timeout_ms. In a transaction of
-- its own.
SELECT {schema}.table_empty_partition(%(table)s::text, %(gen)s::integer, %(lock_timeout_ms)s::integer)

-- name: queue_rates_all
-- queue_rates for the queues among queue_ids in one pass over each table (maintenance's metrics): each
-- queue's messages pushed and finished in the last window_s seconds, zeros for a queue with none.
WITH w AS (SELECT now() - make_interval(secs => %(window_s)s) AS since)
SELECT q.queue_id, coalesce(m.pushed, 0) + coalesce(d.pushed, 0) + coalesce(a.pushed, 0),
       coalesce(d.finished, 0) + coalesce(a.finished, 0)
FROM {schema}.queues q
LEFT JOIN (
    SELECT x.queue_id, count(*) AS pushed FROM {schema}.meta x, w
    WHERE x.enqueued_at > w.since AND x.queue_id = ANY (%(queue_ids)s::integer[])
    GROUP BY x.queue_id) m ON m.queue_id = q.queue_id
LEFT JOIN (
    SELECT x.queue_id, count(*) FILTER (WHERE x.enqueued_at > w.since) AS pushed,
           count(*) FILTER (WHERE x.outcome = 1) AS finished
    FROM {schema}.done x, w
    WHERE x.finished_at > w.since AND x.queue_id = ANY (%(queue_ids)s::integer[])
    GROUP BY x.queue_id) d ON d.queue_id = q.queue_id
LEFT JOIN (
    SELECT x.queue_id, count(*) FILTER (WHERE x.enqueued_at > w.since) AS pushed,
           count(*) FILTER (WHERE x.finished_at > w.since AND x.outcome = 1) AS finished
    FROM {schema}.archive x, w
    WHERE x.archived_at > w.since AND x.queue_id = ANY (%(queue_ids)s::integer[])
    GROUP BY x.queue_id) a ON a.queue_id = q.queue_id
WHERE q.queue_id = ANY (%(queue_ids)s::integer[])
