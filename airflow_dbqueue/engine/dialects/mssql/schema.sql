-- The whole current schema of a dbqueue schema on SQL Server (2016 or later: OPENJSON), for a fresh
-- install. {schema} is replaced by the bracket-quoted schema name. Versions count per dialect: the first
-- SQL Server schema already holds what PostgreSQL reached in four steps (deliveries, batches).
-- Blocks: "schema" is version 1; a block named vN_<what> belongs to version N. A fresh install runs
-- "schema" and then every vN_ block in file order; an install at version k runs the vN_ blocks with
-- N > k (so a migrated schema is the fresh one by construction). Each block is one batch: a CREATE
-- PROCEDURE must be alone in its batch. The schema itself is created by install() (only when it does not
-- exist; an existing one must be empty), not here.
-- SCHEMA_VERSION: 3

-- name: schema
CREATE TABLE {schema}.schema_version (
    version int NOT NULL,
    applied_at datetime2(6) NOT NULL CONSTRAINT schema_version_applied_df DEFAULT SYSUTCDATETIME(),
    CONSTRAINT schema_version_pkey PRIMARY KEY (version)
);

-- One row a queue: its settings. Many queues share the tables below.
CREATE TABLE {schema}.queues (
    queue_id int IDENTITY(1, 1) NOT NULL,
    name nvarchar(48) NOT NULL,
    design varchar(8) NOT NULL,
    payload_type varchar(8) NOT NULL,
    max_payload_bytes int NOT NULL,
    max_attempts int NOT NULL,
    visibility_timeout_s float NOT NULL,
    retry_backoff_s float NOT NULL,
    retry_backoff_max_s float NOT NULL,
    notify varchar(8) NOT NULL,
    archive bit NOT NULL,
    created_at datetime2(6) NOT NULL CONSTRAINT queues_created_df DEFAULT SYSUTCDATETIME(),
    CONSTRAINT queues_pkey PRIMARY KEY (queue_id),
    CONSTRAINT queues_name_key UNIQUE (name),
    CONSTRAINT queues_name_valid CHECK (
        name NOT LIKE '%[^a-z0-9_]%' COLLATE Latin1_General_BIN AND name NOT LIKE '[0-9]%' AND len(name) > 0),
    CONSTRAINT queues_design_valid CHECK (design IN ('table', 'ring')),
    CONSTRAINT queues_payload_type_valid CHECK (payload_type IN ('json', 'text', 'bytes')),
    CONSTRAINT queues_notify_valid CHECK (notify IN ('auto', 'always', 'never')),
    CONSTRAINT queues_limits_valid CHECK (
        max_payload_bytes > 0 AND max_attempts > 0 AND visibility_timeout_s > 0
        AND retry_backoff_s >= 0 AND retry_backoff_max_s >= retry_backoff_s)
);

-- Seed 001: a sequence with a large cache hands out ids without a hot row.
CREATE SEQUENCE {schema}.message_id_seq AS bigint START WITH 1 INCREMENT BY 1 CACHE 1000;

-- The table design's meta table (seed 002's QueueMeta): small rows without LOB columns, the only table
-- the dequeue path searches, so its indexes can be rebuilt online. States and counters as on PostgreSQL:
-- state 0 ready (or delayed, by process_at), 1 leased, 2 failed; deliveries never resets. Times are UTC.
CREATE TABLE {schema}.meta (
    id bigint NOT NULL,
    queue_id int NOT NULL,
    state tinyint NOT NULL CONSTRAINT meta_state_df DEFAULT 0,
    priority smallint NOT NULL CONSTRAINT meta_priority_df DEFAULT 0,
    attempts int NOT NULL CONSTRAINT meta_attempts_df DEFAULT 0,
    process_at datetime2(6) NOT NULL,
    enqueued_at datetime2(6) NOT NULL,
    lease_until datetime2(6) NULL,
    consumer nvarchar(200) NULL,
    last_error nvarchar(1000) NULL,
    deliveries int NOT NULL CONSTRAINT meta_deliveries_df DEFAULT 0,
    CONSTRAINT meta_pkey PRIMARY KEY CLUSTERED (id) WITH (FILLFACTOR = 90),
    CONSTRAINT meta_state_valid CHECK (state IN (0, 1, 2)),
    CONSTRAINT meta_lease_valid CHECK ((state = 1 AND lease_until IS NOT NULL) OR (state <> 1 AND lease_until IS NULL))
);

-- Shaped exactly like the claim: WHERE queue_id = ? AND state = 0 ORDER BY priority DESC, process_at, id.
CREATE INDEX meta_ready_idx ON {schema}.meta (queue_id, priority DESC, process_at, id) WHERE state = 0;
-- Lease reclaim walks expired leases in expiry order; receipt checks probe meta_pkey.
CREATE INDEX meta_leased_idx ON {schema}.meta (queue_id, lease_until) WHERE state = 1;
-- Failed-message admin.
CREATE INDEX meta_failed_idx ON {schema}.meta (queue_id, id) WHERE state = 2;

-- Payloads (seed 002's QueueData), apart from the dequeue path; read only after a claim.
CREATE TABLE {schema}.data (
    id bigint NOT NULL,
    payload varbinary(max) NOT NULL,
    CONSTRAINT data_pkey PRIMARY KEY CLUSTERED (id)
);

-- Finished messages waiting to be archived. outcome: 1 finished, 2 discarded from the failed state.
CREATE TABLE {schema}.done (
    id bigint NOT NULL,
    queue_id int NOT NULL,
    priority smallint NOT NULL,
    attempts int NOT NULL,
    enqueued_at datetime2(6) NOT NULL,
    finished_at datetime2(6) NOT NULL CONSTRAINT done_finished_df DEFAULT SYSUTCDATETIME(),
    outcome tinyint NOT NULL,
    CONSTRAINT done_pkey PRIMARY KEY NONCLUSTERED (id),
    CONSTRAINT done_outcome_valid CHECK (outcome IN (1, 2))
);
CREATE CLUSTERED INDEX done_finished_idx ON {schema}.done (finished_at);

-- Archived messages with their payloads.
CREATE TABLE {schema}.archive (
    id bigint NOT NULL,
    queue_id int NOT NULL,
    priority smallint NOT NULL,
    attempts int NOT NULL,
    enqueued_at datetime2(6) NOT NULL,
    finished_at datetime2(6) NOT NULL,
    archived_at datetime2(6) NOT NULL CONSTRAINT archive_archived_df DEFAULT SYSUTCDATETIME(),
    outcome tinyint NOT NULL,
    payload varbinary(max) NOT NULL,
    CONSTRAINT archive_pkey PRIMARY KEY NONCLUSTERED (id)
);
CREATE CLUSTERED INDEX archive_archived_idx ON {schema}.archive (archived_at);

-- The batch ledger. T-SQL has no arrays: a batch's receipts are rows of batch_items, numbered by ord
-- in claim order (which is also the partition column a Spark JDBC reader wants). state: 0 claimed,
-- 1 acked, 2 released.
CREATE TABLE {schema}.batches (
    batch_id uniqueidentifier NOT NULL,
    queue_id int NOT NULL,
    state tinyint NOT NULL CONSTRAINT batches_state_df DEFAULT 0,
    consumer nvarchar(200) NULL,
    claimed_at datetime2(6) NOT NULL CONSTRAINT batches_claimed_df DEFAULT SYSUTCDATETIME(),
    lease_until datetime2(6) NOT NULL,
    finished_at datetime2(6) NULL,
    last_error nvarchar(1000) NULL,
    CONSTRAINT batches_pkey PRIMARY KEY NONCLUSTERED (batch_id),
    CONSTRAINT batches_state_valid CHECK (state IN (0, 1, 2))
);
CREATE INDEX batches_open_idx ON {schema}.batches (queue_id, claimed_at) WHERE state = 0;

CREATE TABLE {schema}.batch_items (
    batch_id uniqueidentifier NOT NULL,
    ord int NOT NULL,
    id bigint NOT NULL,
    delivery int NOT NULL,
    CONSTRAINT batch_items_pkey PRIMARY KEY CLUSTERED (batch_id, ord)
);

-- name: v2_ring_tables
-- The ring design (seeds 000/001) on SQL Server: a preallocated table of slots per ring, UPDATE only.
-- Number x of a ring lives in slot x % capacity; a push of x may only overwrite a slot whose previous
-- occupant x - capacity is finished. Numbers come from a sequence per ring with CACHE (ring_<id>_seq),
-- a batch's n contiguous numbers from one sp_sequence_get_range call. gap_seq counts numbers given up
-- as gaps (a sequence: counting takes no lock; it may count a skip whose transaction then rolled back).
-- push_seq_id and gap_seq_id are the sequences' object ids, to read their current_value (the last
-- number handed out) from sys.sequences.
CREATE TABLE {schema}.rings (
    queue_id int NOT NULL,
    capacity int NOT NULL,
    push_seq nvarchar(300) NOT NULL,
    gap_seq nvarchar(300) NOT NULL,
    push_seq_id int NOT NULL,
    gap_seq_id int NOT NULL,
    lanes int NOT NULL,
    CONSTRAINT rings_pkey PRIMARY KEY (queue_id),
    CONSTRAINT rings_capacity_valid CHECK (capacity > 0),
    CONSTRAINT rings_lanes_valid CHECK (lanes > 0)
);

-- The slots of every ring, clustered on (queue_id, slot); no other index, and no key column ever
-- changes. Payloads are inline varbinary(4000) (RING_MAX_PAYLOAD): never off-row. ring_create first
-- writes every slot with a filler of the queue's max_payload_bytes and then empties it, so each page
-- keeps room for its slots' full payloads and an update that fills a slot never splits a page.
-- state: 0 free (seq finished), 1 ready (seq, poppable from due_at), 2 leased (seq in flight until
-- due_at), 3 skipped (seq was given up: a gap; counts as finished). Lock escalation is off: a push or
-- pop of more than 5,000 slots keeps its row locks instead of locking the whole table.
CREATE TABLE {schema}.ring_slots (
    queue_id int NOT NULL,
    slot int NOT NULL,
    seq bigint NOT NULL,
    state tinyint NOT NULL,
    attempts int NOT NULL CONSTRAINT ring_slots_attempts_df DEFAULT 0,
    deliveries int NOT NULL CONSTRAINT ring_slots_deliveries_df DEFAULT 0,
    enqueued_at datetime2(6) NULL,
    due_at datetime2(6) NULL,
    consumer nvarchar(200) NULL,
    last_error nvarchar(1000) NULL,
    payload varbinary(4000) NULL,
    CONSTRAINT ring_slots_pkey PRIMARY KEY CLUSTERED (queue_id, slot),
    CONSTRAINT ring_slots_state_valid CHECK (state IN (0, 1, 2, 3))
);
ALTER TABLE {schema}.ring_slots SET (LOCK_ESCALATION = DISABLE);

-- Ring messages that used max_attempts (the ring's failed state), out of the ring.
CREATE TABLE {schema}.ring_failed (
    queue_id int NOT NULL,
    id bigint NOT NULL,
    attempts int NOT NULL,
    enqueued_at datetime2(6) NOT NULL,
    failed_at datetime2(6) NOT NULL CONSTRAINT ring_failed_failed_df DEFAULT SYSUTCDATETIME(),
    last_error nvarchar(1000) NULL,
    payload varbinary(4000) NOT NULL,
    CONSTRAINT ring_failed_pkey PRIMARY KEY CLUSTERED (queue_id, id)
);

-- The gap proof (PostgreSQL reads a snapshot's in-progress transactions; SQL Server has no such
-- function for an ordinary user). Each ring has `lanes` rows here. A push locks one lane (an UPDATE:
-- an exclusive row lock, held until its transaction ends) before it takes its numbers. So a number
-- issued before time t was taken by a transaction that either has ended or held a lane locked at t.
-- A checker reads the issued position, then lists the lanes locked by other transactions (READPAST
-- skips exactly those); once each listed lane has been seen unlocked afterwards, every holder of a
-- number up to that position is gone, and an unwritten number there will never be written. A lane
-- relocked meanwhile belongs to a push that took its numbers after the position was read.
CREATE TABLE {schema}.ring_lanes (
    queue_id int NOT NULL,
    lane int NOT NULL,
    pushes bigint NOT NULL CONSTRAINT ring_lanes_pushes_df DEFAULT 0,
    CONSTRAINT ring_lanes_pkey PRIMARY KEY CLUSTERED (queue_id, lane)
);

-- name: v2_ring_lanes_held
-- The lanes of a ring (all of them, or those of the JSON array @of) that another transaction holds
-- locked now, as a JSON array ("[]": none). A lane row never changes but for its counter, so the list
-- of lanes is read without locks; READCOMMITTEDLOCK, READPAST reads past exactly the locked ones (a
-- locking read even under READ_COMMITTED_SNAPSHOT). The caller's own locks do not count.
CREATE OR ALTER PROCEDURE {schema}.ring_lanes_held
    @queue_id int, @of nvarchar(max), @held nvarchar(max) OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SELECT @held = N'[' + coalesce(STRING_AGG(CAST(l.lane AS nvarchar(max)), N',') WITHIN GROUP (ORDER BY l.lane), N'')
        + N']'
    FROM {schema}.ring_lanes l WITH (NOLOCK)
    WHERE l.queue_id = @queue_id
      AND (@of IS NULL OR l.lane IN (SELECT CAST(j.[value] AS int) FROM OPENJSON(@of) j))
      AND NOT EXISTS (
        SELECT 1 FROM {schema}.ring_lanes u WITH (READCOMMITTEDLOCK, READPAST)
        WHERE u.queue_id = l.queue_id AND u.lane = l.lane);
END

-- name: v2_ring_create
-- Create a ring: its push sequence and gap counter (CACHE 1000; each starts at 0 and hands 0 out at
-- once, so current_value is the last number issued: 0 = none), its header row, its lanes, and capacity
-- free slots. Slot j starts as if it held the last number <= 0 that maps to it, finished.
CREATE OR ALTER PROCEDURE {schema}.ring_create
    @queue_id int, @capacity int, @slot_bytes int
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
    INSERT INTO {schema}.rings (queue_id, capacity, push_seq, gap_seq, push_seq_id, gap_seq_id, lanes)
    VALUES (@queue_id, @capacity, @seq, @gaps, OBJECT_ID(@seq), OBJECT_ID(@gaps), 64);
    WITH d AS (
        SELECT v FROM (VALUES (0), (1), (2), (3), (4), (5), (6), (7), (8), (9), (10), (11), (12), (13), (14), (15)) AS x (v)
    ), g AS (
        SELECT TOP (@capacity) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) - 1 AS g
        FROM d AS d1 CROSS JOIN d AS d2 CROSS JOIN d AS d3 CROSS JOIN d AS d4 CROSS JOIN d AS d5 CROSS JOIN d AS d6
    )
    INSERT INTO {schema}.ring_slots (queue_id, slot, seq, state, payload)
    SELECT @queue_id, g.g, CASE WHEN g.g = 0 THEN 0 ELSE g.g - @capacity END, 0,
           CAST(REPLICATE(CAST('0' AS varchar(max)), @slot_bytes) AS varbinary(4000))
    FROM g;
    UPDATE {schema}.ring_slots SET payload = NULL WHERE queue_id = @queue_id;
    WITH d AS (SELECT v FROM (VALUES (0), (1), (2), (3), (4), (5), (6), (7)) AS x (v))
    INSERT INTO {schema}.ring_lanes (queue_id, lane)
    SELECT @queue_id, d1.v * 8 + d2.v FROM d AS d1 CROSS JOIN d AS d2;
END

-- name: v2_ring_drop
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
    DELETE FROM {schema}.ring_failed WHERE queue_id = @queue_id;
    DELETE FROM {schema}.ring_lanes WHERE queue_id = @queue_id;
    IF @seq IS NOT NULL
    BEGIN
        SET @sql = N'DROP SEQUENCE IF EXISTS ' + @seq + N'; DROP SEQUENCE IF EXISTS ' + @gaps + N';';
        EXEC sys.sp_executesql @sql;
    END;
END

-- name: v2_ring_push
-- Push a batch: lock a lane, take n contiguous numbers (sp_sequence_get_range), write them into their
-- slots, all in the caller's transaction; then SELECT the first number. A slot whose previous occupant
-- is not finished (the ring is full there) is waited for with backoff (1 ms doubling to 50 ms) up to
-- @timeout_s, then the slots this push wrote are put back and error 50000 '[DQ001] ...' is raised.
-- If a consumer gave one of our numbers up as a gap (only with the lane proof, or after its gap
-- timeout), the written slots are put back and '[DQ002] ...' is raised: the caller retries with new
-- numbers. Putting back (rather than a savepoint) leaves a caller's transaction usable after the error
-- (RAISERROR does not abort it, even with XACT_ABORT ON). While waiting, the push gives up predecessors
-- of its slots that are abandoned (numbers a capacity below ours, issued before ours and unwritten)
-- once every lane another transaction held after our numbers were issued has been seen unlocked, so a
-- ring nobody pops keeps taking pushes. SQL Server has no NOTIFY: @notify is not used.
CREATE OR ALTER PROCEDURE {schema}.ring_push
    @queue_id int, @payloads nvarchar(max), @timeout_s float, @notify int
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @cap int;
    DECLARE @seq nvarchar(300);
    DECLARE @gaps nvarchar(300);
    DECLARE @lanes int;
    SELECT @cap = capacity, @seq = push_seq, @gaps = gap_seq, @lanes = lanes FROM {schema}.rings WHERE queue_id = @queue_id;
    IF @cap IS NULL
    BEGIN
        RAISERROR (N'[DQ004] ring %d does not exist', 16, 1, @queue_id);
        RETURN;
    END;
    DECLARE @input TABLE (ord int PRIMARY KEY, payload varbinary(4000) NOT NULL);
    INSERT INTO @input (ord, payload)
    SELECT CAST(p.[key] AS int), CONVERT(varbinary(4000), p.[value], 2) FROM OPENJSON(@payloads) p;
    DECLARE @n int = (SELECT count(*) FROM @input);
    IF @n < 1 OR @n > @cap
    BEGIN
        RAISERROR (N'[DQ003] a ring batch holds 1 to %d (the capacity) messages, got %d', 16, 1, @cap, @n);
        RETURN;
    END;
    -- A lane before the numbers (the gap proof): the first free one from a random start, else wait.
    DECLARE @lane int = NULL;
    DECLARE @start int = ABS(CHECKSUM(NEWID())) % @lanes;
    WITH l AS (
        SELECT TOP (1) lane, pushes FROM {schema}.ring_lanes WITH (ROWLOCK, READPAST)
        WHERE queue_id = @queue_id AND lane >= @start
        ORDER BY lane)
    UPDATE l SET @lane = lane, pushes = pushes + 1;
    IF @lane IS NULL
    BEGIN
        WITH l AS (
            SELECT TOP (1) lane, pushes FROM {schema}.ring_lanes WITH (ROWLOCK, READPAST)
            WHERE queue_id = @queue_id AND lane < @start
            ORDER BY lane)
        UPDATE l SET @lane = lane, pushes = pushes + 1;
    END;
    IF @lane IS NULL
    BEGIN
        UPDATE l SET @lane = l.lane, pushes = l.pushes + 1
        FROM {schema}.ring_lanes l WITH (ROWLOCK)
        WHERE l.queue_id = @queue_id AND l.lane = @start;
    END;
    DECLARE @v sql_variant;
    EXEC sys.sp_sequence_get_range @sequence_name = @seq, @range_size = @n, @range_first_value = @v OUTPUT;
    DECLARE @first bigint = CAST(@v AS bigint);
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
    DECLARE @written int = 0;
    DECLARE @k int;
    DECLARE @pending nvarchar(max) = NULL;
    WHILE 1 = 1
    BEGIN
        SET @now = SYSUTCDATETIME();
        UPDATE s
        SET seq = @base1 + s.slot, state = 1, attempts = 0, deliveries = 0, enqueued_at = @now, due_at = @now,
            consumer = NULL, last_error = NULL, payload = i.payload
        FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
        JOIN @input i ON i.ord = @base1 + s.slot - @first
        WHERE s.queue_id = @queue_id AND s.slot >= @a AND s.slot < @b1
          AND s.seq = @base1 + s.slot - @cap AND s.state IN (0, 3);
        SET @written = @written + @@ROWCOUNT;
        UPDATE s
        SET seq = @base2 + s.slot, state = 1, attempts = 0, deliveries = 0, enqueued_at = @now, due_at = @now,
            consumer = NULL, last_error = NULL, payload = i.payload
        FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
        JOIN @input i ON i.ord = @base2 + s.slot - @first
        WHERE s.queue_id = @queue_id AND s.slot < @b2
          AND s.seq = @base2 + s.slot - @cap AND s.state IN (0, 3);
        SET @written = @written + @@ROWCOUNT;
        IF @written >= @n
        BEGIN
            BREAK;
        END;
        IF EXISTS (
            SELECT 1 FROM {schema}.ring_slots t WITH (READCOMMITTEDLOCK, READPAST)
            WHERE t.queue_id = @queue_id AND t.state = 3
              AND ((t.slot >= @a AND t.slot < @b1 AND t.seq = @base1 + t.slot)
                   OR (t.slot < @b2 AND t.seq = @base2 + t.slot)))
        BEGIN
            UPDATE s SET seq = s.seq - @cap, state = 0, payload = NULL, enqueued_at = NULL, due_at = NULL
            FROM {schema}.ring_slots s
            WHERE s.queue_id = @queue_id AND s.state = 1 AND s.seq BETWEEN @first AND @last
              AND ((s.slot >= @a AND s.slot < @b1 AND s.seq = @base1 + s.slot)
                   OR (s.slot < @b2 AND s.seq = @base2 + s.slot));
            RAISERROR (N'[DQ002] ring %d: numbers %I64d .. %I64d were given up as gaps before this push wrote them',
                16, 1, @queue_id, @first, @last);
            RETURN;
        END;
        EXEC {schema}.ring_lanes_held @queue_id = @queue_id, @of = @pending, @held = @pending OUTPUT;
        IF @pending = N'[]'
        BEGIN
            UPDATE s SET seq = @base1 + s.slot - @cap, state = 3, payload = NULL, enqueued_at = NULL, consumer = NULL,
                last_error = NULL
            FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
            WHERE s.queue_id = @queue_id AND s.slot >= @a AND s.slot < @b1
              AND s.seq = @base1 + s.slot - 2 * @cap AND s.state IN (0, 3);
            SET @k = @@ROWCOUNT;
            UPDATE s SET seq = @base2 + s.slot - @cap, state = 3, payload = NULL, enqueued_at = NULL, consumer = NULL,
                last_error = NULL
            FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
            WHERE s.queue_id = @queue_id AND s.slot < @b2
              AND s.seq = @base2 + s.slot - 2 * @cap AND s.state IN (0, 3);
            SET @k = @k + @@ROWCOUNT;
            IF @k > 0
            BEGIN
                EXEC sys.sp_sequence_get_range @sequence_name = @gaps, @range_size = @k, @range_first_value = @v OUTPUT;
            END;
        END;
        IF SYSUTCDATETIME() >= @deadline
        BEGIN
            UPDATE s SET seq = s.seq - @cap, state = 0, payload = NULL, enqueued_at = NULL, due_at = NULL
            FROM {schema}.ring_slots s
            WHERE s.queue_id = @queue_id AND s.state = 1 AND s.seq BETWEEN @first AND @last
              AND ((s.slot >= @a AND s.slot < @b1 AND s.seq = @base1 + s.slot)
                   OR (s.slot < @b2 AND s.seq = @base2 + s.slot));
            RAISERROR (N'[DQ001] ring %d stayed full for %d ms (capacity %d)', 16, 1, @queue_id,
                CAST(1000 * @timeout_s AS int), @cap);
            RETURN;
        END;
        SET @wait = DATEADD(millisecond, @pause, CAST(0 AS datetime));
        WAITFOR DELAY @wait;
        SET @pause = CASE WHEN @pause >= 25 THEN 50 ELSE 2 * @pause END;
    END;
    SELECT @first;
END

-- name: v2_ring_first_unfinished
-- The first number of base + [@from, @to) (slots @from .. @to - 1, number = @base + slot) that is not
-- finished, in slot order, from committed rows: unwritten (the slot still holds an older number: @unwritten
-- = 1, a gap or a push in progress), ready or leased. A slot another transaction holds locked (READPAST
-- reads past it: being written, claimed or acked) counts as unfinished at its number, never as finished,
-- so a bound taken from this never passes an unfinished number. NULL when all are finished.
CREATE OR ALTER PROCEDURE {schema}.ring_first_unfinished
    @queue_id int, @from int, @to int, @base bigint, @num bigint OUTPUT, @unwritten bit OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET @num = NULL;
    SET @unwritten = 0;
    IF @to <= @from
    BEGIN
        RETURN;
    END;
    SELECT TOP (1)
        @num = CASE WHEN w.slot > w.prev + 1 THEN @base + w.prev + 1
                    WHEN w.seq < @base + w.slot OR w.state IN (1, 2) THEN @base + w.slot
                    ELSE @base + w.slot + 1 END,
        @unwritten = CASE WHEN w.slot = w.prev + 1 AND w.seq < @base + w.slot THEN 1 ELSE 0 END
    FROM (
        SELECT t.slot, t.seq, t.state,
               LAG(t.slot, 1, @from - 1) OVER (ORDER BY t.slot) AS prev,
               LEAD(t.slot, 1, @to) OVER (ORDER BY t.slot) AS next
        FROM {schema}.ring_slots t WITH (READCOMMITTEDLOCK, READPAST)
        WHERE t.queue_id = @queue_id AND t.slot >= @from AND t.slot < @to) w
    WHERE w.slot > w.prev + 1 OR w.seq < @base + w.slot OR (w.seq = @base + w.slot AND w.state IN (1, 2))
       OR w.next > w.slot + 1
    ORDER BY w.slot;
    IF @num IS NULL AND NOT EXISTS (
        SELECT 1 FROM {schema}.ring_slots t WITH (READCOMMITTEDLOCK, READPAST)
        WHERE t.queue_id = @queue_id AND t.slot >= @from AND t.slot < @to)
    BEGIN
        SET @num = @base + @from;
    END;
END

-- name: v2_ring_skip_gap
-- Give up abandoned numbers (gaps) as pops do: the numbers from @gap up to @issued (at most 4096)
-- still unwritten, whose predecessor is finished and that nobody holds locked, once every lane of
-- @snap (the lanes other transactions held after @issued was read) has been seen unlocked; without
-- that proof, @force (the caller's gap timeout ran out) gives up the run of unwritten numbers from @gap
-- up to the first written or locked one (as on PostgreSQL: their predecessors are finished, so a live
-- push would have written them already; a locked one is a push writing it). Nothing happens unless @gap is still unwritten. @remaining: the lanes of
-- @snap still locked now ("[]": the proof holds).
CREATE OR ALTER PROCEDURE {schema}.ring_skip_gap
    @queue_id int, @cap int, @gap bigint, @issued bigint, @snap nvarchar(max), @force bit,
    @remaining nvarchar(max) OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @span bigint = 0;
    DECLARE @gaps nvarchar(300) = (SELECT gap_seq FROM {schema}.rings WHERE queue_id = @queue_id);
    DECLARE @v sql_variant;
    SET @remaining = NULL;
    IF EXISTS (
        SELECT 1 FROM {schema}.ring_slots t WITH (READCOMMITTEDLOCK, READPAST)
        WHERE t.queue_id = @queue_id AND t.slot = @gap % @cap AND t.seq < @gap)
    BEGIN
        IF @snap IS NOT NULL AND @issued IS NOT NULL
        BEGIN
            EXEC {schema}.ring_lanes_held @queue_id = @queue_id, @of = @snap, @held = @remaining OUTPUT;
        END;
        DECLARE @max bigint = CASE WHEN @issued IS NULL OR @issued < @gap THEN 1 ELSE @issued - @gap + 1 END;
        SET @max = CASE WHEN @max > 4096 THEN 4096 ELSE @max END;
        SET @max = CASE WHEN @max > @cap THEN @cap ELSE @max END;
        SET @span = CASE WHEN @remaining = N'[]' THEN @max ELSE 0 END;
        IF @span = 0 AND @force = 1
        BEGIN
            DECLARE @a int = @gap % @cap;
            SELECT @span = count(*) FROM (
                SELECT u.num, row_number() OVER (ORDER BY u.num) AS rn FROM (
                    SELECT @gap - @a + t.slot AS num FROM {schema}.ring_slots t WITH (READCOMMITTEDLOCK, READPAST)
                    WHERE t.queue_id = @queue_id AND t.slot >= @a AND t.slot < @a + @max
                      AND t.seq = @gap - @a + t.slot - @cap AND t.state IN (0, 3)
                    UNION ALL
                    SELECT @gap + @cap - @a + t.slot AS num FROM {schema}.ring_slots t WITH (READCOMMITTEDLOCK, READPAST)
                    WHERE t.queue_id = @queue_id AND t.slot < @a + @max - @cap
                      AND t.seq = @gap + @cap - @a + t.slot - @cap AND t.state IN (0, 3)) AS u) AS w
            WHERE w.num = @gap + w.rn - 1;
        END;
    END;
    IF @span <= 0 OR @gaps IS NULL
    BEGIN
        RETURN;
    END;
    DECLARE @from int = @gap % @cap;
    DECLARE @to1 int = CASE WHEN @from + @span < @cap THEN @from + @span ELSE @cap END;
    DECLARE @to2 int = CASE WHEN @from + @span > @cap THEN @from + @span - @cap ELSE 0 END;
    DECLARE @base1 bigint = @gap - @from;
    DECLARE @base2 bigint = @gap - @from + @cap;
    DECLARE @k int;
    UPDATE s SET seq = @base1 + s.slot, state = 3, payload = NULL, enqueued_at = NULL, consumer = NULL, last_error = NULL
    FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
    WHERE s.queue_id = @queue_id AND s.slot >= @from AND s.slot < @to1
      AND s.seq = @base1 + s.slot - @cap AND s.state IN (0, 3);
    SET @k = @@ROWCOUNT;
    UPDATE s SET seq = @base2 + s.slot, state = 3, payload = NULL, enqueued_at = NULL, consumer = NULL, last_error = NULL
    FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
    WHERE s.queue_id = @queue_id AND s.slot < @to2
      AND s.seq = @base2 + s.slot - @cap AND s.state IN (0, 3);
    SET @k = @k + @@ROWCOUNT;
    IF @k > 0
    BEGIN
        EXEC sys.sp_sequence_get_range @sequence_name = @gaps, @range_size = @k, @range_first_value = @v OUTPUT;
    END;
END

-- name: v2_ring_skip_abandoned
-- Maintenance's gap recovery: give up every number of a ring up to @issued that a push took and never
-- wrote, wherever it lies, once every lane of @snap (taken after @issued was read) has been seen
-- unlocked. Returns one row (skipped, remaining): skipped -1 and the lanes of @snap still locked while
-- the proof does not hold yet (the caller waits and asks again with them), else how many numbers it gave
-- up. A number x is unwritten while its slot holds x - capacity, finished; locked slots are passed over.
CREATE OR ALTER PROCEDURE {schema}.ring_skip_abandoned
    @queue_id int, @issued bigint, @snap nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @remaining nvarchar(max);
    EXEC {schema}.ring_lanes_held @queue_id = @queue_id, @of = @snap, @held = @remaining OUTPUT;
    IF @remaining <> N'[]'
    BEGIN
        SELECT -1 AS skipped, @remaining AS remaining;
        RETURN;
    END;
    DECLARE @cap int;
    DECLARE @gaps nvarchar(300);
    DECLARE @v sql_variant;
    DECLARE @k int;
    DECLARE @total int = 0;
    SELECT @cap = capacity, @gaps = gap_seq FROM {schema}.rings WHERE queue_id = @queue_id;
    WHILE @cap IS NOT NULL
    BEGIN
        UPDATE s SET seq = s.seq + @cap, state = 3, payload = NULL, enqueued_at = NULL, consumer = NULL,
            last_error = NULL
        FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST)
        WHERE s.queue_id = @queue_id AND s.state IN (0, 3) AND s.seq + @cap <= @issued;
        SET @k = @@ROWCOUNT;
        IF @k = 0
        BEGIN
            BREAK;
        END;
        EXEC sys.sp_sequence_get_range @sequence_name = @gaps, @range_size = @k, @range_first_value = @v OUTPUT;
        SET @total = @total + @k;
    END;
    SELECT @total AS skipped, CAST(NULL AS nvarchar(max)) AS remaining;
END

-- name: v2_ring_pop
-- Pop up to @n ready messages in id order from the window [@lo, @lo + capacity), @lo being the caller's
-- lower bound of the lowest unfinished number; take (state 0) or lease (state 2) them. One result set:
-- the messages, then a last row (id NULL, is_meta 1) with the next lower bound and, when the lowest
-- unfinished number is issued but unwritten, that number, the issued position and the lanes held after
-- that position was read (the gap proof's snapshot). The caller passes them back (@gap ...) on its
-- next pop, which gives those numbers up once the lanes have all been seen unlocked, or gives @gap
-- alone up with @force (its gap timeout). While the same gap stays unproven, the snapshot reported is
-- the one given, less the lanes seen unlocked since (with its issued position). @own: the pop runs in
-- the caller's transaction, which may roll back: no bound is kept and no gap skipped then.
-- Claims: TOP (n) in slot order over each part of the window, ROWLOCK, READPAST, UPDLOCK (rows other
-- consumers hold are passed over, as SKIP LOCKED does on PostgreSQL), updated through the CTE with
-- OUTPUT. Only numbers up to the issued position (read first) can be ready, so the window is read only
-- that far.
CREATE OR ALTER PROCEDURE {schema}.ring_pop
    @queue_id int, @cap int, @lo bigint, @n int, @lease bit, @vt float, @consumer nvarchar(200), @own bit,
    @gap bigint, @gap_issued bigint, @gap_snap nvarchar(max), @force bit
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @remaining nvarchar(max) = NULL;
    IF @gap IS NOT NULL AND @own = 0
    BEGIN
        EXEC {schema}.ring_skip_gap @queue_id = @queue_id, @cap = @cap, @gap = @gap, @issued = @gap_issued,
            @snap = @gap_snap, @force = @force, @remaining = @remaining OUTPUT;
    END;
    DECLARE @issued bigint = coalesce((
        SELECT CAST(q.current_value AS bigint) FROM {schema}.rings r JOIN sys.sequences q ON q.object_id = r.push_seq_id
        WHERE r.queue_id = @queue_id), 0);
    DECLARE @span int = CASE WHEN @issued - @lo + 1 <= 0 THEN 0 WHEN @issued - @lo + 1 >= @cap THEN @cap
                             ELSE @issued - @lo + 1 END;
    DECLARE @a int = @lo % @cap;
    DECLARE @to1 int = CASE WHEN @a + @span < @cap THEN @a + @span ELSE @cap END;
    DECLARE @to2 int = @a + @span - @cap;
    DECLARE @base1 bigint = @lo - @a;
    DECLARE @base2 bigint = @lo - @a + @cap;
    DECLARE @now datetime2(6) = SYSUTCDATETIME();
    DECLARE @until datetime2(6) = DATEADD(microsecond, CAST(1e6 * (@vt - FLOOR(@vt)) AS int),
                                          DATEADD(second, CAST(FLOOR(@vt) AS int), @now));
    DECLARE @got int = 0;
    DECLARE @out TABLE (
        id bigint PRIMARY KEY, attempts int, deliveries int, enqueued_at datetime2(6), lease_until datetime2(6),
        payload varbinary(4000));
    IF @to1 > @a
    BEGIN
        WITH c AS (
            SELECT TOP (@n) s.seq, s.state, s.attempts, s.deliveries, s.enqueued_at, s.due_at, s.consumer, s.payload
            FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST, UPDLOCK)
            WHERE s.queue_id = @queue_id AND s.slot >= @a AND s.slot < @to1 AND s.seq = @base1 + s.slot
              AND s.state = 1 AND s.due_at <= @now
            ORDER BY s.slot)
        UPDATE c
        SET state = CASE WHEN @lease = 1 THEN 2 ELSE 0 END, attempts = attempts + 1, deliveries = deliveries + 1,
            due_at = CASE WHEN @lease = 1 THEN @until ELSE due_at END,
            consumer = CASE WHEN @lease = 1 THEN @consumer END,
            payload = CASE WHEN @lease = 1 THEN payload END
        OUTPUT inserted.seq, inserted.attempts, inserted.deliveries, inserted.enqueued_at,
               CASE WHEN @lease = 1 THEN @until END, deleted.payload
        INTO @out;
        SET @got = @@ROWCOUNT;
    END;
    IF @got < @n AND @to2 > 0
    BEGIN
        WITH c AS (
            SELECT TOP (@n - @got) s.seq, s.state, s.attempts, s.deliveries, s.enqueued_at, s.due_at, s.consumer,
                   s.payload
            FROM {schema}.ring_slots s WITH (ROWLOCK, READPAST, UPDLOCK)
            WHERE s.queue_id = @queue_id AND s.slot < @to2 AND s.seq = @base2 + s.slot
              AND s.state = 1 AND s.due_at <= @now
            ORDER BY s.slot)
        UPDATE c
        SET state = CASE WHEN @lease = 1 THEN 2 ELSE 0 END, attempts = attempts + 1, deliveries = deliveries + 1,
            due_at = CASE WHEN @lease = 1 THEN @until ELSE due_at END,
            consumer = CASE WHEN @lease = 1 THEN @consumer END,
            payload = CASE WHEN @lease = 1 THEN payload END
        OUTPUT inserted.seq, inserted.attempts, inserted.deliveries, inserted.enqueued_at,
               CASE WHEN @lease = 1 THEN @until END, deleted.payload
        INTO @out;
        SET @got = @got + @@ROWCOUNT;
    END;
    DECLARE @next_lo bigint = @lo + @span;
    DECLARE @head bigint = NULL;
    DECLARE @unwritten bit = 0;
    DECLARE @report_gap bigint = NULL;
    DECLARE @report_issued bigint = NULL;
    DECLARE @snap nvarchar(max) = NULL;
    IF @own = 1
    BEGIN
        SET @next_lo = @lo;
    END;
    IF @own = 0
    BEGIN
        EXEC {schema}.ring_first_unfinished @queue_id = @queue_id, @from = @a, @to = @to1, @base = @base1,
            @num = @head OUTPUT, @unwritten = @unwritten OUTPUT;
        IF @head IS NULL AND @to2 > 0
        BEGIN
            EXEC {schema}.ring_first_unfinished @queue_id = @queue_id, @from = 0, @to = @to2, @base = @base2,
                @num = @head OUTPUT, @unwritten = @unwritten OUTPUT;
        END;
        SET @next_lo = coalesce(@head, @next_lo);
    END;
    IF @own = 0 AND @head IS NOT NULL AND @unwritten = 1
    BEGIN
        SET @report_gap = @head;
        SET @report_issued = @issued;
        IF @head = @gap AND @remaining IS NOT NULL
        BEGIN
            SET @report_issued = @gap_issued;
            SET @snap = @remaining;
        END;
        IF @snap IS NULL
        BEGIN
            EXEC {schema}.ring_lanes_held @queue_id = @queue_id, @of = NULL, @held = @snap OUTPUT;
        END;
    END;
    SELECT o.id, o.attempts, o.deliveries, o.enqueued_at, o.lease_until, o.payload,
           CAST(NULL AS bigint) AS next_lo, CAST(NULL AS bigint) AS gap, CAST(NULL AS bigint) AS issued,
           CAST(NULL AS nvarchar(max)) AS snap, 0 AS is_meta
    FROM @out o
    UNION ALL
    SELECT NULL, NULL, NULL, NULL, NULL, NULL, @next_lo, @report_gap, @report_issued, @snap, 1
    ORDER BY is_meta, id;
END

-- name: v3_owned_objects
-- The engine's catalogue of what it created here: uninstall drops exactly these objects (and the rings'
-- sequences, which the rings table lists), and the schema only when a row (kind 'schema') says the
-- engine created it. install() fills it with what it created, in its own transaction; for an install
-- made before this version, with the objects of this file found in the schema (by kind and name), and
-- with the schema when nothing else is in it.
CREATE TABLE {schema}.owned_objects (
    kind varchar(32) NOT NULL,
    name nvarchar(128) NOT NULL,
    CONSTRAINT owned_objects_pkey PRIMARY KEY (kind, name)
);
