-- The whole current schema of a dbqueue schema on PostgreSQL, for a fresh install.
-- {schema} is replaced by the quoted schema name. Keep in step with migrations/: a test checks that
-- applying every migration from the first gives exactly this schema.
-- SCHEMA_VERSION: 4

-- name: schema
CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE {schema}.schema_version (
    version integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT schema_version_pkey PRIMARY KEY (version)
);

-- One row a queue: its settings. Many queues share the tables below.
CREATE TABLE {schema}.queues (
    queue_id integer GENERATED ALWAYS AS IDENTITY,
    name text NOT NULL,
    design text NOT NULL,
    payload_type text NOT NULL,
    max_payload_bytes integer NOT NULL,
    max_attempts integer NOT NULL,
    visibility_timeout_s double precision NOT NULL,
    retry_backoff_s double precision NOT NULL,
    retry_backoff_max_s double precision NOT NULL,
    notify text NOT NULL,
    archive boolean NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT queues_pkey PRIMARY KEY (queue_id),
    CONSTRAINT queues_name_key UNIQUE (name),
    CONSTRAINT queues_name_valid CHECK (name ~ '^[a-z_][a-z0-9_]*$' AND length(name) <= 48),
    CONSTRAINT queues_design_valid CHECK (design IN ('table', 'ring')),
    CONSTRAINT queues_payload_type_valid CHECK (payload_type IN ('json', 'text', 'bytes')),
    CONSTRAINT queues_notify_valid CHECK (notify IN ('auto', 'always', 'never')),
    CONSTRAINT queues_limits_valid CHECK (
        max_payload_bytes > 0 AND max_attempts > 0 AND visibility_timeout_s > 0
        AND retry_backoff_s >= 0 AND retry_backoff_max_s >= retry_backoff_s)
);

CREATE SEQUENCE {schema}.message_id_seq AS bigint;

-- The table design's meta table: small rows, the only table the dequeue path searches.
-- state: 0 ready (or delayed, by process_at), 1 leased (in flight), 2 failed.
-- attempts counts deliveries towards max_attempts (requeue_failed resets it); deliveries counts every
-- hand-out and never resets, so (id, deliveries) names one delivery: the receipt ack and nack check.
-- No foreign key to queues: an FK check would take a KEY SHARE lock on the queue's row for every push.
CREATE TABLE {schema}.meta (
    id bigint NOT NULL,
    queue_id integer NOT NULL,
    state smallint NOT NULL DEFAULT 0,
    priority smallint NOT NULL DEFAULT 0,
    attempts integer NOT NULL DEFAULT 0,
    process_at timestamptz NOT NULL,
    enqueued_at timestamptz NOT NULL,
    lease_until timestamptz,
    consumer text,
    last_error text,
    deliveries integer NOT NULL DEFAULT 0,
    CONSTRAINT meta_pkey PRIMARY KEY (id),
    CONSTRAINT meta_state_valid CHECK (state IN (0, 1, 2)),
    CONSTRAINT meta_lease_valid CHECK ((state = 1) = (lease_until IS NOT NULL))
) WITH (fillfactor = 90, autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05,
        autovacuum_vacuum_cost_delay = 0);

-- Shaped exactly like the claim: WHERE queue_id = ? AND state = 0 ORDER BY priority DESC, process_at, id.
CREATE INDEX meta_ready_idx ON {schema}.meta (queue_id, priority DESC, process_at, id) WHERE state = 0;
-- Lease reclaim walks expired leases in expiry order.
CREATE INDEX meta_leased_idx ON {schema}.meta (queue_id, lease_until) WHERE state = 1;
-- Failed-message admin.
CREATE INDEX meta_failed_idx ON {schema}.meta (queue_id, id) WHERE state = 2;

-- Payloads, apart from the dequeue path; joined only after a claim.
CREATE TABLE {schema}.data (
    id bigint NOT NULL,
    payload bytea NOT NULL,
    CONSTRAINT data_pkey PRIMARY KEY (id)
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_scale_factor = 0.05);

-- Finished messages waiting to be archived (queues with archive = true): appended by pop and ack, and
-- moved to archive in small batches by the archiver (maintenance).
-- outcome: 1 finished (popped at most once, or acked), 2 discarded from the failed state.
CREATE TABLE {schema}.done (
    id bigint NOT NULL,
    queue_id integer NOT NULL,
    priority smallint NOT NULL,
    attempts integer NOT NULL,
    enqueued_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now(),
    outcome smallint NOT NULL,
    CONSTRAINT done_outcome_valid CHECK (outcome IN (1, 2))
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_cost_delay = 0, autovacuum_vacuum_insert_scale_factor = 0.05,
        autovacuum_analyze_scale_factor = 0.05);
CREATE INDEX done_finished_brin ON {schema}.done USING brin (finished_at);

-- Archived messages with their payloads, moved out of done/data by the archiver; an archive retention
-- deletes them again after a while.
CREATE TABLE {schema}.archive (
    id bigint NOT NULL,
    queue_id integer NOT NULL,
    priority smallint NOT NULL,
    attempts integer NOT NULL,
    enqueued_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    archived_at timestamptz NOT NULL DEFAULT now(),
    outcome smallint NOT NULL,
    payload bytea NOT NULL,
    CONSTRAINT archive_pkey PRIMARY KEY (id)
) WITH (autovacuum_vacuum_scale_factor = 0.05, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_scale_factor = 0.1, autovacuum_analyze_scale_factor = 0.05);
CREATE INDEX archive_archived_brin ON {schema}.archive USING brin (archived_at);

-- Batches: messages claimed together under one lease and one id (the table design's claim_batch),
-- so a job elsewhere (a Spark application) can read exactly that set by id, and the claimer acks or
-- releases it whole. state: 0 claimed, 1 acked, 2 released. ids[i] was handed out as deliveries[i].
CREATE TABLE {schema}.batches (
    batch_id uuid NOT NULL,
    queue_id integer NOT NULL,
    state smallint NOT NULL DEFAULT 0,
    ids bigint[] NOT NULL,
    deliveries integer[] NOT NULL,
    consumer text,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    lease_until timestamptz NOT NULL,
    finished_at timestamptz,
    last_error text,
    CONSTRAINT batches_pkey PRIMARY KEY (batch_id),
    CONSTRAINT batches_state_valid CHECK (state IN (0, 1, 2)),
    CONSTRAINT batches_receipts_valid CHECK (cardinality(ids) = cardinality(deliveries) AND cardinality(ids) > 0)
);
CREATE INDEX batches_open_idx ON {schema}.batches (queue_id, claimed_at) WHERE state = 0;
