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
