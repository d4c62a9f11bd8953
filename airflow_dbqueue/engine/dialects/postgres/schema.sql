-- The whole current schema of a dbqueue schema on PostgreSQL, for a fresh install.
-- {schema} is replaced by the quoted schema name. Keep in step with migrations/: a test checks that
-- applying every migration from the first gives exactly this schema. The schema itself is created by
-- install() (only when it does not exist; an existing one must be empty), not here.
-- SCHEMA_VERSION: 12

-- name: schema
CREATE TABLE {schema}.schema_version (
    version integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT schema_version_pkey PRIMARY KEY (version)
);

-- The engine's catalogue of what it created here: uninstall drops exactly these objects (and the rings'
-- sequences, which the rings table lists), and the schema only when a row (kind 'schema') says the
-- engine created it. install() fills it with what it created, in its own transaction.
CREATE TABLE {schema}.owned_objects (
    kind text NOT NULL,
    name text NOT NULL,
    CONSTRAINT owned_objects_pkey PRIMARY KEY (kind, name)
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
-- meta, data and done are never truncated by VACUUM (vacuum_truncate = false): truncation takes an
-- ACCESS EXCLUSIVE lock that stalls every push and pop, and a queue table reuses its freed pages.
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
        autovacuum_vacuum_cost_delay = 0, vacuum_truncate = false);

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
        autovacuum_vacuum_insert_scale_factor = 0.05, vacuum_truncate = false);

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
        autovacuum_analyze_scale_factor = 0.05, vacuum_truncate = false);
CREATE INDEX done_finished_brin ON {schema}.done USING brin (finished_at);

-- Raised by ack when some of its receipts no longer hold their lease: the error rolls the whole
-- statement back, so an ack finishes every message it names or none, without locking them first.
CREATE FUNCTION {schema}.receipts_not_held(p_wanted integer, p_held bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% of % receipts do not hold their lease', p_wanted - p_held, p_wanted
        USING ERRCODE = 'DQ005';
END
$$;

-- The table design's push: n messages into queue p_queue_id in one call, ids in payload order; none
-- when the queue does not exist (a dropped queue's handle writes nothing). It first takes the queue's
-- push lock in shared mode, held to the end of the transaction: drop_queue takes it exclusively, so a
-- drop waits for every push in progress, and a push that comes during a drop waits for it. Then it
-- reads queues with a snapshot taken after the lock (each statement of a function in READ COMMITTED
-- gets its own), so a push that waited for a drop finds the queue gone. Under REPEATABLE READ or
-- SERIALIZABLE the transaction's snapshot may predate the drop: there the queue's row is locked FOR KEY
-- SHARE, which fails with a serialization error when a drop committed meanwhile (the caller runs its
-- transaction again and finds the queue gone).
-- Ids come from the sequence in payload order; meta and data rows are written by one statement.
-- p_notify: 0 never, 1 when the queue had no ready message before (the statement's one snapshot does not
-- see this push's own rows), 2 always.
-- A function with generic plans: its statements are planned once a session, where the statement this
-- replaces was planned on every push (a third of a push of one's server time). No sequential scans:
-- the ready check must probe meta_ready_idx whatever the statistics said when the plan was made.
CREATE FUNCTION {schema}.table_push(
    p_queue_id integer, p_payloads bytea[], p_priority smallint, p_delay_s double precision,
    p_notify integer, p_channel text)
RETURNS SETOF bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('dbqueue.queue.' || '{schema}'), p_queue_id);
    IF current_setting('transaction_isolation') = 'read committed' THEN
        IF NOT EXISTS (SELECT 1 FROM {schema}.queues WHERE queue_id = p_queue_id) THEN
            RETURN;
        END IF;
    ELSE
        PERFORM 1 FROM {schema}.queues WHERE queue_id = p_queue_id FOR KEY SHARE;
        IF NOT FOUND THEN
            RETURN;
        END IF;
    END IF;
    IF p_notify = 0 THEN
        RETURN QUERY
        WITH input AS MATERIALIZED (
            SELECT nextval('{schema}.message_id_seq') AS id, p.payload, p.ord
            FROM unnest(p_payloads) WITH ORDINALITY AS p(payload, ord)
        ), m AS (
            INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at)
            SELECT i.id, p_queue_id, p_priority, now() + make_interval(secs => p_delay_s), now() FROM input i
        ), d AS (
            INSERT INTO {schema}.data (id, payload) SELECT i.id, i.payload FROM input i
        )
        SELECT i.id FROM input i ORDER BY i.ord;
    ELSE
        RETURN QUERY
        WITH input AS MATERIALIZED (
            SELECT nextval('{schema}.message_id_seq') AS id, p.payload, p.ord
            FROM unnest(p_payloads) WITH ORDINALITY AS p(payload, ord)
        ), m AS (
            INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at)
            SELECT i.id, p_queue_id, p_priority, now() + make_interval(secs => p_delay_s), now() FROM input i
        ), d AS (
            INSERT INTO {schema}.data (id, payload) SELECT i.id, i.payload FROM input i
        ), n AS (
            SELECT pg_notify(p_channel, '') AS sent
            WHERE p_notify = 2 OR NOT EXISTS (
                SELECT 1 FROM {schema}.meta r
                WHERE r.queue_id = p_queue_id AND r.state = 0 AND r.process_at <= now())
        )
        -- (an inner join: the planner would remove an unused LEFT JOIN, and with it the NOTIFY)
        SELECT i.id FROM input i CROSS JOIN (SELECT count(*) AS c FROM n) x ORDER BY i.ord;
    END IF;
END
$$;

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

-- The ring design (seeds 000/001): a preallocated table of slots per ring, UPDATE only.
-- A ring's message ids are the numbers of its own push sequence; number x lives in slot x % capacity,
-- and a push of x may only overwrite a slot whose previous occupant x - capacity is finished.
-- gap_seq counts numbers given up as gaps (a push rolled back or died after taking them): a sequence,
-- so that counting takes no lock (it may count a skip whose transaction then rolled back).
CREATE TABLE {schema}.rings (
    queue_id integer NOT NULL,
    capacity integer NOT NULL,
    push_seq regclass NOT NULL,
    gap_seq regclass NOT NULL,
    CONSTRAINT rings_pkey PRIMARY KEY (queue_id),
    CONSTRAINT rings_capacity_valid CHECK (capacity > 0)
);

-- The slots of every ring, keyed by (queue_id, slot). No column of the primary key ever changes and
-- there is no other index, so every push, pop, ack and nack is a HOT update when the page has room
-- (fillfactor 50 keeps room for the next version of each row). Payloads stay inline (STORAGE PLAIN,
-- at most 4000 bytes), so nothing goes to TOAST.
-- state: 0 free (seq finished), 1 ready (seq, poppable from due_at), 2 leased (seq in flight until
-- due_at), 3 skipped (seq was given up: a gap; counts as finished). seq is the number the slot holds
-- now: pushes and pops check it, so a late push of a number already skipped fails cleanly.
CREATE TABLE {schema}.ring_slots (
    queue_id integer NOT NULL,
    slot integer NOT NULL,
    seq bigint NOT NULL,
    state smallint NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    deliveries integer NOT NULL DEFAULT 0,
    enqueued_at timestamptz,
    due_at timestamptz,
    consumer text,
    last_error text,
    payload bytea,
    CONSTRAINT ring_slots_pkey PRIMARY KEY (queue_id, slot),
    CONSTRAINT ring_slots_state_valid CHECK (state IN (0, 1, 2, 3))
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.05, autovacuum_vacuum_threshold = 1000);
ALTER TABLE {schema}.ring_slots ALTER COLUMN payload SET STORAGE PLAIN;

-- Ring messages that used max_attempts (the ring's failed state): out of the ring, so no slot stays
-- taken by a poison message.
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

-- Create a ring: its push sequence (CACHE 1: a cached number is invisible to the gap proof below),
-- its gap counter, its header row and capacity free slots. Slot j starts as if it held the last number
-- <= 0 that maps to it, finished, so number j + k * capacity finds its predecessor done. The slots are
-- first written with a filler of 5/4 p_slot_bytes and then emptied: that fixes how many slots share a
-- page (half a page of fillers at fillfactor 50), so that every slot of a page can take a full new
-- version beside its current one and updates stay HOT. With fillers of p_slot_bytes a ring's heap grew
-- in its first wraps until enough slots had moved to new pages (to 1.22-1.27x, then flat to 10M
-- messages); with 5/4 it starts at 1.08x that first size, stayed within 1.02x of it in 150,000-message
-- soaks on a quiet machine, and grew to 1.13x over 10M messages beside a stress load.
CREATE FUNCTION {schema}.ring_create(p_schema text, p_queue_id integer, p_capacity integer, p_slot_bytes integer)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_seq text := format('%I.%I', p_schema, 'ring_' || p_queue_id || '_seq');
    v_gaps text := format('%I.%I', p_schema, 'ring_' || p_queue_id || '_gaps');
BEGIN
    EXECUTE format('CREATE SEQUENCE %s AS bigint MINVALUE 1 CACHE 1', v_seq);
    EXECUTE format('CREATE SEQUENCE %s AS bigint MINVALUE 1 CACHE 1', v_gaps);
    INSERT INTO {schema}.rings (queue_id, capacity, push_seq, gap_seq)
    VALUES (p_queue_id, p_capacity, v_seq::regclass, v_gaps::regclass);
    INSERT INTO {schema}.ring_slots (queue_id, slot, seq, state, payload)
    SELECT p_queue_id, g, CASE WHEN g = 0 THEN 0 ELSE g - p_capacity END, 0,
           decode(repeat('00', p_slot_bytes * 5 / 4), 'hex')
    FROM generate_series(0, p_capacity - 1) AS g;
    UPDATE {schema}.ring_slots SET payload = NULL WHERE queue_id = p_queue_id;
END
$$;

CREATE FUNCTION {schema}.ring_drop(p_queue_id integer)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_seq regclass;
    v_gaps regclass;
BEGIN
    DELETE FROM {schema}.rings WHERE queue_id = p_queue_id RETURNING push_seq, gap_seq INTO v_seq, v_gaps;
    DELETE FROM {schema}.ring_slots WHERE queue_id = p_queue_id;
    DELETE FROM {schema}.ring_failed WHERE queue_id = p_queue_id;
    IF v_seq IS NOT NULL THEN
        EXECUTE format('DROP SEQUENCE IF EXISTS %s, %s', v_seq, v_gaps);
    END IF;
END
$$;

-- The gap proof. A push takes an xid before its numbers, and every transaction with an xid holds the
-- lock on its own transactionid until it ends. So the transactions listed by ring_holders() after a
-- push position was read include every live holder of a number up to that position, and once
-- ring_holders_gone() says none of them holds its lock any more, nobody can still write such a number.
-- (A snapshot's in-progress list cannot serve: it names only xids below its xmax, one past the latest
-- completed xid, so a newer transaction still running is missing from it.) The caller's own xid is
-- left out: it is not a holder it waits for. pg_locks is readable by every role.
CREATE FUNCTION {schema}.ring_holders() RETURNS xid[]
LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(array_agg(l.transactionid), ARRAY[]::xid[])
    FROM pg_locks l
    WHERE l.locktype = 'transactionid' AND l.granted
      AND l.transactionid IS DISTINCT FROM pg_current_xact_id_if_assigned()::xid
$$;

CREATE FUNCTION {schema}.ring_holders_gone(p_holders xid[]) RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    SELECT NOT EXISTS (
        SELECT 1 FROM pg_locks l
        WHERE l.locktype = 'transactionid' AND l.granted AND l.transactionid = ANY (p_holders))
$$;

-- Push a batch: take n contiguous numbers and write them into their slots, all or nothing, in the
-- caller's transaction. Returns the first number (the ids are first .. first + n - 1), or NULL when the
-- ring is full for the batch before anything was taken (the caller waits and calls again).
-- A slot whose previous occupant is not finished yet (the ring is full there) is waited for with
-- backoff up to p_timeout_s, then SQLSTATE DQ001. Slots already written stay locked meanwhile (nothing
-- is visible before commit). If a consumer gave one of our numbers up as a gap (only when it proved
-- every transaction that could hold it finished, or after its gap timeout), SQLSTATE DQ002: the
-- statement fails whole and the caller retries with new numbers.
-- The slots are written by a plain UPDATE that matches their committed version (free, holding the
-- number a capacity before ours), without a SELECT ... FOR UPDATE first: that lock cost a WAL record
-- and a dirtied tuple per message. Besides our push, only gap skips write a free slot; they lock with
-- SKIP LOCKED and commit at once, so our UPDATE waits on nothing else, and after such a wait it finds
-- the number given up (DQ002). Another push's numbers are other slots, or ours a capacity later,
-- matching only a version we have not committed; a ready or leased slot does not match at all: so
-- pushes never wait on each other or on consumers.
-- p_notify: 0 never, 1 when the message before ours is no longer ready (consumers caught up), 2 always.
-- p_cap is the ring's capacity, which the caller read with the queue (it never changes); the sequences
-- are found by name. Every step but the UPDATE is an assignment, which PL/pgSQL evaluates without the
-- executor: a PERFORM or SELECT INTO is a query of its own, about 25 us each at a push of one message.
-- p_first: the numbers were taken already, from p_first on (ring_push_one took one and found its slot
-- not free yet): they are written, waiting as above, instead of new ones taken.
CREATE FUNCTION {schema}.ring_push(
    p_queue_id integer, p_cap integer, p_payloads bytea[], p_timeout_s double precision, p_notify integer,
    p_channel text, p_first bigint)
RETURNS bigint LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off AS $$
DECLARE
    v_n integer := coalesce(cardinality(p_payloads), 0);
    v_cap integer := p_cap;
    v_seq regclass := to_regclass('{schema}.ring_' || p_queue_id || '_seq');
    v_first bigint;
    v_a integer;
    v_b1 integer;
    v_b2 integer;
    v_from integer;
    v_to integer;
    v_base bigint;
    v_written integer := 0;
    v_k integer;
    v_deadline timestamptz;
    v_pause double precision := 0.0005;
    v_gaps regclass := to_regclass('{schema}.ring_' || p_queue_id || '_gaps');
    v_holders xid[];
    v_xid xid8;
    v_ok boolean;
BEGIN
    IF v_seq IS NULL OR v_gaps IS NULL THEN
        RAISE EXCEPTION 'ring % does not exist', p_queue_id USING ERRCODE = 'DQ004';
    END IF;
    IF v_n < 1 OR v_n > v_cap THEN
        RAISE EXCEPTION 'a ring batch holds 1 to % (the capacity) messages, got %', v_cap, v_n
            USING ERRCODE = 'DQ003';
    END IF;
    -- Room first, before this transaction has an xid or any number: when the slot of the highest number
    -- this batch would take holds a message not finished yet (ready or leased: the ring is full there),
    -- return NULL, having taken nothing; the caller waits and calls again. A transaction with an xid
    -- holds back the pruning of every row version newer than it, so a push that waited here for
    -- consumers kept the ring's old versions from being pruned while it waited, and the heap grew
    -- (a 10M-message soak grew 1.16x in one step while a push and a pop ran 170-220 ms). A slot holding
    -- an older, unwritten number (a gap) is not a full ring: the loop below waits for it and helps.
    IF p_first IS NULL THEN
        v_first := coalesce(pg_sequence_last_value(v_seq), 0) + v_n;
        IF EXISTS (
                SELECT 1 FROM {schema}.ring_slots t
                WHERE t.queue_id = p_queue_id AND t.slot = (v_first % v_cap)::integer
                  AND t.seq = v_first - v_cap AND t.state IN (1, 2)) THEN
            RETURN NULL;
        END IF;
    END IF;
    -- Give this transaction an xid before it holds any number: the gap proof in ring_pop relies on it.
    v_xid := pg_current_xact_id();
    -- n contiguous numbers: a batch never spans more than the capacity, so it never waits on itself,
    -- and every wait points at lower numbers (no cycle). Every push takes its numbers under this
    -- session lock, so nextval then setval to the batch's last number is a range of its own; the lock
    -- is held only for those two calls and released on error too.
    -- ring_push_one takes its number under the same lock in shared mode.
    IF p_first IS NOT NULL THEN
        v_first := p_first;
    ELSE
        v_ok := pg_advisory_lock(1685221713, (v_seq::oid::bigint - 2147483648)::integer) IS NULL;
        BEGIN
            v_first := nextval(v_seq);
            IF v_n > 1 THEN
                v_ok := setval(v_seq, v_first + v_n - 1) > 0;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            v_ok := pg_advisory_unlock(1685221713, (v_seq::oid::bigint - 2147483648)::integer);
            RAISE;
        END;
        v_ok := pg_advisory_unlock(1685221713, (v_seq::oid::bigint - 2147483648)::integer);
    END IF;
    v_a := (v_first % v_cap)::integer;
    v_b1 := least(v_cap, v_a + v_n);
    v_b2 := greatest(0, v_a + v_n - v_cap);
    v_deadline := clock_timestamp() + make_interval(secs => p_timeout_s);
    LOOP
        FOR part IN 1 .. 2 LOOP
            IF part = 1 THEN
                v_from := v_a; v_to := v_b1; v_base := v_first - v_a;
            ELSE
                v_from := 0; v_to := v_b2; v_base := v_first + v_cap - v_a;
            END IF;
            CONTINUE WHEN v_to <= v_from;
            UPDATE {schema}.ring_slots s
            SET seq = v_base + s.slot, state = 1, attempts = 0, deliveries = 0,
                enqueued_at = now(), due_at = now(), consumer = NULL, last_error = NULL,
                payload = p_payloads[(v_base + s.slot - v_first + 1)::integer]
            WHERE s.queue_id = p_queue_id AND s.slot >= v_from AND s.slot < v_to
              AND s.seq = v_base + s.slot - v_cap AND s.state IN (0, 3);
            GET DIAGNOSTICS v_k = ROW_COUNT;
            v_written := v_written + v_k;
        END LOOP;
        EXIT WHEN v_written >= v_n;
        IF EXISTS (
            SELECT 1 FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot >= v_a AND t.slot < v_b1
              AND t.seq = v_first - v_a + t.slot AND t.state = 3
            UNION ALL
            SELECT 1 FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot < v_b2
              AND t.seq = v_first + v_cap - v_a + t.slot AND t.state = 3) THEN
            RAISE EXCEPTION 'ring %: numbers % .. % were given up as gaps before this push wrote them',
                p_queue_id, v_first, v_first + v_n - 1 USING ERRCODE = 'DQ002';
        END IF;
        -- Help: a slot still holding the number before its predecessor (num - 2 capacity) waits on a
        -- predecessor that was issued (it is lower than ours) and is unwritten. Once every holder
        -- listed after our numbers were issued is gone, nobody can write it: give it up as a gap, as
        -- ring_pop would, so that a ring nobody pops keeps taking pushes. The list is kept from the
        -- first wait on: a list taken anew each time would name new transactions under load for ever.
        IF v_holders IS NOT NULL AND {schema}.ring_holders_gone(v_holders) THEN
            FOR part IN 1 .. 2 LOOP
                IF part = 1 THEN
                    v_from := v_a; v_to := v_b1; v_base := v_first - v_a;
                ELSE
                    v_from := 0; v_to := v_b2; v_base := v_first + v_cap - v_a;
                END IF;
                CONTINUE WHEN v_to <= v_from;
                UPDATE {schema}.ring_slots s
                SET seq = v_base + s.slot - v_cap, state = 3, payload = NULL, enqueued_at = NULL,
                    consumer = NULL, last_error = NULL
                WHERE s.ctid = ANY (ARRAY(
                    SELECT t.ctid FROM {schema}.ring_slots t
                    WHERE t.queue_id = p_queue_id AND t.slot >= v_from AND t.slot < v_to
                      AND t.seq = v_base + t.slot - 2 * v_cap AND t.state IN (0, 3)
                    FOR UPDATE SKIP LOCKED));
                GET DIAGNOSTICS v_k = ROW_COUNT;
                IF v_k > 0 THEN
                    PERFORM nextval(v_gaps) FROM generate_series(1, v_k);
                END IF;
            END LOOP;
        END IF;
        IF v_holders IS NULL THEN
            v_holders := {schema}.ring_holders();
        END IF;
        IF clock_timestamp() >= v_deadline THEN
            RAISE EXCEPTION 'ring % stayed full for % s (capacity %)', p_queue_id, p_timeout_s, v_cap
                USING ERRCODE = 'DQ001';
        END IF;
        PERFORM pg_sleep(v_pause);
        v_pause := least(v_pause * 2, 0.05);
    END LOOP;
    IF p_notify = 2 OR (p_notify = 1 AND NOT EXISTS (
            SELECT 1 FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot = ((v_first - 1) % v_cap)::integer
              AND t.seq = v_first - 1 AND t.state = 1)) THEN
        PERFORM pg_notify(p_channel, '');
    END IF;
    RETURN v_first;
END
$$;

-- Push one message in one statement: the path of a push of one outside a caller's transaction (the
-- usual call at batch 1). ring_push is a PL/pgSQL loop that can wait; this is a single UPDATE. Measured
-- with pgbench on one connection (each call a transaction of its own, synchronous_commit off), a push
-- and a pop of one took 0.27-0.29 ms with ring_push_one and ring_claim, 0.41-0.42 ms with ring_push and
-- ring_pop, and 0.13-0.14 ms with the naive queue's INSERT and DELETE (a slot's update, found by its
-- key, costs more than an append). It takes one number, under the push lock in shared mode until its
-- transaction ends (a batch takes a range under it in exclusive mode, so that no single number lands
-- inside the range), and writes the slot if it is free. When it is not (the ring is full there), nothing is
-- written: r_written is false and the caller writes the number with ring_push(p_first => r_num), which
-- waits for the slot; in between, the number is issued and unwritten, as a push in progress is. A NULL
-- r_num: the ring does not exist. The number is taken before this transaction has an xid (the gap proof
-- relies on a push having one first), so a pop could give it up as a gap in that instant: the UPDATE
-- then finds the slot moved on and writes nothing, and ring_push fails with DQ002 (new numbers).
-- r_notified: p_notify as in ring_push (NULL when no notification was sent).
CREATE FUNCTION {schema}.ring_push_one(
    p_queue_id integer, p_cap integer, p_payload bytea, p_notify integer, p_channel text)
RETURNS TABLE (r_num bigint, r_written boolean, r_notified boolean)
LANGUAGE sql SET plan_cache_mode = force_generic_plan AS $$
WITH n AS MATERIALIZED (
    SELECT nextval(l.seq) AS num
    FROM (
        SELECT r.seq, pg_advisory_xact_lock_shared(1685221713, (r.seq::oid::bigint - 2147483648)::integer)
        FROM (SELECT to_regclass('{schema}.ring_' || p_queue_id || '_seq') AS seq) r
        OFFSET 0) l
), w AS (
    UPDATE {schema}.ring_slots s
    SET seq = (SELECT num FROM n), state = 1, attempts = 0, deliveries = 0, enqueued_at = now(),
        due_at = now(), consumer = NULL, last_error = NULL, payload = p_payload
    WHERE s.queue_id = p_queue_id AND s.slot = ((SELECT num FROM n) % p_cap)::integer
      AND s.seq = (SELECT num FROM n) - p_cap AND s.state IN (0, 3)
    RETURNING s.seq
)
SELECT n.num, w.seq IS NOT NULL,
       CASE WHEN w.seq IS NOT NULL AND (p_notify = 2 OR (p_notify = 1 AND NOT EXISTS (
                SELECT 1 FROM {schema}.ring_slots t
                WHERE t.queue_id = p_queue_id AND t.slot = ((n.num - 1) % p_cap)::integer
                  AND t.seq = n.num - 1 AND t.state = 1)))
            THEN pg_notify(p_channel, '') IS NULL END
FROM n LEFT JOIN w ON true
$$;

-- The lowest number that is not finished (ready, leased, or issued and not written yet), from a full
-- scan of the ring: every number below it is finished. Used to place a consumer and for stats.
CREATE FUNCTION {schema}.ring_head(p_queue_id integer)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_cap integer;
    v_seq regclass;
    v_issued bigint;
    v_head bigint;
BEGIN
    SELECT capacity, push_seq INTO v_cap, v_seq FROM {schema}.rings WHERE queue_id = p_queue_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    v_issued := coalesce(pg_sequence_last_value(v_seq), 0);
    SELECT min(CASE WHEN t.state IN (1, 2) THEN t.seq WHEN t.seq + v_cap <= v_issued THEN t.seq + v_cap END)
    INTO v_head
    FROM {schema}.ring_slots t WHERE t.queue_id = p_queue_id;
    RETURN coalesce(v_head, v_issued + 1);
END
$$;

-- Give up abandoned numbers (gaps) of a ring, as pops and maintenance do: the numbers from p_gap up to
-- p_issued (at most 4096) still unwritten, whose predecessor is finished and that nobody holds locked,
-- once every holder in p_holders is gone (listed by ring_holders() after p_issued was read).
-- Without that proof, p_force (a gap timeout ran out: some transaction listed is still running) gives
-- up the run of unwritten numbers that starts at p_gap, up to the first written or locked one. Those
-- numbers' predecessors are finished (p_gap is the head), so a live push would have written them the
-- moment it took them: they belong to pushes that rolled back or died, or to one stalled that long
-- between taking its numbers and writing them, which then fails with DQ002 and pushes again. Giving up one number per
-- gap timeout instead stalled pushes behind a rolled-back batch for as many timeouts as it had numbers,
-- while pushers waiting on the full ring kept the proof from holding. Numbers past the run (a live
-- holder beyond a written number) are kept. Nothing happens unless p_gap is still unwritten.
-- Returns how many numbers it gave up.
CREATE FUNCTION {schema}.ring_skip_gap(
    p_queue_id integer, p_cap integer, p_gap bigint, p_issued bigint, p_holders xid[], p_force boolean)
RETURNS integer LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off AS $$
DECLARE
    v_a integer := (p_gap % p_cap)::integer;
    v_max integer := least(greatest(coalesce(p_issued, p_gap), p_gap) - p_gap + 1, 4096, p_cap)::integer;
    v_span integer := 0;
    v_from integer;
    v_to integer;
    v_base bigint;
    v_k integer;
    v_skipped integer := 0;
BEGIN
    IF EXISTS (
            SELECT 1 FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot = (p_gap % p_cap)::integer AND t.seq < p_gap) THEN
        IF p_holders IS NOT NULL AND p_issued IS NOT NULL AND {schema}.ring_holders_gone(p_holders) THEN
            v_span := v_max;
        ELSIF p_force THEN
            -- The run: the numbers from p_gap on that are unwritten and that nobody holds locked, up to
            -- the first that is written or locked (a push writing it, perhaps in a long transaction of
            -- its caller: the pushes behind it may be waiting, and their numbers are kept).
            SELECT count(*) INTO v_span FROM (
                SELECT u.num, row_number() OVER (ORDER BY u.num) AS rn FROM (
                    SELECT p_gap - v_a + a.slot AS num FROM (
                        SELECT t.slot FROM {schema}.ring_slots t
                        WHERE t.queue_id = p_queue_id AND t.slot >= v_a AND t.slot < least(p_cap, v_a + v_max)
                          AND t.seq = p_gap - v_a + t.slot - p_cap AND t.state IN (0, 3)
                        FOR UPDATE SKIP LOCKED) AS a
                    UNION ALL
                    SELECT p_gap + p_cap - v_a + b.slot FROM (
                        SELECT t.slot FROM {schema}.ring_slots t
                        WHERE t.queue_id = p_queue_id AND t.slot < v_a + v_max - p_cap
                          AND t.seq = p_gap + p_cap - v_a + t.slot - p_cap AND t.state IN (0, 3)
                        FOR UPDATE SKIP LOCKED) AS b) AS u) AS w
            WHERE w.num = p_gap + w.rn - 1;
        END IF;
    END IF;
    IF v_span <= 0 THEN
        RETURN 0;
    END IF;
    FOR part IN 1 .. 2 LOOP
        IF part = 1 THEN
            v_from := v_a; v_to := least(p_cap, v_a + v_span); v_base := p_gap - v_a;
        ELSE
            v_from := 0; v_to := greatest(0, v_a + v_span - p_cap); v_base := p_gap + p_cap - v_a;
        END IF;
        CONTINUE WHEN v_to <= v_from;
        UPDATE {schema}.ring_slots s
        SET seq = v_base + s.slot, state = 3, payload = NULL, enqueued_at = NULL, consumer = NULL,
            last_error = NULL
        WHERE s.ctid = ANY (ARRAY(
            SELECT t.ctid FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot >= v_from AND t.slot < v_to
              AND t.seq = v_base + t.slot - p_cap AND t.state IN (0, 3)
            FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS v_k = ROW_COUNT;
        IF v_k > 0 THEN
            PERFORM nextval(r.gap_seq) FROM {schema}.rings r, generate_series(1, v_k)
            WHERE r.queue_id = p_queue_id;
            v_skipped := v_skipped + v_k;
        END IF;
    END LOOP;
    RETURN v_skipped;
END
$$;

-- Maintenance's gap recovery: give up every number of a ring up to p_issued that a push took and never
-- wrote, wherever it lies (the head or past it), once every holder in p_holders is gone. p_holders
-- must be listed (ring_holders) after p_issued was read: each such number was taken by a transaction
-- that had an xid before it (ring_push takes one first), so its holder was finished then or is listed,
-- and is gone now. A number x is unwritten while its slot holds x - capacity, finished; slots locked by
-- a push writing them are passed over. Returns how many numbers were given up, or -1 while some holder
-- is still running (the caller waits and asks again).
CREATE FUNCTION {schema}.ring_skip_abandoned(p_queue_id integer, p_issued bigint, p_holders xid[])
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_cap integer;
    v_gaps regclass;
    v_k integer;
    v_total integer := 0;
BEGIN
    IF NOT {schema}.ring_holders_gone(p_holders) THEN
        RETURN -1;
    END IF;
    SELECT capacity, gap_seq INTO v_cap, v_gaps FROM {schema}.rings WHERE queue_id = p_queue_id;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    LOOP  -- a slot can hold more than one such number: x, and x + capacity behind it
        UPDATE {schema}.ring_slots s
        SET seq = s.seq + v_cap, state = 3, payload = NULL, enqueued_at = NULL, consumer = NULL,
            last_error = NULL
        WHERE s.ctid = ANY (ARRAY(
            SELECT t.ctid FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.state IN (0, 3) AND t.seq + v_cap <= p_issued
            FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS v_k = ROW_COUNT;
        EXIT WHEN v_k = 0;
        PERFORM nextval(v_gaps) FROM generate_series(1, v_k);
        v_total := v_total + v_k;
    END LOOP;
    RETURN v_total;
END
$$;

-- Pop up to p_n ready messages in id order from the window of numbers [p_lo, p_lo + capacity), where
-- p_lo is the caller's lower bound of the lowest unfinished number. Take (state 0) or lease (state 2)
-- them. Rows: the messages, then one last row (r_id NULL) with the next lower bound and, when the
-- lowest unfinished number is issued but not written, that number, the issued position and, from its
-- second sighting on, the holders (ring_holders) listed after that position was read: the caller passes
-- them back (p_gap...) on its next pop, which skips every number up to that position still unwritten
-- once those holders are gone (a push takes an xid before its numbers), or the run at the head when
-- p_force is set (the caller's gap timeout). A head unwritten for one pop only is nearly always a push
-- writing it, so pg_locks is read only when it stays; once listed, the same holders and position are
-- passed on until the proof holds (a new list would name new transactions for ever under load).
-- Only numbers up to the issued position (read first) can be ready, so the claim and the bound scan
-- the window only that far: an empty or short pop reads what was pushed, not the whole ring.
-- p_own: the pop runs in the caller's transaction, which may roll back: the caller keeps no bound and
-- skips no gap then, so the last row carries p_lo unchanged and nothing else.
-- Plans are generic (the ring's table never changes size, so its statistics never mislead) and never
-- bitmap scans: the claim must walk the primary key in slot order and stop after n rows, where a
-- bitmap scan reads the whole window and sorts it.
-- lock_timeout: SKIP LOCKED does not cover the update chain. When a ready row the claim saw was popped
-- by another consumer just as the claim came to it, and a push is writing the slot's next number, the
-- lock follows the chain and waits for that push; the push waits (polling, so no deadlock is detected)
-- for predecessors that this claim may already hold locked. A 2x2 stress run stalled that way once in
-- about 45 runs of 150,000 messages, until the push gave up after its timeout. The wait now ends after
-- 200 ms: the pop fails, its locks are released, and the caller pops again.
CREATE FUNCTION {schema}.ring_pop(
    p_queue_id integer, p_cap integer, p_lo bigint, p_n integer, p_lease boolean,
    p_vt double precision, p_consumer text, p_own boolean,
    p_gap bigint, p_gap_issued bigint, p_gap_snap xid[], p_force boolean)
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz,
               r_lease_until timestamptz, r_payload bytea, r_next_lo bigint, r_gap bigint,
               r_issued bigint, r_snap xid[])
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off SET lock_timeout = 200
AS $$
DECLARE
    v_a integer := (p_lo % p_cap)::integer;
    v_from integer;
    v_to integer;
    v_base bigint;
    v_k integer := 0;
    v_got integer := 0;
    v_issued bigint;
    v_span integer;
BEGIN
    -- 1. Skip abandoned numbers (gaps) that the caller saw at the head of its last pop: the numbers
    --    from p_gap up to p_gap_issued (at most 4096) still unwritten, whose predecessor is finished
    --    and that nobody holds locked.
    --    Without the proof (p_force: the caller's gap timeout ran out) only the head number itself is
    --    given up: a holder alive but slow has written (and locks) its first numbers, while the rest of
    --    the range may belong to pushes still writing.
    IF p_gap IS NOT NULL AND NOT p_own THEN
        PERFORM {schema}.ring_skip_gap(p_queue_id, p_cap, p_gap, p_gap_issued, p_gap_snap, p_force);
    END IF;

    -- 2. The window's issued numbers: [p_lo, p_lo + v_span). The issued position is read before any
    --    snapshot below, so every number up to it was taken by a transaction older than them.
    v_issued := coalesce(pg_sequence_last_value(to_regclass('{schema}.ring_' || p_queue_id || '_seq')), 0);
    v_span := greatest(0, least(p_cap::bigint, v_issued - p_lo + 1))::integer;

    -- 3. Claim: the window is slots v_a .. capacity - 1, then 0 .. v_a - 1; within each part slot order
    --    is id order, so the primary key serves the scan, without a sort. One statement locks the
    --    lowest ready rows (SKIP LOCKED: other consumers' claims are passed over), updates them and
    --    returns their payloads, in slot order (the caller sorts them by id all the same).
    FOR part IN 1 .. 2 LOOP
        EXIT WHEN v_got >= p_n;
        IF part = 1 THEN
            v_from := v_a; v_to := least(p_cap, v_a + v_span); v_base := p_lo - v_a;
        ELSE
            v_from := 0; v_to := v_a + v_span - p_cap; v_base := p_lo + p_cap - v_a;
        END IF;
        CONTINUE WHEN v_to <= v_from;
        RETURN QUERY
        UPDATE {schema}.ring_slots s
        SET state = CASE WHEN p_lease THEN 2 ELSE 0 END,
            attempts = s.attempts + 1, deliveries = s.deliveries + 1,
            due_at = CASE WHEN p_lease THEN now() + make_interval(secs => p_vt) ELSE s.due_at END,
            consumer = CASE WHEN p_lease THEN p_consumer END,
            payload = CASE WHEN p_lease THEN s.payload END
        FROM (
            SELECT t.ctid AS tid, t.payload
            FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot >= v_from AND t.slot < v_to
              AND t.seq = v_base + t.slot AND t.state = 1 AND t.due_at <= now()
            ORDER BY t.slot
            LIMIT p_n - v_got
            FOR UPDATE SKIP LOCKED) q
        WHERE s.ctid = q.tid
        RETURNING s.seq, s.attempts, s.deliveries, s.enqueued_at, CASE WHEN p_lease THEN s.due_at END, q.payload,
            NULL::bigint, NULL::bigint, NULL::bigint, NULL::xid[];
        GET DIAGNOSTICS v_k = ROW_COUNT;
        v_got := v_got + v_k;
    END LOOP;
    IF p_own THEN
        RETURN QUERY SELECT NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz,
            NULL::timestamptz, NULL::bytea, p_lo, NULL::bigint, NULL::bigint, NULL::xid[];
        RETURN;
    END IF;

    -- 4. The next lower bound: the first issued number of the window not finished (unwritten, ready or
    --    leased); past the issued ones when all of them are. When that number is issued but unwritten
    --    (a push in progress, or a gap), it is reported with the issued position and, when the caller
    --    saw it too, the holders listed after that position was read (or the ones it passed, kept with
    --    their position). Each part's scan stops at its first row, and the lower number of the two parts
    --    is the head.
    RETURN QUERY
    SELECT NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz, NULL::timestamptz, NULL::bytea,
           coalesce(h.num, p_lo + v_span), CASE WHEN h.unwritten THEN h.num END,
           CASE WHEN h.num = p_gap AND p_gap_snap IS NOT NULL THEN p_gap_issued ELSE v_issued END,
           CASE WHEN h.num IS NULL OR NOT h.unwritten OR h.num IS DISTINCT FROM p_gap THEN NULL
                WHEN p_gap_snap IS NOT NULL THEN p_gap_snap
                ELSE {schema}.ring_holders() END
    FROM (SELECT 1) AS one
    LEFT JOIN LATERAL (
        SELECT * FROM (
            SELECT p_lo - v_a + t.slot AS num, t.seq < p_lo - v_a + t.slot AS unwritten
            FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot >= v_a AND t.slot < least(p_cap, v_a + v_span)
              AND (t.seq < p_lo - v_a + t.slot OR (t.seq = p_lo - v_a + t.slot AND t.state IN (1, 2)))
            ORDER BY t.slot
            LIMIT 1) h1
        UNION ALL
        SELECT * FROM (
            SELECT p_lo + p_cap - v_a + t.slot, t.seq < p_lo + p_cap - v_a + t.slot
            FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot < v_a + v_span - p_cap
              AND (t.seq < p_lo + p_cap - v_a + t.slot
                   OR (t.seq = p_lo + p_cap - v_a + t.slot AND t.state IN (1, 2)))
            ORDER BY t.slot
            LIMIT 1) h2
        ORDER BY 1
        LIMIT 1) h ON true;
END
$$;

-- Claim up to p_n ready messages from the first part of a pop's window (numbers p_lo up to the end of
-- the ring's slots, and no further than the issued position), in one statement: the fast path of a pop
-- outside a caller's transaction, as ring_pop's step 3 does it, without its gap skip, its second part
-- (past the wrap) and its next lower bound. The caller uses it while its bound is fresh and its pops
-- come back full; a short claim is followed by ring_pop for the rest, which moves the bound on and
-- skips gaps. The issued position is a scalar subquery, evaluated once, so that it bounds the index
-- scan. Generic plans, no bitmap scans and a 200 ms lock wait, as ring_pop.
CREATE FUNCTION {schema}.ring_claim(
    p_queue_id integer, p_cap integer, p_lo bigint, p_n integer, p_lease boolean, p_vt double precision,
    p_consumer text)
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz,
               r_lease_until timestamptz, r_payload bytea)
LANGUAGE sql SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off SET lock_timeout = 200
AS $$
UPDATE {schema}.ring_slots s
SET state = CASE WHEN p_lease THEN 2 ELSE 0 END,
    attempts = s.attempts + 1, deliveries = s.deliveries + 1,
    due_at = CASE WHEN p_lease THEN now() + make_interval(secs => p_vt) ELSE s.due_at END,
    consumer = CASE WHEN p_lease THEN p_consumer END,
    payload = CASE WHEN p_lease THEN s.payload END
FROM (
    SELECT t.ctid AS tid, t.payload
    FROM {schema}.ring_slots t
    WHERE t.queue_id = p_queue_id AND t.slot >= (p_lo % p_cap)::integer
      AND t.slot < least(p_cap::bigint, p_lo % p_cap - p_lo + 1 + (
            SELECT coalesce(pg_sequence_last_value(to_regclass('{schema}.ring_' || p_queue_id || '_seq')), 0)))
      AND t.seq = p_lo - p_lo % p_cap + t.slot AND t.state = 1 AND t.due_at <= now()
    ORDER BY t.slot
    LIMIT p_n
    FOR UPDATE SKIP LOCKED) q
WHERE s.ctid = q.tid
RETURNING s.seq, s.attempts, s.deliveries, s.enqueued_at, CASE WHEN p_lease THEN s.due_at END, q.payload
$$;
