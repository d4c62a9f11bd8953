-- Named queries of the SQL Server dialect: claimed batches (a Spark batch's messages, claimed, published and acked or released as one).
-- The conventions of every file of this folder are in queues.sql's opening lines.

-- name: claim_batch
-- at-least-once claim of up to n ready messages under one lease, recorded in the batch ledger in the
-- same transaction; no payload leaves the database. ids and deliveries come back as JSON arrays in
-- claim order (the dialect turns them into lists).
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @batch_id uniqueidentifier = %(batch_id)s;
DECLARE @vt float = %(visibility_timeout_s)s;
DECLARE @until datetime2(6) = DATEADD(microsecond, CAST(1e6 * (@vt - FLOOR(@vt)) AS int),
                                      DATEADD(second, CAST(FLOOR(@vt) AS int), @now));
DECLARE @claimed TABLE (id bigint PRIMARY KEY, deliveries int, priority smallint, process_at datetime2(6));
WITH head AS (
    SELECT TOP (%(n)s) id, state, attempts, deliveries, consumer, lease_until, priority, process_at
    FROM {schema}.meta WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= @now
    ORDER BY priority DESC, process_at, id)
UPDATE head
SET state = 1, attempts = attempts + 1, deliveries = deliveries + 1, consumer = %(consumer)s, lease_until = @until
OUTPUT inserted.id, inserted.deliveries, inserted.priority, inserted.process_at INTO @claimed;
IF EXISTS (SELECT 1 FROM @claimed)
BEGIN
    INSERT INTO {schema}.batches (batch_id, queue_id, consumer, claimed_at, lease_until)
    VALUES (@batch_id, %(queue_id)s, %(consumer)s, @now, @until);
    INSERT INTO {schema}.batch_items (batch_id, ord, id, delivery)
    SELECT @batch_id, ROW_NUMBER() OVER (ORDER BY priority DESC, process_at, id), id, deliveries FROM @claimed;
END;
SELECT b.batch_id, b.state,
       N'[' + (SELECT STRING_AGG(CAST(i.id AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS ids,
       N'[' + (SELECT STRING_AGG(CAST(i.delivery AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS deliveries,
       b.consumer, b.claimed_at, b.lease_until, b.finished_at, b.last_error
FROM {schema}.batches b
WHERE b.batch_id = @batch_id

-- name: claim_batch_with
-- claim_batch for a queue whose messages may expire (created with a ttl) or that is ordered per key: it
-- passes over expired messages and those whose key has an earlier message ready, delayed or in flight, as
-- the pops do (pop_lease_with in table.sql, which says how it reads them), so a batch holds at most the
-- head of each key.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @batch_id uniqueidentifier = %(batch_id)s;
DECLARE @vt float = %(visibility_timeout_s)s;
DECLARE @expiring bit = %(expiring)s;
DECLARE @per_key bit = %(per_key)s;
DECLARE @until datetime2(6) = DATEADD(microsecond, CAST(1e6 * (@vt - FLOOR(@vt)) AS int),
                                      DATEADD(second, CAST(FLOOR(@vt) AS int), @now));
DECLARE @claimed TABLE (id bigint PRIMARY KEY, deliveries int, priority smallint, process_at datetime2(6));
WITH head AS (
    SELECT TOP (%(n)s) s.id, s.state, s.attempts, s.deliveries, s.consumer, s.lease_until, s.priority,
           s.process_at
    FROM {schema}.meta s WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE s.queue_id = %(queue_id)s AND s.state = 0 AND s.process_at <= @now
      AND NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
          WHERE o.queue_id = s.queue_id AND o.id = s.id
            AND ((@expiring = 1 AND o.expires_at IS NOT NULL AND o.expires_at <= @now)
                 OR (@per_key = 1 AND o.okey_hash IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                     WHERE e.queue_id = o.queue_id AND e.okey_hash = o.okey_hash AND e.id < o.id
                       AND NOT EXISTS (SELECT 1 FROM {schema}.meta f WITH (READPAST)
                           WHERE f.id = e.id AND f.state = 2)))))
    ORDER BY s.priority DESC, s.process_at, s.id)
UPDATE head
SET state = 1, attempts = attempts + 1, deliveries = deliveries + 1, consumer = %(consumer)s, lease_until = @until
OUTPUT inserted.id, inserted.deliveries, inserted.priority, inserted.process_at INTO @claimed;
IF EXISTS (SELECT 1 FROM @claimed)
BEGIN
    INSERT INTO {schema}.batches (batch_id, queue_id, consumer, claimed_at, lease_until)
    VALUES (@batch_id, %(queue_id)s, %(consumer)s, @now, @until);
    INSERT INTO {schema}.batch_items (batch_id, ord, id, delivery)
    SELECT @batch_id, ROW_NUMBER() OVER (ORDER BY priority DESC, process_at, id), id, deliveries FROM @claimed;
END;
SELECT b.batch_id, b.state,
       N'[' + (SELECT STRING_AGG(CAST(i.id AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS ids,
       N'[' + (SELECT STRING_AGG(CAST(i.delivery AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS deliveries,
       b.consumer, b.claimed_at, b.lease_until, b.finished_at, b.last_error
FROM {schema}.batches b
WHERE b.batch_id = @batch_id

-- name: get_batch
SELECT b.batch_id, b.state,
       N'[' + (SELECT STRING_AGG(CAST(i.id AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS ids,
       N'[' + (SELECT STRING_AGG(CAST(i.delivery AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS deliveries,
       b.consumer, b.claimed_at, b.lease_until, b.finished_at, b.last_error
FROM {schema}.batches b
WHERE b.batch_id = %(batch_id)s AND b.queue_id = %(queue_id)s

-- name: lock_batch
-- The batch's ledger row, locked (UPDLOCK, HOLDLOCK) so that a concurrent ack and release of one batch
-- serialize.
SELECT b.batch_id, b.state,
       N'[' + (SELECT STRING_AGG(CAST(i.id AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS ids,
       N'[' + (SELECT STRING_AGG(CAST(i.delivery AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS deliveries,
       b.consumer, b.claimed_at, b.lease_until, b.finished_at, b.last_error
FROM {schema}.batches b WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
WHERE b.batch_id = %(batch_id)s AND b.queue_id = %(queue_id)s

-- name: finish_batch
UPDATE {schema}.batches
SET state = %(state)s,
    finished_at = CASE WHEN %(state)s = 0 THEN NULL ELSE SYSUTCDATETIME() END,
    lease_until = coalesce(%(lease_until)s, lease_until), last_error = coalesce(LEFT(%(error)s, 1000), last_error)
WHERE batch_id = %(batch_id)s AND queue_id = %(queue_id)s

-- name: purge_batches
-- The ledger rows of batches finished (acked or released) more than older_than_s ago, up to n.
SET NOCOUNT ON;
DECLARE @older_than_s float = %(older_than_s)s;
DECLARE @gone TABLE (batch_id uniqueidentifier PRIMARY KEY);
WITH old AS (
    SELECT TOP (%(n)s) batch_id FROM {schema}.batches WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE queue_id = %(queue_id)s AND state <> 0
      AND finished_at < DATEADD(second, -CAST(FLOOR(@older_than_s) AS int), SYSUTCDATETIME()))
DELETE FROM old OUTPUT deleted.batch_id INTO @gone;
DELETE i FROM {schema}.batch_items i JOIN @gone g ON g.batch_id = i.batch_id;
SELECT batch_id FROM @gone

-- name: open_batches
-- Batches still claimed, oldest first (for operators of the platform and for cleanup), of every
-- consumer or of those whose consumer starts with consumer_prefix (a task's earlier tries; the length
-- of the prefix with an x added, less one, counts trailing spaces, which LEN drops).
SELECT TOP (%(limit)s) b.batch_id, b.state,
       N'[' + (SELECT STRING_AGG(CAST(i.id AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS ids,
       N'[' + (SELECT STRING_AGG(CAST(i.delivery AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS deliveries,
       b.consumer, b.claimed_at, b.lease_until, b.finished_at, b.last_error
FROM {schema}.batches b
WHERE b.queue_id = %(queue_id)s AND b.state = 0
  AND (%(consumer_prefix)s IS NULL
       OR LEFT(b.consumer, LEN(%(consumer_prefix)s + N'x') - 1) = %(consumer_prefix)s)
ORDER BY b.claimed_at

-- name: batch_rows
-- The messages of one batch with their payloads, numbered 1..n in claim order (ord: a Spark JDBC
-- reader partitions on it). Rendered to text with its parameters for readers in other processes.
SELECT i.ord, i.id, i.delivery,
       coalesce(CONVERT(varbinary(max), (SELECT m.payload FROM {schema}.meta m WHERE m.id = i.id)),
                (SELECT d.payload FROM {schema}.data d WHERE d.id = i.id)) AS payload
FROM {schema}.batches b
JOIN {schema}.batch_items i ON i.batch_id = b.batch_id
WHERE b.batch_id = %(batch_id)s AND b.queue_id = %(queue_id)s
