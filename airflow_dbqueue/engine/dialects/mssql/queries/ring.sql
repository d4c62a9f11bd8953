-- Named queries of the SQL Server dialect: the ring design: push, take and pop, settle, gaps, inspection, failed messages and consumer groups.
-- The conventions of every file of this folder are in queues.sql's opening lines.

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

-- name: ring_take_one
-- A pop of one at most once outside a caller's transaction (PostgreSQL sends it as one statement):
-- ring_take of one message that does not wait for lanes other pops hold; the caller then calls
-- ring_take. group: the key of the group's lanes (the ring's queue_id for its default group).
EXEC {schema}.ring_take @queue_id = %(group)s, @cap = %(capacity)s, @lanes = %(lanes)s, @n = 1,
    @lease = 0, @vt = 1, @consumer = NULL, @retries = 1, @wait = 0

-- name: ring_take_lease
-- ring_take at least once: its messages leased until their lease_until.
EXEC {schema}.ring_take @queue_id = %(queue_id)s, @cap = %(capacity)s, @lanes = %(lanes)s, @n = %(n)s,
    @lease = %(lease)s, @vt = %(visibility_timeout_s)s, @consumer = %(consumer)s, @retries = 1,
    @wait = %(wait)s

-- name: ring_take_lease_ids
-- ring_take at least once for a claimed batch: its messages leased until their lease_until, whole (a
-- batch's result set cannot be narrowed here; the caller reads the id and lease_until of each).
EXEC {schema}.ring_take @queue_id = %(queue_id)s, @cap = %(capacity)s, @lanes = %(lanes)s, @n = %(n)s,
    @lease = 1, @vt = %(visibility_timeout_s)s, @consumer = %(consumer)s, @retries = 1, @wait = 0

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
-- What pops would take first: the messages due again, then the lanes', each in id order; ring_ready's
-- due messages, read as far as they go and no further (PostgreSQL's ring_look). Each part is the first
-- n of its own: the due retry rows by id; the lanes' messages (a slot past its lane's position and
-- written) in slot order on the slots' key, from the lowest lane position's slot (a) to the end, then
-- from slot 0 to a. Every number a slot holds lies below that position + capacity (a push may overwrite
-- x - capacity only below the floor), so slot order within each range is id order, and a TOP (n) seek
-- in it stops at the n-th message it keeps instead of reading every slot of the ring.
SELECT TOP (%(n)s) u.r_id, u.r_attempts, u.r_deliveries, u.r_enqueued_at, CAST(NULL AS datetime2(6)) AS lease_until,
       u.r_payload
FROM (
    SELECT x.r_id, x.r_attempts, x.r_deliveries, x.r_enqueued_at, x.r_payload FROM (
        SELECT TOP (%(n)s) r.id AS r_id, r.attempts AS r_attempts, r.deliveries AS r_deliveries,
               s.enqueued_at AS r_enqueued_at, s.payload AS r_payload
        FROM {schema}.rings g
        JOIN {schema}.ring_retry r ON r.queue_id = %(group)s
        JOIN {schema}.ring_slots s ON s.queue_id = g.queue_id AND s.slot = r.id % g.capacity
        WHERE g.queue_id = %(queue_id)s AND r.state = 1 AND r.due_at <= SYSUTCDATETIME()
        ORDER BY r.id) AS x
    UNION ALL
    SELECT y.r_id, y.r_attempts, y.r_deliveries, y.r_enqueued_at, y.r_payload FROM (
        SELECT TOP (%(n)s) s.seq AS r_id, 0 AS r_attempts, 0 AS r_deliveries, s.enqueued_at AS r_enqueued_at,
               s.payload AS r_payload
        FROM {schema}.rings g
        JOIN {schema}.ring_slots s ON s.queue_id = g.queue_id
        JOIN {schema}.ring_lanes l ON l.queue_id = %(group)s AND l.lane = s.seq % g.lanes
        WHERE g.queue_id = %(queue_id)s AND s.payload IS NOT NULL AND s.seq >= l.pos
          AND s.slot >= (SELECT min(m.pos) FROM {schema}.ring_lanes m WHERE m.queue_id = %(group)s) % g.capacity
        ORDER BY s.slot) AS y
    UNION ALL
    SELECT z.r_id, z.r_attempts, z.r_deliveries, z.r_enqueued_at, z.r_payload FROM (
        SELECT TOP (%(n)s) s.seq AS r_id, 0 AS r_attempts, 0 AS r_deliveries, s.enqueued_at AS r_enqueued_at,
               s.payload AS r_payload
        FROM {schema}.rings g
        JOIN {schema}.ring_slots s ON s.queue_id = g.queue_id
        JOIN {schema}.ring_lanes l ON l.queue_id = %(group)s AND l.lane = s.seq % g.lanes
        WHERE g.queue_id = %(queue_id)s AND s.payload IS NOT NULL AND s.seq >= l.pos
          AND s.slot < (SELECT min(m.pos) FROM {schema}.ring_lanes m WHERE m.queue_id = %(group)s) % g.capacity
        ORDER BY s.slot) AS z
) AS u
ORDER BY CASE WHEN u.r_attempts = 0 THEN 1 ELSE 0 END, u.r_id

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
       h.r_deliveries AS head_deliveries,
       -- alive: the ring and the group still exist (a queue id and a gid are never used twice), so
       -- that an observer tells an empty ring from a dropped one in this one trip.
       CASE WHEN EXISTS (SELECT 1 FROM {schema}.queues q WHERE q.queue_id = %(queue_id)s)
             AND (%(group)s = %(queue_id)s
                  OR EXISTS (SELECT 1 FROM {schema}.ring_groups g WHERE g.gid = %(group)s))
            THEN 1 ELSE 0 END AS alive
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
-- gaps, and its lanes; estimated: always false here. No row when the ring does not exist.
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
    r.lanes,
    CAST(0 AS bit) AS estimated  -- every message counted (PostgreSQL estimates above a cap)
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

-- name: ring_record_batch
-- A claimed batch of a consumer group in the batch ledger (batches and batch_items, keyed by the group's
-- key): the receipts of the pop at least once that took its messages, in the same transaction. ids and
-- deliveries come back as JSON arrays in claim order (the dialect turns them into lists).
SET NOCOUNT ON;
DECLARE @batch_id uniqueidentifier = %(batch_id)s;
INSERT INTO {schema}.batches (batch_id, queue_id, consumer, claimed_at, lease_until)
VALUES (@batch_id, %(group)s, %(consumer)s, SYSUTCDATETIME(), %(lease_until)s);
INSERT INTO {schema}.batch_items (batch_id, ord, id, delivery)
SELECT @batch_id, CAST(i.[key] AS int) + 1, CAST(i.[value] AS bigint), CAST(d.[value] AS int)
FROM OPENJSON(%(ids)s) i JOIN OPENJSON(%(deliveries)s) d ON d.[key] = i.[key];
SELECT b.batch_id, b.state,
       N'[' + (SELECT STRING_AGG(CAST(i.id AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS ids,
       N'[' + (SELECT STRING_AGG(CAST(i.delivery AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY i.ord)
               FROM {schema}.batch_items i WHERE i.batch_id = b.batch_id) + N']' AS deliveries,
       b.consumer, b.claimed_at, b.lease_until, b.finished_at, b.last_error
FROM {schema}.batches b
WHERE b.batch_id = @batch_id

-- name: ring_batch_rows
-- The messages of one batch of a consumer group with their payloads, numbered 1..n in claim order (ord:
-- a Spark JDBC reader partitions on it). Rendered to text with its parameters for readers in other
-- processes. The slots read are those of the range of the batch's numbers (a_lo..a_hi, and b_lo..b_hi
-- where it wraps past the last slot), each matched to its number by its slot (number mod capacity) and
-- its seq: a slot gives its payload only while it holds the batch's number, and one overwritten since
-- (the batch's lease expired, and its message was delivered and finished elsewhere) reads as a NULL
-- payload; that batch cannot be acked anyway. The slot's equality lets a plan that expects few numbers
-- (a reader's filter on ord) probe the slots' key a number instead of scanning the range a number.
SELECT i.ord, i.id, i.delivery, s.payload
FROM {schema}.batches b
JOIN {schema}.batch_items i ON i.batch_id = b.batch_id
LEFT JOIN {schema}.ring_slots s
  ON s.queue_id = %(queue_id)s AND s.slot = i.id % %(capacity)s AND s.seq = i.id
 AND (s.slot BETWEEN %(a_lo)s AND %(a_hi)s OR s.slot BETWEEN %(b_lo)s AND %(b_hi)s)
WHERE b.batch_id = %(batch_id)s AND b.queue_id = %(group)s

-- name: ring_extend_batch
-- Push the leases of a batch's receipts out to secs from now: the ring_leases rows holding them and
-- their leased retry rows, each only while its lease holds. Returns (the receipts held and extended,
-- the new end); the caller rolls back unless every receipt was. A lease row holds only messages of the
-- pop that wrote it, so the n of the rows extended counts receipts.
SET NOCOUNT ON;
DECLARE @gid int = %(group)s;
DECLARE @now datetime2(6) = SYSUTCDATETIME();
DECLARE @secs float = %(secs)s;
DECLARE @until datetime2(6) = DATEADD(microsecond, CAST(1e6 * (@secs - FLOOR(@secs)) AS int),
                                      DATEADD(second, CAST(FLOOR(@secs) AS int), @now));
DECLARE @h TABLE (id bigint PRIMARY KEY, lease bigint);
DECLARE @e TABLE (lo bigint PRIMARY KEY, n int NOT NULL);
DECLARE @t TABLE (id bigint PRIMARY KEY);
INSERT INTO @h (id, lease)
SELECT r_id, r_lease FROM {schema}.ring_held(%(queue_id)s, %(lanes)s, %(ids)s, %(deliveries)s, @gid);
UPDATE {schema}.ring_leases SET lease_until = @until
OUTPUT inserted.lo, inserted.n INTO @e
WHERE queue_id = @gid AND lease_until > @now
  AND lo IN (SELECT h.lease FROM @h h WHERE h.lease IS NOT NULL);
UPDATE {schema}.ring_retry SET due_at = @until
OUTPUT inserted.id INTO @t
WHERE queue_id = @gid AND state = 2 AND due_at > @now
  AND id IN (SELECT h.id FROM @h h WHERE h.lease IS NULL);
DECLARE @held int = (SELECT count(*) FROM @h);
DECLARE @done int = (SELECT coalesce(sum(n), 0) FROM @e) + (SELECT count(*) FROM @t);
SELECT CASE WHEN @held < @done THEN @held ELSE @done END AS r_held, @until AS r_until
