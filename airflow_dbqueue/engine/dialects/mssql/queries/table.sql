-- Named queries of the SQL Server dialect: the table design: push, the pops, ack and nack, leases, inspection and failed messages.
-- The conventions of every file of this folder are in queues.sql's opening lines.

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

-- name: push_with
-- A push with deduplication keys (keys: a JSON array, one a payload, distinct; NULL: none), ordering keys
-- (okeys: a JSON array, one a payload, null for a message ordered with no other; NULL: none) or a time to
-- live (ttl_s; NULL: none), as PostgreSQL's table_push_with(): rows (id, new) in payload order, where new
-- is 0 for a key pushed within the queue's dedup window (id is then the message the key's first push made,
-- whether or not it was consumed since, and nothing was written for it); no row when the queue was dropped.
-- A message with a time to live or an ordering key gets its meta_opt row (schema.sql) in this batch. In
-- this order:
-- - The queue's push lock, shared, as in push; the queue's row (its dedup window) is read after it.
-- - Ordering keys: an exclusive application lock a key (sp_getapplock on the key's SHA-256, owned by the
--   transaction), taken in hash order before any id is taken, so that the pushes of one key serialize and
--   a key's ids grow in the order its pushes commit: the claims' check of an earlier id is then a check of
--   an earlier push. Two batches sharing keys take their locks in one order and do not deadlock each other.
-- - Ids from the sequence for every payload in payload order, so a batch's new messages keep their push
--   order; a duplicate leaves its number unused (ids have gaps already, as a rolled-back push leaves).
-- - Deduplication keys: each key's dedup row is read WITH (UPDLOCK, HOLDLOCK): an update lock on the row,
--   or, for a key with no row yet, a key-range lock on where it would go, held to the end of the
--   transaction. Two pushes of one key in separate transactions meet there: the second waits for the
--   first's transaction; if that committed, it reads the first's row and returns its id; if it rolled
--   back, it finds no row and pushes its own message. Update locks are not compatible with each other, so
--   the two never both read "no row" and then both insert (shared range locks would let them, ending in a
--   deadlock or a duplicate key). This is the upsert of Michael J. Swart's "SQL Server UPSERT Patterns and
--   Antipatterns" rather than a MERGE, which needs the same HOLDLOCK to be safe (Aaron Bertrand, "Use
--   Caution with SQL Server's MERGE Statement") and would not say as plainly which keys are new. A row
--   older than the window is taken over (the new id and time), a key without one gets one. FORCESEEK keeps
--   each key's read (and its range lock) to that key's place in dedup_pkey, whatever the statistics.
--   Batches whose keys fall in neighbouring ranges may still deadlock there; the dialect runs the victim
--   again when the transaction is its own, as for any deadlock.
-- Under SNAPSHOT isolation in a caller's transaction, a key whose row changed after the transaction began
-- fails the update lock's read with error 3960 (an update conflict), a TransientDatabaseError: the caller
-- runs its transaction again and gets the first push's id, as PostgreSQL's serialization error asks.
-- RAISERROR does not end the batch (XACT_ABORT ignores it), so the statements after a refused lock check
-- @locked and write nothing. notify and channel are not used: SQL Server has no NOTIFY.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @queue_id int = %(queue_id)s;
DECLARE @delay_s float = %(delay_s)s;
DECLARE @ttl_s float = %(ttl_s)s;
DECLARE @keys nvarchar(max) = %(keys)s;
DECLARE @okeys nvarchar(max) = %(okeys)s;
DECLARE @at datetime2(6) = DATEADD(microsecond, CAST(1e6 * (@delay_s - FLOOR(@delay_s)) AS int),
                                   DATEADD(second, CAST(FLOOR(@delay_s) AS int), @now));
DECLARE @expires datetime2(6) = DATEADD(microsecond, CAST(1e6 * (@ttl_s - FLOOR(@ttl_s)) AS int),
                                        DATEADD(second, CAST(FLOOR(@ttl_s) AS int), @now));
DECLARE @resource nvarchar(255) = N'dbqueue.queue.{schema}.' + CAST(@queue_id AS nvarchar(11));
DECLARE @locked int;
EXEC @locked = sys.sp_getapplock @Resource = @resource, @LockMode = 'Shared', @LockOwner = 'Transaction',
    @LockTimeout = -1;
IF @locked < 0
    RAISERROR (N'[DQ007] the push lock of queue %s was not granted (sp_getapplock returned %d: a deadlock victim)',
        16, 1, @resource, @locked);
DECLARE @window float = (SELECT dedup_window_s FROM {schema}.queues WHERE queue_id = @queue_id AND @locked >= 0);
DECLARE @cutoff datetime2(6) = DATEADD(microsecond, -CAST(1e6 * (@window - FLOOR(@window)) AS int),
                                       DATEADD(second, -CAST(FLOOR(@window) AS int), @now));
DECLARE @okey_locks TABLE (okey_hash binary(32) PRIMARY KEY);
INSERT INTO @okey_locks (okey_hash)
SELECT DISTINCT HASHBYTES('SHA2_256', CAST(o.[value] AS nvarchar(1024)))
FROM OPENJSON(@okeys) o
WHERE @window IS NOT NULL AND o.[value] IS NOT NULL;
DECLARE @okey_hash binary(32) = (SELECT min(okey_hash) FROM @okey_locks);
WHILE @okey_hash IS NOT NULL AND @locked >= 0
BEGIN
    SET @resource = N'dbqueue.okey.{schema}.' + CAST(@queue_id AS nvarchar(11)) + N'.'
        + CONVERT(nvarchar(64), @okey_hash, 2);
    EXEC @locked = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive',
        @LockOwner = 'Transaction', @LockTimeout = -1;
    SET @okey_hash = (SELECT min(okey_hash) FROM @okey_locks WHERE okey_hash > @okey_hash);
END;
IF @locked < 0
    RAISERROR (N'[DQ007] the ordering key lock %s was not granted (sp_getapplock returned %d: a deadlock victim)',
        16, 1, @resource, @locked);
DECLARE @input TABLE (
    ord int PRIMARY KEY, id bigint NOT NULL, payload varbinary(max) NOT NULL, dedup_key nvarchar(1024) NULL,
    key_hash binary(32) NULL, okey_hash binary(32) NULL, is_new bit NOT NULL);
INSERT INTO @input (ord, id, payload, dedup_key, key_hash, okey_hash, is_new)
SELECT CAST(p.[key] AS int), NEXT VALUE FOR {schema}.message_id_seq OVER (ORDER BY CAST(p.[key] AS int)),
       CONVERT(varbinary(max), p.[value], 2), CAST(k.[value] AS nvarchar(1024)),
       HASHBYTES('SHA2_256', CAST(k.[value] AS nvarchar(1024))),
       HASHBYTES('SHA2_256', CAST(o.[value] AS nvarchar(1024))), 1
FROM OPENJSON(%(payloads)s) p
LEFT JOIN OPENJSON(@keys) k ON k.[key] = p.[key]
LEFT JOIN OPENJSON(@okeys) o ON o.[key] = p.[key]
WHERE @window IS NOT NULL AND @locked >= 0;
DECLARE @seen TABLE (key_hash binary(32) PRIMARY KEY, id bigint NOT NULL, pushed_at datetime2(6) NOT NULL);
INSERT INTO @seen (key_hash, id, pushed_at)
SELECT d.key_hash, d.id, d.pushed_at
FROM @input i
JOIN {schema}.dedup d WITH (UPDLOCK, HOLDLOCK, ROWLOCK, FORCESEEK)
  ON d.queue_id = @queue_id AND d.key_hash = i.key_hash
WHERE i.key_hash IS NOT NULL;
UPDATE i SET is_new = 0, id = s.id
FROM @input i JOIN @seen s ON s.key_hash = i.key_hash
WHERE s.pushed_at > @cutoff;
UPDATE d SET id = i.id, pushed_at = @now
FROM {schema}.dedup d
JOIN @input i ON d.queue_id = @queue_id AND d.key_hash = i.key_hash
WHERE i.is_new = 1 AND d.pushed_at <= @cutoff;
INSERT INTO {schema}.dedup (queue_id, key_hash, dedup_key, id, pushed_at)
SELECT @queue_id, i.key_hash, i.dedup_key, i.id, @now
FROM @input i
WHERE i.key_hash IS NOT NULL AND NOT EXISTS (SELECT 1 FROM @seen s WHERE s.key_hash = i.key_hash);
INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at, payload)
SELECT id, @queue_id, %(priority)s, @at, @now,
       CASE WHEN DATALENGTH(payload) <= 1900 THEN CONVERT(varbinary(1900), payload) END
FROM @input WHERE is_new = 1;
INSERT INTO {schema}.data (id, payload) SELECT id, payload FROM @input WHERE is_new = 1 AND DATALENGTH(payload) > 1900;
INSERT INTO {schema}.meta_opt (queue_id, id, expires_at, okey_hash)
SELECT @queue_id, id, @expires, okey_hash FROM @input
WHERE is_new = 1 AND (@expires IS NOT NULL OR okey_hash IS NOT NULL);
SELECT id, is_new FROM @input ORDER BY ord

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

-- name: pop_lease_with
-- pop_lease for a queue whose messages may expire (expiring: created with a ttl) or that is ordered per key
-- (per_key), as PostgreSQL's table_lease_with(). The client calls it only for such a queue, so that
-- pop_lease's claim, which every other queue's pops run, evaluates neither check. Besides the rows
-- pop_lease skips, it skips rows whose time to live has passed (left to the expiry sweep) and rows whose
-- ordering key has an earlier message (a smaller id) ready, delayed or in flight: a meta_opt row of the key
-- with a smaller id (meta_opt_key_idx) whose meta row is not failed. That meta row is read WITH (READPAST):
-- one another transaction is changing (a pop leasing or taking it, a nack) counts as not failed, so the
-- later message waits, as it should while the earlier one is being handed out. The key's earlier meta_opt
-- rows are read as committed: under READ_COMMITTED_SNAPSHOT the last committed version (a take or an ack
-- not committed yet still counts, as on PostgreSQL); without it the read waits for a transaction that is
-- deleting one (an ack, a take in the caller's transaction) to end, rather than pass over it and hand out
-- the next message of the key before that transaction is known to commit.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @vt float = %(visibility_timeout_s)s;
DECLARE @expiring bit = %(expiring)s;
DECLARE @per_key bit = %(per_key)s;
DECLARE @until datetime2(6) = DATEADD(microsecond, CAST(1e6 * (@vt - FLOOR(@vt)) AS int),
                                      DATEADD(second, CAST(FLOOR(@vt) AS int), @now));
DECLARE @claimed TABLE (
    id bigint PRIMARY KEY, priority smallint, attempts int, deliveries int, process_at datetime2(6),
    enqueued_at datetime2(6), lease_until datetime2(6), payload varbinary(1900));
WITH head AS (
    SELECT TOP (%(n)s) s.id, s.state, s.attempts, s.deliveries, s.consumer, s.lease_until, s.priority,
           s.process_at, s.enqueued_at, s.payload
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
OUTPUT inserted.id, inserted.priority, inserted.attempts, inserted.deliveries, inserted.process_at,
       inserted.enqueued_at, inserted.lease_until, inserted.payload
INTO @claimed;
SELECT c.id, c.priority, c.attempts, c.deliveries, c.enqueued_at, c.lease_until,
       coalesce(CONVERT(varbinary(max), c.payload), (SELECT d.payload FROM {schema}.data d WHERE d.id = c.id))
           AS payload
FROM @claimed c
ORDER BY c.priority DESC, c.process_at, c.id

-- name: pop_take_with
-- pop_take for such a queue: it skips what pop_lease_with skips, and deletes the meta_opt rows of what it
-- takes in the same transaction.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @archive bit = %(archive)s;
DECLARE @expiring bit = %(expiring)s;
DECLARE @per_key bit = %(per_key)s;
DECLARE @queue_id int = %(queue_id)s;
DECLARE @taken TABLE (
    id bigint PRIMARY KEY, queue_id int, priority smallint, attempts int, deliveries int,
    process_at datetime2(6), enqueued_at datetime2(6), payload varbinary(max), in_row bit);
WITH head AS (
    SELECT TOP (%(n)s) s.id, s.queue_id, s.priority, s.attempts, s.deliveries, s.process_at, s.enqueued_at,
           s.payload
    FROM {schema}.meta s WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE s.queue_id = @queue_id AND s.state = 0 AND s.process_at <= @now
      AND NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
          WHERE o.queue_id = s.queue_id AND o.id = s.id
            AND ((@expiring = 1 AND o.expires_at IS NOT NULL AND o.expires_at <= @now)
                 OR (@per_key = 1 AND o.okey_hash IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                     WHERE e.queue_id = o.queue_id AND e.okey_hash = o.okey_hash AND e.id < o.id
                       AND NOT EXISTS (SELECT 1 FROM {schema}.meta f WITH (READPAST)
                           WHERE f.id = e.id AND f.state = 2)))))
    ORDER BY s.priority DESC, s.process_at, s.id)
DELETE FROM head
OUTPUT deleted.id, deleted.queue_id, deleted.priority, deleted.attempts + 1, deleted.deliveries + 1,
       deleted.process_at, deleted.enqueued_at, deleted.payload,
       CASE WHEN deleted.payload IS NULL THEN 0 ELSE 1 END
INTO @taken;
DELETE o FROM {schema}.meta_opt o WHERE o.queue_id = @queue_id AND o.id IN (SELECT id FROM @taken);
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

-- name: ack_with
-- ack for a queue whose messages may expire or that is ordered per key (the client calls it only for such
-- a queue): the acked messages' meta_opt rows are deleted with their meta rows, in the same transaction.
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
    DELETE o FROM {schema}.meta_opt o WHERE o.queue_id = %(queue_id)s AND o.id IN (SELECT id FROM @acked);
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

-- name: nack_with
-- nack for a queue whose messages may expire or that is ordered per key: nack's statement. PostgreSQL's
-- also moves the message's process_at in its meta_opt row, a copy its expiry sweep finds the meta row by;
-- this dialect's meta_opt keeps no copy (schema.sql). A message made ready again keeps its meta_opt row,
-- and with it its expiry and its key's place: the key's later messages still wait for it.
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

-- name: expire_fail
-- Ready messages of the queue whose time to live has passed (up to limit, oldest expiry first, through
-- meta_opt_expiring_idx, each meta row found by id through meta_pkey) go to the failed state with
-- last_error 'expired' (on_expiry 'fail'). expires_at is cleared, so a failed message leaves the index and
-- requeue_failed makes it deliverable again. Leased messages are left to their consumer: a nack or an
-- expired lease makes them ready, and then this finds them. Rows other transactions hold are passed over
-- (READPAST), the meta rows picked are held with update locks to the end of the transaction.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @queue_id int = %(queue_id)s;
DECLARE @picked TABLE (id bigint PRIMARY KEY);
INSERT INTO @picked (id)
SELECT TOP (%(limit)s) m.id
FROM {schema}.meta_opt o WITH (READPAST)
JOIN {schema}.meta m WITH (ROWLOCK, READPAST, UPDLOCK) ON m.id = o.id
WHERE o.queue_id = @queue_id AND o.expires_at IS NOT NULL AND o.expires_at <= @now
  AND m.queue_id = @queue_id AND m.state = 0
ORDER BY o.expires_at;
DECLARE @failed TABLE (id bigint PRIMARY KEY);
UPDATE m SET state = 2, last_error = N'expired'
OUTPUT inserted.id INTO @failed
FROM {schema}.meta m JOIN @picked p ON p.id = m.id
WHERE m.state = 0;
UPDATE o SET expires_at = NULL
FROM {schema}.meta_opt o JOIN @failed f ON f.id = o.id
WHERE o.queue_id = @queue_id;
SELECT id FROM @failed

-- name: expire_drop
-- As expire_fail, for on_expiry 'drop': the messages are deleted with their payloads and meta_opt rows,
-- or kept in done as discarded (outcome 2, as delete_failed does) where the queue archives.
SET NOCOUNT ON;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @queue_id int = %(queue_id)s;
DECLARE @archive bit = %(archive)s;
DECLARE @picked TABLE (id bigint PRIMARY KEY);
INSERT INTO @picked (id)
SELECT TOP (%(limit)s) m.id
FROM {schema}.meta_opt o WITH (READPAST)
JOIN {schema}.meta m WITH (ROWLOCK, READPAST, UPDLOCK) ON m.id = o.id
WHERE o.queue_id = @queue_id AND o.expires_at IS NOT NULL AND o.expires_at <= @now
  AND m.queue_id = @queue_id AND m.state = 0
ORDER BY o.expires_at;
DECLARE @gone TABLE (
    id bigint PRIMARY KEY, queue_id int, priority smallint, attempts int, enqueued_at datetime2(6),
    payload varbinary(1900));
DELETE m
OUTPUT deleted.id, deleted.queue_id, deleted.priority, deleted.attempts, deleted.enqueued_at, deleted.payload
INTO @gone
FROM {schema}.meta m JOIN @picked p ON p.id = m.id
WHERE m.state = 0;
DELETE o FROM {schema}.meta_opt o WHERE o.queue_id = @queue_id AND o.id IN (SELECT id FROM @gone);
IF @archive = 1
    INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload)
    SELECT id, queue_id, priority, attempts, enqueued_at, 2, payload FROM @gone;
ELSE
    DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM @gone WHERE payload IS NULL);
SELECT id FROM @gone

-- name: count_expired
-- Failed messages of the queue that failed by expiry, counted up to a cap (stats().extra["expired"]).
SELECT count(*) FROM (
    SELECT TOP (%(cap)s) 1 AS one FROM {schema}.meta
    WHERE queue_id = %(queue_id)s AND state = 2 AND last_error = N'expired') s

-- name: peek
-- opts: the queue may have meta_opt rows (created with a ttl or ordered per key); then a message a pop
-- would pass over (expired, or behind an earlier message of its key) is left out, as pop_lease_with does.
SELECT TOP (%(n)s) m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until,
       coalesce(CONVERT(varbinary(max), m.payload), (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id))
           AS payload
FROM {schema}.meta m
WHERE m.queue_id = %(queue_id)s AND m.state = 0 AND m.process_at <= SYSUTCDATETIME()
  AND (%(opts)s = 0 OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
      WHERE o.queue_id = m.queue_id AND o.id = m.id
        AND ((o.expires_at IS NOT NULL AND o.expires_at <= SYSUTCDATETIME())
             OR (o.okey_hash IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                 WHERE e.queue_id = o.queue_id AND e.okey_hash = o.okey_hash AND e.id < o.id
                   AND NOT EXISTS (SELECT 1 FROM {schema}.meta f WITH (READPAST)
                       WHERE f.id = e.id AND f.state = 2))))))
ORDER BY m.priority DESC, m.process_at, m.id

-- name: count_ready
-- Messages a pop could take now, of at least min_priority, counted up to a cap (a sensor needs "at
-- least k", not a total): those ready, and those whose lease expired with attempts left, which a pop
-- reclaims first (back to ready in their place). An expired lease out of attempts goes to failed. opts:
-- as in peek (a message expired, or behind an earlier message of its key, is not counted; nor is an
-- expired lease whose message expired, which the reclaim makes ready and the pops then pass over).
SELECT count(*) FROM (
    SELECT TOP (%(cap)s) 1 AS one FROM (
        SELECT TOP (%(cap)s) 1 AS one FROM {schema}.meta m
        WHERE m.queue_id = %(queue_id)s AND m.state = 0 AND m.process_at <= SYSUTCDATETIME()
          AND m.priority >= %(min_priority)s
          AND (%(opts)s = 0 OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
              WHERE o.queue_id = m.queue_id AND o.id = m.id
                AND ((o.expires_at IS NOT NULL AND o.expires_at <= SYSUTCDATETIME())
                     OR (o.okey_hash IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                         WHERE e.queue_id = o.queue_id AND e.okey_hash = o.okey_hash AND e.id < o.id
                           AND NOT EXISTS (SELECT 1 FROM {schema}.meta f WITH (READPAST)
                               WHERE f.id = e.id AND f.state = 2))))))
        UNION ALL
        SELECT TOP (%(cap)s) 1 AS one FROM {schema}.meta m
        WHERE m.queue_id = %(queue_id)s AND m.state = 1 AND m.lease_until <= SYSUTCDATETIME()
          AND m.attempts < %(max_attempts)s AND m.priority >= %(min_priority)s
          AND (%(opts)s = 0 OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
              WHERE o.queue_id = m.queue_id AND o.id = m.id
                AND o.expires_at IS NOT NULL AND o.expires_at <= SYSUTCDATETIME()))) u) s

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
-- A requeued message is ready now, with its attempts reset and no time to live (one that failed by expiry
-- would otherwise expire again at once): its meta_opt row, if any, loses its expiry.
SET NOCOUNT ON;
DECLARE @queue_id int = %(queue_id)s;
DECLARE @requeued TABLE (id bigint PRIMARY KEY);
UPDATE {schema}.meta
SET state = 0, attempts = 0, process_at = SYSUTCDATETIME(), last_error = NULL
OUTPUT inserted.id INTO @requeued
WHERE queue_id = @queue_id AND state = 2
  AND (%(all)s = 1 OR id IN (SELECT CAST([value] AS bigint) FROM OPENJSON(%(ids)s)));
UPDATE o SET expires_at = NULL
FROM {schema}.meta_opt o JOIN @requeued r ON r.id = o.id
WHERE o.queue_id = @queue_id AND o.expires_at IS NOT NULL;
SELECT id FROM @requeued

-- name: delete_failed
-- The failed messages go with their payloads and meta_opt rows, or are kept in done as discarded
-- (outcome 2) where the queue archives.
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
DELETE o FROM {schema}.meta_opt o WHERE o.queue_id = %(queue_id)s AND o.id IN (SELECT id FROM @gone);
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
-- be once reclaimed. opts: as in count_ready.
SELECT r.ready, h.id AS head_id, h.deliveries AS head_deliveries
FROM (SELECT count(*) AS ready FROM (
        SELECT TOP (%(cap)s) 1 AS one FROM (
            SELECT TOP (%(cap)s) 1 AS one FROM {schema}.meta m
            WHERE m.queue_id = %(queue_id)s AND m.state = 0 AND m.process_at <= SYSUTCDATETIME()
              AND m.priority >= %(min_priority)s
              AND (%(opts)s = 0 OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
                  WHERE o.queue_id = m.queue_id AND o.id = m.id
                    AND ((o.expires_at IS NOT NULL AND o.expires_at <= SYSUTCDATETIME())
                         OR (o.okey_hash IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                             WHERE e.queue_id = o.queue_id AND e.okey_hash = o.okey_hash AND e.id < o.id
                               AND NOT EXISTS (SELECT 1 FROM {schema}.meta f WITH (READPAST)
                                   WHERE f.id = e.id AND f.state = 2))))))
            UNION ALL
            SELECT TOP (%(cap)s) 1 AS one FROM {schema}.meta m
            WHERE m.queue_id = %(queue_id)s AND m.state = 1 AND m.lease_until <= SYSUTCDATETIME()
              AND m.attempts < %(max_attempts)s AND m.priority >= %(min_priority)s
              AND (%(opts)s = 0 OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
                  WHERE o.queue_id = m.queue_id AND o.id = m.id
                    AND o.expires_at IS NOT NULL AND o.expires_at <= SYSUTCDATETIME()))) u) s) r
OUTER APPLY (
    SELECT TOP (1) c.id, c.deliveries FROM (
        SELECT a.id, a.deliveries, a.priority, a.process_at FROM (
            SELECT TOP (1) m.id, m.deliveries, m.priority, m.process_at FROM {schema}.meta m
            WHERE m.queue_id = %(queue_id)s AND m.state = 0 AND m.process_at <= SYSUTCDATETIME()
              AND (%(opts)s = 0 OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
                  WHERE o.queue_id = m.queue_id AND o.id = m.id
                    AND ((o.expires_at IS NOT NULL AND o.expires_at <= SYSUTCDATETIME())
                         OR (o.okey_hash IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                             WHERE e.queue_id = o.queue_id AND e.okey_hash = o.okey_hash AND e.id < o.id
                               AND NOT EXISTS (SELECT 1 FROM {schema}.meta f WITH (READPAST)
                                   WHERE f.id = e.id AND f.state = 2))))))
            ORDER BY m.priority DESC, m.process_at, m.id) a
        UNION ALL
        SELECT b.id, b.deliveries, b.priority, b.process_at FROM (
            SELECT TOP (1) m.id, m.deliveries, m.priority, m.process_at FROM {schema}.meta m
            WHERE m.queue_id = %(queue_id)s AND m.state = 1 AND m.lease_until <= SYSUTCDATETIME()
              AND m.attempts < %(max_attempts)s
              AND (%(opts)s = 0 OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
                  WHERE o.queue_id = m.queue_id AND o.id = m.id
                    AND o.expires_at IS NOT NULL AND o.expires_at <= SYSUTCDATETIME()))
            ORDER BY m.priority DESC, m.process_at, m.id) b) c
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

-- name: forget_dedup
-- Deduplication keys of the queue older than its window (window_s), up to n: a push would take them over
-- anyway, so forgetting them changes no push's outcome and keeps the table at about a window of keys. The
-- rows are read with update locks (a row a push holds is passed over, READPAST), so the age is checked on
-- the row as it is when it goes: a key a push has just taken over (a newer pushed_at) stays.
SET NOCOUNT ON;
DECLARE @window float = %(window_s)s;
DECLARE @cutoff datetime2(6) = DATEADD(microsecond, -CAST(1e6 * (@window - FLOOR(@window)) AS int),
                                       DATEADD(second, -CAST(FLOOR(@window) AS int), SYSUTCDATETIME()));
DECLARE @gone TABLE (dedup_key nvarchar(1024));
WITH old AS (
    SELECT TOP (%(n)s) queue_id, key_hash, dedup_key, pushed_at
    FROM {schema}.dedup WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE queue_id = %(queue_id)s AND pushed_at <= @cutoff)
DELETE FROM old OUTPUT deleted.dedup_key INTO @gone;
SELECT dedup_key FROM @gone
