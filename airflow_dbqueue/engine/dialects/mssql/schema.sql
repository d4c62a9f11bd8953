-- The tables, indexes and sequences of a dbqueue schema on SQL Server (2017 or later: OPENJSON,
-- STRING_AGG), as a fresh install creates them: the baseline of release 1.0. {schema} is replaced by the
-- bracket-quoted schema name. The schema itself is created by install() (only when it does not exist; an
-- existing one must be empty), not here. The procedures and functions are in functions.sql, which
-- install() applies after this file and again whenever it changes. A release that changes a table adds
-- migrations/<release>.sql (tables and data only, one batch a named block), which upgrades an install of
-- the release before it, and changes this file to match, as on PostgreSQL. Versions are recorded as
-- major * 100 + minor (1.0 is 100); schema_version holds one row a release. The block is one batch:
-- T-SQL checks the columns of a table that exists when it compiles a batch, and every table here is new.
-- SCHEMA_VERSION: 1.0

-- name: schema
CREATE TABLE {schema}.schema_version (
    version int NOT NULL,
    applied_at datetime2(6) NOT NULL CONSTRAINT schema_version_applied_df DEFAULT SYSUTCDATETIME(),
    CONSTRAINT schema_version_pkey PRIMARY KEY (version)
);

-- The engine's catalogue of what it created here: uninstall drops exactly these objects (and the rings'
-- sequences, which the rings table lists), and the schema only when a row (kind 'schema') says the
-- engine created it. install() fills it with what it created, in its own transaction. One row of kind
-- 'functions' names the SHA-256 of the functions.sql that install() last applied.
CREATE TABLE {schema}.owned_objects (
    kind varchar(32) NOT NULL,
    name nvarchar(128) NOT NULL,
    CONSTRAINT owned_objects_pkey PRIMARY KEY (kind, name)
);

-- One row a queue: its settings. Many queues share the tables below. dedup_window_s, ttl_s, on_expiry and
-- ordering mean what they mean on PostgreSQL (see its schema.sql): how long a push's deduplication key is
-- remembered (the dedup table), the messages' default time to live (meta_opt.expires_at) and what becomes
-- of a message not popped by then ('fail': the failed state, last_error 'expired'; 'drop': deleted, or
-- kept in done as discarded where the queue archives), and whether pushes may give messages an ordering
-- key ('per_key': meta_opt.okey_hash).
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
    dedup_window_s float NOT NULL CONSTRAINT queues_dedup_window_df DEFAULT 300,
    ttl_s float NULL,
    on_expiry varchar(8) NOT NULL CONSTRAINT queues_on_expiry_df DEFAULT 'fail',
    ordering varchar(8) NOT NULL CONSTRAINT queues_ordering_df DEFAULT 'none',
    CONSTRAINT queues_pkey PRIMARY KEY (queue_id),
    CONSTRAINT queues_name_key UNIQUE (name),
    CONSTRAINT queues_name_valid CHECK (
        name NOT LIKE '%[^a-z0-9_]%' COLLATE Latin1_General_BIN AND name NOT LIKE '[0-9]%' AND len(name) > 0),
    CONSTRAINT queues_design_valid CHECK (design IN ('table', 'ring')),
    CONSTRAINT queues_payload_type_valid CHECK (payload_type IN ('json', 'text', 'bytes')),
    CONSTRAINT queues_notify_valid CHECK (notify IN ('auto', 'always', 'never')),
    CONSTRAINT queues_limits_valid CHECK (
        max_payload_bytes > 0 AND max_attempts > 0 AND visibility_timeout_s > 0
        AND retry_backoff_s >= 0 AND retry_backoff_max_s >= retry_backoff_s),
    CONSTRAINT queues_dedup_window_valid CHECK (dedup_window_s > 0),
    CONSTRAINT queues_ttl_valid CHECK (ttl_s > 0),
    CONSTRAINT queues_on_expiry_valid CHECK (on_expiry IN ('fail', 'drop')),
    CONSTRAINT queues_ordering_valid CHECK (ordering IN ('none', 'per_key'))
);

-- A sequence with a large cache hands out ids without a hot row (Kejser, "Implementing Message Queues
-- in Relational Databases").
CREATE SEQUENCE {schema}.message_id_seq AS bigint START WITH 1 INCREMENT BY 1 CACHE 1000;

-- The table design's meta table (QueueMeta in Al Zabir's "Building High Performance Queue in
-- Database"): rows without LOB columns, the only table the dequeue path searches, so its indexes can be
-- rebuilt online. payload holds a payload of up to 1900 bytes (NULL: the payload is in data): a push of a
-- small payload writes one row instead of two, and a pop deletes from one table; varbinary(1900) is stored
-- in the row, not as a large object, so meta's indexes still rebuild online. States and counters as on
-- PostgreSQL: state 0 ready (or delayed, by process_at), 1 leased, 2 failed; deliveries never resets.
-- Times are UTC.
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
    payload varbinary(1900) NULL,
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

-- What only a message pushed with a time to live or an ordering key needs, one row a message of a queue
-- created with a ttl or ordered per key, written by push_with in the batch that writes its meta row, as on
-- PostgreSQL (see its schema.sql); every statement that deletes a meta row of such a queue (the pops at
-- most once and the acks of the queues with options, the expiry sweep, delete_failed, drop_queue) deletes
-- its meta_opt row in the same transaction, so a meta_opt row is a message ready, delayed, in flight or
-- failed. The statements find a message's meta row by id (meta_pkey, clustered), so unlike PostgreSQL's
-- this table keeps no copy of the meta row's priority and process_at.
-- expires_at: when the message expires (UTC; NULL: never). No claim takes a ready message whose expires_at
-- has passed; the expiry sweep (expire_fail, expire_drop) moves it to failed or drops it, walking
-- meta_opt_expiring_idx.
-- okey_hash: the SHA-256 of the ordering key as nvarchar (HASHBYTES('SHA2_256', key): its UTF-16 bytes),
-- NULL for none. A key of up to 512 characters (MAX_DEDUP_KEY_CHARS, up to 2,048 bytes in UTF-16) would
-- not fit an index key (1,700 bytes), its hash always does; two keys are one key exactly when their
-- characters are, as PostgreSQL's text compares. No claim takes a message while a message of its key with
-- a smaller id is ready, delayed or in flight: one whose meta_opt row exists (meta_opt_key_idx) and whose
-- meta row is not failed.
CREATE TABLE {schema}.meta_opt (
    queue_id int NOT NULL,
    id bigint NOT NULL,
    expires_at datetime2(6) NULL,
    okey_hash binary(32) NULL,
    CONSTRAINT meta_opt_pkey PRIMARY KEY CLUSTERED (queue_id, id)
);
-- Messages with a time to live, by expiry, for the expiry sweep.
CREATE INDEX meta_opt_expiring_idx ON {schema}.meta_opt (queue_id, expires_at) WHERE expires_at IS NOT NULL;
-- A key's messages in push order, for the claims' check of an earlier message of the key.
CREATE INDEX meta_opt_key_idx ON {schema}.meta_opt (queue_id, okey_hash, id) WHERE okey_hash IS NOT NULL;

-- Payloads over 1900 bytes (Al Zabir's QueueData), apart from the dequeue path; read by id only after a
-- claim, when the meta or done row holds no payload of its own.
CREATE TABLE {schema}.data (
    id bigint NOT NULL,
    payload varbinary(max) NOT NULL,
    CONSTRAINT data_pkey PRIMARY KEY CLUSTERED (id)
);

-- Finished messages waiting to be archived. outcome: 1 finished, 2 discarded from the failed state.
-- payload: the meta row's payload, moved here with it (NULL: the payload is in data).
CREATE TABLE {schema}.done (
    id bigint NOT NULL,
    queue_id int NOT NULL,
    priority smallint NOT NULL,
    attempts int NOT NULL,
    enqueued_at datetime2(6) NOT NULL,
    finished_at datetime2(6) NOT NULL CONSTRAINT done_finished_df DEFAULT SYSUTCDATETIME(),
    outcome tinyint NOT NULL,
    payload varbinary(1900) NULL,
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

-- The deduplication keys of the table design's pushes (push(dedup_key=...)), as on PostgreSQL: one row a
-- key a queue, naming the message its first push made (id) and when (pushed_at, UTC). A push of a key
-- whose row is younger than the queue's dedup_window_s pushes nothing and returns that id; an older row is
-- taken over by the new push (push_with). key_hash is the SHA-256 of the key as nvarchar (see meta_opt's
-- okey_hash): the primary key on it is what makes racing pushes of one key agree, through the update
-- lock push_with reads it with (UPDLOCK, HOLDLOCK: on a key that has no row yet, a key-range lock), held
-- to the end of its transaction. dedup_key is the key itself, for people reading the table. Rows older
-- than the window are deleted by the queue's upkeep (forget_dedup, through dedup_pushed_idx), so the
-- table holds about a window of keys. Pushes without a key never touch it.
CREATE TABLE {schema}.dedup (
    queue_id int NOT NULL,
    key_hash binary(32) NOT NULL,
    dedup_key nvarchar(1024) NOT NULL,
    id bigint NOT NULL,
    pushed_at datetime2(6) NOT NULL,
    CONSTRAINT dedup_pkey PRIMARY KEY CLUSTERED (queue_id, key_hash)
);
CREATE INDEX dedup_pushed_idx ON {schema}.dedup (queue_id, pushed_at);

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

-- The ring design (after Kejser's ring buffer in a table, and the LMAX Disruptor) on SQL Server, as on
-- PostgreSQL (its schema.sql states the invariants): a preallocated table of slots per ring that only
-- pushes write. Number x of a ring lives in slot x % capacity. Consumers never write the slots: they
-- advance positions of their own (ring_lanes: a ring's numbers are dealt to its lanes by x % lanes), a
-- pop at least once leases what it took as one row (ring_leases), messages delivered again are rows of
-- ring_retry, and a push of x may overwrite its slot only when x - capacity lies below the ring's floor
-- (ring_floor). Numbers come from a sequence per ring with CACHE (ring_<id>_seq), a batch's n contiguous
-- numbers from one sp_sequence_get_range call. gap_seq counts numbers given up as gaps (a sequence:
-- counting takes no lock; it may count a skip whose transaction then rolled back). push_seq_id and
-- gap_seq_id are the sequences' object ids, to read their current_value (the last number handed out)
-- from sys.sequences. lanes counts the consumers' lanes, push_lanes the gap proof's (ring_push_lanes).
CREATE TABLE {schema}.rings (
    queue_id int NOT NULL,
    capacity int NOT NULL,
    push_seq nvarchar(300) NOT NULL,
    gap_seq nvarchar(300) NOT NULL,
    push_seq_id int NOT NULL,
    gap_seq_id int NOT NULL,
    lanes int NOT NULL,
    push_lanes int NOT NULL,
    CONSTRAINT rings_pkey PRIMARY KEY (queue_id),
    CONSTRAINT rings_capacity_valid CHECK (capacity > 0),
    CONSTRAINT rings_lanes_valid CHECK (lanes > 0 AND lanes <= capacity),
    CONSTRAINT rings_push_lanes_valid CHECK (push_lanes > 0)
);

-- The slots of every ring, clustered on (queue_id, slot); no other index, and no key column ever
-- changes. Payloads are inline varbinary(4000) (RING_MAX_PAYLOAD): never off-row. ring_create first
-- writes every slot with a filler of the queue's max_payload_bytes and then empties it, so each page
-- keeps room for its slots' full payloads and an update that fills a slot never splits a page. seq is
-- the number the slot holds now; a slot whose payload is NULL holds a number given up as a gap (or,
-- before the ring's first wrap, none): consumers pass over it. Lock escalation is off: a push of more
-- than 5,000 slots keeps its row locks instead of locking the whole table.
CREATE TABLE {schema}.ring_slots (
    queue_id int NOT NULL,
    slot int NOT NULL,
    seq bigint NOT NULL,
    enqueued_at datetime2(6) NULL,
    payload varbinary(4000) NULL,
    CONSTRAINT ring_slots_pkey PRIMARY KEY CLUSTERED (queue_id, slot)
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

-- The gap proof's lanes (docs/sqlserver.md): a push locks one of its ring's push_lanes rows here (an
-- UPDATE: an exclusive row lock, held until its transaction ends) before it takes its numbers. So a
-- number issued before time t was taken by a transaction that either has ended or held a lane locked at
-- t. A checker reads the issued position, then lists the lanes locked by other transactions (READPAST
-- skips exactly those); once each listed lane has been seen unlocked afterwards, every holder of a
-- number up to that position is gone, and an unwritten number there will never be written.
CREATE TABLE {schema}.ring_push_lanes (
    queue_id int NOT NULL,
    lane int NOT NULL,
    pushes bigint NOT NULL CONSTRAINT ring_push_lanes_pushes_df DEFAULT 0,
    CONSTRAINT ring_push_lanes_pkey PRIMARY KEY CLUSTERED (queue_id, lane)
);

-- The consumers' positions: pos is the next number of the lane that no pop has taken yet. A pop locks
-- the lanes it takes from, lowest position first (ring_lanes_pos_idx, so that it reads and locks only
-- those), reads the slots past their positions and moves them on, in one short transaction (or the
-- caller's).
CREATE TABLE {schema}.ring_lanes (
    queue_id int NOT NULL,
    lane int NOT NULL,
    pos bigint NOT NULL,
    CONSTRAINT ring_lanes_pkey PRIMARY KEY CLUSTERED (queue_id, lane)
);
CREATE INDEX ring_lanes_pos_idx ON {schema}.ring_lanes (queue_id, pos);

-- At-least-once pops lease what they took as one row a pop: the numbers from lo to hi of the lanes it
-- took from, from each lane's position at the time (starts: a JSON array of the ring's lanes, element k
-- the position of lane k, or null for a lane the pop did not take from), of which n are messages (the
-- rest are numbers given up as gaps). lo and hi are its lowest and highest message. The messages of a
-- lease are first deliveries (attempt 1, delivery 1).
CREATE TABLE {schema}.ring_leases (
    queue_id int NOT NULL,
    lo bigint NOT NULL,
    hi bigint NOT NULL,
    starts nvarchar(max) NOT NULL,
    n int NOT NULL,
    lease_until datetime2(6) NOT NULL,
    consumer nvarchar(200) NULL,
    CONSTRAINT ring_leases_pkey PRIMARY KEY CLUSTERED (queue_id, lo),
    CONSTRAINT ring_leases_range_valid CHECK (lo <= hi AND n > 0)
);

-- Ring messages delivered again, one row each: nacked, their lease expired, or left in a lease of which
-- only some messages were acked. state 1: ready from due_at (pops serve these first); state 2: leased
-- until due_at. The payload stays in the slot, which the floor keeps.
CREATE TABLE {schema}.ring_retry (
    queue_id int NOT NULL,
    id bigint NOT NULL,
    state tinyint NOT NULL,
    attempts int NOT NULL,
    deliveries int NOT NULL,
    due_at datetime2(6) NOT NULL,
    consumer nvarchar(200) NULL,
    last_error nvarchar(1000) NULL,
    CONSTRAINT ring_retry_pkey PRIMARY KEY CLUSTERED (queue_id, id),
    CONSTRAINT ring_retry_state_valid CHECK (state IN (1, 2))
);
CREATE INDEX ring_retry_ready_idx ON {schema}.ring_retry (queue_id, due_at, id) WHERE state = 1;

-- A ring's consumer groups besides its default one, as on PostgreSQL.
-- Every group sees every message of the ring at its own pace: it has lanes, leases, messages to deliver
-- again and failed messages of its own, the rows of ring_lanes, ring_leases, ring_retry and ring_failed
-- whose queue_id is the group's gid, a negative number no queue has (the default group's rows carry the
-- ring's own queue_id, so that its pops find their rows by one key, as a ring without groups does).
-- ring_floor, the lowest number over the ring's rows and its groups', keeps each message until every
-- group has passed it. on_lag: what maintenance does with a group whose lanes have not moved for
-- lag_timeout_s while it has messages to take (0 block: a warning, and the group keeps holding the floor,
-- so that pushes wait for it once the ring is full; 1 drop_group: it is dropped). moved_pos and
-- moved_at: the sum of the group's lane positions when maintenance last saw them move, and when (UTC).
-- Names compare as PostgreSQL's text does, byte for byte (a binary collation: "Audit" and "audit" are
-- two groups). ring_groups_gid_key is the index by which a pop of a group finds its ring.
CREATE TABLE {schema}.ring_groups (
    queue_id int NOT NULL,
    gid int NOT NULL,
    name nvarchar(63) COLLATE Latin1_General_BIN2 NOT NULL,
    created_at datetime2(6) NOT NULL CONSTRAINT ring_groups_created_df DEFAULT SYSUTCDATETIME(),
    on_lag smallint NOT NULL CONSTRAINT ring_groups_on_lag_df DEFAULT 0,
    lag_timeout_s float NOT NULL,
    moved_pos bigint NULL,
    moved_at datetime2(6) NOT NULL CONSTRAINT ring_groups_moved_df DEFAULT SYSUTCDATETIME(),
    CONSTRAINT ring_groups_pkey PRIMARY KEY CLUSTERED (queue_id, gid),
    CONSTRAINT ring_groups_name_key UNIQUE (queue_id, name),
    CONSTRAINT ring_groups_gid_key UNIQUE (gid),
    CONSTRAINT ring_groups_gid_valid CHECK (gid < 0),
    CONSTRAINT ring_groups_on_lag_valid CHECK (on_lag IN (0, 1)),
    CONSTRAINT ring_groups_lag_timeout_valid CHECK (lag_timeout_s > 0)
);
-- The gids, negated: a gid is never used twice, so that a handle of a dropped group finds no rows of
-- another. Numbers a restart drops from the cache are never handed out: gids have gaps, which is fine.
CREATE SEQUENCE {schema}.group_gids AS int START WITH 1 MINVALUE 1 CACHE 50;

-- Samples: one row a queue a maintenance run, as on PostgreSQL (see its schema.sql): written and deleted
-- only by maintenance, kept samples_keep_s (a day by default). Times in UTC; groups is JSON text.
CREATE TABLE {schema}.samples (
    queue_id int NOT NULL,
    taken_at datetime2(6) NOT NULL,
    ready bigint NOT NULL,
    delayed bigint NOT NULL,
    in_flight bigint NOT NULL,
    failed bigint NOT NULL,
    oldest_age_s float NULL,
    push_total bigint NULL,
    pop_total bigint NULL,
    pushed bigint NULL,
    popped bigint NULL,
    groups nvarchar(max) NULL,
    horizon_xid_age bigint NULL,
    horizon_age_s float NULL,
    dead_rows bigint NULL,
    CONSTRAINT samples_pkey PRIMARY KEY CLUSTERED (queue_id, taken_at)
);
