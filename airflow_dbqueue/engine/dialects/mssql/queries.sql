-- Named queries of the SQL Server dialect, under the names of the PostgreSQL dialect (a test checks the
-- parity; dialect.NOT_YET_PORTED would name any still missing: none). {schema} is the bracket-quoted schema
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

-- name: schema_exists
SELECT CASE WHEN SCHEMA_ID(%(schema)s) IS NULL THEN 0 ELSE 1 END

-- name: create_schema
-- CREATE SCHEMA must be alone in its batch, hence sp_executesql.
EXEC sys.sp_executesql N'CREATE SCHEMA {schema}'

-- name: schema_objects
-- Everything in the schema that DROP SCHEMA would refuse to leave: objects with no parent (constraints
-- and triggers belong to their table), user-defined types and XML schema collections. kind is 'table',
-- 'sequence', 'procedure', 'function', 'view', or SQL Server's own description in lower case.
SELECT CASE o.type WHEN 'U' THEN 'table' WHEN 'SO' THEN 'sequence' WHEN 'P' THEN 'procedure'
                   WHEN 'FN' THEN 'function' WHEN 'IF' THEN 'function' WHEN 'TF' THEN 'function'
                   WHEN 'V' THEN 'view' ELSE lower(o.type_desc) END AS kind,
       o.name, QUOTENAME(s.name) + N'.' + QUOTENAME(o.name) AS identity
FROM sys.objects o JOIN sys.schemas s ON s.schema_id = o.schema_id
WHERE s.name = %(schema)s AND o.parent_object_id = 0
UNION ALL
SELECT 'type', t.name, QUOTENAME(s.name) + N'.' + QUOTENAME(t.name)
FROM sys.types t JOIN sys.schemas s ON s.schema_id = t.schema_id
WHERE s.name = %(schema)s AND t.is_user_defined = 1 AND t.is_table_type = 0
UNION ALL
SELECT 'xml schema collection', x.name, QUOTENAME(s.name) + N'.' + QUOTENAME(x.name)
FROM sys.xml_schema_collections x JOIN sys.schemas s ON s.schema_id = x.schema_id
WHERE s.name = %(schema)s
ORDER BY 1, 2

-- name: owned_ring_sequences
-- The sequences of the schema's rings (ring_create makes two a ring), by name.
SELECT o.name
FROM {schema}.rings r
JOIN sys.objects o ON o.object_id IN (r.push_seq_id, r.gap_seq_id)
WHERE o.schema_id = SCHEMA_ID(%(schema)s)
ORDER BY 1

-- name: owned_objects
SELECT kind, name FROM {schema}.owned_objects ORDER BY kind, name

-- name: record_owned
INSERT INTO {schema}.owned_objects (kind, name)
SELECT k.[value], n.[value]
FROM OPENJSON(%(kinds)s) k
JOIN OPENJSON(%(names)s) n ON n.[key] = k.[key]
WHERE NOT EXISTS (SELECT 1 FROM {schema}.owned_objects w WHERE w.kind = k.[value] AND w.name = n.[value])

-- name: drop_owned_table
-- This and the next three drop one object the engine's catalogue lists. SQL Server drops a table under
-- a view or function that refers to it without schema binding, so those (and foreign keys from other
-- tables) are looked for first: if anything outside the engine's own objects refers to the table, the
-- statement raises [DQ006] and the uninstall fails whole, dropping nothing. The engine's procedures and
-- functions are dropped before its tables.
SET NOCOUNT ON;
DECLARE @found nvarchar(max) = N'';
SELECT @found = @found + N'; ' + QUOTENAME(OBJECT_SCHEMA_NAME(d.referencing_id)) + N'.'
    + QUOTENAME(OBJECT_NAME(d.referencing_id))
FROM sys.sql_expression_dependencies d
WHERE d.referenced_id = OBJECT_ID(N'{schema}.{table}') AND d.referencing_id <> d.referenced_id;
SELECT @found = @found + N'; ' + QUOTENAME(OBJECT_SCHEMA_NAME(f.parent_object_id)) + N'.'
    + QUOTENAME(OBJECT_NAME(f.parent_object_id)) + N' (foreign key ' + QUOTENAME(f.name) + N')'
FROM sys.foreign_keys f
WHERE f.referenced_object_id = OBJECT_ID(N'{schema}.{table}') AND f.parent_object_id <> f.referenced_object_id;
IF @found = N''
    DROP TABLE {schema}.{table};
ELSE
    RAISERROR (N'[DQ006] objects that are not the engine''s refer to %s: %s; nothing was dropped', 16, 1,
        N'{schema}.{table}', @found);

-- name: drop_owned_sequence
DROP SEQUENCE IF EXISTS {schema}.{sequence}

-- name: drop_owned_routine
-- A stored procedure, or a function (the ring's inline table-valued functions), by what it is.
IF OBJECT_ID(N'{schema}.{routine}', N'P') IS NOT NULL
    DROP PROCEDURE {schema}.{routine};
ELSE
    DROP FUNCTION {schema}.{routine};

-- name: drop_owned_schema
-- DROP SCHEMA refuses a schema that still holds anything.
DROP SCHEMA {schema}

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
-- The columns of client._SETTINGS_COLUMNS, in order (a unit test checks both dialects).
SELECT queue_id, name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
       retry_backoff_s, retry_backoff_max_s, notify, archive,
       (SELECT r.capacity FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS capacity,
       (SELECT r.lanes FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS lanes
FROM {schema}.queues q WHERE name = %(name)s

-- name: list_queues
SELECT queue_id, name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
       retry_backoff_s, retry_backoff_max_s, notify, archive,
       (SELECT r.capacity FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS capacity,
       (SELECT r.lanes FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS lanes
FROM {schema}.queues q ORDER BY name

-- name: drop_queue_lock
-- A drop runs in one transaction, in four statements, as on PostgreSQL: first the queue's push lock,
-- exclusively (a push takes it shared), so it waits for the pushes in progress and keeps new ones out
-- until it commits.
SET NOCOUNT ON;
DECLARE @resource nvarchar(255) = N'dbqueue.queue.{schema}.' + CAST(%(queue_id)s AS nvarchar(11));
DECLARE @locked int;
EXEC @locked = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Transaction',
    @LockTimeout = -1;
IF @locked < 0
    RAISERROR (N'[DQ007] the push lock of queue %s was not granted (sp_getapplock returned %d: a deadlock victim)',
        16, 1, @resource, @locked)

-- name: drop_queue_messages
-- Then the queue's messages with their payloads (rows a pop, ack, nack or claim holds are waited for).
SET NOCOUNT ON;
DECLARE @queue_id int = %(queue_id)s;
DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM {schema}.meta WHERE queue_id = @queue_id);
DELETE FROM {schema}.meta WHERE queue_id = @queue_id

-- name: drop_queue_finished
-- Then its finished messages and their payloads (an archiver batch holding some is waited for).
SET NOCOUNT ON;
DECLARE @queue_id int = %(queue_id)s;
DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM {schema}.done WHERE queue_id = @queue_id);
DELETE FROM {schema}.done WHERE queue_id = @queue_id

-- name: drop_queue
SET NOCOUNT ON;
DECLARE @queue_id int = %(queue_id)s;
DELETE FROM {schema}.archive WHERE queue_id = @queue_id;
DELETE i FROM {schema}.batch_items i
WHERE i.batch_id IN (SELECT batch_id FROM {schema}.batches WHERE queue_id = @queue_id);
DELETE FROM {schema}.batches WHERE queue_id = @queue_id;
DELETE q OUTPUT deleted.queue_id FROM {schema}.queues q WHERE q.queue_id = @queue_id

-- name: push
-- One round trip a batch. payloads is a JSON array of hex strings (CONVERT style 2 turns one into
-- varbinary); ids come from the sequence in payload order. The queue's push lock, shared and held to
-- the end of the transaction, makes a push and a drop of its queue serialize (drop_queue_lock); the
-- queue is then read by a later statement (under read committed snapshot too, with a snapshot taken
-- after the lock), so a push that waited for a drop finds it gone and writes nothing. Under SNAPSHOT
-- isolation in a caller's transaction the read is the transaction's snapshot, which may predate the drop.
-- notify and channel are not used: SQL Server has no NOTIFY (waiting pops poll).
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @delay_s float = %(delay_s)s;
DECLARE @resource nvarchar(255) = N'dbqueue.queue.{schema}.' + CAST(%(queue_id)s AS nvarchar(11));
DECLARE @locked int;
EXEC @locked = sys.sp_getapplock @Resource = @resource, @LockMode = 'Shared', @LockOwner = 'Transaction',
    @LockTimeout = -1;
IF @locked < 0
    RAISERROR (N'[DQ007] the push lock of queue %s was not granted (sp_getapplock returned %d: a deadlock victim)',
        16, 1, @resource, @locked);
DECLARE @input TABLE (ord int PRIMARY KEY, id bigint NOT NULL, payload varbinary(max) NOT NULL);
INSERT INTO @input (ord, id, payload)
SELECT CAST(p.[key] AS int), NEXT VALUE FOR {schema}.message_id_seq OVER (ORDER BY CAST(p.[key] AS int)),
       CONVERT(varbinary(max), p.[value], 2)
FROM OPENJSON(%(payloads)s) p
WHERE @locked >= 0 AND EXISTS (SELECT 1 FROM {schema}.queues WHERE queue_id = %(queue_id)s);
INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at, payload)
SELECT id, %(queue_id)s, %(priority)s,
       DATEADD(microsecond, CAST(1e6 * (@delay_s - FLOOR(@delay_s)) AS int),
               DATEADD(second, CAST(FLOOR(@delay_s) AS int), @now)), @now,
       CASE WHEN DATALENGTH(payload) <= 1900 THEN CONVERT(varbinary(1900), payload) END
FROM @input;
INSERT INTO {schema}.data (id, payload) SELECT id, payload FROM @input WHERE DATALENGTH(payload) > 1900;
SELECT id FROM @input ORDER BY ord

-- name: pop_lease
-- at-least-once: claim up to n ready messages and lease them. The CTE takes the head of the ready index
-- with ROWLOCK, READPAST, UPDLOCK (rows other consumers hold are skipped, never waited for, as in Al Zabir's queue),
-- and the UPDATE through it claims exactly those rows. Payloads are read after the claim, by id.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @vt float = %(visibility_timeout_s)s;
DECLARE @until datetime2(6) = DATEADD(microsecond, CAST(1e6 * (@vt - FLOOR(@vt)) AS int),
                                      DATEADD(second, CAST(FLOOR(@vt) AS int), @now));
DECLARE @claimed TABLE (
    id bigint PRIMARY KEY, priority smallint, attempts int, deliveries int, process_at datetime2(6),
    enqueued_at datetime2(6), lease_until datetime2(6), payload varbinary(1900));
WITH head AS (
    SELECT TOP (%(n)s) id, state, attempts, deliveries, consumer, lease_until, priority, process_at, enqueued_at,
           payload
    FROM {schema}.meta WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= @now
    ORDER BY priority DESC, process_at, id)
UPDATE head
SET state = 1, attempts = attempts + 1, deliveries = deliveries + 1, consumer = %(consumer)s, lease_until = @until
OUTPUT inserted.id, inserted.priority, inserted.attempts, inserted.deliveries, inserted.process_at,
       inserted.enqueued_at, inserted.lease_until, inserted.payload
INTO @claimed;
SELECT c.id, c.priority, c.attempts, c.deliveries, c.enqueued_at, c.lease_until,
       coalesce(CONVERT(varbinary(max), c.payload), (SELECT d.payload FROM {schema}.data d WHERE d.id = c.id))
           AS payload
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
    process_at datetime2(6), enqueued_at datetime2(6), payload varbinary(max), in_row bit);
WITH head AS (
    SELECT TOP (%(n)s) id, queue_id, priority, attempts, deliveries, process_at, enqueued_at, payload
    FROM {schema}.meta WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= @now
    ORDER BY priority DESC, process_at, id)
DELETE FROM head
OUTPUT deleted.id, deleted.queue_id, deleted.priority, deleted.attempts + 1, deleted.deliveries + 1,
       deleted.process_at, deleted.enqueued_at, deleted.payload,
       CASE WHEN deleted.payload IS NULL THEN 0 ELSE 1 END
INTO @taken;
UPDATE t SET payload = d.payload FROM @taken t JOIN {schema}.data d ON d.id = t.id WHERE t.in_row = 0;
IF @archive = 1
    INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload)
    SELECT id, queue_id, priority, attempts, enqueued_at, 1, CASE WHEN in_row = 1 THEN payload END FROM @taken;
ELSE
    DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM @taken WHERE in_row = 0);
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
DECLARE @acked TABLE (
    id bigint PRIMARY KEY, queue_id int, priority smallint, attempts int, enqueued_at datetime2(6),
    payload varbinary(1900));
DECLARE @wanted int = (SELECT count(*) FROM @receipts);
DECLARE @got int = (SELECT count(*) FROM @held);
IF @got = @wanted
BEGIN
    DELETE m
    OUTPUT deleted.id, deleted.queue_id, deleted.priority, deleted.attempts, deleted.enqueued_at,
           deleted.payload INTO @acked
    FROM {schema}.meta m JOIN @held h ON h.id = m.id;
    IF @archive = 1
        INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload)
        SELECT id, queue_id, priority, attempts, enqueued_at, 1, payload FROM @acked;
    ELSE
        DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM @acked WHERE payload IS NULL);
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
       coalesce(CONVERT(varbinary(max), m.payload), (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id))
           AS payload
FROM {schema}.meta m
WHERE m.queue_id = %(queue_id)s AND m.state = 0 AND m.process_at <= SYSUTCDATETIME()
ORDER BY m.priority DESC, m.process_at, m.id

-- name: count_ready
-- Messages a pop could take now, of at least min_priority, counted up to a cap (a sensor needs "at
-- least k", not a total): those ready, and those whose lease expired with attempts left, which a pop
-- reclaims first (back to ready in their place). An expired lease out of attempts goes to failed.
SELECT count(*) FROM (
    SELECT TOP (%(cap)s) 1 AS one FROM (
        SELECT TOP (%(cap)s) 1 AS one FROM {schema}.meta
        WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= SYSUTCDATETIME()
          AND priority >= %(min_priority)s
        UNION ALL
        SELECT TOP (%(cap)s) 1 AS one FROM {schema}.meta
        WHERE queue_id = %(queue_id)s AND state = 1 AND lease_until <= SYSUTCDATETIME()
          AND attempts < %(max_attempts)s AND priority >= %(min_priority)s) u) s

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
       coalesce(CONVERT(varbinary(max), m.payload), (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id))
           AS payload
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
DECLARE @gone TABLE (
    id bigint PRIMARY KEY, queue_id int, priority smallint, attempts int, enqueued_at datetime2(6),
    payload varbinary(1900));
DELETE m
OUTPUT deleted.id, deleted.queue_id, deleted.priority, deleted.attempts, deleted.enqueued_at, deleted.payload
INTO @gone
FROM {schema}.meta m
WHERE m.queue_id = %(queue_id)s AND m.state = 2
  AND (%(all)s = 1 OR m.id IN (SELECT CAST([value] AS bigint) FROM OPENJSON(%(ids)s)));
IF @archive = 1
    INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload)
    SELECT id, queue_id, priority, attempts, enqueued_at, 2, payload FROM @gone;
ELSE
    DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM @gone WHERE payload IS NULL);
SELECT id FROM @gone

-- name: ready_head
-- For observers (sensor, trigger): what a pop could take now (as count_ready: ready messages and
-- expired leases with attempts left) of at least min_priority, counted up to a cap, and the
-- (id, deliveries) of the message a pop would take first. head_id is NULL when nothing is ready. A
-- reclaim keeps a message's place (process_at) and deliveries, so an expired lease is the head it will
-- be once reclaimed.
SELECT r.ready, h.id AS head_id, h.deliveries AS head_deliveries
FROM (SELECT count(*) AS ready FROM (
        SELECT TOP (%(cap)s) 1 AS one FROM (
            SELECT TOP (%(cap)s) 1 AS one FROM {schema}.meta
            WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= SYSUTCDATETIME()
              AND priority >= %(min_priority)s
            UNION ALL
            SELECT TOP (%(cap)s) 1 AS one FROM {schema}.meta
            WHERE queue_id = %(queue_id)s AND state = 1 AND lease_until <= SYSUTCDATETIME()
              AND attempts < %(max_attempts)s AND priority >= %(min_priority)s) u) s) r
OUTER APPLY (
    SELECT TOP (1) c.id, c.deliveries FROM (
        SELECT a.id, a.deliveries, a.priority, a.process_at FROM (
            SELECT TOP (1) id, deliveries, priority, process_at FROM {schema}.meta
            WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= SYSUTCDATETIME()
            ORDER BY priority DESC, process_at, id) a
        UNION ALL
        SELECT b.id, b.deliveries, b.priority, b.process_at FROM (
            SELECT TOP (1) id, deliveries, priority, process_at FROM {schema}.meta
            WHERE queue_id = %(queue_id)s AND state = 1 AND lease_until <= SYSUTCDATETIME()
              AND attempts < %(max_attempts)s
            ORDER BY priority DESC, process_at, id) b) c
    ORDER BY c.priority DESC, c.process_at, c.id) h

-- name: leased
-- The leased messages of the given receipts (id, delivery) whose lease is still held, with payloads.
SELECT m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until,
       coalesce(CONVERT(varbinary(max), m.payload), (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id))
           AS payload
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

-- name: maintenance_try_lock
-- Maintenance (engine/maintenance/, and this dialect's maintenance.py) from here on.
-- One maintenance run a schema at a time: an application lock owned by the session (not a transaction)
-- of the run's own connection, so it holds across the run's transactions and goes when the connection
-- closes, whatever happened. @LockTimeout = 0: answer at once (the caller polls up to lock_wait_s).
-- Only the first 32 characters of a lock's name can be read back (sys.dm_tran_locks), so the name is
-- 'dbqueue.maint.' and 18 hex digits of the SHA-256 of the schema name: unique per schema and findable.
SET NOCOUNT ON;
DECLARE @resource nvarchar(32) = N'dbqueue.maint.'
    + LEFT(CONVERT(nvarchar(64), HASHBYTES('SHA2_256', CAST(%(schema)s AS nvarchar(128))), 2), 18);
DECLARE @got int;
EXEC @got = sys.sp_getapplock @Resource = @resource, @LockMode = N'Exclusive', @LockOwner = N'Session',
    @LockTimeout = 0, @DbPrincipal = N'public';
SELECT CASE WHEN @got >= 0 THEN 1 ELSE 0 END

-- name: maintenance_unlock
SET NOCOUNT ON;
DECLARE @resource nvarchar(32) = N'dbqueue.maint.'
    + LEFT(CONVERT(nvarchar(64), HASHBYTES('SHA2_256', CAST(%(schema)s AS nvarchar(128))), 2), 18);
DECLARE @released int;
EXEC @released = sys.sp_releaseapplock @Resource = @resource, @LockOwner = N'Session', @DbPrincipal = N'public';
SELECT CASE WHEN @released = 0 THEN 1 ELSE 0 END

-- name: maintenance_lock_holder
-- Who holds a schema's maintenance lock (for the log line of a run that skips or waits). Needs VIEW
-- SERVER STATE to see other sessions; without it the run says "holder unknown" and skips all the same.
SET NOCOUNT ON;
DECLARE @resource nvarchar(32) = N'dbqueue.maint.'
    + LEFT(CONVERT(nvarchar(64), HASHBYTES('SHA2_256', CAST(%(schema)s AS nvarchar(128))), 2), 18);
SELECT TOP (1) s.session_id, s.program_name, c.client_net_address,
       DATEDIFF_BIG(millisecond, s.login_time, GETDATE()) / 1e3 AS connected_s, s.status
FROM sys.dm_tran_locks l
JOIN sys.dm_exec_sessions s ON s.session_id = l.request_session_id
LEFT JOIN sys.dm_exec_connections c ON c.session_id = s.session_id AND c.parent_connection_id IS NULL
WHERE l.resource_type = N'APPLICATION' AND l.resource_database_id = DB_ID()
  AND l.request_owner_type = N'SESSION' AND l.request_status = N'GRANT'
  AND CHARINDEX(@resource, l.resource_description) > 0

-- name: set_timeouts
-- SET LOCK_TIMEOUT takes a constant: neither a variable nor a bound parameter. And a SET run inside
-- dynamic SQL (sp_executesql) is undone when that batch returns, and a batch with parameters reaches
-- the server the same way (sp_executesql or a prepared statement). So the dialect writes lock_ms into this text as an integer it has validated
-- (MssqlDatabase.statement, never a caller's string), and the text goes as a plain batch without
-- parameters: the setting then holds for the rest of the session, the maintenance run's own connection. The statement timeout is the driver's query timeout
-- (SQL_ATTR_QUERY_TIMEOUT, whole seconds), set on the connection by MssqlDatabase.set_timeouts.
SET LOCK_TIMEOUT %(lock_ms)s

-- name: reset_timeouts
-- Back to the session's default (wait for locks without limit); the query timeout goes back to 0 with it.
SET LOCK_TIMEOUT -1

-- name: archive_batch
-- Continuous archiving, one bounded batch a round trip, in one short transaction (the dialect's): up to n
-- finished messages older than older_than_s leave done (oldest first: done is clustered on finished_at)
-- with ROWLOCK, READPAST, UPDLOCK, so rows other sessions hold are skipped and never waited for, and the
-- rows push, pop and ack write are the newest ones, at the other end. Their payloads move from data into
-- archive with them; a done row whose payload is missing is archived with an empty one rather than lost,
-- and one of a queue that no longer exists is deleted, not archived. Returns (rows taken, rows archived).
-- (T-SQL could write DELETE ... OUTPUT ... INTO {schema}.archive (...) straight from data, but the
-- offline check cannot parse a schema-qualified OUTPUT INTO target, so the rows go through @batch.)
-- older_than_s is capped at 6e10 s (1,900 years, older than any row) so that DATEADD cannot overflow.
SET NOCOUNT ON;
DECLARE @s float = CASE WHEN %(older_than_s)s > 6e10 THEN 6e10 ELSE %(older_than_s)s END;
DECLARE @days int = FLOOR(@s / 86400);
DECLARE @rest float = @s - 86400.0 * @days;
DECLARE @cutoff datetime2(6) = DATEADD(microsecond, -CAST(1e6 * (@rest - FLOOR(@rest)) AS int),
    DATEADD(second, -CAST(FLOOR(@rest) AS int), DATEADD(day, -@days, SYSUTCDATETIME())));
DECLARE @all bit = %(all_queues)s;
DECLARE @queues TABLE (queue_id int PRIMARY KEY);
INSERT INTO @queues (queue_id) SELECT DISTINCT CAST([value] AS int) FROM OPENJSON(%(queue_ids)s);
DECLARE @batch TABLE (
    id bigint PRIMARY KEY, queue_id int, priority smallint, attempts int, enqueued_at datetime2(6),
    finished_at datetime2(6), outcome tinyint, payload varbinary(1900));
WITH old AS (
    SELECT TOP (%(n)s) id, queue_id, priority, attempts, enqueued_at, finished_at, outcome, payload
    FROM {schema}.done WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE finished_at < @cutoff AND (@all = 1 OR queue_id IN (SELECT queue_id FROM @queues))
    ORDER BY finished_at)
DELETE FROM old
OUTPUT deleted.id, deleted.queue_id, deleted.priority, deleted.attempts, deleted.enqueued_at,
       deleted.finished_at, deleted.outcome, deleted.payload
INTO @batch;
INSERT INTO {schema}.archive (id, queue_id, priority, attempts, enqueued_at, finished_at, outcome, payload)
SELECT b.id, b.queue_id, b.priority, b.attempts, b.enqueued_at, b.finished_at, b.outcome,
       coalesce(CONVERT(varbinary(max), b.payload), x.payload, 0x)
FROM @batch b LEFT JOIN {schema}.data x ON x.id = b.id
WHERE EXISTS (SELECT 1 FROM {schema}.queues q WHERE q.queue_id = b.queue_id);
DECLARE @archived int = @@ROWCOUNT;
DELETE x FROM {schema}.data x WHERE x.id IN (SELECT id FROM @batch WHERE payload IS NULL);
SELECT count(*), @archived FROM @batch

-- name: purge_archive_batch
-- Archive retention, one bounded batch a round trip: delete up to n archived messages older than
-- older_than_s, oldest first (archive is clustered on archived_at), skipping rows other sessions hold.
SET NOCOUNT ON;
DECLARE @s float = CASE WHEN %(older_than_s)s > 6e10 THEN 6e10 ELSE %(older_than_s)s END;
DECLARE @days int = FLOOR(@s / 86400);
DECLARE @rest float = @s - 86400.0 * @days;
DECLARE @cutoff datetime2(6) = DATEADD(microsecond, -CAST(1e6 * (@rest - FLOOR(@rest)) AS int),
    DATEADD(second, -CAST(FLOOR(@rest) AS int), DATEADD(day, -@days, SYSUTCDATETIME())));
DECLARE @all bit = %(all_queues)s;
DECLARE @queues TABLE (queue_id int PRIMARY KEY);
INSERT INTO @queues (queue_id) SELECT DISTINCT CAST([value] AS int) FROM OPENJSON(%(queue_ids)s);
WITH old AS (
    SELECT TOP (%(n)s) id FROM {schema}.archive WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE archived_at < @cutoff AND (@all = 1 OR queue_id IN (SELECT queue_id FROM @queues))
    ORDER BY archived_at)
DELETE FROM old;
SELECT @@ROWCOUNT

-- name: vacuum_table
-- SQL Server has no VACUUM: the rows a DELETE leaves (ghost records) are removed by the server's own
-- ghost cleanup task, and there is nothing for a client to run. What VACUUM (ANALYZE) also does, fresh
-- statistics, is UPDATE STATISTICS (default sampling). This and the next three take a table or index name
-- as an identifier placeholder, bracket-quoted after validation: utility statements take no parameters.
UPDATE STATISTICS {schema}.{table}

-- name: analyze_table
UPDATE STATISTICS {schema}.{table}

-- name: reindex_concurrently
-- Rebuild one index of the schema without blocking the queue. online = 1 (the maintenance code decides
-- from SERVERPROPERTY('EngineEdition'), read at run time by index_health: 3 Enterprise/Developer,
-- 5 Azure SQL Database, 8 Managed Instance): ALTER INDEX ... REBUILD WITH (ONLINE = ON), whose short
-- schema lock at the end waits at low priority, so that pushes and pops do not queue behind it, for at
-- most max_duration_min minutes, and then gives up (ABORT_AFTER_WAIT = SELF). online = 0: REORGANIZE,
-- which every edition runs online (page locks only). Returns the statement run, or NULL when the index
-- is not on that table of the schema (nothing run).
SET NOCOUNT ON;
DECLARE @schema sysname = PARSENAME(N'{schema}', 1);
DECLARE @table sysname = PARSENAME(N'{table}', 1);
DECLARE @index sysname = PARSENAME(N'{index}', 1);
DECLARE @online bit = %(online)s;
DECLARE @minutes int = %(max_duration_min)s;
DECLARE @found int = (
    SELECT count(*) FROM sys.indexes i
    WHERE i.object_id = OBJECT_ID(QUOTENAME(@schema) + N'.' + QUOTENAME(@table)) AND i.name = @index);
DECLARE @sql nvarchar(max) = N'ALTER INDEX ' + QUOTENAME(@index) + N' ON ' + QUOTENAME(@schema) + N'.'
    + QUOTENAME(@table) + CASE WHEN @online = 1
        THEN N' REBUILD WITH (ONLINE = ON (WAIT_AT_LOW_PRIORITY (MAX_DURATION = '
             + CAST(@minutes AS nvarchar(10)) + N' MINUTES, ABORT_AFTER_WAIT = SELF)))'
        ELSE N' REORGANIZE' END;
IF @found = 1 BEGIN EXEC sys.sp_executesql @sql END;
SELECT CASE WHEN @found = 1 THEN @sql END AS statement

-- name: drop_index_concurrently
-- Not run by maintenance on SQL Server: PostgreSQL needs it for the INVALID index a failed REINDEX
-- CONCURRENTLY leaves, but a failed ALTER INDEX ... REBUILD rolls back and leaves no half-built index,
-- so there is nothing to clean (the rebuild report says so). Here under the same name for the parity
-- of names, as the plain statement an operator would run.
DROP INDEX IF EXISTS {index} ON {schema}.{table}

-- name: index_health
-- Every index of the schema's tables (rowstore: clustered and nonclustered) with its size (used pages,
-- all levels, LOB included), the leaf level's page density and logical fragmentation, entries and page
-- count from sys.dm_db_index_physical_stats in SAMPLED mode (every page below 10,000 pages, 1% above),
-- its fill factor, the engine edition (whether ONLINE rebuilds exist), and whether an index operation
-- (CREATE or ALTER INDEX, REORGANIZE and other DBCC) runs in this database or a resumable one is paused
-- on the table: never start a rebuild next to one. Needs VIEW DATABASE STATE (VIEW SERVER STATE to see
-- other sessions' index operations).
SET NOCOUNT ON;
DECLARE @edition int = CAST(SERVERPROPERTY('EngineEdition') AS int);
DECLARE @operations int = (
    SELECT count(*) FROM sys.dm_exec_requests r
    WHERE r.database_id = DB_ID() AND r.session_id <> @@SPID
      AND r.command IN (N'CREATE INDEX', N'ALTER INDEX', N'DBCC'));
SELECT i.name, t.name AS table_name, lower(i.type_desc) AS method,
       CASE WHEN i.is_disabled = 1 THEN 0 ELSE 1 END AS valid,
       coalesce((SELECT sum(p.used_page_count) FROM sys.dm_db_partition_stats p
                 WHERE p.object_id = i.object_id AND p.index_id = i.index_id), 0) * CAST(8192 AS bigint) AS size_bytes,
       ps.entries, ps.leaf_pages, ps.fragmentation_pct, ps.page_density_pct,
       CASE WHEN i.fill_factor = 0 THEN 100 ELSE i.fill_factor END AS fill_factor,
       @edition AS engine_edition,
       CASE WHEN @operations > 0 OR EXISTS (
                SELECT 1 FROM sys.index_resumable_operations o WHERE o.object_id = i.object_id)
            THEN 1 ELSE 0 END AS build_running
FROM sys.indexes i
JOIN sys.tables t ON t.object_id = i.object_id
OUTER APPLY (
    SELECT sum(s.record_count) AS entries, sum(s.page_count) AS leaf_pages,
           max(s.avg_fragmentation_in_percent) AS fragmentation_pct,
           max(s.avg_page_space_used_in_percent) AS page_density_pct
    FROM sys.dm_db_index_physical_stats(DB_ID(), i.object_id, i.index_id, NULL, 'SAMPLED') s
    WHERE s.index_level = 0 AND s.alloc_unit_type_desc = N'IN_ROW_DATA') ps
WHERE t.schema_id = SCHEMA_ID(%(schema)s) AND i.type IN (1, 2)
ORDER BY t.name, i.name

-- name: table_health
-- Size and row count of every table of the schema (sys.dm_db_partition_stats: the table is its heap or
-- clustered index, LOB pages included; indexes are the others). SQL Server keeps no count of dead rows
-- (ghost records are its cleanup task's business) and has no VACUUM: those columns are NULL. last_analyze
-- is the newest statistics update of the table, converted from the server's local time to UTC.
SET NOCOUNT ON;
DECLARE @tz int = DATEPART(TZOFFSET, SYSDATETIMEOFFSET());
SELECT t.name,
       sum(CASE WHEN p.index_id IN (0, 1) THEN p.used_page_count ELSE 0 END) * CAST(8192 AS bigint) AS table_bytes,
       sum(CASE WHEN p.index_id > 1 THEN p.used_page_count ELSE 0 END) * CAST(8192 AS bigint) AS index_bytes,
       sum(p.used_page_count) * CAST(8192 AS bigint) AS total_bytes,
       sum(CASE WHEN p.index_id IN (0, 1) THEN p.row_count ELSE 0 END) AS live_rows,
       CAST(NULL AS bigint) AS dead_rows,
       CAST(NULL AS datetime2(6)) AS last_vacuum,
       (SELECT DATEADD(minute, -@tz, max(STATS_DATE(st.object_id, st.stats_id)))
          FROM sys.stats st WHERE st.object_id = t.object_id) AS last_analyze,
       CAST(NULL AS bigint) AS autovacuum_count,
       CAST(NULL AS bigint) AS vacuum_count
FROM sys.tables t
JOIN sys.dm_db_partition_stats p ON p.object_id = t.object_id
WHERE t.schema_id = SCHEMA_ID(%(schema)s)
GROUP BY t.object_id, t.name
ORDER BY t.name

-- name: xmin_holders
-- What holds back cleanup on SQL Server (there is no xmin horizon): transactions open longer than
-- min_age_s that touched this database (the log cannot be truncated past them, and the rows they hold
-- stay), and snapshot transactions of any database older than that (with snapshot isolation or RCSI,
-- row versions and the ghost records they need stay while one runs). Same columns as PostgreSQL's; xid_age
-- is NULL (SQL Server has no transaction-id age, so min_xid_age is not used). Times are converted from
-- the server's local time to UTC. Needs VIEW SERVER STATE to see other sessions.
SET NOCOUNT ON;
DECLARE @min_age_ms float = 1000 * %(min_age_s)s;
DECLARE @tz int = DATEPART(TZOFFSET, SYSDATETIMEOFFSET());
SELECT CASE WHEN v.transaction_id IS NULL THEN N'transaction' ELSE N'snapshot transaction' END AS kind,
       s.session_id, coalesce(s.program_name, N'') AS name, s.login_name, s.status,
       DATEDIFF_BIG(millisecond, a.transaction_begin_time, GETDATE()) / 1e3 AS age_s,
       CAST(NULL AS bigint) AS xid_age,
       DATEADD(minute, -@tz, a.transaction_begin_time) AS xact_start,
       DATEADD(minute, -@tz, s.last_request_start_time) AS query_start,
       LEFT(q.text, 200) AS query
FROM sys.dm_tran_session_transactions x
JOIN sys.dm_tran_active_transactions a ON a.transaction_id = x.transaction_id
JOIN sys.dm_exec_sessions s ON s.session_id = x.session_id
LEFT JOIN sys.dm_tran_active_snapshot_database_transactions v ON v.transaction_id = x.transaction_id
LEFT JOIN sys.dm_exec_connections c ON c.session_id = s.session_id AND c.parent_connection_id IS NULL
OUTER APPLY sys.dm_exec_sql_text(c.most_recent_sql_handle) q
WHERE x.session_id <> @@SPID
  AND DATEDIFF_BIG(millisecond, a.transaction_begin_time, GETDATE()) >= @min_age_ms
  AND (v.transaction_id IS NOT NULL OR EXISTS (
        SELECT 1 FROM sys.dm_tran_database_transactions d
        WHERE d.transaction_id = x.transaction_id AND d.database_id = DB_ID()))
ORDER BY 6 DESC

-- name: queue_rates
-- Messages pushed and finished in the last window_s seconds, counted from the tables as on PostgreSQL: a
-- message pushed in the window is in meta, done or archive with a recent enqueued_at (finished_at and
-- archived_at are later still, and done and archive are clustered on them, which narrows the scans).
SET NOCOUNT ON;
DECLARE @queue_id int = %(queue_id)s;
DECLARE @s float = CASE WHEN %(window_s)s > 6e10 THEN 6e10 ELSE %(window_s)s END;
DECLARE @days int = FLOOR(@s / 86400);
DECLARE @rest float = @s - 86400.0 * @days;
DECLARE @since datetime2(6) = DATEADD(microsecond, -CAST(1e6 * (@rest - FLOOR(@rest)) AS int),
    DATEADD(second, -CAST(FLOOR(@rest) AS int), DATEADD(day, -@days, SYSUTCDATETIME())));
SELECT
    (SELECT count_big(*) FROM {schema}.meta WHERE queue_id = @queue_id AND enqueued_at > @since)
    + (SELECT count_big(*) FROM {schema}.done
        WHERE queue_id = @queue_id AND finished_at > @since AND enqueued_at > @since)
    + (SELECT count_big(*) FROM {schema}.archive
        WHERE queue_id = @queue_id AND archived_at > @since AND enqueued_at > @since) AS pushed,
    (SELECT count_big(*) FROM {schema}.done
      WHERE queue_id = @queue_id AND finished_at > @since AND outcome = 1)
    + (SELECT count_big(*) FROM {schema}.archive
        WHERE queue_id = @queue_id AND archived_at > @since AND finished_at > @since AND outcome = 1)
      AS finished


-- name: ring_create
-- The ring design (schema.sql states its invariants). Push, take, pop, settle, reclaim and the gap
-- recovery are stored procedures, the receipts' leases and the observers' view inline functions
-- (ring_held, ring_ready); the statements below call them. Number x of a ring lives in slot x % capacity,
-- so a receipt finds its slot with one primary-key probe. The schema name is the procedure's own
-- (PostgreSQL's ring_create is given it). group: the key (gid) of a consumer group's rows in ring_lanes,
-- ring_leases, ring_retry and ring_failed, which is the ring's queue_id for its default group
-- (ring_groups).
EXEC {schema}.ring_create @queue_id = %(queue_id)s, @capacity = %(capacity)s, @slot_bytes = %(slot_bytes)s,
    @lanes = %(lanes)s

-- name: ring_drop
EXEC {schema}.ring_drop @queue_id = %(queue_id)s

-- name: ring_push
-- payloads: a JSON array of hex strings. The first number, or NULL when the ring is full for the batch
-- before anything was taken. SQL Server has no NOTIFY: notify and channel are not used.
SET NOCOUNT ON;
DECLARE @num bigint;
DECLARE @written bit;
EXEC {schema}.ring_push @queue_id = %(queue_id)s, @cap = %(capacity)s, @payloads = %(payloads)s, @payload = NULL,
    @timeout_s = %(timeout_s)s, @first = %(first)s, @once = 0, @num = @num OUTPUT, @written = @written OUTPUT;
SELECT @num

-- name: ring_push_one
-- The number, negated when it was not written, as on PostgreSQL: a push of one that takes its number
-- and tries its slot once; when the slot is not free yet, the number stays issued and unwritten and the
-- caller writes it with ring_push (first), which waits.
SET NOCOUNT ON;
DECLARE @num bigint;
DECLARE @written bit;
EXEC {schema}.ring_push @queue_id = %(queue_id)s, @cap = %(capacity)s, @payloads = NULL, @payload = %(payload)s,
    @timeout_s = 0, @first = NULL, @once = 1, @num = @num OUTPUT, @written = @written OUTPUT;
SELECT CASE WHEN @written = 1 THEN @num ELSE -@num END AS r_num

-- name: ring_floor
-- The ring's floor, or NULL when its reads stay locked (ring_floor_try). PostgreSQL's pushes of one take
-- it from their caller; SQL Server's ring_push reads the floor itself under its own locks.
SET NOCOUNT ON;
DECLARE @floor bigint;
EXEC {schema}.ring_floor_try @queue_id = %(queue_id)s, @floor = @floor OUTPUT;
SELECT @floor AS r_floor

-- name: ring_take
-- The fast path of a pop at most once (schema.sql): messages from the lanes, nothing when messages to
-- deliver again are due (ring_pop serves those first). Its rows are ring_pop's messages (PostgreSQL's
-- query sends three of their columns; the engine reads either). wait: when other pops hold every lane,
-- wait for them (not in a caller's transaction), 1 s at most (then error 1222).
EXEC {schema}.ring_take @queue_id = %(queue_id)s, @cap = %(capacity)s, @lanes = %(lanes)s, @n = %(n)s,
    @lease = %(lease)s, @vt = %(visibility_timeout_s)s, @consumer = %(consumer)s, @retries = 1,
    @wait = %(wait)s

-- name: ring_take_lease
-- ring_take at least once: its messages leased until their lease_until.
EXEC {schema}.ring_take @queue_id = %(queue_id)s, @cap = %(capacity)s, @lanes = %(lanes)s, @n = %(n)s,
    @lease = %(lease)s, @vt = %(visibility_timeout_s)s, @consumer = %(consumer)s, @retries = 1,
    @wait = %(wait)s

-- name: ring_pop
-- The messages, then the last row (r_id NULL): the gap at the head, the issued position and the push
-- lanes still to be seen unlocked (a JSON array).
EXEC {schema}.ring_pop @queue_id = %(queue_id)s, @cap = %(capacity)s, @lanes = %(lanes)s, @n = %(n)s,
    @lease = %(lease)s, @vt = %(visibility_timeout_s)s, @consumer = %(consumer)s, @own = %(own)s,
    @gap = %(gap)s, @gap_issued = %(gap_issued)s, @gap_snap = %(gap_snap)s, @force = %(force)s

-- name: ring_unwritten
-- Maintenance's gap recovery, first step: the push position, and whether any number up to it is issued
-- but unwritten while its slot is free for it (the slot holds the number a capacity before it, below the
-- floor; slots a push holds are read past). A full scan of the ring's slots. The push lanes
-- (ring_snapshot) are listed by a later statement.
SET NOCOUNT ON;
DECLARE @queue_id int = %(queue_id)s;
DECLARE @floor bigint;
EXEC {schema}.ring_floor @queue_id = @queue_id, @floor = @floor OUTPUT;
SELECT i.issued,
       CASE WHEN EXISTS (
           SELECT 1 FROM {schema}.ring_slots t WITH (READCOMMITTEDLOCK, READPAST)
           WHERE t.queue_id = r.queue_id AND t.seq + r.capacity <= i.issued AND t.seq < @floor) THEN 1 ELSE 0 END
FROM {schema}.rings r
CROSS APPLY (
    SELECT coalesce((
        SELECT CAST(q.current_value AS bigint) FROM sys.sequences q WHERE q.object_id = r.push_seq_id), 0) AS issued
) i
WHERE r.queue_id = @queue_id

-- name: ring_snapshot
-- The gap proof's snapshot on SQL Server: the ring's push lanes that other transactions hold locked now,
-- as a JSON array (PostgreSQL's lists the transactions holding their transactionid lock).
SET NOCOUNT ON;
DECLARE @held nvarchar(max);
EXEC {schema}.ring_push_lanes_held @queue_id = %(queue_id)s, @of = NULL, @held = @held OUTPUT;
SELECT @held

-- name: ring_skip_abandoned
EXEC {schema}.ring_skip_abandoned @queue_id = %(queue_id)s, @issued = %(issued)s, @snap = %(snap)s

-- name: ring_pass
-- Lanes moved over given-up numbers at their heads (schema.sql), after maintenance gave gaps up: how many.
SET NOCOUNT ON;
DECLARE @moved int;
EXEC {schema}.ring_pass @queue_id = %(queue_id)s, @cap = %(capacity)s, @lanes = %(lanes)s, @moved = @moved OUTPUT;
SELECT @moved

-- name: ring_ack
-- The ack of whole leases, the usual one: receipts naming every message of one ring_leases row or more
-- (first deliveries; a pop writes one row, or two when it ran past the end of the ring's slots), in one
-- batch. A candidate lease lies within the receipts' range and is whole when as many receipts fall in
-- its range and lanes as it holds messages; the candidates are locked (UPDLOCK) and deleted only when
-- the whole ones hold every receipt (each message is in one lease at most). Rows: the n of each lease
-- deleted, none otherwise (the caller settles the receipts with ring_settle).
SET NOCOUNT ON;
DECLARE @gid int = %(group)s;
DECLARE @lanes int = %(lanes)s;
DECLARE @r TABLE (ord int PRIMARY KEY, id bigint NOT NULL, d int NOT NULL);
DECLARE @lo bigint;
DECLARE @hi bigint;
DECLARE @n int;
DECLARE @first int;
DECLARE @c TABLE (lo bigint PRIMARY KEY, n int NOT NULL);
DECLARE @done TABLE (n int NOT NULL);
INSERT INTO @r (ord, id, d)
SELECT CAST(i.[key] AS int), CAST(i.[value] AS bigint), CAST(d.[value] AS int)
FROM OPENJSON(%(ids)s) i JOIN OPENJSON(%(deliveries)s) d ON d.[key] = i.[key];
SELECT @lo = min(id), @hi = max(id), @n = count(*), @first = min(CASE WHEN d = 1 THEN 1 ELSE 0 END) FROM @r;
INSERT INTO @c (lo, n)
SELECT e.lo, e.n
FROM {schema}.ring_leases e WITH (ROWLOCK, UPDLOCK)
WHERE e.queue_id = @gid AND e.lo >= @lo AND e.lo <= @hi AND e.hi <= @hi AND @first = 1
  AND e.lease_until > SYSUTCDATETIME()
  AND (SELECT count(*) FROM @r i
       WHERE i.id BETWEEN e.lo AND e.hi AND EXISTS (
           SELECT 1 FROM OPENJSON(e.starts) j
           WHERE j.[key] = CAST(i.id % @lanes AS nvarchar(11)) AND CAST(j.[value] AS bigint) <= i.id)) = e.n;
DELETE e OUTPUT deleted.n INTO @done
FROM {schema}.ring_leases e
WHERE e.queue_id = @gid AND e.lo IN (SELECT c.lo FROM @c c) AND (SELECT sum(c.n) FROM @c c) = @n;
SELECT n FROM @done

-- name: ring_settle
-- Ack (nack false) or nack receipts, all or nothing (schema.sql): (id, state) of each, none when some
-- receipt no longer holds its lease. The error is cut to 1000 characters (the column's size).
EXEC {schema}.ring_settle @queue_id = %(queue_id)s, @cap = %(capacity)s, @lanes = %(lanes)s, @ids = %(ids)s,
    @deliveries = %(deliveries)s, @nack = %(nack)s, @delay_s = %(delay_s)s, @backoff_s = %(backoff_s)s,
    @backoff_max_s = %(backoff_max_s)s, @max_attempts = %(max_attempts)s, @error = %(error)s, @gid = %(group)s

-- name: ring_held_receipts
SELECT r_id, r_delivery FROM {schema}.ring_held(%(queue_id)s, %(lanes)s, %(ids)s, %(deliveries)s, %(group)s)

-- name: ring_reclaim_expired
-- Expired leases go back to ready (keeping their id) or, after max_attempts, to ring_failed. Pops run it
-- at most once a second.
EXEC {schema}.ring_reclaim_expired @queue_id = %(queue_id)s, @cap = %(capacity)s, @lanes = %(lanes)s,
    @max_attempts = %(max_attempts)s, @limit = %(limit)s, @gid = %(group)s

-- name: ring_peek
-- What pops would take first: the messages due again, then the lanes', each in id order.
SELECT TOP (%(n)s) r_id, r_attempts, r_deliveries, r_enqueued_at, CAST(NULL AS datetime2(6)) AS lease_until, r_payload
FROM {schema}.ring_ready(%(queue_id)s, %(group)s)
WHERE r_due <= SYSUTCDATETIME()
ORDER BY CASE WHEN r_attempts = 0 THEN 1 ELSE 0 END, r_id

-- name: ring_count_ready
-- What a pop could take now, counted up to a cap: ring_ready()'s due messages, and those whose lease
-- expired with attempts left, which a pop reclaims first (ring_reclaim_expired): the n messages of each
-- expired ring_leases row (first deliveries, attempt 1: attempts left when max_attempts > 1) and each
-- expired leased retry row with attempts left. An expired lease out of attempts goes to ring_failed.
SELECT CASE WHEN x.ready > %(cap)s THEN %(cap)s ELSE x.ready END FROM (SELECT
    (SELECT count(*) FROM (
        SELECT TOP (%(cap)s) 1 AS one FROM {schema}.ring_ready(%(queue_id)s, %(group)s) WHERE r_due <= SYSUTCDATETIME()) s)
    + (SELECT count(*) FROM {schema}.ring_retry t
       WHERE t.queue_id = %(group)s AND t.state = 2 AND t.due_at <= SYSUTCDATETIME()
         AND t.attempts < %(max_attempts)s)
    + (SELECT coalesce(sum(CAST(e.n AS bigint)), 0) FROM {schema}.ring_leases e
       WHERE e.queue_id = %(group)s AND e.lease_until <= SYSUTCDATETIME() AND %(max_attempts)s > 1)
    AS ready) x

-- name: ring_ready_head
-- For observers: ring_count_ready's count and the (id, delivery) a pop would take first. Pops serve the
-- messages to deliver again first, in id order (an expired lease among them once reclaimed: a retry row
-- keeps its deliveries, and a ring_leases row's lowest message is its lo, delivered once), then the
-- lanes' messages in id order.
SELECT CASE WHEN x.ready > %(cap)s THEN %(cap)s ELSE x.ready END AS ready, h.r_id AS head_id,
       h.r_deliveries AS head_deliveries
FROM (SELECT
    (SELECT count(*) FROM (
        SELECT TOP (%(cap)s) 1 AS one FROM {schema}.ring_ready(%(queue_id)s, %(group)s) WHERE r_due <= SYSUTCDATETIME()) s)
    + (SELECT count(*) FROM {schema}.ring_retry t
       WHERE t.queue_id = %(group)s AND t.state = 2 AND t.due_at <= SYSUTCDATETIME()
         AND t.attempts < %(max_attempts)s)
    + (SELECT coalesce(sum(CAST(e.n AS bigint)), 0) FROM {schema}.ring_leases e
       WHERE e.queue_id = %(group)s AND e.lease_until <= SYSUTCDATETIME() AND %(max_attempts)s > 1)
    AS ready) x
OUTER APPLY (
    SELECT TOP (1) c.r_id, c.r_deliveries FROM (
        SELECT r_id, r_deliveries, CASE WHEN r_attempts = 0 THEN 1 ELSE 0 END AS fresh
        FROM {schema}.ring_ready(%(queue_id)s, %(group)s) WHERE r_due <= SYSUTCDATETIME()
        UNION ALL
        SELECT t.id, t.deliveries, 0 FROM {schema}.ring_retry t
        WHERE t.queue_id = %(group)s AND t.state = 2 AND t.due_at <= SYSUTCDATETIME()
          AND t.attempts < %(max_attempts)s
        UNION ALL
        SELECT e.lo, 1, 0 FROM {schema}.ring_leases e
        WHERE e.queue_id = %(group)s AND e.lease_until <= SYSUTCDATETIME() AND %(max_attempts)s > 1) c
    ORDER BY c.fresh, c.r_id) h

-- name: ring_stats
-- Depth by state of one consumer group, plus the ring's own figures: the push position (last number
-- issued), the group's pop position (its lowest lane position: the next number none of its pops has
-- taken), the floor (the lowest number a consumer of any group may still need), the numbers given up as
-- gaps, and its lanes. No row when the ring does not exist.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @queue_id int = %(queue_id)s;
DECLARE @gid int = %(group)s;
DECLARE @floor bigint;
DECLARE @rd TABLE (enqueued_at datetime2(6), due datetime2(6));
EXEC {schema}.ring_floor @queue_id = @queue_id, @floor = @floor OUTPUT;
INSERT INTO @rd (enqueued_at, due) SELECT r_enqueued_at, r_due FROM {schema}.ring_ready(@queue_id, @gid);
SELECT
    (SELECT count(*) FROM @rd WHERE due <= @now) AS ready,
    (SELECT count(*) FROM @rd WHERE due > @now) AS delayed,
    (SELECT coalesce(sum(e.n), 0) FROM {schema}.ring_leases e WHERE e.queue_id = @gid)
    + (SELECT count(*) FROM {schema}.ring_retry t WHERE t.queue_id = @gid AND t.state = 2) AS in_flight,
    (SELECT count(*) FROM {schema}.ring_failed f WHERE f.queue_id = @gid) AS failed,
    (SELECT DATEDIFF_BIG(microsecond, min(enqueued_at), @now) / 1e6 FROM @rd WHERE due <= @now) AS oldest_ready_age_s,
    coalesce(CAST(q.current_value AS bigint), 0) AS push_position,
    (SELECT min(l.pos) FROM {schema}.ring_lanes l WHERE l.queue_id = @gid) AS pop_position,
    @floor AS floor,
    coalesce(CAST(gq.current_value AS bigint), 0) AS gaps_skipped,
    r.lanes
FROM {schema}.rings r
LEFT JOIN sys.sequences q ON q.object_id = r.push_seq_id
LEFT JOIN sys.sequences gq ON gq.object_id = r.gap_seq_id
WHERE r.queue_id = @queue_id

-- name: ring_list_failed
SELECT TOP (%(limit)s) id, attempts, enqueued_at, last_error, payload
FROM {schema}.ring_failed
WHERE queue_id = %(group)s AND id > %(after_id)s
ORDER BY id

-- name: ring_take_failed
-- requeue_failed: the failed messages leave ring_failed and are pushed again (new ids) in the same
-- transaction.
DELETE f
OUTPUT deleted.id, deleted.payload
FROM {schema}.ring_failed f
WHERE f.queue_id = %(group)s
  AND (%(all)s = 1 OR f.id IN (SELECT CAST([value] AS bigint) FROM OPENJSON(%(ids)s)))

-- name: ring_delete_failed
DELETE f
OUTPUT deleted.id
FROM {schema}.ring_failed f
WHERE f.queue_id = %(group)s
  AND (%(all)s = 1 OR f.id IN (SELECT CAST([value] AS bigint) FROM OPENJSON(%(ids)s)))

-- name: ring_leased
-- The held receipts' messages with their payloads, in id order.
SELECT h.r_id, coalesce(t.attempts, 1), h.r_delivery, s.enqueued_at, h.r_until, s.payload
FROM {schema}.ring_held(%(queue_id)s, %(lanes)s, %(ids)s, %(deliveries)s, %(group)s) h
JOIN {schema}.ring_slots s ON s.queue_id = %(queue_id)s AND s.slot = h.r_id % %(capacity)s
LEFT JOIN {schema}.ring_retry t ON t.queue_id = %(group)s AND t.id = h.r_id
ORDER BY h.r_id

-- name: ring_add_group
-- A new consumer group's gid (schema.sql), NULL when the ring does not exist.
SET NOCOUNT ON;
DECLARE @gid int;
EXEC {schema}.ring_add_group @queue_id = %(queue_id)s, @name = %(name)s, @earliest = %(earliest)s,
    @on_lag = %(on_lag)s, @lag_timeout_s = %(lag_timeout_s)s, @gid = @gid OUTPUT;
SELECT @gid AS r_gid

-- name: ring_drop_group
-- Whether the group was there (schema.sql).
SET NOCOUNT ON;
DECLARE @dropped bit;
EXEC {schema}.ring_drop_group @queue_id = %(queue_id)s, @gid = %(group)s, @dropped = @dropped OUTPUT;
SELECT @dropped AS r_dropped

-- name: ring_groups
-- The ring's consumer groups, the default one first (gid: the ring's queue_id; no ring_groups row), with
-- the figures of each: its lowest lane position, the sum of its lane positions (which moves whenever it
-- takes), when maintenance last saw that sum move, and the ring's push position. No row when the ring
-- does not exist.
SELECT k.gid, g.name, g.created_at, g.on_lag, g.lag_timeout_s, g.moved_pos, g.moved_at,
       (SELECT min(l.pos) FROM {schema}.ring_lanes l WHERE l.queue_id = k.gid) AS min_pos,
       (SELECT sum(l.pos) FROM {schema}.ring_lanes l WHERE l.queue_id = k.gid) AS sum_pos,
       coalesce(CAST(q.current_value AS bigint), 0) AS issued
FROM {schema}.rings r
CROSS APPLY (
    SELECT r.queue_id AS gid
    UNION ALL
    SELECT x.gid FROM {schema}.ring_groups x WHERE x.queue_id = r.queue_id) AS k
LEFT JOIN {schema}.ring_groups g ON g.queue_id = r.queue_id AND g.gid = k.gid
LEFT JOIN sys.sequences q ON q.object_id = r.push_seq_id
WHERE r.queue_id = %(queue_id)s
ORDER BY CASE WHEN k.gid = r.queue_id THEN 0 ELSE 1 END, g.name

-- name: ring_group_moved
-- Maintenance saw the group's lanes at moved_pos (the sum of their positions): when that differs from
-- what it saw last, the group moved now. Returns the seconds since it last moved.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
UPDATE {schema}.ring_groups
SET moved_at = CASE WHEN moved_pos IS NULL OR moved_pos <> %(moved_pos)s THEN @now ELSE moved_at END,
    moved_pos = %(moved_pos)s
OUTPUT DATEDIFF_BIG(microsecond, inserted.moved_at, @now) / 1e6 AS r_idle_s
WHERE queue_id = %(queue_id)s AND gid = %(group)s
