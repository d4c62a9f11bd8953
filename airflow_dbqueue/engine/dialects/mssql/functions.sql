-- The procedures and functions of a dbqueue schema on SQL Server: every one of them, in its current form.
-- {schema} is replaced by the bracket-quoted schema name. install() applies this file after schema.sql on
-- a fresh install, and again, in one transaction, whenever its SHA-256 differs from the one recorded in
-- owned_objects (kind 'functions'), so changing a routine is an edit of its body here, nothing else; a
-- routine of the engine's that this file no longer defines is then dropped. Each named block is one
-- batch (a CREATE PROCEDURE or FUNCTION must be alone in its batch) and is CREATE OR ALTER: altering a
-- routine while pushes and pops run is safe (a call that already runs it finishes with the body it
-- started with; the next call compiles the new one). The inline functions come first, then each
-- procedure after the ones it calls, so that every name a batch uses exists when it compiles.
--
-- The contract with the client (the named queries in queries/*.sql) is PostgreSQL's (see its
-- functions.sql): the client calls these routines by name, with the parameters listed here; a change of
-- a routine's parameters or results gives it a new name, and the old one stays here, working, for one
-- more release.

-- name: ring_series
-- The numbers 0 .. @n - 1 (k), from a cross join of constants: up to 16^6 = 16,777,216, a ring's largest
-- capacity. An inline function: its body is expanded where it is used.
CREATE OR ALTER FUNCTION {schema}.ring_series(@n bigint)
RETURNS TABLE
AS
RETURN (
    WITH d AS (
        SELECT v FROM (VALUES (0), (1), (2), (3), (4), (5), (6), (7), (8), (9), (10), (11), (12), (13), (14), (15)) AS x (v)
    )
    SELECT TOP (CASE WHEN @n > 0 THEN @n ELSE 0 END) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) - 1 AS k
    FROM d AS d1 CROSS JOIN d AS d2 CROSS JOIN d AS d3 CROSS JOIN d AS d4 CROSS JOIN d AS d5 CROSS JOIN d AS d6
)

-- name: ring_held
-- The receipts (id, delivery) of a ring that still hold their lease, from the JSON arrays @ids and
-- @deliveries: a first delivery (delivery 1) inside an open lease of its range and lanes, or a retry row
-- leased as that delivery. r_lease names the lease row (its lo), NULL for a retry row. A message is in
-- one lease or one retry row, never both.
-- @gid: the key of the consumer group's leases and retry rows (the ring's queue_id for its default group,
-- a gid for another: ring_groups).
CREATE OR ALTER FUNCTION {schema}.ring_held(@queue_id int, @lanes int, @ids nvarchar(max), @deliveries nvarchar(max),
    @gid int)
RETURNS TABLE
AS
RETURN (
    SELECT u.id AS r_id, u.d AS r_delivery, e.lo AS r_lease, e.lease_until AS r_until
    FROM (
        SELECT CAST(i.[value] AS bigint) AS id, CAST(d.[value] AS int) AS d
        FROM OPENJSON(@ids) i JOIN OPENJSON(@deliveries) d ON d.[key] = i.[key]) AS u
    CROSS APPLY (
        SELECT TOP (1) e.lo, e.lease_until FROM {schema}.ring_leases e
        WHERE e.queue_id = @gid AND e.lo <= u.id AND e.hi >= u.id AND e.lease_until > SYSUTCDATETIME()
          AND (SELECT CAST(j.[value] AS bigint) FROM OPENJSON(e.starts) j
               WHERE j.[key] = CAST(u.id % @lanes AS nvarchar(11))) <= u.id
        ORDER BY e.lo DESC) AS e
    WHERE u.d = 1
    UNION ALL
    SELECT u.id, u.d, NULL, r.due_at
    FROM (
        SELECT CAST(i.[value] AS bigint) AS id, CAST(d.[value] AS int) AS d
        FROM OPENJSON(@ids) i JOIN OPENJSON(@deliveries) d ON d.[key] = i.[key]) AS u
    JOIN {schema}.ring_retry r ON r.queue_id = @gid AND r.id = u.id
    WHERE r.state = 2 AND r.deliveries = u.d AND r.due_at > SYSUTCDATETIME()
)

-- name: ring_ready
-- The messages of a ring that a pop could take now or later, without taking them: those of the lanes
-- past their positions (attempts 0), and those to deliver again (r_due: when they are due). A full scan
-- of the ring's slots: for observers (counts, stats, and the peek of a client older than ring_peek's
-- bounded reads, whose query reads this; a peek reads only what it shows: ring_peek), not for pops.
-- Of one consumer group: @gid is the key of its lanes and retry rows (the ring's queue_id for its default
-- group, a gid for another: ring_groups); the slots are the ring's (@queue_id).
CREATE OR ALTER FUNCTION {schema}.ring_ready(@queue_id int, @gid int)
RETURNS TABLE
AS
RETURN (
    SELECT s.seq AS r_id, 0 AS r_attempts, 0 AS r_deliveries, s.enqueued_at AS r_enqueued_at, s.enqueued_at AS r_due,
           s.payload AS r_payload
    FROM {schema}.rings g
    JOIN {schema}.ring_lanes l ON l.queue_id = @gid
    JOIN {schema}.ring_slots s ON s.queue_id = g.queue_id AND s.seq % g.lanes = l.lane AND s.seq >= l.pos
    WHERE g.queue_id = @queue_id AND s.payload IS NOT NULL
    UNION ALL
    SELECT r.id, r.attempts, r.deliveries, s.enqueued_at, r.due_at, s.payload
    FROM {schema}.rings g
    JOIN {schema}.ring_retry r ON r.queue_id = @gid
    JOIN {schema}.ring_slots s ON s.queue_id = g.queue_id AND s.slot = r.id % g.capacity
    WHERE g.queue_id = @queue_id AND r.state = 1
)

-- name: ring_push_lanes_held
-- The push lanes of a ring (all of them, or those of the JSON array @of) that another transaction holds
-- locked now, as a JSON array ("[]": none). A lane row never changes but for its counter, so the list of
-- lanes is read without locks; READCOMMITTEDLOCK, READPAST reads past exactly the locked ones (a locking
-- read even under READ_COMMITTED_SNAPSHOT). The caller's own locks do not count.
CREATE OR ALTER PROCEDURE {schema}.ring_push_lanes_held
    @queue_id int, @of nvarchar(max), @held nvarchar(max) OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SELECT @held = N'[' + coalesce(STRING_AGG(CAST(l.lane AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY l.lane), N'')
        + N']'
    FROM {schema}.ring_push_lanes l WITH (NOLOCK)
    WHERE l.queue_id = @queue_id
      AND (@of IS NULL OR l.lane IN (SELECT CAST(j.[value] AS int) FROM OPENJSON(@of) j))
      AND NOT EXISTS (
        SELECT 1 FROM {schema}.ring_push_lanes u WITH (READCOMMITTEDLOCK, READPAST)
        WHERE u.queue_id = l.queue_id AND u.lane = l.lane);
END

-- name: ring_floor
-- The floor of a ring: the lowest number that some consumer may still need, below which a slot's message
-- may be overwritten: the lowest, over every consumer group, of the lanes' positions (numbers not taken
-- yet), of the open leases (taken at least once, not acked) and of the messages to deliver again. A
-- committed floor never goes down: a number becomes needed again only by moving from a lease to the retry
-- rows, in one transaction, a pop's take and its lease commit together, and a new group's lanes start at
-- or above the floor (ring_add_group). Needed numbers only move, within a group, from the lanes to the
-- leases and from the leases to the retry rows, so reading the lanes of every group, then the leases,
-- then the retry rows, each committed (locking read committed waits for a writer in progress;
-- READ_COMMITTED_SNAPSHOT reads the last committed version), never misses one still needed: the result
-- is a safe bound for a later write, as a snapshot's is on PostgreSQL. The ring's own rows and its
-- groups' are read by separate statements, each a seek on its key. NULL when the ring has no lanes (it
-- does not exist).
CREATE OR ALTER PROCEDURE {schema}.ring_floor
    @queue_id int, @floor bigint OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @lanes bigint;
    DECLARE @leased bigint;
    DECLARE @leased_g bigint;
    DECLARE @retry bigint;
    DECLARE @retry_g bigint;
    SET @floor = (SELECT min(l.pos) FROM {schema}.ring_lanes l WHERE l.queue_id = @queue_id);
    SET @lanes = (
        SELECT min(l.pos) FROM {schema}.ring_groups g JOIN {schema}.ring_lanes l ON l.queue_id = g.gid
        WHERE g.queue_id = @queue_id);
    SET @leased = (SELECT min(e.lo) FROM {schema}.ring_leases e WHERE e.queue_id = @queue_id);
    SET @leased_g = (
        SELECT min(e.lo) FROM {schema}.ring_groups g JOIN {schema}.ring_leases e ON e.queue_id = g.gid
        WHERE g.queue_id = @queue_id);
    SET @retry = (SELECT min(r.id) FROM {schema}.ring_retry r WHERE r.queue_id = @queue_id);
    SET @retry_g = (
        SELECT min(r.id) FROM {schema}.ring_groups g JOIN {schema}.ring_retry r ON r.queue_id = g.gid
        WHERE g.queue_id = @queue_id);
    IF @lanes < @floor OR @floor IS NULL
    BEGIN
        SET @floor = @lanes;
    END;
    IF @leased < @floor OR @floor IS NULL
    BEGIN
        SET @floor = @leased;
    END;
    IF @leased_g < @floor OR @floor IS NULL
    BEGIN
        SET @floor = @leased_g;
    END;
    IF @retry < @floor OR @floor IS NULL
    BEGIN
        SET @floor = @retry;
    END;
    IF @retry_g < @floor OR @floor IS NULL
    BEGIN
        SET @floor = @retry_g;
    END;
END

-- name: ring_floor_try
-- ring_floor for the pushes and for the pops' gap skips, which must not wait on a transaction of unknown
-- length (a caller's transaction that popped exactly once holds its lanes until it ends): when a row it
-- reads stays locked for more than 100 ms, the floor is unknown (NULL). No slot is then free for a push
-- (it waits and looks again, up to its timeout), and a pop gives no gap up this time. The lock timeout
-- (error 1222) cancels that statement alone: XACT_ABORT is off in this procedure (SET options return to
-- the caller's when it returns), so the caller's transaction goes on. Any other error is raised again.
-- @gone: 1 when the floor was read and is NULL: the ring has no lanes, so it was dropped (a drop deletes
-- its lanes, leases and retry rows in one transaction), as PostgreSQL's ring_push reads a NULL floor.
CREATE OR ALTER PROCEDURE {schema}.ring_floor_try
    @queue_id int, @floor bigint OUTPUT, @gone bit = NULL OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT OFF;
    SET LOCK_TIMEOUT 100;
    SET @gone = 0;
    BEGIN TRY
        EXEC {schema}.ring_floor @queue_id = @queue_id, @floor = @floor OUTPUT;
        IF @floor IS NULL
        BEGIN
            SET @gone = 1;
        END;
    END TRY
    BEGIN CATCH
        SET @floor = NULL;
        IF ERROR_NUMBER() <> 1222
        BEGIN
            THROW;
        END;
    END CATCH;
END

-- name: ring_create
-- Create a ring: its push sequence and gap counter (CACHE 1000; each starts at 0 and hands 0 out at
-- once, so current_value is the last number issued: 0 = none), its header row, its lanes, its push lanes
-- (64) and capacity empty slots. Slot j starts as if it held the last number <= 0 that maps to it, so
-- number j + k * capacity finds its predecessor written and below every lane's first position. Lane k
-- starts at the first number of the lane (k, or @lanes for lane 0). The slots are first written with a
-- filler of @slot_bytes and then emptied, so each page keeps room for its slots' full payloads and an
-- update that fills a slot never splits a page.
CREATE OR ALTER PROCEDURE {schema}.ring_create
    @queue_id int, @capacity int, @slot_bytes int, @lanes int
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @schema sysname = OBJECT_SCHEMA_NAME(@@PROCID);
    DECLARE @seq nvarchar(300) = QUOTENAME(@schema) + N'.' + QUOTENAME(N'ring_' + CAST(@queue_id AS nvarchar(11)) + N'_seq');
    DECLARE @gaps nvarchar(300) = QUOTENAME(@schema) + N'.'
        + QUOTENAME(N'ring_' + CAST(@queue_id AS nvarchar(11)) + N'_gaps');
    DECLARE @sql nvarchar(max) = N'CREATE SEQUENCE ' + @seq + N' AS bigint START WITH 0 MINVALUE 0 CACHE 1000; '
        + N'CREATE SEQUENCE ' + @gaps + N' AS bigint START WITH 0 MINVALUE 0 CACHE 1000;';
    EXEC sys.sp_executesql @sql;
    DECLARE @zero sql_variant;
    EXEC sys.sp_sequence_get_range @sequence_name = @seq, @range_size = 1, @range_first_value = @zero OUTPUT;
    EXEC sys.sp_sequence_get_range @sequence_name = @gaps, @range_size = 1, @range_first_value = @zero OUTPUT;
    INSERT INTO {schema}.rings (queue_id, capacity, push_seq, gap_seq, push_seq_id, gap_seq_id, lanes, push_lanes)
    VALUES (@queue_id, @capacity, @seq, @gaps, OBJECT_ID(@seq), OBJECT_ID(@gaps), @lanes, 64);
    INSERT INTO {schema}.ring_lanes (queue_id, lane, pos)
    SELECT @queue_id, g.k, CASE WHEN g.k = 0 THEN @lanes ELSE g.k END FROM {schema}.ring_series(@lanes) g;
    INSERT INTO {schema}.ring_slots (queue_id, slot, seq, payload)
    SELECT @queue_id, g.k, CASE WHEN g.k = 0 THEN 0 ELSE g.k - @capacity END,
           CAST(REPLICATE(CAST('0' AS varchar(max)), @slot_bytes) AS varbinary(4000))
    FROM {schema}.ring_series(@capacity) g;
    UPDATE {schema}.ring_slots SET payload = NULL WHERE queue_id = @queue_id;
    INSERT INTO {schema}.ring_push_lanes (queue_id, lane)
    SELECT @queue_id, g.k FROM {schema}.ring_series(64) g;
END

-- name: ring_drop
-- Drop a ring: its header, slots and push lanes, the rows of every consumer group (the default group's
-- carry the ring's queue_id; another group's its gid) and the groups, and its sequences.
CREATE OR ALTER PROCEDURE {schema}.ring_drop
    @queue_id int
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @seq nvarchar(300);
    DECLARE @gaps nvarchar(300);
    DECLARE @sql nvarchar(max);
    SELECT @seq = push_seq, @gaps = gap_seq FROM {schema}.rings WHERE queue_id = @queue_id;
    DELETE FROM {schema}.rings WHERE queue_id = @queue_id;
    DELETE FROM {schema}.ring_slots WHERE queue_id = @queue_id;
    DELETE FROM {schema}.ring_lanes WHERE queue_id = @queue_id;
    DELETE FROM {schema}.ring_leases WHERE queue_id = @queue_id;
    DELETE FROM {schema}.ring_retry WHERE queue_id = @queue_id;
    DELETE FROM {schema}.ring_failed WHERE queue_id = @queue_id;
    DELETE FROM {schema}.ring_push_lanes WHERE queue_id = @queue_id;
    DELETE FROM {schema}.ring_lanes WHERE queue_id IN (SELECT g.gid FROM {schema}.ring_groups g WHERE g.queue_id = @queue_id);
    DELETE FROM {schema}.ring_leases WHERE queue_id IN (SELECT g.gid FROM {schema}.ring_groups g WHERE g.queue_id = @queue_id);
    DELETE FROM {schema}.ring_retry WHERE queue_id IN (SELECT g.gid FROM {schema}.ring_groups g WHERE g.queue_id = @queue_id);
    DELETE FROM {schema}.ring_failed WHERE queue_id IN (SELECT g.gid FROM {schema}.ring_groups g WHERE g.queue_id = @queue_id);
    DELETE FROM {schema}.ring_groups WHERE queue_id = @queue_id;
    IF @seq IS NOT NULL
    BEGIN
        SET @sql = N'DROP SEQUENCE IF EXISTS ' + @seq + N'; DROP SEQUENCE IF EXISTS ' + @gaps + N';';
        EXEC sys.sp_executesql @sql;
    END;
END

-- name: ring_add_group
-- Add a consumer group to a ring: its row in ring_groups (a new gid, from group_gids) and lanes of its
-- own. @earliest 1: each lane starts at the lowest position of that lane over the ring's groups (the
-- group sees every message that some group has not taken yet; messages that other groups hold leased or
-- to deliver again are theirs alone); otherwise at the first number of the lane past the push position
-- (the group sees what is pushed from now on). Either way each new lane starts at or above a lane of the
-- same numbers that holds the floor up already, so the floor does not go down: the ring's row and the
-- lanes of all its groups are locked (UPDLOCK, until the caller's transaction ends) first, so that no
-- other add runs and no lane moves on and lets a push overwrite a number the new group starts below.
-- @gid: the new group's gid, or NULL when the ring does not exist; a name taken is error 2627
-- (ring_groups_name_key).
CREATE OR ALTER PROCEDURE {schema}.ring_add_group
    @queue_id int, @name nvarchar(63), @earliest bit, @on_lag smallint, @lag_timeout_s float, @gid int OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET @gid = NULL;
    DECLARE @lanes int;
    DECLARE @issued bigint;
    DECLARE @locked int;
    DECLARE @v sql_variant;
    DECLARE @seq nvarchar(300) = QUOTENAME(OBJECT_SCHEMA_NAME(@@PROCID)) + N'.' + QUOTENAME(N'group_gids');
    SELECT @lanes = r.lanes, @issued = coalesce(CAST(q.current_value AS bigint), 0)
    FROM {schema}.rings r WITH (ROWLOCK, UPDLOCK)
    LEFT JOIN sys.sequences q ON q.object_id = r.push_seq_id
    WHERE r.queue_id = @queue_id;
    IF @lanes IS NULL
    BEGIN
        RETURN;
    END;
    SELECT @locked = count(*) FROM {schema}.ring_lanes t WITH (ROWLOCK, UPDLOCK) WHERE t.queue_id = @queue_id;
    SELECT @locked = count(*)
    FROM {schema}.ring_groups g JOIN {schema}.ring_lanes t WITH (ROWLOCK, UPDLOCK) ON t.queue_id = g.gid
    WHERE g.queue_id = @queue_id;
    EXEC sys.sp_sequence_get_range @sequence_name = @seq, @range_size = 1, @range_first_value = @v OUTPUT;
    SET @gid = -CAST(@v AS int);
    INSERT INTO {schema}.ring_lanes (queue_id, lane, pos)
    SELECT @gid, t.lane,
           CASE WHEN @earliest = 1 THEN min(t.pos)
                WHEN max(t.pos) > @issued + 1 + ((t.lane - (@issued + 1) % @lanes + @lanes) % @lanes) THEN max(t.pos)
                ELSE @issued + 1 + ((t.lane - (@issued + 1) % @lanes + @lanes) % @lanes) END
    FROM (
        SELECT l.lane, l.pos FROM {schema}.ring_lanes l WHERE l.queue_id = @queue_id
        UNION ALL
        SELECT l.lane, l.pos
        FROM {schema}.ring_groups g JOIN {schema}.ring_lanes l ON l.queue_id = g.gid
        WHERE g.queue_id = @queue_id) AS t
    GROUP BY t.lane;
    INSERT INTO {schema}.ring_groups (queue_id, gid, name, on_lag, lag_timeout_s)
    VALUES (@queue_id, @gid, @name, @on_lag, @lag_timeout_s);
END

-- name: ring_drop_group
-- Drop a consumer group (not the default one, whose rows carry the ring's queue_id: a gid names a row of
-- ring_groups): its lanes, leases, messages to deliver again, failed messages, batches and row. The floor rises to
-- what the other groups still need. @dropped: whether it was there.
CREATE OR ALTER PROCEDURE {schema}.ring_drop_group
    @queue_id int, @gid int, @dropped bit OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET @dropped = 0;
    DELETE FROM {schema}.ring_groups WHERE queue_id = @queue_id AND gid = @gid;
    IF @@ROWCOUNT = 0
    BEGIN
        RETURN;
    END;
    SET @dropped = 1;
    DELETE FROM {schema}.ring_lanes WHERE queue_id = @gid;
    DELETE FROM {schema}.ring_leases WHERE queue_id = @gid;
    DELETE FROM {schema}.ring_retry WHERE queue_id = @gid;
    DELETE FROM {schema}.ring_failed WHERE queue_id = @gid;
    DELETE FROM {schema}.batch_items
    WHERE batch_id IN (SELECT b.batch_id FROM {schema}.batches b WHERE b.queue_id = @gid);
    DELETE FROM {schema}.batches WHERE queue_id = @gid;
END

-- name: ring_push
-- Push a batch: take n contiguous numbers (sp_sequence_get_range) and write them into their slots, all or
-- nothing, in the caller's transaction. @num: the first number (the ids are @num .. @num + n - 1), or NULL
-- when the ring is full for the batch before anything was taken (the caller waits and calls again);
-- @written: whether the numbers are written. The payloads are the JSON array @payloads (hex strings), or
-- @payload alone. As on PostgreSQL, a slot is written when it holds the number a capacity before ours and
-- that number is below the ring's floor (no consumer needs it): a push never looks at what consumers did
-- to a slot, only at the floor. A slot not free yet (the ring is full there, or its previous number is a
-- gap not given up yet) is waited for with backoff (1 ms doubling to 50 ms) up to @timeout_s, then error
-- 50000 '[DQ001] ...'. If a consumer gave one of our numbers up as a gap (only with the lane proof, or
-- after its gap timeout), '[DQ002] ...': the caller retries with new numbers; its slot holds our number
-- without a payload, or a later number once the ring has gone round over it (nobody else writes our
-- number), which a push that waited long must not take for a full ring. Either way the slots this
-- push wrote are put back first (each to the number a capacity before, without a payload: that number is
-- below the floor, where nothing reads a slot), which leaves a caller's transaction usable after the
-- error (RAISERROR does not abort it, even with XACT_ABORT ON). Slots are written past locks (READPAST:
-- a locked slot is another writer's, and is not free for us yet), so pushes never wait on each other or
-- on consumers' slots; the floor is read committed, waiting 100 ms at most (ring_floor_try). The floor
-- read for the room check serves the first write too (a floor never goes down); each later attempt reads
-- it again. A lane stopped at a gap (a number issued and never written) holds the floor down too: the
-- caller helps to give it up between its calls (ring_pop of none), outside this transaction.
-- @first: the numbers were taken already, from @first on (ring_push_one took one and found its slot not
-- free yet): they are written, waiting as above, instead of new ones taken. @once (ring_push_one): take
-- the numbers and try once, without waiting; when they are not all written, put back what was written
-- and return @num with @written 0, the numbers issued and unwritten. A push locks one of the ring's push
-- lanes before it takes its numbers (the gap proof). SQL Server has no NOTIFY: waiting pops poll.
-- A ring that does not exist, or was dropped meanwhile (its floor is read as NULL: it has no lanes), is
-- error '[DQ004] ...', as on PostgreSQL; the slots this push wrote are put back first.
CREATE OR ALTER PROCEDURE {schema}.ring_push
    @queue_id int, @cap int, @payloads nvarchar(max), @payload varbinary(4000), @timeout_s float, @first bigint,
    @once bit, @num bigint OUTPUT, @written bit OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET @num = NULL;
    SET @written = 0;
    DECLARE @seq nvarchar(300);
    DECLARE @seq_id int;
    DECLARE @push_lanes int;
    SELECT @seq = push_seq, @seq_id = push_seq_id, @push_lanes = push_lanes FROM {schema}.rings WHERE queue_id = @queue_id;
    IF @seq IS NULL
    BEGIN
        RAISERROR (N'[DQ004] ring %d does not exist', 16, 1, @queue_id);
        RETURN;
    END;
    DECLARE @input TABLE (ord int PRIMARY KEY, payload varbinary(4000) NOT NULL);
    IF @payloads IS NULL AND @payload IS NOT NULL
    BEGIN
        INSERT INTO @input (ord, payload) VALUES (0, @payload);
    END;
    IF @payloads IS NOT NULL
    BEGIN
        INSERT INTO @input (ord, payload)
        SELECT CAST(p.[key] AS int), CONVERT(varbinary(4000), p.[value], 2) FROM OPENJSON(@payloads) p;
    END;
    DECLARE @n int = (SELECT count(*) FROM @input);
    IF @n < 1 OR @n > @cap
    BEGIN
        RAISERROR (N'[DQ003] a ring batch holds 1 to %d (the capacity) messages, got %d', 16, 1, @cap, @n);
        RETURN;
    END;
    DECLARE @floor bigint;
    DECLARE @gone bit = 0;
    -- Room first, before any lane or number is taken: when the number a capacity before the highest this
    -- batch would take is not below the floor (the ring is full there, or the floor is not known now),
    -- return with @num NULL. A floor read as NULL (no lanes) is a ring dropped since its row was read.
    IF @first IS NULL AND @once = 0
    BEGIN
        EXEC {schema}.ring_floor_try @queue_id = @queue_id, @floor = @floor OUTPUT, @gone = @gone OUTPUT;
        IF @gone = 1
        BEGIN
            RAISERROR (N'[DQ004] ring %d does not exist', 16, 1, @queue_id);
            RETURN;
        END;
        IF @floor IS NULL OR coalesce((
                SELECT CAST(q.current_value AS bigint) FROM sys.sequences q WHERE q.object_id = @seq_id), 0)
            + @n - @cap >= @floor
        BEGIN
            RETURN;
        END;
    END;
    -- A push lane before the numbers (the gap proof): the first free one from a random start, else wait.
    DECLARE @lane int = NULL;
    DECLARE @start int = ABS(CHECKSUM(NEWID())) % @push_lanes;
    WITH l AS (
        SELECT TOP (1) lane, pushes FROM {schema}.ring_push_lanes WITH (ROWLOCK, READPAST)
        WHERE queue_id = @queue_id AND lane >= @start
        ORDER BY lane)
    UPDATE l SET @lane = lane, pushes = pushes + 1;
    IF @lane IS NULL
    BEGIN
        WITH l AS (
            SELECT TOP (1) lane, pushes FROM {schema}.ring_push_lanes WITH (ROWLOCK, READPAST)
            WHERE queue_id = @queue_id AND lane < @start
            ORDER BY lane)
        UPDATE l SET @lane = lane, pushes = pushes + 1;
    END;
    IF @lane IS NULL
    BEGIN
        UPDATE l SET @lane = l.lane, pushes = l.pushes + 1
        FROM {schema}.ring_push_lanes l WITH (ROWLOCK)
        WHERE l.queue_id = @queue_id AND l.lane = @start;
    END;
    DECLARE @v sql_variant;
    IF @first IS NULL
    BEGIN
        EXEC sys.sp_sequence_get_range @sequence_name = @seq, @range_size = @n, @range_first_value = @v OUTPUT;
        SET @first = CAST(@v AS bigint);
    END;
    DECLARE @last bigint = @first + @n - 1;
    DECLARE @a int = @first % @cap;
    DECLARE @b1 int = CASE WHEN @a + @n < @cap THEN @a + @n ELSE @cap END;
    DECLARE @b2 int = CASE WHEN @a + @n > @cap THEN @a + @n - @cap ELSE 0 END;
    DECLARE @base1 bigint = @first - @a;
    DECLARE @base2 bigint = @first - @a + @cap;
    DECLARE @deadline datetime2(6) = DATEADD(millisecond, CAST(1000 * @timeout_s AS int), SYSUTCDATETIME());
    DECLARE @now datetime2(6);
    DECLARE @pause int = 1;
    DECLARE @wait datetime;
    DECLARE @done int = 0;
    DECLARE @fail int = 0;
    WHILE 1 = 1
    BEGIN
        IF @floor IS NULL
        BEGIN
            EXEC {schema}.ring_floor_try @queue_id = @queue_id, @floor = @floor OUTPUT, @gone = @gone OUTPUT;
            IF @gone = 1
            BEGIN
                SET @fail = 4;
                BREAK;
            END;
        END;
        SET @now = SYSUTCDATETIME();
        UPDATE s SET seq = @base1 + s.slot, enqueued_at = @now, payload = i.payload
        FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
        JOIN @input i ON i.ord = @base1 + s.slot - @first
        WHERE s.queue_id = @queue_id AND s.slot >= @a AND s.slot < @b1
          AND s.seq = @base1 + s.slot - @cap AND s.seq < @floor;
        SET @done = @done + @@ROWCOUNT;
        UPDATE s SET seq = @base2 + s.slot, enqueued_at = @now, payload = i.payload
        FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
        JOIN @input i ON i.ord = @base2 + s.slot - @first
        WHERE s.queue_id = @queue_id AND s.slot < @b2
          AND s.seq = @base2 + s.slot - @cap AND s.seq < @floor;
        SET @done = @done + @@ROWCOUNT;
        IF @done >= @n
        BEGIN
            BREAK;
        END;
        IF @once = 1
        BEGIN
            SET @fail = 3;
            BREAK;
        END;
        IF EXISTS (
            SELECT 1 FROM {schema}.ring_slots t WITH (READCOMMITTEDLOCK, READPAST)
            WHERE t.queue_id = @queue_id
              AND ((t.slot >= @a AND t.slot < @b1
                    AND (t.seq = @base1 + t.slot AND t.payload IS NULL OR t.seq > @base1 + t.slot))
                   OR (t.slot < @b2
                       AND (t.seq = @base2 + t.slot AND t.payload IS NULL OR t.seq > @base2 + t.slot))))
        BEGIN
            SET @fail = 2;
            BREAK;
        END;
        IF SYSUTCDATETIME() >= @deadline
        BEGIN
            SET @fail = 1;
            BREAK;
        END;
        SET @wait = DATEADD(millisecond, @pause, CAST(0 AS datetime));
        WAITFOR DELAY @wait;
        SET @pause = CASE WHEN @pause >= 25 THEN 50 ELSE 2 * @pause END;
        SET @floor = NULL;
    END;
    IF @fail > 0
    BEGIN
        -- Put back the slots this push wrote: they hold our numbers with a payload (a number given up as a
        -- gap holds no payload, and no one else writes our numbers). Our own locks are never read past.
        UPDATE s SET seq = s.seq - @cap, payload = NULL, enqueued_at = NULL
        FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
        WHERE s.queue_id = @queue_id AND s.slot >= @a AND s.slot < @b1 AND s.seq = @base1 + s.slot
          AND s.payload IS NOT NULL;
        UPDATE s SET seq = s.seq - @cap, payload = NULL, enqueued_at = NULL
        FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
        WHERE s.queue_id = @queue_id AND s.slot < @b2 AND s.seq = @base2 + s.slot AND s.payload IS NOT NULL;
    END;
    IF @fail = 1
    BEGIN
        RAISERROR (N'[DQ001] ring %d stayed full for %d ms (capacity %d)', 16, 1, @queue_id,
            CAST(1000 * @timeout_s AS int), @cap);
        RETURN;
    END;
    IF @fail = 2
    BEGIN
        RAISERROR (N'[DQ002] ring %d: numbers %I64d .. %I64d were given up as gaps before this push wrote them',
            16, 1, @queue_id, @first, @last);
        RETURN;
    END;
    IF @fail = 4
    BEGIN
        RAISERROR (N'[DQ004] ring %d does not exist', 16, 1, @queue_id);
        RETURN;
    END;
    SET @num = @first;
    SET @written = CASE WHEN @fail = 0 THEN 1 ELSE 0 END;
END

-- name: ring_skip_gap
-- Give up abandoned numbers (gaps) of a ring, as pops do: the numbers from @gap up to @issued (at most
-- 4096) still unwritten, whose slot holds the number a capacity before them below the floor and that
-- nobody holds locked, once every push lane of @snap (the lanes other transactions held after @issued
-- was read) has been seen unlocked. Without that proof, @force (the caller's gap timeout ran out) gives
-- up the run of unwritten numbers that starts at @gap, up to the first written or locked one (a push
-- writing it, perhaps in a long transaction of its caller: the pushes behind it may be waiting, and their
-- numbers are kept). Those numbers' slots are free for them, so a live push would have written them the
-- moment it took them: they belong to pushes that rolled back or died, or to one stalled that long
-- between taking its numbers and writing them, which then fails with DQ002 and pushes again. Nothing
-- happens unless @gap is still unwritten (a slot another transaction holds counts as written: its writer
-- is alive) and the floor is known (ring_floor_try). A given-up number's slot holds it with no payload.
-- @remaining: the lanes of @snap still locked now ("[]": the proof holds; NULL: not asked). @skipped: how
-- many numbers it gave up.
CREATE OR ALTER PROCEDURE {schema}.ring_skip_gap
    @queue_id int, @cap int, @gap bigint, @issued bigint, @snap nvarchar(max), @force bit,
    @remaining nvarchar(max) OUTPUT, @skipped int = NULL OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET @remaining = NULL;
    SET @skipped = 0;
    DECLARE @a int = @gap % @cap;
    DECLARE @max bigint = CASE WHEN @issued > @gap THEN @issued - @gap + 1 ELSE 1 END;
    DECLARE @floor bigint;
    DECLARE @span bigint = 0;
    DECLARE @gaps nvarchar(300) = (SELECT gap_seq FROM {schema}.rings WHERE queue_id = @queue_id);
    DECLARE @to1 int;
    DECLARE @to2 int;
    DECLARE @base1 bigint = @gap - @a;
    DECLARE @base2 bigint = @gap - @a + @cap;
    DECLARE @k int;
    DECLARE @v sql_variant;
    SET @max = CASE WHEN @max > 4096 THEN 4096 ELSE @max END;
    SET @max = CASE WHEN @max > @cap THEN @cap ELSE @max END;
    EXEC {schema}.ring_floor_try @queue_id = @queue_id, @floor = @floor OUTPUT;
    IF EXISTS (
        SELECT 1 FROM {schema}.ring_slots t WITH (READCOMMITTEDLOCK, READPAST)
        WHERE t.queue_id = @queue_id AND t.slot = @a AND t.seq = @gap - @cap AND t.seq < @floor)
    BEGIN
        IF @snap IS NOT NULL AND @issued IS NOT NULL
        BEGIN
            EXEC {schema}.ring_push_lanes_held @queue_id = @queue_id, @of = @snap, @held = @remaining OUTPUT;
        END;
        IF @remaining = N'[]'
        BEGIN
            SET @span = @max;
        END;
        IF @span = 0 AND @force = 1
        BEGIN
            -- The run: the numbers from @gap on that are unwritten and that nobody holds locked, up to the
            -- first that is written or locked. The run's slots stay locked (UPDLOCK) until it is given up.
            SELECT @span = count(*) FROM (
                SELECT u.num, row_number() OVER (ORDER BY u.num) AS rn FROM (
                    SELECT @gap - @a + t.slot AS num FROM {schema}.ring_slots t WITH (ROWLOCK, UPDLOCK, READPAST)
                    WHERE t.queue_id = @queue_id AND t.slot >= @a AND t.slot < @a + @max AND t.slot < @cap
                      AND t.seq = @gap - @a + t.slot - @cap AND t.seq < @floor
                    UNION ALL
                    SELECT @gap + @cap - @a + t.slot FROM {schema}.ring_slots t WITH (ROWLOCK, UPDLOCK, READPAST)
                    WHERE t.queue_id = @queue_id AND t.slot < @a + @max - @cap
                      AND t.seq = @gap + @cap - @a + t.slot - @cap AND t.seq < @floor) AS u) AS w
            WHERE w.num = @gap + w.rn - 1;
        END;
    END;
    IF @span <= 0 OR @gaps IS NULL
    BEGIN
        RETURN;
    END;
    SET @to1 = CASE WHEN @a + @span < @cap THEN @a + @span ELSE @cap END;
    SET @to2 = CASE WHEN @a + @span > @cap THEN @a + @span - @cap ELSE 0 END;
    UPDATE s SET seq = @base1 + s.slot, payload = NULL, enqueued_at = NULL
    FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
    WHERE s.queue_id = @queue_id AND s.slot >= @a AND s.slot < @to1
      AND s.seq = @base1 + s.slot - @cap AND s.seq < @floor;
    SET @k = @@ROWCOUNT;
    UPDATE s SET seq = @base2 + s.slot, payload = NULL, enqueued_at = NULL
    FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
    WHERE s.queue_id = @queue_id AND s.slot < @to2
      AND s.seq = @base2 + s.slot - @cap AND s.seq < @floor;
    SET @k = @k + @@ROWCOUNT;
    SET @skipped = @k;
    IF @k > 0
    BEGIN
        EXEC sys.sp_sequence_get_range @sequence_name = @gaps, @range_size = @k, @range_first_value = @v OUTPUT;
    END;
END

-- name: ring_skip_abandoned
-- Maintenance's gap recovery: give up every number of a ring up to @issued that a push took and never
-- wrote, wherever it lies, once every push lane of @snap (taken after @issued was read) has been seen
-- unlocked. A number x is unwritten while its slot holds x - capacity; it is given up when that number is
-- below the floor (its slot is free for x). Slots locked by a push writing them are passed over. Returns
-- one row (skipped, remaining): skipped -1 and the lanes of @snap still locked while the proof does not
-- hold yet (the caller waits and asks again with them), else how many numbers it gave up.
CREATE OR ALTER PROCEDURE {schema}.ring_skip_abandoned
    @queue_id int, @issued bigint, @snap nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @remaining nvarchar(max);
    DECLARE @cap int;
    DECLARE @gaps nvarchar(300);
    DECLARE @floor bigint;
    DECLARE @v sql_variant;
    DECLARE @k int = 0;
    EXEC {schema}.ring_push_lanes_held @queue_id = @queue_id, @of = @snap, @held = @remaining OUTPUT;
    IF @remaining <> N'[]'
    BEGIN
        SELECT -1 AS skipped, @remaining AS remaining;
        RETURN;
    END;
    SELECT @cap = capacity, @gaps = gap_seq FROM {schema}.rings WHERE queue_id = @queue_id;
    IF @cap IS NOT NULL
    BEGIN
        EXEC {schema}.ring_floor @queue_id = @queue_id, @floor = @floor OUTPUT;
        UPDATE s SET seq = s.seq + @cap, payload = NULL, enqueued_at = NULL
        FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
        WHERE s.queue_id = @queue_id AND s.seq + @cap <= @issued AND s.seq < @floor;
        SET @k = @@ROWCOUNT;
    END;
    IF @k > 0
    BEGIN
        EXEC sys.sp_sequence_get_range @sequence_name = @gaps, @range_size = @k, @range_first_value = @v OUTPUT;
    END;
    SELECT @k AS skipped, CAST(NULL AS nvarchar(max)) AS remaining;
END

-- name: ring_pass
-- Move lanes on over numbers given up as gaps at their heads (a slot holding the number with no payload).
-- Nothing is delivered by that, so whoever can lock a lane may do it: pops pass such numbers as they take,
-- and pushes waiting for the floor and maintenance pass them too, so that a ring whose consumers are away
-- does not stay full of given-up numbers. The lanes of every consumer group move (the ring's own, and
-- those of its groups' gids). Lanes held by pops are left to them (ROWLOCK, UPDLOCK, READPAST, as SKIP
-- LOCKED). Slots are read past locks (READCOMMITTEDLOCK, READPAST): a slot another transaction holds is
-- being written and stops its lane, as its committed version does on PostgreSQL. Each round moves every
-- lane whose head is a given-up number one number of its lane on. @moved: how many lanes moved.
CREATE OR ALTER PROCEDURE {schema}.ring_pass
    @queue_id int, @cap int, @lanes int, @moved int = NULL OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @l TABLE (gid int NOT NULL, lane int NOT NULL, pos bigint NOT NULL, start bigint NOT NULL, PRIMARY KEY (gid, lane));
    INSERT INTO @l (gid, lane, pos, start)
    SELECT t.queue_id, t.lane, t.pos, t.pos FROM {schema}.ring_lanes t WITH (ROWLOCK, UPDLOCK, READPAST)
    WHERE t.queue_id = @queue_id;
    INSERT INTO @l (gid, lane, pos, start)
    SELECT t.queue_id, t.lane, t.pos, t.pos
    FROM {schema}.ring_groups g JOIN {schema}.ring_lanes t WITH (ROWLOCK, UPDLOCK, READPAST) ON t.queue_id = g.gid
    WHERE g.queue_id = @queue_id;
    WHILE 1 = 1
    BEGIN
        UPDATE l SET pos = l.pos + @lanes
        FROM @l l
        WHERE EXISTS (
            SELECT 1 FROM {schema}.ring_slots s WITH (READCOMMITTEDLOCK, READPAST)
            WHERE s.queue_id = @queue_id AND s.slot = l.pos % @cap AND s.seq = l.pos AND s.payload IS NULL);
        IF @@ROWCOUNT = 0
        BEGIN
            BREAK;
        END;
    END;
    UPDATE t SET pos = l.pos
    FROM {schema}.ring_lanes t JOIN @l l ON l.gid = t.queue_id AND l.lane = t.lane
    WHERE l.pos > l.start;
    SET @moved = @@ROWCOUNT;
END

-- name: ring_take
-- Take up to @n messages from the lanes: the fast path of every pop (the ring_take query), and the last
-- step of ring_pop, which inserts its rows. Lanes are locked lowest position first, passing over those
-- other pops hold (ROWLOCK, UPDLOCK, READPAST on ring_lanes_pos_idx, as SKIP LOCKED): a pop of one takes
-- one lane, a batch up to @n of them, so that consumers take from different lanes at once. Within the
-- lanes it holds, a pop takes the numbers from their positions on, in id order, up to the first number
-- that is issued but not written yet (a push in progress, or a gap): positions never pass a number
-- nobody has seen, so every message is delivered. A lane whose next number is not written is left alone
-- for this pop (it is not even locked). The window is at most a capacity of numbers from the lowest
-- position held, no further than the issued position and about @n messages of the lanes held; its
-- numbers come from ring_series, and its slots are read past locks (READCOMMITTEDLOCK, READPAST): a slot
-- another transaction holds (a push writing it) is unwritten for this pop, as its committed version is
-- on PostgreSQL. Numbers given up as gaps (no payload) are passed over and not returned. The positions
-- move past the last number taken; with @lease the messages are leased as one ring_leases row a part
-- (below), otherwise they are finished when the transaction commits.
-- @retries: take nothing while messages to deliver again are ready (past those other pops hold): ring_pop
-- serves them first. The check is part of the statements that lock the lanes, and it is made again
-- before a wait, so that a pop never waits for lanes while such messages are due. @wait: when every lane
-- is locked by other pops, wait for them (for one lane, the lowest, at a pop of one) instead of returning
-- nothing, at most LOCK_TIMEOUT (1 s, set here; error 1222 after it): batch consumers then take turns
-- with all the lanes, each pop one short transaction, instead of finding nothing and calling again.
-- One result set at most: the messages (id, attempts, deliveries, enqueued_at, lease_until, payload), in
-- id order.
-- @queue_id: the ring's queue_id, for its default group; for another consumer group its gid (negative,
-- ring_groups), the key of its lanes, leases and retry rows, by which the ring is looked up (its slots
-- and sequence are the ring's). So the default group's pops pass what a ring without groups does.
-- A group dropped meanwhile has no lanes: the take finds nothing.
CREATE OR ALTER PROCEDURE {schema}.ring_take
    @queue_id int, @cap int, @lanes int, @n int, @lease bit, @vt float, @consumer nvarchar(200), @retries bit,
    @wait bit
AS
BEGIN
    SET NOCOUNT ON;
    SET LOCK_TIMEOUT 1000;
    DECLARE @gid int = @queue_id;
    IF @queue_id < 0
    BEGIN
        SET @queue_id = (SELECT g.queue_id FROM {schema}.ring_groups g WHERE g.gid = @gid);
    END;
    DECLARE @now datetime2(6) = SYSUTCDATETIME();
    DECLARE @until datetime2(6) = CASE WHEN @lease = 1 THEN DATEADD(microsecond, CAST(1e6 * (@vt - FLOOR(@vt)) AS int),
                                                                    DATEADD(second, CAST(FLOOR(@vt) AS int), @now)) END;
    DECLARE @one TABLE (lane int NOT NULL, pos bigint NOT NULL);
    DECLARE @m TABLE (lane int NOT NULL, seq bigint NOT NULL, enqueued_at datetime2(6), payload varbinary(4000));
    DECLARE @held TABLE (lane int PRIMARY KEY, pos bigint NOT NULL);
    -- The parts taken (at most two): slots a .. b, holding the numbers base + slot, of the lanes held from
    -- their positions at the part (@starts).
    DECLARE @parts TABLE (part int PRIMARY KEY, a int NOT NULL, b int NOT NULL, base bigint NOT NULL);
    DECLARE @starts TABLE (part int NOT NULL, lane int NOT NULL, pos bigint NOT NULL, PRIMARY KEY (part, lane));
    DECLARE @most int = CASE WHEN @n < @lanes THEN @n ELSE @lanes END;
    DECLARE @lo bigint;
    DECLARE @count int;
    DECLARE @issued bigint;
    DECLARE @a int;
    DECLARE @span bigint;
    DECLARE @width bigint;
    DECLARE @part int = 0;
    DECLARE @got int = 0;
    DECLARE @top bigint;
    DECLARE @first bigint;
    DECLARE @last bigint;
    DECLARE @k int;
    DECLARE @whole int;
    DECLARE @more int;
    DECLARE @lease_starts nvarchar(max);
    IF @n = 1
    BEGIN
        -- One message: the lowest lane whose next number is written, one row locked and moved on, and
        -- nothing when messages to deliver again are due (checked by the same statement).
        WITH l AS (
            SELECT TOP (1) t.lane, t.pos FROM {schema}.ring_lanes t WITH (ROWLOCK, UPDLOCK, READPAST)
            WHERE t.queue_id = @gid AND EXISTS (
                SELECT 1 FROM {schema}.ring_slots s WITH (READCOMMITTEDLOCK, READPAST)
                WHERE s.queue_id = @queue_id AND s.slot = t.pos % @cap AND s.seq = t.pos)
              AND NOT (@retries = 1 AND EXISTS (
                SELECT 1 FROM {schema}.ring_retry r WITH (READCOMMITTEDLOCK, READPAST)
                WHERE r.queue_id = @gid AND r.state = 1 AND r.due_at <= @now))
            ORDER BY t.pos)
        UPDATE l SET pos = pos + @lanes
        OUTPUT deleted.lane, deleted.pos INTO @one;
        INSERT INTO @m (lane, seq, enqueued_at, payload)
        SELECT o.lane, s.seq, s.enqueued_at, s.payload
        FROM @one o JOIN {schema}.ring_slots s ON s.queue_id = @queue_id AND s.slot = o.pos % @cap;
        IF EXISTS (SELECT 1 FROM @m WHERE payload IS NOT NULL)
        BEGIN
            IF @lease = 1
            BEGIN
                INSERT INTO {schema}.ring_leases (queue_id, lo, hi, starts, n, lease_until, consumer)
                SELECT @gid, m.seq, m.seq,
                       (SELECT N'[' + STRING_AGG(CASE WHEN g.k = m.lane THEN CAST(m.seq AS nvarchar(max))
                                                      ELSE CAST(N'null' AS nvarchar(max)) END, N',')
                                      WITHIN GROUP (ORDER BY g.k) + N']'
                        FROM {schema}.ring_series(@lanes) g),
                       1, @until, @consumer
                FROM @m m;
            END;
            SELECT m.seq, 1, 1, m.enqueued_at, @until, m.payload FROM @m m;
            RETURN;
        END;
        IF @wait = 0
        BEGIN
            RETURN;
        END;
    END;
    -- A batch: the lanes whose next number is written, lowest first, as many as the batch could use;
    -- none while messages to deliver again are due.
    INSERT INTO @held (lane, pos)
    SELECT TOP (@most) t.lane, t.pos FROM {schema}.ring_lanes t WITH (ROWLOCK, UPDLOCK, READPAST)
    WHERE t.queue_id = @gid AND EXISTS (
        SELECT 1 FROM {schema}.ring_slots s WITH (READCOMMITTEDLOCK, READPAST)
        WHERE s.queue_id = @queue_id AND s.slot = t.pos % @cap AND s.seq = t.pos)
      AND NOT (@retries = 1 AND EXISTS (
        SELECT 1 FROM {schema}.ring_retry r WITH (READCOMMITTEDLOCK, READPAST)
        WHERE r.queue_id = @gid AND r.state = 1 AND r.due_at <= @now))
    ORDER BY t.pos;
    -- None: because messages to deliver again are due (then nothing is taken and nothing waited for), or,
    -- when waiting, because every lane is held by another pop? (Separate statements: T-SQL does not
    -- promise to evaluate an AND in order, and the second look locks the lane it finds, as PostgreSQL's
    -- does.)
    IF @retries = 1 AND NOT EXISTS (SELECT 1 FROM @held)
    BEGIN
        IF EXISTS (
            SELECT 1 FROM {schema}.ring_retry r WITH (READCOMMITTEDLOCK, READPAST)
            WHERE r.queue_id = @gid AND r.state = 1 AND r.due_at <= @now)
        BEGIN
            RETURN;
        END;
    END;
    IF @wait = 1 AND NOT EXISTS (SELECT 1 FROM @held)
    BEGIN
        IF NOT EXISTS (
            SELECT 1 FROM {schema}.ring_lanes t WITH (ROWLOCK, UPDLOCK, READPAST) WHERE t.queue_id = @gid)
        BEGIN
            -- Every lane is held by other pops: wait for the lowest one, then take free ones up to half the
            -- lanes. A pop that finds the lanes free takes all it can use (one consumer alone sees ids in
            -- order); consumers popping at the same time then share the lanes, each its part, instead of
            -- taking turns with all of them (as on PostgreSQL, whose ring_take says what that was worth).
            INSERT INTO @held (lane, pos)
            SELECT TOP (1) t.lane, t.pos FROM {schema}.ring_lanes t WITH (ROWLOCK, UPDLOCK)
            WHERE t.queue_id = @gid
            ORDER BY t.pos;
            IF @n > 1 AND @lanes > 2
            BEGIN
                SET @more = CASE WHEN @n < @lanes / 2 THEN @n ELSE @lanes / 2 END - 1;
                INSERT INTO @held (lane, pos)
                SELECT TOP (@more) t.lane, t.pos FROM {schema}.ring_lanes t WITH (ROWLOCK, UPDLOCK, READPAST)
                WHERE t.queue_id = @gid AND t.lane NOT IN (SELECT h.lane FROM @held h)
                ORDER BY t.pos;
            END;
            -- Only those whose next number is written: a lane stopped at a push in progress or a gap gives
            -- nothing now, and must not stop the others.
            DELETE h FROM @held h
            WHERE NOT EXISTS (
                SELECT 1 FROM {schema}.ring_slots s WITH (READCOMMITTEDLOCK, READPAST)
                WHERE s.queue_id = @queue_id AND s.slot = h.pos % @cap AND s.seq = h.pos);
        END;
    END;
    SET @lo = (SELECT min(h.pos) FROM @held h);
    IF @lo IS NULL
    BEGIN
        RETURN;
    END;
    SET @issued = coalesce((
        SELECT CAST(q.current_value AS bigint) FROM {schema}.rings r JOIN sys.sequences q ON q.object_id = r.push_seq_id
        WHERE r.queue_id = @queue_id), 0);
    SET @count = (SELECT count(*) FROM @held);
    SET @span = CASE WHEN @issued - @lo + 1 < @cap THEN @issued - @lo + 1 ELSE @cap END;
    SET @span = CASE WHEN CAST(@n AS bigint) * @lanes / @count + @lanes < @span
                     THEN CAST(@n AS bigint) * @lanes / @count + @lanes ELSE @span END;
    -- The window's numbers of the lanes held, past their positions, in slot order, which is id order up to
    -- the end of the slots: "bad" counts the unwritten numbers so far and "before" the messages, so the
    -- numbers before the first unwritten one, up to the @n-th message, are taken. One lease row holds what
    -- a part took: every number of a held lane from its position up to the last one taken. A window that
    -- runs past the end of the slots is taken in two parts (two lease rows), the second from slot 0 once
    -- the first took everything to the end.
    WHILE @part < 2 AND @span > 0 AND @got < @n
    BEGIN
        SET @part = @part + 1;
        SET @a = @lo % @cap;
        SET @width = CASE WHEN @cap - @a < @span THEN @cap - @a ELSE @span END;
        -- Where the part ends, from the slots' numbers alone (no payload is read). Usually every number of
        -- the first @n - @got rows is written: the part ends at the last of them (one plain aggregate).
        -- Otherwise it ends before the first one unwritten, up to the (@n - @got)-th message ("bad" counts
        -- the unwritten numbers so far and "before" the messages).
        SELECT @top = max(r.x), @first = min(CASE WHEN r.msg = 1 THEN r.x END),
               @last = max(CASE WHEN r.msg = 1 THEN r.x END), @k = count(CASE WHEN r.msg = 1 THEN 1 END),
               @whole = min(r.ok)
        FROM (
            SELECT TOP (@n - @got) @lo + g.k AS x, CASE WHEN s.seq = @lo + g.k THEN 1 ELSE 0 END AS ok,
                   CASE WHEN s.payload IS NOT NULL THEN 1 ELSE 0 END AS msg
            FROM {schema}.ring_series(@width) g
            JOIN @held h ON h.lane = (@lo + g.k) % @lanes AND h.pos <= @lo + g.k
            LEFT JOIN {schema}.ring_slots s WITH (READCOMMITTEDLOCK, READPAST)
              ON s.queue_id = @queue_id AND s.slot = @a + g.k
            ORDER BY g.k) AS r;
        IF @whole = 0
        BEGIN
            SELECT @top = max(w.x), @first = min(CASE WHEN w.msg = 1 THEN w.x END),
                   @last = max(CASE WHEN w.msg = 1 THEN w.x END), @k = count(CASE WHEN w.msg = 1 THEN 1 END)
            FROM (
                SELECT r.x, r.msg,
                       sum(r.bad) OVER (ORDER BY r.k ROWS UNBOUNDED PRECEDING) AS bad,
                       sum(r.msg) OVER (ORDER BY r.k ROWS UNBOUNDED PRECEDING) - r.msg AS before
                FROM (
                    SELECT g.k, @lo + g.k AS x, CASE WHEN s.seq = @lo + g.k THEN 0 ELSE 1 END AS bad,
                           CASE WHEN s.payload IS NOT NULL THEN 1 ELSE 0 END AS msg
                    FROM {schema}.ring_series(@width) g
                    JOIN @held h ON h.lane = (@lo + g.k) % @lanes AND h.pos <= @lo + g.k
                    LEFT JOIN {schema}.ring_slots s WITH (READCOMMITTEDLOCK, READPAST)
                      ON s.queue_id = @queue_id AND s.slot = @a + g.k) AS r) AS w
            WHERE w.bad = 0 AND w.before < @n - @got;
        END;
        IF @top IS NULL
        BEGIN
            BREAK;
        END;
        UPDATE l
        SET pos = CASE WHEN l.pos > @top + 1 + ((l.lane - (@top + 1) % @lanes + @lanes) % @lanes) THEN l.pos
                       ELSE @top + 1 + ((l.lane - (@top + 1) % @lanes + @lanes) % @lanes) END
        FROM {schema}.ring_lanes l JOIN @held h ON h.lane = l.lane
        WHERE l.queue_id = @gid;
        IF @lease = 1 AND @k > 0
        BEGIN
            SET @lease_starts = (
                SELECT N'[' + STRING_AGG(coalesce(CAST(h.pos AS nvarchar(max)), CAST(N'null' AS nvarchar(max))), N',')
                              WITHIN GROUP (ORDER BY g.k) + N']'
                FROM {schema}.ring_series(@lanes) g LEFT JOIN @held h ON h.lane = g.k);
            INSERT INTO {schema}.ring_leases (queue_id, lo, hi, starts, n, lease_until, consumer)
            VALUES (@gid, @first, @last, @lease_starts, @k, @until, @consumer);
        END;
        INSERT INTO @parts (part, a, b, base) VALUES (@part, @a, @top - @lo + @a, @lo - @a);
        INSERT INTO @starts (part, lane, pos) SELECT @part, h.lane, h.pos FROM @held h;
        SET @got = @got + @k;
        IF @a + @span <= @cap OR @got >= @n
        BEGIN
            BREAK;
        END;
        -- Past the end of the slots: go on from slot 0 only if the held lanes took everything up to it.
        UPDATE h SET pos = l.pos
        FROM @held h JOIN {schema}.ring_lanes l ON l.queue_id = @gid AND l.lane = h.lane;
        IF EXISTS (SELECT 1 FROM @held h WHERE h.pos < @lo - @a + @cap)
        BEGIN
            BREAK;
        END;
        SET @span = @span - (@cap - @a);
        SET @lo = @lo - @a + @cap;
    END;
    -- The messages taken, their payloads read in one range a part (past locks: a slot of a lane not held
    -- may be a push writing it; the numbers taken are written and nobody writes them before this commits).
    SELECT p.base + s.slot, 1, 1, s.enqueued_at, @until, s.payload
    FROM @parts p
    JOIN {schema}.ring_slots s WITH (READCOMMITTEDLOCK, READPAST)
      ON s.queue_id = @queue_id AND s.slot >= p.a AND s.slot <= p.b
    JOIN @starts h ON h.part = p.part AND h.lane = (p.base + s.slot) % @lanes AND h.pos <= p.base + s.slot
    WHERE s.payload IS NOT NULL
    ORDER BY p.part, s.slot;
END

-- name: ring_split_leases
-- Turn whole leases (the JSON array @los of their lo) into retry rows leased as before, one a message:
-- before some of their messages are acked, nacked or reclaimed alone. The caller holds the leases locked.
-- @made: the rows made.
-- @gid: the key of the consumer group's leases and retry rows (the ring's queue_id for its default group,
-- a gid for another); the slots are the ring's (@queue_id).
CREATE OR ALTER PROCEDURE {schema}.ring_split_leases
    @queue_id int, @cap int, @lanes int, @los nvarchar(max), @error nvarchar(1000), @gid int, @made int = NULL OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @e TABLE (
        lo bigint PRIMARY KEY, hi bigint NOT NULL, starts nvarchar(max) NOT NULL, lease_until datetime2(6) NOT NULL,
        consumer nvarchar(200));
    DECLARE @s TABLE (lo bigint NOT NULL, lane int NOT NULL, start bigint NOT NULL, PRIMARY KEY (lo, lane));
    DECLARE @x TABLE (id bigint PRIMARY KEY, lease_until datetime2(6) NOT NULL, consumer nvarchar(200));
    DELETE e
    OUTPUT deleted.lo, deleted.hi, deleted.starts, deleted.lease_until, deleted.consumer INTO @e
    FROM {schema}.ring_leases e
    WHERE e.queue_id = @gid AND e.lo IN (SELECT CAST(j.[value] AS bigint) FROM OPENJSON(@los) j);
    INSERT INTO @s (lo, lane, start)
    SELECT e.lo, CAST(j.[key] AS int), CAST(j.[value] AS bigint)
    FROM @e e CROSS APPLY OPENJSON(e.starts) j
    WHERE j.[type] = 2;
    -- The numbers of each lease's range in its lanes, from each lane's start; then those that are
    -- messages (their slot holds them with a payload; the rest were given up as gaps).
    INSERT INTO @x (id, lease_until, consumer)
    SELECT e.lo + g.k, e.lease_until, e.consumer
    FROM @e e
    CROSS APPLY {schema}.ring_series(e.hi - e.lo + 1) g
    JOIN @s s ON s.lo = e.lo AND s.lane = (e.lo + g.k) % @lanes AND s.start <= e.lo + g.k;
    INSERT INTO {schema}.ring_retry (queue_id, id, state, attempts, deliveries, due_at, consumer, last_error)
    SELECT @gid, x.id, 2, 1, 1, x.lease_until, x.consumer, @error
    FROM @x x
    JOIN {schema}.ring_slots t ON t.queue_id = @queue_id AND t.slot = x.id % @cap AND t.seq = x.id
    WHERE t.payload IS NOT NULL;
    SET @made = @@ROWCOUNT;
END

-- name: ring_pop
-- Pop: the path of a pop that the fast one (ring_take alone) did not fill. In order: (1) give up the gap
-- the caller saw at the head of its last pop (ring_skip_gap: with the lane proof, or @force after the
-- caller's gap timeout) and, when it gave something up, move every lane it can lock over given-up numbers
-- (ring_pass); (2) serve the messages to deliver again that are due, lowest id first, past those other
-- pops hold (a lease makes each a retry row leased until now + @vt, with one more attempt; otherwise it
-- is finished); (3) take the rest from the lanes (ring_take), waiting for a lane when other pops hold
-- every one, unless the pop runs in the caller's transaction. A pop of none (@n 0) does only (1) and the
-- report below: a push that finds the ring full calls it between its attempts, so that gaps alone never
-- keep a ring full. One result set: the messages,
-- then one last row (r_id NULL) that reports the lowest lane position when its number is issued but not
-- written (a push in progress, or a gap), with the issued position and, from its second sighting on, the
-- push lanes held (ring_push_lanes_held) after that position was read: the caller passes them back
-- (@gap...) on its next pop, which gives the gap up once those lanes have all been seen unlocked. A head
-- unwritten for one pop only is nearly always a push writing it, so the lanes are listed only when it
-- stays; once listed, the same position is passed on with the lanes of the list still locked, until the
-- proof holds (a new list would name new pushes for ever under load).
-- @own: the pop runs in the caller's transaction, which may roll back: it skips no gap, waits for no lane
-- and reports none. LOCK_TIMEOUT (1 s, for this procedure and those it calls) bounds the wait for lanes
-- held by other pops (a caller's long transaction may hold them): the pop then fails with error 1222,
-- and the caller pops again. Lanes and slots of the head are read past locks: a lane another pop is
-- moving is that pop's to report, and a slot a push holds is unwritten. A pop not in the caller's
-- transaction of a ring whose row is gone (it was dropped) is error '[DQ004] ...', as on PostgreSQL.
-- @queue_id as ring_take's: the ring's queue_id, or another consumer group's gid (its lanes and retry
-- rows), by which the ring is looked up for the gap's handling (ring_skip_gap and ring_pass are the
-- ring's) and its slots. A pop of a group dropped meanwhile finds no ring: '[DQ004] ...'.
CREATE OR ALTER PROCEDURE {schema}.ring_pop
    @queue_id int, @cap int, @lanes int, @n int, @lease bit, @vt float, @consumer nvarchar(200), @own bit,
    @gap bigint, @gap_issued bigint, @gap_snap nvarchar(max), @force bit
AS
BEGIN
    SET NOCOUNT ON;
    SET LOCK_TIMEOUT 1000;
    DECLARE @gid int = @queue_id;
    IF @queue_id < 0
    BEGIN
        SET @queue_id = (SELECT g.queue_id FROM {schema}.ring_groups g WHERE g.gid = @gid);
    END;
    DECLARE @remaining nvarchar(max) = NULL;
    DECLARE @skipped int = 0;
    DECLARE @moved int;
    DECLARE @issued bigint;
    DECLARE @now datetime2(6);
    DECLARE @until datetime2(6);
    DECLARE @rest int;
    DECLARE @wait bit = CASE WHEN @own = 1 THEN 0 ELSE 1 END;
    DECLARE @head bigint = NULL;
    DECLARE @r_gap bigint = NULL;
    DECLARE @r_issued bigint = NULL;
    DECLARE @r_snap nvarchar(max) = NULL;
    DECLARE @r TABLE (id bigint PRIMARY KEY, attempts int NOT NULL, deliveries int NOT NULL);
    DECLARE @out TABLE (
        id bigint NOT NULL, attempts int NOT NULL, deliveries int NOT NULL, enqueued_at datetime2(6),
        lease_until datetime2(6), payload varbinary(4000));
    IF @gap IS NOT NULL AND @own = 0
    BEGIN
        EXEC {schema}.ring_skip_gap @queue_id = @queue_id, @cap = @cap, @gap = @gap, @issued = @gap_issued,
            @snap = @gap_snap, @force = @force, @remaining = @remaining OUTPUT, @skipped = @skipped OUTPUT;
    END;
    IF @skipped > 0
    BEGIN
        -- The lanes stopped at the numbers given up move over them now, even those this pop does not take
        -- from: until they do, those numbers keep the ring's floor down.
        EXEC {schema}.ring_pass @queue_id = @queue_id, @cap = @cap, @lanes = @lanes, @moved = @moved OUTPUT;
    END;
    -- The issued position, read before any list of push lanes below.
    SET @issued = coalesce((
        SELECT CAST(q.current_value AS bigint) FROM {schema}.rings g JOIN sys.sequences q ON q.object_id = g.push_seq_id
        WHERE g.queue_id = @queue_id), 0);
    SET @now = SYSUTCDATETIME();
    SET @until = CASE WHEN @lease = 1 THEN DATEADD(microsecond, CAST(1e6 * (@vt - FLOOR(@vt)) AS int),
                                                   DATEADD(second, CAST(FLOOR(@vt) AS int), @now)) END;
    IF @lease = 1
    BEGIN
        WITH c AS (
            SELECT TOP (@n) t.id, t.state, t.attempts, t.deliveries, t.due_at, t.consumer
            FROM {schema}.ring_retry t WITH (ROWLOCK, UPDLOCK, READPAST)
            WHERE t.queue_id = @gid AND t.state = 1 AND t.due_at <= @now
            ORDER BY t.id)
        UPDATE c SET state = 2, attempts = attempts + 1, deliveries = deliveries + 1, due_at = @until, consumer = @consumer
        OUTPUT inserted.id, inserted.attempts, inserted.deliveries INTO @r;
    END;
    IF @lease = 0
    BEGIN
        WITH c AS (
            SELECT TOP (@n) t.id, t.attempts, t.deliveries
            FROM {schema}.ring_retry t WITH (ROWLOCK, UPDLOCK, READPAST)
            WHERE t.queue_id = @gid AND t.state = 1 AND t.due_at <= @now
            ORDER BY t.id)
        DELETE FROM c
        OUTPUT deleted.id, deleted.attempts + 1, deleted.deliveries + 1 INTO @r;
    END;
    INSERT INTO @out (id, attempts, deliveries, enqueued_at, lease_until, payload)
    SELECT r.id, r.attempts, r.deliveries, s.enqueued_at, @until, s.payload
    FROM @r r JOIN {schema}.ring_slots s ON s.queue_id = @queue_id AND s.slot = r.id % @cap;
    SET @rest = @n - (SELECT count(*) FROM @r);
    IF @rest > 0
    BEGIN
        INSERT INTO @out (id, attempts, deliveries, enqueued_at, lease_until, payload)
        EXEC {schema}.ring_take @queue_id = @gid, @cap = @cap, @lanes = @lanes, @n = @rest, @lease = @lease,
            @vt = @vt, @consumer = @consumer, @retries = 0, @wait = @wait;
    END;
    IF @own = 0
    BEGIN
        -- A ring whose row is gone was dropped: '[DQ004] ...', as on PostgreSQL (the caller then finds its
        -- queue gone).
        IF NOT EXISTS (SELECT 1 FROM {schema}.rings g WHERE g.queue_id = @queue_id)
        BEGIN
            RAISERROR (N'[DQ004] ring %d does not exist', 16, 1, @queue_id);
            RETURN;
        END;
        -- The head: the lowest lane position whose number is issued and not written.
        SELECT TOP (1) @head = l.pos
        FROM {schema}.ring_lanes l WITH (READCOMMITTEDLOCK, READPAST)
        LEFT JOIN {schema}.ring_slots s WITH (READCOMMITTEDLOCK, READPAST)
          ON s.queue_id = @queue_id AND s.slot = l.pos % @cap
        WHERE l.queue_id = @gid AND l.pos <= @issued AND (s.seq IS NULL OR s.seq < l.pos)
        ORDER BY l.pos;
    END;
    IF @head IS NOT NULL
    BEGIN
        SET @r_gap = @head;
        SET @r_issued = CASE WHEN @head = @gap AND @gap_snap IS NOT NULL THEN @gap_issued ELSE @issued END;
        IF @head = @gap AND @gap_snap IS NOT NULL
        BEGIN
            SET @r_snap = coalesce(@remaining, @gap_snap);
        END;
        IF @head = @gap AND @gap_snap IS NULL
        BEGIN
            EXEC {schema}.ring_push_lanes_held @queue_id = @queue_id, @of = NULL, @held = @r_snap OUTPUT;
        END;
    END;
    SELECT x.r_id, x.r_attempts, x.r_deliveries, x.r_enqueued_at, x.r_lease_until, x.r_payload, x.r_gap, x.r_issued,
           x.r_snap
    FROM (
        SELECT o.id AS r_id, o.attempts AS r_attempts, o.deliveries AS r_deliveries, o.enqueued_at AS r_enqueued_at,
               o.lease_until AS r_lease_until, o.payload AS r_payload, CAST(NULL AS bigint) AS r_gap,
               CAST(NULL AS bigint) AS r_issued, CAST(NULL AS nvarchar(max)) AS r_snap, 0 AS is_meta
        FROM @out o
        UNION ALL
        SELECT NULL, NULL, NULL, NULL, NULL, NULL, @r_gap, @r_issued, @r_snap, 1) AS x
    ORDER BY x.is_meta, x.r_id;
END

-- name: ring_settle
-- Ack (@nack 0) or nack the deliveries named by receipts (the JSON arrays @ids and @deliveries), all or
-- nothing: when any receipt does not hold its lease, nothing changes and no row comes back (the caller
-- asks ring_held which did). Leases are split into retry rows first (ring_split_leases), so every receipt
-- is then a retry row leased as its delivery. An ack deletes them; a nack makes them ready again after
-- @delay_s or the backoff (backoff_s * 2^(attempts-1), at most backoff_max_s), or, after @max_attempts,
-- copies them with their payload to ring_failed (their slots are then free for a push). Rows: (id, state)
-- of each: 0 finished, 1 ready again, 2 failed. The leases and retry rows are locked (UPDLOCK) in key
-- order first, so two settles never deadlock, and then the receipts are checked again.
-- @gid: the key of the consumer group's leases, retry rows and failed messages (the ring's queue_id for
-- its default group, a gid for another); the slots are the ring's (@queue_id).
CREATE OR ALTER PROCEDURE {schema}.ring_settle
    @queue_id int, @cap int, @lanes int, @ids nvarchar(max), @deliveries nvarchar(max), @nack bit, @delay_s float,
    @backoff_s float, @backoff_max_s float, @max_attempts int, @error nvarchar(1000), @gid int
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @now datetime2(6) = SYSUTCDATETIME();
    DECLARE @wanted int = (SELECT count(*) FROM OPENJSON(@ids));
    DECLARE @held int;
    DECLARE @locked int;
    DECLARE @split nvarchar(max);
    DECLARE @r TABLE (id bigint PRIMARY KEY);
    DECLARE @los TABLE (lo bigint PRIMARY KEY);
    DECLARE @h TABLE (ord int IDENTITY(1, 1) PRIMARY KEY, id bigint NOT NULL, lease bigint NULL);
    DECLARE @f TABLE (id bigint PRIMARY KEY, attempts int NOT NULL);
    DECLARE @done TABLE (id bigint NOT NULL, state int NOT NULL);
    INSERT INTO @r (id) SELECT DISTINCT CAST(j.[value] AS bigint) FROM OPENJSON(@ids) j;
    INSERT INTO @los (lo)
    SELECT DISTINCT h.r_lease FROM {schema}.ring_held(@queue_id, @lanes, @ids, @deliveries, @gid) h
    WHERE h.r_lease IS NOT NULL;
    SELECT @locked = count(*)
    FROM @los l JOIN {schema}.ring_leases e WITH (ROWLOCK, UPDLOCK) ON e.queue_id = @gid AND e.lo = l.lo;
    SELECT @locked = count(*)
    FROM @r r JOIN {schema}.ring_retry t WITH (ROWLOCK, UPDLOCK) ON t.queue_id = @gid AND t.id = r.id;
    INSERT INTO @h (id, lease)
    SELECT h.r_id, h.r_lease FROM {schema}.ring_held(@queue_id, @lanes, @ids, @deliveries, @gid) h;
    SET @held = (SELECT count(*) FROM @h);
    IF @held >= @wanted
    BEGIN
        SET @split = (
            SELECT N'[' + STRING_AGG(CAST(l.lease AS nvarchar(max)), N',') + N']'
            FROM (SELECT DISTINCT h.lease FROM @h h WHERE h.lease IS NOT NULL) AS l);
        IF @split IS NOT NULL
        BEGIN
            EXEC {schema}.ring_split_leases @queue_id = @queue_id, @cap = @cap, @lanes = @lanes, @los = @split,
                @error = NULL, @gid = @gid;
        END;
        IF @nack = 0
        BEGIN
            DELETE t OUTPUT deleted.id, 0 INTO @done
            FROM {schema}.ring_retry t
            WHERE t.queue_id = @gid AND t.id IN (SELECT r.id FROM @r r);
        END;
        IF @nack = 1
        BEGIN
            DELETE t OUTPUT deleted.id, deleted.attempts INTO @f
            FROM {schema}.ring_retry t
            WHERE t.queue_id = @gid AND t.id IN (SELECT r.id FROM @r r) AND t.attempts >= @max_attempts;
            INSERT INTO {schema}.ring_failed (queue_id, id, attempts, enqueued_at, last_error, payload)
            OUTPUT inserted.id, 2 INTO @done
            SELECT @gid, f.id, f.attempts, s.enqueued_at, @error, coalesce(s.payload, 0x)
            FROM @f f JOIN {schema}.ring_slots s ON s.queue_id = @queue_id AND s.slot = f.id % @cap;
            UPDATE t
            SET state = 1, consumer = NULL, last_error = @error,
                due_at = DATEADD(microsecond, CAST(1e6 * (b.w - FLOOR(b.w)) AS int),
                                 DATEADD(second, CAST(FLOOR(b.w) AS int), @now))
            OUTPUT inserted.id, 1 INTO @done
            FROM {schema}.ring_retry t
            CROSS APPLY (
                SELECT coalesce(@delay_s, CASE
                    WHEN @backoff_s * POWER(2e0, CASE WHEN t.attempts > 1 THEN t.attempts - 1 ELSE 0 END) > @backoff_max_s
                    THEN @backoff_max_s
                    ELSE @backoff_s * POWER(2e0, CASE WHEN t.attempts > 1 THEN t.attempts - 1 ELSE 0 END) END) AS w) AS b
            WHERE t.queue_id = @gid AND t.id IN (SELECT r.id FROM @r r) AND t.attempts < @max_attempts;
        END;
    END;
    SELECT d.id AS r_id, d.state AS r_state FROM @done d;
END

-- name: ring_reclaim_expired
-- Expired leases go back to ready as retry rows (keeping their ids) or, after @max_attempts, to
-- ring_failed: whole ring_leases rows and leased retry rows alike, up to @limit of each, past those
-- other transactions hold. Rows: (id, state) of each message moved, 1 ready again, 2 failed.
-- @gid: the key of the consumer group's leases, retry rows and failed messages (the ring's queue_id for
-- its default group, a gid for another); the slots are the ring's (@queue_id).
CREATE OR ALTER PROCEDURE {schema}.ring_reclaim_expired
    @queue_id int, @cap int, @lanes int, @max_attempts int, @limit int, @gid int
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @now datetime2(6) = SYSUTCDATETIME();
    DECLARE @split nvarchar(max);
    DECLARE @los TABLE (lo bigint PRIMARY KEY);
    DECLARE @x TABLE (id bigint PRIMARY KEY, attempts int NOT NULL, error nvarchar(1000));
    DECLARE @f TABLE (id bigint PRIMARY KEY, attempts int NOT NULL, error nvarchar(1000));
    DECLARE @done TABLE (id bigint NOT NULL, state int NOT NULL);
    INSERT INTO @los (lo)
    SELECT TOP (@limit) e.lo FROM {schema}.ring_leases e WITH (ROWLOCK, UPDLOCK, READPAST)
    WHERE e.queue_id = @gid AND e.lease_until <= @now
    ORDER BY e.lo;
    SET @split = (SELECT N'[' + STRING_AGG(CAST(l.lo AS nvarchar(max)), N',') + N']' FROM @los l);
    IF @split IS NOT NULL
    BEGIN
        EXEC {schema}.ring_split_leases @queue_id = @queue_id, @cap = @cap, @lanes = @lanes, @los = @split,
            @error = NULL, @gid = @gid;
    END;
    INSERT INTO @x (id, attempts, error)
    SELECT TOP (@limit) r.id, r.attempts, N'lease expired (held by ' + coalesce(r.consumer, N'?') + N')'
    FROM {schema}.ring_retry r WITH (ROWLOCK, UPDLOCK, READPAST)
    WHERE r.queue_id = @gid AND r.state = 2 AND r.due_at <= @now
    ORDER BY r.id;
    DELETE t OUTPUT deleted.id, deleted.attempts, x.error INTO @f
    FROM {schema}.ring_retry t JOIN @x x ON x.id = t.id
    WHERE t.queue_id = @gid AND x.attempts >= @max_attempts;
    INSERT INTO {schema}.ring_failed (queue_id, id, attempts, enqueued_at, last_error, payload)
    OUTPUT inserted.id, 2 INTO @done
    SELECT @gid, f.id, f.attempts, s.enqueued_at, f.error, coalesce(s.payload, 0x)
    FROM @f f JOIN {schema}.ring_slots s ON s.queue_id = @queue_id AND s.slot = f.id % @cap;
    UPDATE t SET state = 1, due_at = @now, consumer = NULL, last_error = x.error
    OUTPUT inserted.id, 1 INTO @done
    FROM {schema}.ring_retry t JOIN @x x ON x.id = t.id
    WHERE t.queue_id = @gid AND x.attempts < @max_attempts;
    SELECT d.id AS r_id, d.state AS r_state FROM @done d;
END
