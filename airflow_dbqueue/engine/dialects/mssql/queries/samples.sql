-- Named queries of the SQL Server dialect: samples, one row a queue a maintenance run (Maintenance.sample),
-- as on PostgreSQL. The conventions of every file of this folder are in queues.sql's opening lines.

-- name: sample_clock
SELECT SYSUTCDATETIME()

-- name: samples_last
SET NOCOUNT ON;
SELECT s.queue_id, s.taken_at, s.push_total, s.pop_total
FROM {schema}.samples s
JOIN (SELECT CAST(value AS int) AS queue_id FROM OPENJSON(%(queue_ids)s)) w ON w.queue_id = s.queue_id
WHERE s.taken_at = (SELECT max(x.taken_at) FROM {schema}.samples x WHERE x.queue_id = s.queue_id)

-- name: table_flow
SET NOCOUNT ON;
DECLARE @queue_id int = %(queue_id)s;
DECLARE @since datetime2(6) = %(since)s;
DECLARE @until datetime2(6) = %(until)s;
SELECT
    (SELECT count_big(*) FROM {schema}.meta
      WHERE queue_id = @queue_id AND enqueued_at > @since AND enqueued_at <= @until)
    + (SELECT count_big(*) FROM {schema}.done
        WHERE queue_id = @queue_id AND finished_at > @since AND enqueued_at > @since AND enqueued_at <= @until)
    + (SELECT count_big(*) FROM {schema}.archive
        WHERE queue_id = @queue_id AND archived_at > @since AND enqueued_at > @since AND enqueued_at <= @until)
      AS pushed,
    (SELECT count_big(*) FROM {schema}.done
      WHERE queue_id = @queue_id AND outcome = 1 AND finished_at > @since AND finished_at <= @until)
    + (SELECT count_big(*) FROM {schema}.archive
        WHERE queue_id = @queue_id AND outcome = 1 AND archived_at > @since
          AND finished_at > @since AND finished_at <= @until) AS popped

-- name: sample_insert
SET NOCOUNT ON;
INSERT INTO {schema}.samples (queue_id, taken_at, ready, delayed, in_flight, failed, oldest_age_s, push_total,
                              pop_total, pushed, popped, groups, horizon_xid_age, horizon_age_s, dead_rows)
SELECT %(queue_id)s, %(taken_at)s, %(ready)s, %(delayed)s, %(in_flight)s, %(failed)s, %(oldest_age_s)s,
       %(push_total)s, %(pop_total)s, %(pushed)s, %(popped)s, %(groups)s, %(horizon_xid_age)s,
       %(horizon_age_s)s, %(dead_rows)s
WHERE NOT EXISTS (SELECT 1 FROM {schema}.samples WHERE queue_id = %(queue_id)s AND taken_at = %(taken_at)s)

-- name: samples_purge_batch
SET NOCOUNT ON;
DECLARE @before datetime2(6) = DATEADD(second, -CAST(%(keep_s)s AS int), SYSUTCDATETIME());
DELETE TOP (%(n)s) FROM {schema}.samples WITH (ROWLOCK, READPAST) WHERE taken_at < @before;
SELECT @@ROWCOUNT

-- name: samples_read
SET NOCOUNT ON;
DECLARE @since datetime2(6) = DATEADD(second, -CAST(%(window_s)s AS int), SYSUTCDATETIME());
SELECT q.name, DATEDIFF_BIG(millisecond, '1970-01-01', s.taken_at) / 1e3, s.ready, s.delayed, s.in_flight,
       s.failed, s.oldest_age_s, s.push_total, s.pop_total, s.pushed, s.popped, s.groups, s.horizon_xid_age,
       s.horizon_age_s, s.dead_rows
FROM {schema}.samples s
JOIN {schema}.queues q ON q.queue_id = s.queue_id
WHERE s.taken_at > @since
  AND (%(all_queues)s = 1 OR q.name IN (SELECT value FROM OPENJSON(%(names)s)))
ORDER BY q.name, s.taken_at
