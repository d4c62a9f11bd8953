-- Named queries of the SQL Server dialect, under the names of the PostgreSQL dialect (a test checks the
-- parity; dialect.NOT_YET_PORTED names the ones still missing). {schema} is the bracket-quoted schema
-- name; values are bound parameters, written %(name)s as on PostgreSQL and sent to pyodbc as ? in order.
-- Each named query runs as one transaction (or inside the caller's), with XACT_ABORT ON: an error rolls
-- all of it back. A batch of several statements starts with SET NOCOUNT ON so that only its last
-- SELECT returns rows. Lists (receipts, payloads) arrive as JSON arrays read with OPENJSON, whose [key]
-- is the element's position. Times are UTC datetime2(6).

-- name: install_lock
-- Held until the install transaction ends; concurrent installs of one schema queue up here.
EXEC sys.sp_getapplock @Resource = %(schema)s, @LockMode = 'Exclusive', @LockOwner = 'Transaction'

-- name: schema_installed
SELECT CASE WHEN OBJECT_ID(QUOTENAME(%(schema)s) + N'.schema_version', N'U') IS NULL THEN 0 ELSE 1 END

-- name: schema_version
SELECT coalesce(max(version), 0) FROM {schema}.schema_version

-- name: record_version
INSERT INTO {schema}.schema_version (version)
SELECT %(version)s WHERE NOT EXISTS (SELECT 1 FROM {schema}.schema_version WHERE version = %(version)s)

-- name: drop_schema
-- No DROP SCHEMA ... CASCADE in T-SQL: drop the schema's tables and sequences, then the schema.
SET NOCOUNT ON;
DECLARE @schema sysname = %(schema)s;
DECLARE @sql nvarchar(max) = N'';
SELECT @sql = @sql + N'DROP TABLE ' + QUOTENAME(@schema) + N'.' + QUOTENAME(t.name) + N'; '
FROM sys.tables t WHERE t.schema_id = SCHEMA_ID(@schema);
SELECT @sql = @sql + N'DROP SEQUENCE ' + QUOTENAME(@schema) + N'.' + QUOTENAME(s.name) + N'; '
FROM sys.sequences s WHERE s.schema_id = SCHEMA_ID(@schema);
IF SCHEMA_ID(@schema) IS NOT NULL SET @sql = @sql + N'DROP SCHEMA ' + QUOTENAME(@schema) + N';';
EXEC sys.sp_executesql @sql

-- name: create_queue
-- UPDLOCK, HOLDLOCK on the name: two concurrent creates of one queue serialize instead of failing.
INSERT INTO {schema}.queues (
    name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
    retry_backoff_s, retry_backoff_max_s, notify, archive)
OUTPUT inserted.queue_id
SELECT %(name)s, %(design)s, %(payload_type)s, %(max_payload_bytes)s, %(max_attempts)s,
       %(visibility_timeout_s)s, %(retry_backoff_s)s, %(retry_backoff_max_s)s, %(notify)s, %(archive)s
WHERE NOT EXISTS (SELECT 1 FROM {schema}.queues WITH (UPDLOCK, HOLDLOCK) WHERE name = %(name)s)

-- name: get_queue
SELECT queue_id, name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
       retry_backoff_s, retry_backoff_max_s, notify, archive
FROM {schema}.queues WHERE name = %(name)s

-- name: list_queues
SELECT queue_id, name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
       retry_backoff_s, retry_backoff_max_s, notify, archive
FROM {schema}.queues ORDER BY name

-- name: drop_queue
SET NOCOUNT ON;
DECLARE @queue_id int = %(queue_id)s;
DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM {schema}.meta WHERE queue_id = @queue_id);
DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM {schema}.done WHERE queue_id = @queue_id);
DELETE FROM {schema}.meta WHERE queue_id = @queue_id;
DELETE FROM {schema}.done WHERE queue_id = @queue_id;
DELETE FROM {schema}.archive WHERE queue_id = @queue_id;
DELETE i FROM {schema}.batch_items i
WHERE i.batch_id IN (SELECT batch_id FROM {schema}.batches WHERE queue_id = @queue_id);
DELETE FROM {schema}.batches WHERE queue_id = @queue_id;
DELETE q OUTPUT deleted.queue_id FROM {schema}.queues q WHERE q.queue_id = @queue_id

-- name: push
-- One round trip a batch. payloads is a JSON array of hex strings (CONVERT style 2 turns one into
-- varbinary); ids come from the sequence in payload order.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @delay_s float = %(delay_s)s;
DECLARE @input TABLE (ord int PRIMARY KEY, id bigint NOT NULL, payload varbinary(max) NOT NULL);
INSERT INTO @input (ord, id, payload)
SELECT CAST(p.[key] AS int), NEXT VALUE FOR {schema}.message_id_seq OVER (ORDER BY CAST(p.[key] AS int)),
       CONVERT(varbinary(max), p.[value], 2)
FROM OPENJSON(%(payloads)s) p;
INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at)
SELECT id, %(queue_id)s, %(priority)s,
       DATEADD(microsecond, CAST(1e6 * (@delay_s - FLOOR(@delay_s)) AS int),
               DATEADD(second, CAST(FLOOR(@delay_s) AS int), @now)), @now
FROM @input;
INSERT INTO {schema}.data (id, payload) SELECT id, payload FROM @input;
SELECT id FROM @input ORDER BY ord

-- name: push_notify
-- SQL Server has no NOTIFY: waiting pops poll (a short spin, then growing sleeps), so this is push.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @delay_s float = %(delay_s)s;
DECLARE @input TABLE (ord int PRIMARY KEY, id bigint NOT NULL, payload varbinary(max) NOT NULL);
INSERT INTO @input (ord, id, payload)
SELECT CAST(p.[key] AS int), NEXT VALUE FOR {schema}.message_id_seq OVER (ORDER BY CAST(p.[key] AS int)),
       CONVERT(varbinary(max), p.[value], 2)
FROM OPENJSON(%(payloads)s) p;
INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at)
SELECT id, %(queue_id)s, %(priority)s,
       DATEADD(microsecond, CAST(1e6 * (@delay_s - FLOOR(@delay_s)) AS int),
               DATEADD(second, CAST(FLOOR(@delay_s) AS int), @now)), @now
FROM @input;
INSERT INTO {schema}.data (id, payload) SELECT id, payload FROM @input;
SELECT id FROM @input ORDER BY ord

-- name: pop_lease
-- at-least-once: claim up to n ready messages and lease them. The CTE takes the head of the ready index
-- with ROWLOCK, READPAST, UPDLOCK (rows other consumers hold are skipped, never waited for: seed 002),
-- and the UPDATE through it claims exactly those rows. Payloads are read after the claim, by id.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @vt float = %(visibility_timeout_s)s;
DECLARE @until datetime2(6) = DATEADD(microsecond, CAST(1e6 * (@vt - FLOOR(@vt)) AS int),
                                      DATEADD(second, CAST(FLOOR(@vt) AS int), @now));
DECLARE @claimed TABLE (
    id bigint PRIMARY KEY, priority smallint, attempts int, deliveries int, process_at datetime2(6),
    enqueued_at datetime2(6), lease_until datetime2(6));
WITH head AS (
    SELECT TOP (%(n)s) id, state, attempts, deliveries, consumer, lease_until, priority, process_at, enqueued_at
    FROM {schema}.meta WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= @now
    ORDER BY priority DESC, process_at, id)
UPDATE head
SET state = 1, attempts = attempts + 1, deliveries = deliveries + 1, consumer = %(consumer)s, lease_until = @until
OUTPUT inserted.id, inserted.priority, inserted.attempts, inserted.deliveries, inserted.process_at,
       inserted.enqueued_at, inserted.lease_until
INTO @claimed;
SELECT c.id, c.priority, c.attempts, c.deliveries, c.enqueued_at, c.lease_until,
       (SELECT d.payload FROM {schema}.data d WHERE d.id = c.id) AS payload
FROM @claimed c
ORDER BY c.priority DESC, c.process_at, c.id

-- name: pop_take
-- at-most-once and exactly-once: claim up to n ready messages and finish them in the same transaction
-- (kept in done for the archiver, or deleted with their payloads when the queue does not archive).
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @archive bit = %(archive)s;
DECLARE @taken TABLE (
    id bigint PRIMARY KEY, queue_id int, priority smallint, attempts int, deliveries int,
    process_at datetime2(6), enqueued_at datetime2(6), payload varbinary(max));
WITH head AS (
    SELECT TOP (%(n)s) id, queue_id, priority, attempts, deliveries, process_at, enqueued_at
    FROM {schema}.meta WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= @now
    ORDER BY priority DESC, process_at, id)
DELETE FROM head
OUTPUT deleted.id, deleted.queue_id, deleted.priority, deleted.attempts + 1, deleted.deliveries + 1,
       deleted.process_at, deleted.enqueued_at, NULL
INTO @taken;
UPDATE t SET payload = d.payload FROM @taken t JOIN {schema}.data d ON d.id = t.id;
IF @archive = 1
    INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome)
    SELECT id, queue_id, priority, attempts, enqueued_at, 1 FROM @taken;
ELSE
    DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM @taken);
SELECT t.id, t.priority, t.attempts, t.deliveries, t.enqueued_at, CAST(NULL AS datetime2(6)) AS lease_until,
       t.payload
FROM @taken t
ORDER BY t.priority DESC, t.process_at, t.id

-- name: ack
-- Finish leased messages, all or nothing: the receipts (id, delivery) whose lease is still valid are
-- locked (UPDLOCK holds until commit, and waits for a concurrent reclaim), and rows go only when every
-- receipt is held. A lost lease makes the batch return no row.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @archive bit = %(archive)s;
DECLARE @receipts TABLE (id bigint NOT NULL, delivery int NOT NULL, PRIMARY KEY (id, delivery));
INSERT INTO @receipts (id, delivery)
SELECT CAST(i.[value] AS bigint), CAST(d.[value] AS int)
FROM OPENJSON(%(ids)s) i JOIN OPENJSON(%(deliveries)s) d ON d.[key] = i.[key];
DECLARE @held TABLE (id bigint NOT NULL, delivery int NOT NULL, PRIMARY KEY (id, delivery));
INSERT INTO @held (id, delivery)
SELECT m.id, m.deliveries FROM {schema}.meta m WITH (UPDLOCK, ROWLOCK)
JOIN @receipts r ON m.id = r.id AND m.deliveries = r.delivery
WHERE m.queue_id = %(queue_id)s AND m.lease_until > @now;
DECLARE @acked TABLE (id bigint PRIMARY KEY, queue_id int, priority smallint, attempts int, enqueued_at datetime2(6));
DECLARE @wanted int = (SELECT count(*) FROM @receipts);
DECLARE @got int = (SELECT count(*) FROM @held);
IF @got = @wanted
BEGIN
    DELETE m
    OUTPUT deleted.id, deleted.queue_id, deleted.priority, deleted.attempts, deleted.enqueued_at INTO @acked
    FROM {schema}.meta m JOIN @held h ON h.id = m.id;
    IF @archive = 1
        INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome)
        SELECT id, queue_id, priority, attempts, enqueued_at, 1 FROM @acked;
    ELSE
        DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM @acked);
END;
SELECT id FROM @acked

-- name: nack
-- Return leased messages for another try after delay_s (NULL: the queue's exponential backoff,
-- backoff_s * 2^(attempts - 1) capped at backoff_max_s), or to the failed state after max_attempts;
-- all or nothing, like ack.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @max_attempts int = %(max_attempts)s;
DECLARE @delay_s float = %(delay_s)s;
DECLARE @backoff_s float = %(backoff_s)s;
DECLARE @backoff_max_s float = %(backoff_max_s)s;
DECLARE @receipts TABLE (id bigint NOT NULL, delivery int NOT NULL, PRIMARY KEY (id, delivery));
INSERT INTO @receipts (id, delivery)
SELECT CAST(i.[value] AS bigint), CAST(d.[value] AS int)
FROM OPENJSON(%(ids)s) i JOIN OPENJSON(%(deliveries)s) d ON d.[key] = i.[key];
DECLARE @held TABLE (id bigint NOT NULL, delivery int NOT NULL, PRIMARY KEY (id, delivery));
INSERT INTO @held (id, delivery)
SELECT m.id, m.deliveries FROM {schema}.meta m WITH (UPDLOCK, ROWLOCK)
JOIN @receipts r ON m.id = r.id AND m.deliveries = r.delivery
WHERE m.queue_id = %(queue_id)s AND m.lease_until > @now;
DECLARE @done TABLE (id bigint PRIMARY KEY, state tinyint);
DECLARE @wanted int = (SELECT count(*) FROM @receipts);
DECLARE @got int = (SELECT count(*) FROM @held);
IF @got = @wanted
    UPDATE m
    SET state = CASE WHEN m.attempts >= @max_attempts THEN 2 ELSE 0 END,
        process_at = CASE WHEN m.attempts >= @max_attempts THEN m.process_at
                          ELSE DATEADD(millisecond, CAST(1000 * x.secs - 1000 * FLOOR(x.secs) AS int),
                                       DATEADD(second, CAST(FLOOR(x.secs) AS int), @now)) END,
        lease_until = NULL, consumer = NULL, last_error = LEFT(%(error)s, 1000)
    OUTPUT inserted.id, inserted.state INTO @done
    FROM {schema}.meta m
    JOIN @held h ON h.id = m.id
    CROSS APPLY (SELECT coalesce(@delay_s, CASE
        WHEN @backoff_s * POWER(CAST(2 AS float), CASE WHEN m.attempts > 1 THEN m.attempts - 1 ELSE 0 END)
             > @backoff_max_s THEN @backoff_max_s
        ELSE @backoff_s * POWER(CAST(2 AS float), CASE WHEN m.attempts > 1 THEN m.attempts - 1 ELSE 0 END)
        END) AS secs) x;
SELECT id, state FROM @done

-- name: held_receipts
-- Which of the receipts still hold a valid lease (to name the lost ones in an error).
SELECT m.id, m.deliveries
FROM {schema}.meta m
JOIN (SELECT CAST(i.[value] AS bigint) AS id, CAST(d.[value] AS int) AS delivery
      FROM OPENJSON(%(ids)s) i JOIN OPENJSON(%(deliveries)s) d ON d.[key] = i.[key]) r
  ON m.id = r.id AND m.deliveries = r.delivery
WHERE m.queue_id = %(queue_id)s AND m.lease_until > SYSUTCDATETIME()

-- name: reclaim_expired
-- Expired leases go back to ready, keeping their place (process_at), or to failed after max_attempts.
SET NOCOUNT ON;
DECLARE @max_attempts int = %(max_attempts)s;
DECLARE @moved TABLE (id bigint PRIMARY KEY, state tinyint);
WITH expired AS (
    SELECT TOP (%(limit)s) id, state, attempts, lease_until, consumer, last_error
    FROM {schema}.meta WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE queue_id = %(queue_id)s AND state = 1 AND lease_until <= SYSUTCDATETIME()
    ORDER BY lease_until)
UPDATE expired
SET state = CASE WHEN attempts >= @max_attempts THEN 2 ELSE 0 END,
    lease_until = NULL, consumer = NULL,
    last_error = LEFT(N'lease expired (held by ' + coalesce(consumer, N'?') + N')', 1000)
OUTPUT inserted.id, inserted.state INTO @moved;
SELECT id, state FROM @moved

-- name: peek
SELECT TOP (%(n)s) m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until,
       (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id) AS payload
FROM {schema}.meta m
WHERE m.queue_id = %(queue_id)s AND m.state = 0 AND m.process_at <= SYSUTCDATETIME()
ORDER BY m.priority DESC, m.process_at, m.id

-- name: count_ready
-- Ready messages of at least min_priority, counted up to a cap (a sensor needs "at least k", not a total).
SELECT count(*) FROM (
    SELECT TOP (%(cap)s) 1 AS one FROM {schema}.meta
    WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= SYSUTCDATETIME()
      AND priority >= %(min_priority)s) s

-- name: next_due
-- Seconds until the earliest delayed message becomes ready (NULL when none is delayed).
SELECT DATEDIFF_BIG(microsecond, SYSUTCDATETIME(), min(process_at)) / 1e6 FROM {schema}.meta
WHERE queue_id = %(queue_id)s AND state = 0 AND process_at > SYSUTCDATETIME()

-- name: stats
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @queue_id int = %(queue_id)s;
SELECT
    (SELECT count(*) FROM {schema}.meta WHERE queue_id = @queue_id AND state = 0 AND process_at <= @now) AS ready,
    (SELECT count(*) FROM {schema}.meta WHERE queue_id = @queue_id AND state = 0 AND process_at > @now) AS delayed,
    (SELECT count(*) FROM {schema}.meta WHERE queue_id = @queue_id AND state = 1) AS in_flight,
    (SELECT count(*) FROM {schema}.meta WHERE queue_id = @queue_id AND state = 2) AS failed,
    (SELECT count(*) FROM {schema}.done WHERE queue_id = @queue_id) AS finished,
    (SELECT DATEDIFF_BIG(microsecond, min(enqueued_at), @now) / 1e6 FROM {schema}.meta
      WHERE queue_id = @queue_id AND state = 0 AND process_at <= @now) AS oldest_ready_age_s

-- name: list_failed
SELECT TOP (%(limit)s) m.id, m.priority, m.attempts, m.enqueued_at, m.last_error,
       (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id) AS payload
FROM {schema}.meta m
WHERE m.queue_id = %(queue_id)s AND m.state = 2 AND m.id > %(after_id)s
ORDER BY m.id

-- name: requeue_failed
UPDATE {schema}.meta
SET state = 0, attempts = 0, process_at = SYSUTCDATETIME(), last_error = NULL
OUTPUT inserted.id
WHERE queue_id = %(queue_id)s AND state = 2
  AND (%(all)s = 1 OR id IN (SELECT CAST([value] AS bigint) FROM OPENJSON(%(ids)s)))

-- name: delete_failed
SET NOCOUNT ON;
DECLARE @archive bit = %(archive)s;
DECLARE @gone TABLE (id bigint PRIMARY KEY, queue_id int, priority smallint, attempts int, enqueued_at datetime2(6));
DELETE m
OUTPUT deleted.id, deleted.queue_id, deleted.priority, deleted.attempts, deleted.enqueued_at INTO @gone
FROM {schema}.meta m
WHERE m.queue_id = %(queue_id)s AND m.state = 2
  AND (%(all)s = 1 OR m.id IN (SELECT CAST([value] AS bigint) FROM OPENJSON(%(ids)s)));
IF @archive = 1
    INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome)
    SELECT id, queue_id, priority, attempts, enqueued_at, 2 FROM @gone;
ELSE
    DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM @gone);
SELECT id FROM @gone

-- name: ready_head
-- For observers (sensor, trigger): ready messages of at least min_priority counted up to a cap, and the
-- (id, deliveries) of the message a pop would take first. head_id is NULL when nothing is ready.
SELECT r.ready, h.id AS head_id, h.deliveries AS head_deliveries
FROM (SELECT count(*) AS ready FROM (
        SELECT TOP (%(cap)s) 1 AS one FROM {schema}.meta
        WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= SYSUTCDATETIME()
          AND priority >= %(min_priority)s) s) r
OUTER APPLY (
    SELECT TOP (1) id, deliveries FROM {schema}.meta
    WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= SYSUTCDATETIME()
    ORDER BY priority DESC, process_at, id) h

-- name: leased
-- The leased messages of the given receipts (id, delivery) whose lease is still held, with payloads.
SELECT m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until,
       (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id) AS payload
FROM {schema}.meta m
JOIN (SELECT CAST(i.[value] AS bigint) AS id, CAST(d.[value] AS int) AS delivery
      FROM OPENJSON(%(ids)s) i JOIN OPENJSON(%(deliveries)s) d ON d.[key] = i.[key]) r
  ON m.id = r.id AND m.deliveries = r.delivery
WHERE m.queue_id = %(queue_id)s AND m.lease_until > SYSUTCDATETIME()
ORDER BY m.priority DESC, m.process_at, m.id

-- name: extend_leases
-- Push the lease of held receipts out to now + secs (a long job keeps its claim); all or nothing.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @secs float = %(secs)s;
DECLARE @receipts TABLE (id bigint NOT NULL, delivery int NOT NULL, PRIMARY KEY (id, delivery));
INSERT INTO @receipts (id, delivery)
SELECT CAST(i.[value] AS bigint), CAST(d.[value] AS int)
FROM OPENJSON(%(ids)s) i JOIN OPENJSON(%(deliveries)s) d ON d.[key] = i.[key];
DECLARE @held TABLE (id bigint NOT NULL, delivery int NOT NULL, PRIMARY KEY (id, delivery));
INSERT INTO @held (id, delivery)
SELECT m.id, m.deliveries FROM {schema}.meta m WITH (UPDLOCK, ROWLOCK)
JOIN @receipts r ON m.id = r.id AND m.deliveries = r.delivery
WHERE m.queue_id = %(queue_id)s AND m.lease_until > @now;
DECLARE @extended TABLE (id bigint PRIMARY KEY, lease_until datetime2(6));
DECLARE @wanted int = (SELECT count(*) FROM @receipts);
DECLARE @got int = (SELECT count(*) FROM @held);
IF @got = @wanted
    UPDATE m
    SET lease_until = DATEADD(microsecond, CAST(1e6 * (@secs - FLOOR(@secs)) AS int),
                              DATEADD(second, CAST(FLOOR(@secs) AS int), @now))
    OUTPUT inserted.id, inserted.lease_until INTO @extended
    FROM {schema}.meta m JOIN @held h ON h.id = m.id;
SELECT id, lease_until FROM @extended

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
-- Batches still claimed, oldest first (for operators of the platform and for cleanup).
SELECT TOP (%(limit)s) b.batch_id, b.state,
       N'[' + (SELECT STRING_AGG(CAST(i.id AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS ids,
       N'[' + (SELECT STRING_AGG(CAST(i.delivery AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS deliveries,
       b.consumer, b.claimed_at, b.lease_until, b.finished_at, b.last_error
FROM {schema}.batches b
WHERE b.queue_id = %(queue_id)s AND b.state = 0
ORDER BY b.claimed_at

-- name: batch_rows
-- The messages of one batch with their payloads, numbered 1..n in claim order (ord: a Spark JDBC
-- reader partitions on it). Rendered to text with its parameters for readers in other processes.
SELECT i.ord, i.id, i.delivery, (SELECT d.payload FROM {schema}.data d WHERE d.id = i.id) AS payload
FROM {schema}.batches b
JOIN {schema}.batch_items i ON i.batch_id = b.batch_id
WHERE b.batch_id = %(batch_id)s AND b.queue_id = %(queue_id)s

-- name: reindex_concurrently
-- Rebuild one index of the schema without blocking the queue: ONLINE = ON where the edition allows it
-- (Enterprise, Developer, Azure SQL: EngineEdition 3, 5, 8), REORGANIZE (always online) otherwise,
-- chosen at run time. {index} is the bracket-quoted index name; its table is looked up.
DECLARE @index sysname = PARSENAME(N'{index}', 1);
DECLARE @table sysname = (
    SELECT OBJECT_NAME(i.object_id) FROM sys.indexes i
    WHERE i.name = @index AND OBJECT_SCHEMA_NAME(i.object_id) = PARSENAME(N'{schema}', 1));
DECLARE @target nvarchar(600) = QUOTENAME(@index) + N' ON {schema}.' + QUOTENAME(@table);
DECLARE @sql nvarchar(max) = CASE
    WHEN CAST(SERVERPROPERTY('EngineEdition') AS int) IN (3, 5, 8)
    THEN N'ALTER INDEX ' + @target + N' REBUILD WITH (ONLINE = ON)'
    ELSE N'ALTER INDEX ' + @target + N' REORGANIZE' END;
IF @table IS NOT NULL EXEC sys.sp_executesql @sql
