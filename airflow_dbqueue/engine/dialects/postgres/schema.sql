-- The tables, indexes and sequences of a dbqueue schema on PostgreSQL, as a fresh install creates them:
-- the baseline of release 1.0. {schema} is replaced by the quoted schema name. The schema itself is
-- created by install() (only when it does not exist; an existing one must be empty), not here. The
-- functions are in functions.sql, which install() applies after this file and again whenever it changes.
-- A release that changes a table adds migrations/<release>.sql (tables and data only), which upgrades
-- an install of the release before it, and changes this file to match (see migrations/README.md).
-- Versions are recorded as major * 100 + minor (1.0 is 100); schema_version holds one row a release.
-- SCHEMA_VERSION: 1.0

-- name: schema
CREATE TABLE {schema}.schema_version (
    version integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT schema_version_pkey PRIMARY KEY (version)
);

-- The engine's catalogue of what it created here: uninstall drops exactly these objects (and the rings'
-- sequences, which the rings table lists), and the schema only when a row (kind 'schema') says the
-- engine created it. install() fills it with what it created, in its own transaction. One row of kind
-- 'functions' names the SHA-256 of the functions.sql that install() last applied.
CREATE TABLE {schema}.owned_objects (
    kind text NOT NULL,
    name text NOT NULL,
    CONSTRAINT owned_objects_pkey PRIMARY KEY (kind, name)
);

-- One row a queue: its settings. Many queues share the tables below.
-- dedup_window_s: how long a push's deduplication key is remembered (table_push_with, the dedup table).
-- ttl_s: the time to live of the queue's messages unless a push names another (NULL: none); on_expiry:
-- what becomes of a message not popped by then, 'fail' (the failed state, last_error 'expired') or
-- 'drop' (deleted, or kept in done as discarded where the queue archives). ordering: 'per_key' lets pushes
-- give messages an ordering key (meta_opt.okey), 'none' does not.
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
    dedup_window_s double precision NOT NULL DEFAULT 300,
    ttl_s double precision,
    on_expiry text NOT NULL DEFAULT 'fail',
    ordering text NOT NULL DEFAULT 'none',
    CONSTRAINT queues_pkey PRIMARY KEY (queue_id),
    CONSTRAINT queues_name_key UNIQUE (name),
    CONSTRAINT queues_name_valid CHECK (name ~ '^[a-z_][a-z0-9_]*$' AND length(name) <= 48),
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

CREATE SEQUENCE {schema}.message_id_seq AS bigint;

-- The table design's storage is partitioned by generation, so that what a held xmin horizon keeps
-- can be given back without VACUUM: meta, data and done are LIST-partitioned on gen, eight partitions
-- each (meta_0 .. meta_7 and so on). A message's gen is (id >> 14) & 7 when it is pushed: ids move
-- through the generations 16,384 at a time and come back to generation 0 after 131,072. Maintenance
-- (table_empty_partition in functions.sql) TRUNCATEs a partition that holds no row any more, which
-- removes its dead row versions and their index entries at once, whether or not the horizon is held;
-- and it moves the few messages that would keep an old partition from emptying (delayed past the
-- next second, or failed) into the generation pushes write now (table_move_stragglers: an UPDATE of
-- gen, which keeps the id, the deliveries and so every receipt). The claims read every partition
-- through the parent, in one ordered merge of the partitions' indexes, so priorities and process-at
-- order hold across generations. Eight partitions keep a generic plan (which locks every partition
-- it may read) at 45 relation locks, below PostgreSQL 18's fast-path slots.
--
-- The table design's meta table: one row a message, the only table the dequeue path searches.
-- payload holds a payload of up to 1900 bytes (NULL: the payload is in data). With the row's other
-- columns that stays below PostgreSQL's TOAST threshold (about 2 kB a row), so a small message is one
-- plain heap row; a larger payload would be moved to TOAST (another table and index) anyway, and goes
-- to data instead.
-- state: 0 ready (or delayed, by process_at), 1 leased (in flight), 2 failed.
-- attempts counts deliveries towards max_attempts (requeue_failed resets it); deliveries counts every
-- hand-out and never resets, so (id, deliveries) names one delivery: the receipt ack and nack check.
-- No foreign key to queues: an FK check would take a KEY SHARE lock on the queue's row for every push.
-- meta, data and done are never truncated by VACUUM (vacuum_truncate = false): truncation takes an
-- ACCESS EXCLUSIVE lock that stalls every push and pop, and a queue table reuses its freed pages.
-- No primary key: ids come from one sequence (message_id_seq, only table_push inserts), so they are
-- unique without an index, and a push writes one index entry a message (meta_ready_idx), not two.
-- Every lookup by id names what it expects, so that one of the partial indexes below serves it:
-- receipts and a batch's messages (leased: lease_until set) meta_leased_id_idx, failed messages
-- (state 2) meta_failed_idx. Ready messages (state 0) are never looked up by id.
-- state: 0 ready, 1 leased, 2 failed; lease_until is set exactly when state = 1. Only this schema's
-- functions and the engine's statements write meta, and each keeps both rules; they are not CHECK
-- constraints because PostgreSQL reads a constraint's expression back from its stored text on every
-- statement that inserts or updates rows (about 53,600 instructions for the two, a fifth of a push of
-- one). The state-machine tests check both rules after every step.
-- gen: the message's generation (the partition it is in), see above.
-- A message's time to live and ordering key are in meta_opt (below), not here: a queue that uses
-- neither writes, reads and indexes nothing for them.
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
    payload bytea,
    gen smallint NOT NULL
) PARTITION BY LIST (gen);

-- What only a message pushed with a time to live or an ordering key needs, one row a message of a queue
-- created with a ttl or ordered per key, written by table_push_with() beside its meta row (only a message
-- with neither has none). The row lives exactly as long as its meta row: every statement that deletes a
-- meta row of such a queue (the pops at most once and the acks of the queues with options, the expiry
-- sweep, delete_failed, drop_queue) deletes its meta_opt row in the same statement, so a meta_opt row is a
-- message that is ready, delayed, in flight or failed.
-- expires_at: when the message expires (NULL: never). No claim takes a ready row whose expires_at has
-- passed; the expiry sweep (expire_fail, expire_drop) then moves it to failed or drops it, walking
-- meta_opt_expiring_idx and finding its meta row through meta_ready_idx by (priority, process_at, id).
-- priority and process_at are the meta row's, for that lookup, and are kept equal to it: pushes write
-- both rows alike, and a nack or requeue of such a queue that makes the message ready again sets both
-- (nack_with, requeue_failed); no other statement changes a ready message's process_at or priority (a
-- reclaimed lease keeps its place; a move to another generation changes gen only).
-- okey: the ordering key (NULL: none). No claim takes a message while a message of its key with a smaller
-- id is ready, delayed or in flight: one whose meta_opt row exists (meta_opt_key_idx) and whose meta row
-- is not failed (state 2, meta_failed_idx).
CREATE TABLE {schema}.meta_opt (
    queue_id integer NOT NULL,
    id bigint NOT NULL,
    priority smallint NOT NULL,
    process_at timestamptz NOT NULL,
    expires_at timestamptz,
    okey text,
    CONSTRAINT meta_opt_pkey PRIMARY KEY (queue_id, id)
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05,
        autovacuum_vacuum_cost_delay = 0, vacuum_truncate = false);
-- Messages with a time to live, by expiry, for the expiry sweep.
CREATE INDEX meta_opt_expiring_idx ON {schema}.meta_opt (queue_id, expires_at) WHERE expires_at IS NOT NULL;
-- A key's messages in push order, for the claims' check of an earlier message of the key.
CREATE INDEX meta_opt_key_idx ON {schema}.meta_opt (queue_id, okey, id) WHERE okey IS NOT NULL;

-- Payloads over 1900 bytes, apart from the dequeue path; read by id
-- only after a claim, when the meta or done row has no payload of its own. gen: as the message's meta row.
CREATE TABLE {schema}.data (
    id bigint NOT NULL,
    queue_id integer NOT NULL,
    payload bytea NOT NULL,
    gen smallint NOT NULL
) PARTITION BY LIST (gen);

-- Finished messages waiting to be archived (queues with archive = true): appended by pop and ack, and
-- moved to archive in small batches by the archiver (maintenance).
-- outcome: 1 finished (popped at most once, or acked), 2 discarded from the failed state.
-- payload: the meta row's payload, moved here with it (NULL: the payload is in data).
-- gen: the generation of the message's meta row when it finished.
CREATE TABLE {schema}.done (
    id bigint NOT NULL,
    queue_id integer NOT NULL,
    priority smallint NOT NULL,
    attempts integer NOT NULL,
    enqueued_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now(),
    outcome smallint NOT NULL,
    payload bytea,
    gen smallint NOT NULL,
    CONSTRAINT done_outcome_valid CHECK (outcome IN (1, 2))
) PARTITION BY LIST (gen);
-- The partitions, each with the storage settings of its table and its indexes, named after its
-- table's index with the generation appended (meta_ready_idx_3 is meta_3's part of meta_ready_idx):
-- the indexes of the parents, created after the partitions, take the partitions' matching indexes as
-- their parts. Without a primary key, logical replication needs the whole old row to find a meta row it
-- updates or deletes (REPLICA IDENTITY FULL, written to WAL only at wal_level = logical). Created here,
-- in the install's transaction: a partition goes with its parent (uninstall drops the parents that
-- owned_objects lists).
DO $partitions$
DECLARE
    g integer;
BEGIN
    FOR g IN 0..7 LOOP
        EXECUTE format('CREATE TABLE %1$s.%2$I PARTITION OF %1$s.meta FOR VALUES IN (%3$s) WITH (fillfactor = 90, '
            'autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000, '
            'autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05, '
            'autovacuum_vacuum_cost_delay = 0, vacuum_truncate = false)', '{schema}', 'meta_' || g, g);
        EXECUTE format('ALTER TABLE %s.%I REPLICA IDENTITY FULL', '{schema}', 'meta_' || g);
        EXECUTE format('CREATE INDEX %2$I ON %1$s.%3$I (queue_id, priority DESC, process_at, id) '
            'WITH (fillfactor = 100, deduplicate_items = off) WHERE state = 0', '{schema}', 'meta_ready_idx_' || g, 'meta_' || g);
        EXECUTE format('CREATE INDEX %2$I ON %1$s.%3$I (queue_id, lease_until) WHERE state = 1',
            '{schema}', 'meta_leased_idx_' || g, 'meta_' || g);
        EXECUTE format('CREATE INDEX %2$I ON %1$s.%3$I (id) WHERE lease_until IS NOT NULL',
            '{schema}', 'meta_leased_id_idx_' || g, 'meta_' || g);
        EXECUTE format('CREATE INDEX %2$I ON %1$s.%3$I (queue_id, id) WHERE state = 2',
            '{schema}', 'meta_failed_idx_' || g, 'meta_' || g);
        EXECUTE format('CREATE TABLE %1$s.%2$I PARTITION OF %1$s.data FOR VALUES IN (%3$s) WITH ('
            'autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000, '
            'autovacuum_vacuum_insert_scale_factor = 0.05, vacuum_truncate = false)', '{schema}', 'data_' || g, g);
        EXECUTE format('ALTER TABLE %1$s.%2$I ADD CONSTRAINT %3$I PRIMARY KEY (id, gen)',
            '{schema}', 'data_' || g, 'data_pkey_' || g);
        EXECUTE format('CREATE TABLE %1$s.%2$I PARTITION OF %1$s.done FOR VALUES IN (%3$s) WITH ('
            'autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000, '
            'autovacuum_vacuum_cost_delay = 0, autovacuum_vacuum_insert_scale_factor = 0.05, '
            'autovacuum_analyze_scale_factor = 0.05, vacuum_truncate = false)', '{schema}', 'done_' || g, g);
        EXECUTE format('CREATE INDEX %2$I ON %1$s.%3$I USING brin (finished_at)',
            '{schema}', 'done_finished_brin_' || g, 'done_' || g);
        EXECUTE format('CREATE INDEX %2$I ON %1$s.%3$I (queue_id, finished_at)',
            '{schema}', 'done_queue_idx_' || g, 'done_' || g);
    END LOOP;
END
$partitions$;

-- Shaped exactly like the claim: WHERE queue_id = ? AND state = 0 ORDER BY priority DESC, process_at, id.
-- Its parts fill their leaf pages (fillfactor 100, above): a queue's entries mostly arrive in claim order
-- at the end of their priority's run (a push's process_at is its transaction's start, plus its delay),
-- where the free tenth that the default leaves on a page is rarely used, while every claim passes, page
-- by page, the entries of the messages popped since the last VACUUM (dead, skipped without reading their
-- rows): fuller pages are fewer pages to pass. An entry that lands in a full page (a push whose
-- transaction started before the one that filled it, a nacked message, a delay shorter than an earlier
-- one's) splits it, as any insert into a full page does. Nor do they deduplicate: no two entries are
-- equal (each ends in its message's id), so the deduplication pass a btree makes on a full page before
-- it splits finds nothing to merge, and cost a push about 470 server instructions a message at batch
-- 100 (cachegrind). A page still drops the entries scans marked dead before it splits.
CREATE INDEX meta_ready_idx ON {schema}.meta (queue_id, priority DESC, process_at, id) WHERE state = 0;
-- Lease reclaim walks expired leases in expiry order.
CREATE INDEX meta_leased_idx ON {schema}.meta (queue_id, lease_until) WHERE state = 1;
-- Receipts (ack, nack, extend, the checks of held receipts, a batch's reads): leased messages by id.
-- Its predicate is the other side of state = 1 (see meta), so that the receipt lookups, which say
-- lease_until > now() (a strict comparison: the planner proves lease_until IS NOT NULL from it), can
-- use it without saying state = 1, which would let them walk every lease of the queue through
-- meta_leased_idx instead (the planner's choice under the statistics of an empty queue).
CREATE INDEX meta_leased_id_idx ON {schema}.meta (id) WHERE lease_until IS NOT NULL;
-- Failed-message admin.
CREATE INDEX meta_failed_idx ON {schema}.meta (queue_id, id) WHERE state = 2;

-- data's key: a message's payload row by id (gen, the partition key, must be part of it).
ALTER TABLE {schema}.data ADD CONSTRAINT data_pkey PRIMARY KEY (id, gen);
CREATE INDEX done_finished_brin ON {schema}.done USING brin (finished_at);
-- A queue's finished messages: its stats count them, and its rates and samples count those finished in
-- a window, reading that queue's entries only, not every queue's rows (a pop or ack of a queue that
-- archives writes one entry a message here).
CREATE INDEX done_queue_idx ON {schema}.done (queue_id, finished_at);

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

-- The deduplication keys of the table design's pushes (push(dedup_key=...)): one row a key a queue,
-- naming the message its first push made (id) and when (pushed_at). A push of a key whose row is younger
-- than the queue's dedup_window_s pushes nothing and returns that id; an older row is taken over by the
-- new push (table_push_with, functions.sql). The primary key is what makes racing pushes of one key
-- agree: the second INSERT ... ON CONFLICT waits for the first's transaction, and then takes over its row
-- (first committed) or inserts its own (first rolled back). Rows older than the window are deleted by
-- the queue's upkeep (forget_dedup), through dedup_pushed_idx, so the table holds about a window of keys.
-- Pushes without a key never touch it.
CREATE TABLE {schema}.dedup (
    queue_id integer NOT NULL,
    dedup_key text NOT NULL,
    id bigint NOT NULL,
    pushed_at timestamptz NOT NULL,
    CONSTRAINT dedup_pkey PRIMARY KEY (queue_id, dedup_key)
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05);
CREATE INDEX dedup_pushed_idx ON {schema}.dedup (queue_id, pushed_at);

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

-- The ring design (Kejser, "Implementing Message Queues in Relational Databases", after the LMAX
-- Disruptor): a preallocated table of slots per ring that only pushes write. A ring's message ids are
-- the numbers of its own push sequence; number x lives in slot x % capacity. As in the Disruptor,
-- consumers never write to the slots: they advance positions of their own (ring_lanes), and a push of
-- x may overwrite its slot only when the previous occupant x - capacity lies below the ring's floor,
-- the lowest number a consumer may still need (ring_floor). That keeps a pop's work per message a read.
-- gap_seq counts numbers given up as gaps (a push rolled back or died after taking them): a sequence,
-- so that counting takes no lock (it may count a skip whose transaction then rolled back).
CREATE TABLE {schema}.rings (
    queue_id integer NOT NULL,
    capacity integer NOT NULL,
    push_seq regclass NOT NULL,
    gap_seq regclass NOT NULL,
    lanes integer NOT NULL,
    CONSTRAINT rings_pkey PRIMARY KEY (queue_id),
    CONSTRAINT rings_capacity_valid CHECK (capacity > 0),
    CONSTRAINT rings_lanes_valid CHECK (lanes > 0 AND lanes <= capacity)
);

-- The rings of the rows layout (PostgreSQL only; functions.sql, ring_rows_template): rings whose rows
-- are pushes in four insert-only segment tables of their own, emptied with TRUNCATE once every lane has
-- passed them, so that pushes and pops write no dead row. capacity: rows (pushes) the ring holds, a
-- quarter of them a segment (seg_rows). A ring of this layout has no rings row.
CREATE TABLE {schema}.ring_rows (
    queue_id integer NOT NULL,
    capacity integer NOT NULL,
    lanes integer NOT NULL,
    seg_rows integer NOT NULL,
    CONSTRAINT ring_rows_pkey PRIMARY KEY (queue_id),
    CONSTRAINT ring_rows_shape_valid CHECK (lanes > 0 AND seg_rows >= 2 * lanes AND capacity = 4 * seg_rows)
);

-- The slots of every ring, keyed by (queue_id, slot). Only a push (and the skip of a gap) writes a
-- slot; no column of the primary key ever changes and there is no other index, so every write is a
-- HOT update when the page has room (fillfactor 50 keeps room for the next version of each row).
-- Payloads stay inline (STORAGE PLAIN, at most 4000 bytes), so nothing goes to TOAST.
-- seq is the number the slot holds now. A slot whose payload is NULL holds a number given up as a gap
-- (or, before the ring's first wrap, none): consumers pass over it and deliver nothing. A push checks
-- seq, so a late push of a number already given up fails cleanly.
CREATE TABLE {schema}.ring_slots (
    queue_id integer NOT NULL,
    slot integer NOT NULL,
    seq bigint NOT NULL,
    enqueued_at timestamptz,
    payload bytea,
    CONSTRAINT ring_slots_pkey PRIMARY KEY (queue_id, slot)
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.05, autovacuum_vacuum_threshold = 1000);
ALTER TABLE {schema}.ring_slots ALTER COLUMN payload SET STORAGE PLAIN;

-- The consumers' positions: a ring's numbers are dealt to its lanes by x % lanes, and pos is the next
-- number of its lane that no consumer has taken yet. A pop locks the lanes it takes from, reads the
-- slots past their positions and moves them on, in one short transaction (or the caller's). Pops of a
-- batch take every lane they can lock; pops of one message take one lane each, so several consumers
-- popping one at a time do not queue behind a single row. fillfactor 10: each row's next version stays
-- on its page (HOT).
CREATE TABLE {schema}.ring_lanes (
    queue_id integer NOT NULL,
    lane integer NOT NULL,
    pos bigint NOT NULL,
    CONSTRAINT ring_lanes_pkey PRIMARY KEY (queue_id, lane)
) WITH (fillfactor = 10);

-- At-least-once pops of a ring lease what they took as one row a pop: the numbers from lo to hi of the
-- lanes it took from, from each lane's position at the time (starts[lane + 1]; NULL for lanes it did not
-- take), of which n are messages (the rest are numbers given up as gaps). lo and hi are its lowest and
-- highest message, so that an ack naming them all finds the row by its key. The messages of a lease
-- are first deliveries (attempt 1, delivery 1).
CREATE TABLE {schema}.ring_leases (
    queue_id integer NOT NULL,
    lo bigint NOT NULL,
    hi bigint NOT NULL,
    starts bigint[] NOT NULL,
    n integer NOT NULL,
    lease_until timestamptz NOT NULL,
    consumer text,
    CONSTRAINT ring_leases_pkey PRIMARY KEY (queue_id, lo),
    CONSTRAINT ring_leases_range_valid CHECK (lo <= hi AND n > 0)
);

-- Ring messages delivered again, one row each: nacked, their lease expired, or left in a lease of which
-- only some messages were acked. state 1: ready from due_at (pops serve these first); state 2: leased
-- until due_at. The payload stays in the slot, which the floor keeps.
CREATE TABLE {schema}.ring_retry (
    queue_id integer NOT NULL,
    id bigint NOT NULL,
    state smallint NOT NULL,
    attempts integer NOT NULL,
    deliveries integer NOT NULL,
    due_at timestamptz NOT NULL,
    consumer text,
    last_error text,
    CONSTRAINT ring_retry_pkey PRIMARY KEY (queue_id, id),
    CONSTRAINT ring_retry_state_valid CHECK (state IN (1, 2))
);
CREATE INDEX ring_retry_ready_idx ON {schema}.ring_retry (queue_id, due_at, id) WHERE state = 1;

-- Ring messages that used max_attempts (the ring's failed state): copied out of the ring, so that no
-- slot stays taken by a poison message.
CREATE TABLE {schema}.ring_failed (
    queue_id integer NOT NULL,
    id bigint NOT NULL,
    attempts integer NOT NULL,
    enqueued_at timestamptz NOT NULL,
    failed_at timestamptz NOT NULL DEFAULT now(),
    last_error text,
    payload bytea NOT NULL,
    CONSTRAINT ring_failed_pkey PRIMARY KEY (queue_id, id)
);

-- A ring's consumer groups besides its default one. Every group sees every message of the ring at its
-- own pace: it has lanes, leases, messages to deliver again and failed messages of its own, the rows of
-- ring_lanes, ring_leases, ring_retry and ring_failed whose queue_id is the group's gid, a negative
-- number no queue has (the default group's rows carry the ring's own queue_id, so that its pops find
-- their rows by one key, as a ring without groups does). ring_floor, the lowest number over the ring's
-- rows and its groups', keeps each message until every group has passed it. on_lag: what maintenance
-- does with a group whose lanes have not moved for lag_timeout_s while it has messages to take (0
-- block: a warning, and the group keeps holding the floor, so that pushes wait for it once the ring is
-- full; 1 drop_group: it is dropped). moved_pos and moved_at: the sum of the group's lane positions
-- when maintenance last saw them move, and when.
CREATE TABLE {schema}.ring_groups (
    queue_id integer NOT NULL,
    gid integer NOT NULL,
    name text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    on_lag smallint NOT NULL DEFAULT 0,
    lag_timeout_s double precision NOT NULL,
    moved_pos bigint,
    moved_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT ring_groups_pkey PRIMARY KEY (queue_id, gid),
    CONSTRAINT ring_groups_name_key UNIQUE (queue_id, name),
    CONSTRAINT ring_groups_gid_key UNIQUE (gid),
    CONSTRAINT ring_groups_gid_valid CHECK (gid < 0),
    CONSTRAINT ring_groups_on_lag_valid CHECK (on_lag IN (0, 1)),
    CONSTRAINT ring_groups_lag_timeout_valid CHECK (lag_timeout_s > 0)
);
-- The gids, negated: a gid is never used twice, so that a handle of a dropped group finds no rows of
-- another.
CREATE SEQUENCE {schema}.group_gids AS integer MINVALUE 1;

-- Who may do what to which queue, for roles other than the schema's owner (DbQueue.grant): action is
-- push, pop (pop, ack, nack, claims and batches), read (stats, peek, failed messages) or admin (create
-- and drop queues, requeue and delete failed messages, maintenance); queue_id NULL: every queue,
-- present and future. Roles read it only through the functions may and may_all (functions.sql), which
-- the row-level security policies below call.
CREATE TABLE {schema}.grants (
    role name NOT NULL,
    queue_id integer,
    action text NOT NULL,
    CONSTRAINT grants_action_valid CHECK (action IN ('push', 'pop', 'read', 'admin')),
    CONSTRAINT grants_key UNIQUE NULLS NOT DISTINCT (role, queue_id, action)
);

-- Samples: one row a queue a maintenance run (Maintenance.sample), so that the Queues page can draw each
-- queue's depth, oldest age, push and pop rates and the xmin horizon over the last hours. Written only
-- by maintenance, never on the push or pop path; maintenance deletes rows older than samples_keep_s
-- (a day by default) in small batches, so the table stays at a few hundred rows a queue.
-- push_total and pop_total: a ring's push position and its default group's pop position (numbers it
-- has handed out, gaps included), NULL for the table design. pushed and popped: messages pushed and
-- popped since the queue's previous sample (NULL on its first, and where they cannot be counted: the
-- table design counts them from the timestamps its rows carry, which a queue that does not archive
-- deletes). groups: a ring's consumer groups besides its default one, each name with its lag_messages.
-- horizon_xid_age, horizon_age_s and dead_rows describe the schema as a whole at the time (the oldest
-- transaction, slot or prepared transaction holding the xmin horizon, and the dead rows of the
-- schema's tables after the run's VACUUM); every queue's row of a run carries the same values.
CREATE TABLE {schema}.samples (
    queue_id integer NOT NULL,
    taken_at timestamptz NOT NULL DEFAULT now(),
    ready bigint NOT NULL,
    delayed bigint NOT NULL,
    in_flight bigint NOT NULL,
    failed bigint NOT NULL,
    oldest_age_s double precision,
    push_total bigint,
    pop_total bigint,
    pushed bigint,
    popped bigint,
    groups jsonb,
    horizon_xid_age bigint,
    horizon_age_s double precision,
    dead_rows bigint,
    CONSTRAINT samples_pkey PRIMARY KEY (queue_id, taken_at)
);

-- name: policies
-- Row-level security: a role other than the owner sees and changes only the rows of the queues it was
-- granted an action on, whatever it runs (the engine's statements, its functions, or SQL of its own).
-- The owner (and its members) are not subject to these policies, so its statements cost what they
-- cost without them. Each policy asks may() once a statement (a scalar subquery becomes an InitPlan),
-- never once a row. Applied by install() after functions.sql, on a fresh install (policies, like
-- constraints, change only with a release's migration).
ALTER TABLE {schema}.queues ENABLE ROW LEVEL SECURITY;
CREATE POLICY queues_see ON {schema}.queues FOR SELECT USING (
    queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY queues_admin ON {schema}.queues FOR ALL USING (
    (SELECT {schema}.may_all('admin', current_user)) OR queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]))
    WITH CHECK ((SELECT {schema}.may_all('admin', current_user)) OR queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]));

ALTER TABLE {schema}.meta ENABLE ROW LEVEL SECURITY;
CREATE POLICY meta_see ON {schema}.meta FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY meta_push ON {schema}.meta FOR INSERT WITH CHECK (queue_id = ANY ((SELECT {schema}.may('push', current_user))::integer[]));
CREATE POLICY meta_pop ON {schema}.meta FOR UPDATE USING (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]));
CREATE POLICY meta_take ON {schema}.meta FOR DELETE USING (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]));

ALTER TABLE {schema}.data ENABLE ROW LEVEL SECURITY;
CREATE POLICY data_see ON {schema}.data FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY data_push ON {schema}.data FOR INSERT WITH CHECK (queue_id = ANY ((SELECT {schema}.may('push', current_user))::integer[]));
CREATE POLICY data_take ON {schema}.data FOR DELETE USING (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]));

ALTER TABLE {schema}.done ENABLE ROW LEVEL SECURITY;
CREATE POLICY done_see ON {schema}.done FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY done_pop ON {schema}.done FOR INSERT WITH CHECK (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]));
CREATE POLICY done_admin ON {schema}.done FOR DELETE USING (queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]));

-- A key is written by a push (an INSERT, or the UPDATE of ON CONFLICT, which also needs to see the
-- row) and deleted by the upkeep or a drop (admin).
ALTER TABLE {schema}.dedup ENABLE ROW LEVEL SECURITY;
CREATE POLICY dedup_see ON {schema}.dedup FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY dedup_push ON {schema}.dedup FOR INSERT WITH CHECK (queue_id = ANY ((SELECT {schema}.may('push', current_user))::integer[]));
CREATE POLICY dedup_push_again ON {schema}.dedup FOR UPDATE USING (queue_id = ANY ((SELECT {schema}.may('push', current_user))::integer[]))
    WITH CHECK (queue_id = ANY ((SELECT {schema}.may('push', current_user))::integer[]));
CREATE POLICY dedup_admin ON {schema}.dedup FOR DELETE USING (queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]));

ALTER TABLE {schema}.archive ENABLE ROW LEVEL SECURITY;
CREATE POLICY archive_see ON {schema}.archive FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY archive_admin ON {schema}.archive FOR ALL USING (queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]))
    WITH CHECK (queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]));

ALTER TABLE {schema}.batches ENABLE ROW LEVEL SECURITY;
CREATE POLICY batches_see ON {schema}.batches FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY batches_pop ON {schema}.batches FOR ALL USING (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]))
    WITH CHECK (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]));

ALTER TABLE {schema}.rings ENABLE ROW LEVEL SECURITY;
CREATE POLICY rings_see ON {schema}.rings FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY rings_admin ON {schema}.rings FOR ALL USING (
    (SELECT {schema}.may_all('admin', current_user)) OR queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]))
    WITH CHECK ((SELECT {schema}.may_all('admin', current_user)) OR queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]));

-- The registry of the rings of the rows layout: read by the roles that may see the ring, written by
-- those that create and drop it (their own tables: grants.py gives them to the ring's roles).
ALTER TABLE {schema}.ring_rows ENABLE ROW LEVEL SECURITY;
CREATE POLICY ring_rows_see ON {schema}.ring_rows FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY ring_rows_admin ON {schema}.ring_rows FOR ALL USING (
    (SELECT {schema}.may_all('admin', current_user)) OR queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]))
    WITH CHECK ((SELECT {schema}.may_all('admin', current_user)) OR queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]));

ALTER TABLE {schema}.ring_slots ENABLE ROW LEVEL SECURITY;
CREATE POLICY ring_slots_see ON {schema}.ring_slots FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY ring_slots_push ON {schema}.ring_slots FOR UPDATE USING (queue_id = ANY ((SELECT {schema}.may('push', current_user))::integer[]))
    WITH CHECK (queue_id = ANY ((SELECT {schema}.may('push', current_user))::integer[]));
CREATE POLICY ring_slots_admin ON {schema}.ring_slots FOR ALL USING (
    (SELECT {schema}.may_all('admin', current_user)) OR queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]))
    WITH CHECK ((SELECT {schema}.may_all('admin', current_user)) OR queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]));

ALTER TABLE {schema}.ring_lanes ENABLE ROW LEVEL SECURITY;
CREATE POLICY ring_lanes_see ON {schema}.ring_lanes FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY ring_lanes_pop ON {schema}.ring_lanes FOR UPDATE USING (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]))
    WITH CHECK (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]));
CREATE POLICY ring_lanes_admin ON {schema}.ring_lanes FOR ALL USING (
    (SELECT {schema}.may_all('admin', current_user)) OR queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]))
    WITH CHECK ((SELECT {schema}.may_all('admin', current_user)) OR queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]));

ALTER TABLE {schema}.ring_leases ENABLE ROW LEVEL SECURITY;
CREATE POLICY ring_leases_see ON {schema}.ring_leases FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY ring_leases_pop ON {schema}.ring_leases FOR ALL USING (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]))
    WITH CHECK (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]));

ALTER TABLE {schema}.ring_retry ENABLE ROW LEVEL SECURITY;
CREATE POLICY ring_retry_see ON {schema}.ring_retry FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY ring_retry_pop ON {schema}.ring_retry FOR ALL USING (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]))
    WITH CHECK (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]));

ALTER TABLE {schema}.ring_failed ENABLE ROW LEVEL SECURITY;
CREATE POLICY ring_failed_see ON {schema}.ring_failed FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY ring_failed_pop ON {schema}.ring_failed FOR ALL USING (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]))
    WITH CHECK (queue_id = ANY ((SELECT {schema}.may('pop', current_user))::integer[]));

ALTER TABLE {schema}.ring_groups ENABLE ROW LEVEL SECURITY;
CREATE POLICY ring_groups_see ON {schema}.ring_groups FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY ring_groups_admin ON {schema}.ring_groups FOR ALL USING (queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]))
    WITH CHECK (queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]));

-- Samples: read by the roles that may see the queue; written and deleted by maintenance (admin).
ALTER TABLE {schema}.samples ENABLE ROW LEVEL SECURITY;
CREATE POLICY samples_see ON {schema}.samples FOR SELECT USING (queue_id = ANY ((SELECT {schema}.may('any', current_user))::integer[]));
CREATE POLICY samples_admin ON {schema}.samples FOR ALL USING (queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]))
    WITH CHECK (queue_id = ANY ((SELECT {schema}.may('admin', current_user))::integer[]));
