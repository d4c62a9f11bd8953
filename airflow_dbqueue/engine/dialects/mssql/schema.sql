-- The whole current schema of a dbqueue schema on SQL Server (2016 or later: OPENJSON), for a fresh
-- install. {schema} is replaced by the bracket-quoted schema name. Versions count per dialect: the first
-- SQL Server schema already holds what PostgreSQL reached in four steps (deliveries, batches).
-- SCHEMA_VERSION: 1

-- name: schema
-- CREATE SCHEMA must be alone in its batch, hence sp_executesql.
EXEC sys.sp_executesql N'CREATE SCHEMA {schema}';

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
