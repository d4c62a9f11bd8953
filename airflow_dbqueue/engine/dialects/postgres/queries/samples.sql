-- Named queries of the PostgreSQL dialect: samples, one row a queue a maintenance run (Maintenance.sample),
-- which the Queues page draws. The conventions of every file of this folder are in queues.sql's opening lines.

-- name: sample_clock
-- The time of a run's samples: every queue's row of the run carries it, and the table design's pushes
-- and pops are counted up to it.
SELECT now()

-- name: samples_last
-- Each queue's newest sample: when, and a ring's totals then (what the next sample's counts start from).
SELECT DISTINCT ON (queue_id) queue_id, taken_at, push_total, pop_total
FROM {schema}.samples
WHERE queue_id = ANY (%(queue_ids)s::integer[])
ORDER BY queue_id, taken_at DESC

-- name: table_flow
-- The table design's messages pushed and popped in (since, until], from the timestamps its rows carry (as
-- queue_rates counts them): a push is a row of meta, done or archive with enqueued_at in the window, a pop a
-- finished row (outcome 1) of done or archive with finished_at in it. finished_at and archived_at are
-- later than enqueued_at, which lets the BRIN indexes of done and archive narrow the scans.
SELECT
    (SELECT count(*) FROM {schema}.meta
      WHERE queue_id = %(queue_id)s AND enqueued_at > %(since)s AND enqueued_at <= %(until)s)
    + (SELECT count(*) FROM {schema}.done
        WHERE queue_id = %(queue_id)s AND finished_at > %(since)s
          AND enqueued_at > %(since)s AND enqueued_at <= %(until)s)
    + (SELECT count(*) FROM {schema}.archive
        WHERE queue_id = %(queue_id)s AND archived_at > %(since)s
          AND enqueued_at > %(since)s AND enqueued_at <= %(until)s) AS pushed,
    (SELECT count(*) FROM {schema}.done
      WHERE queue_id = %(queue_id)s AND outcome = 1 AND finished_at > %(since)s AND finished_at <= %(until)s)
    + (SELECT count(*) FROM {schema}.archive
        WHERE queue_id = %(queue_id)s AND outcome = 1 AND archived_at > %(since)s
          AND finished_at > %(since)s AND finished_at <= %(until)s) AS popped

-- name: sample_insert
INSERT INTO {schema}.samples (queue_id, taken_at, ready, delayed, in_flight, failed, oldest_age_s, push_total,
                              pop_total, pushed, popped, groups, horizon_xid_age, horizon_age_s, dead_rows)
VALUES (%(queue_id)s, %(taken_at)s, %(ready)s, %(delayed)s, %(in_flight)s, %(failed)s, %(oldest_age_s)s,
        %(push_total)s, %(pop_total)s, %(pushed)s, %(popped)s, %(groups)s::jsonb, %(horizon_xid_age)s,
        %(horizon_age_s)s, %(dead_rows)s)
ON CONFLICT (queue_id, taken_at) DO NOTHING

-- name: samples_purge_batch
-- Sample retention, one bounded batch a statement: delete up to n samples older than keep_s.
WITH gone AS (
    DELETE FROM {schema}.samples s
    WHERE s.ctid = ANY (ARRAY(
        SELECT ctid FROM {schema}.samples
        WHERE taken_at < now() - make_interval(secs => %(keep_s)s)
        LIMIT %(n)s
        FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT count(*) FROM gone

-- name: samples_read
-- The samples of the last window_s seconds of the queues that exist (and that the role may see), oldest
-- first; taken_at as seconds since the epoch.
SELECT q.name, extract(epoch FROM s.taken_at)::float8, s.ready, s.delayed, s.in_flight, s.failed,
       s.oldest_age_s, s.push_total, s.pop_total, s.pushed, s.popped, s.groups::text, s.horizon_xid_age,
       s.horizon_age_s, s.dead_rows
FROM {schema}.samples s
JOIN {schema}.queues q ON q.queue_id = s.queue_id
WHERE s.taken_at > now() - make_interval(secs => %(window_s)s)
  AND (%(all_queues)s OR q.name = ANY (%(names)s::text[]))
ORDER BY q.name, s.taken_at

-- name: table_flow_all
-- table_flow for many queues at once, each from its own since (the arrays queue_ids and since, in step)
-- to until, in one pass over each table: min_since, the earliest since, bounds the scans of done and
-- archive (their BRIN indexes on finished_at and archived_at).
WITH w AS (
    SELECT u.queue_id, u.since FROM unnest(%(queue_ids)s::integer[], %(since)s::timestamptz[]) AS u(queue_id, since)
)
SELECT w.queue_id,
       coalesce(m.pushed, 0) + coalesce(d.pushed, 0) + coalesce(a.pushed, 0),
       coalesce(d.popped, 0) + coalesce(a.popped, 0)
FROM w
LEFT JOIN (
    SELECT x.queue_id, count(*) AS pushed
    FROM {schema}.meta x JOIN w ON w.queue_id = x.queue_id
    WHERE x.enqueued_at > w.since AND x.enqueued_at <= %(until)s
    GROUP BY x.queue_id) m ON m.queue_id = w.queue_id
LEFT JOIN (
    SELECT x.queue_id,
           count(*) FILTER (WHERE x.enqueued_at > w.since AND x.enqueued_at <= %(until)s) AS pushed,
           count(*) FILTER (WHERE x.outcome = 1 AND x.finished_at <= %(until)s) AS popped
    FROM {schema}.done x JOIN w ON w.queue_id = x.queue_id
    WHERE x.finished_at > %(min_since)s AND x.finished_at > w.since
    GROUP BY x.queue_id) d ON d.queue_id = w.queue_id
LEFT JOIN (
    SELECT x.queue_id,
           count(*) FILTER (WHERE x.enqueued_at > w.since AND x.enqueued_at <= %(until)s) AS pushed,
           count(*) FILTER (WHERE x.outcome = 1 AND x.finished_at > w.since AND x.finished_at <= %(until)s)
               AS popped
    FROM {schema}.archive x JOIN w ON w.queue_id = x.queue_id
    WHERE x.archived_at > %(min_since)s AND x.archived_at > w.since
    GROUP BY x.queue_id) a ON a.queue_id = w.queue_id

-- name: sample_insert_all
-- The samples of many queues in one statement (the arrays in step, one element a queue; groups as JSON
-- text or NULL), all taken at taken_at, with the schema's horizon figures.
INSERT INTO {schema}.samples (queue_id, taken_at, ready, delayed, in_flight, failed, oldest_age_s, push_total,
                              pop_total, pushed, popped, groups, horizon_xid_age, horizon_age_s, dead_rows)
SELECT u.queue_id, %(taken_at)s, u.ready, u.delayed, u.in_flight, u.failed, u.oldest_age_s, u.push_total,
       u.pop_total, u.pushed, u.popped, u.groups::jsonb, %(horizon_xid_age)s, %(horizon_age_s)s, %(dead_rows)s
FROM unnest(%(queue_ids)s::integer[], %(ready)s::bigint[], %(delayed)s::bigint[], %(in_flight)s::bigint[],
            %(failed)s::bigint[], %(oldest_age_s)s::float8[], %(push_total)s::bigint[], %(pop_total)s::bigint[],
            %(pushed)s::bigint[], %(popped)s::bigint[], %(groups)s::text[])
     AS u(queue_id, ready, delayed, in_flight, failed, oldest_age_s, push_total, pop_total, pushed, popped, groups)
ON CONFLICT (queue_id, taken_at) DO NOTHING
