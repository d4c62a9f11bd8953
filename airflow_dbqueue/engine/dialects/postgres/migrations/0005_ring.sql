-- Migration 5: the ring design (after Kejser's ring buffer in a table): rings, ring_slots, ring_failed and the ring's
-- server-side functions. Self-contained: it touches no table of the earlier versions.

-- name: migrate
-- The ring design (Kejser, "Implementing Message Queues in Relational Databases"): a preallocated table of slots per ring, UPDATE only.
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
-- first written with a p_slot_bytes filler and then emptied: that fixes how many slots share a page
-- (about half a page of full slots at fillfactor 50), so that every slot of a page can take a full
-- new version beside its current one and updates stay HOT.
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
           decode(repeat('00', p_slot_bytes), 'hex')
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

-- Push a batch: take n contiguous numbers and write them into their slots, all or nothing, in the
-- caller's transaction. Returns the first number (the ids are first .. first + n - 1).
-- A slot whose previous occupant is not finished yet (the ring is full there) is waited for with
-- backoff up to p_timeout_s, then SQLSTATE DQ001. Slots already written stay locked meanwhile (nothing
-- is visible before commit). If a consumer gave one of our numbers up as a gap (only when it proved
-- every transaction that could hold it finished, or after its gap timeout), SQLSTATE DQ002: the
-- statement fails whole and the caller retries with new numbers.
-- p_notify: 0 never, 1 when the message before ours is no longer ready (consumers caught up), 2 always.
CREATE FUNCTION {schema}.ring_push(
    p_queue_id integer, p_payloads bytea[], p_timeout_s double precision, p_notify integer, p_channel text)
RETURNS bigint LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_n integer := coalesce(cardinality(p_payloads), 0);
    v_cap integer;
    v_seq regclass;
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
    v_gaps regclass;
    v_snap pg_snapshot;
BEGIN
    SELECT capacity, push_seq, gap_seq INTO v_cap, v_seq, v_gaps FROM {schema}.rings WHERE queue_id = p_queue_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'ring % does not exist', p_queue_id USING ERRCODE = 'DQ004';
    END IF;
    IF v_n < 1 OR v_n > v_cap THEN
        RAISE EXCEPTION 'a ring batch holds 1 to % (the capacity) messages, got %', v_cap, v_n
            USING ERRCODE = 'DQ003';
    END IF;
    -- Give this transaction an xid before it holds any number: the gap proof in ring_pop relies on it.
    PERFORM pg_current_xact_id();
    -- n contiguous numbers: a batch never spans more than the capacity, so it never waits on itself,
    -- and every wait points at lower numbers (no cycle). The session lock is held only for the
    -- nextval calls and released on error too.
    PERFORM pg_advisory_lock(1685221713, (v_seq::oid::bigint - 2147483648)::integer);
    BEGIN
        v_first := nextval(v_seq);
        IF v_n > 1 THEN
            PERFORM nextval(v_seq) FROM generate_series(2, v_n);
        END IF;
    EXCEPTION WHEN OTHERS THEN
        PERFORM pg_advisory_unlock(1685221713, (v_seq::oid::bigint - 2147483648)::integer);
        RAISE;
    END;
    PERFORM pg_advisory_unlock(1685221713, (v_seq::oid::bigint - 2147483648)::integer);
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
            WHERE s.ctid = ANY (ARRAY(
                SELECT t.ctid FROM {schema}.ring_slots t
                WHERE t.queue_id = p_queue_id AND t.slot >= v_from AND t.slot < v_to
                  AND t.seq = v_base + t.slot - v_cap AND t.state IN (0, 3)
                FOR UPDATE SKIP LOCKED));
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
        -- predecessor that was issued (it is lower than ours) and is unwritten. Once every transaction
        -- of the snapshot taken after our numbers were issued has finished, nobody can write it:
        -- give it up as a gap, as ring_pop would, so that a ring nobody pops keeps taking pushes.
        IF v_snap IS NOT NULL AND NOT EXISTS (
                SELECT 1 FROM pg_snapshot_xip(v_snap) AS x(xid)
                WHERE x.xid <> pg_current_xact_id() AND pg_xact_status(x.xid) = 'in progress') THEN
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
        v_snap := pg_current_snapshot();
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

-- Pop up to p_n ready messages in id order from the window of numbers [p_lo, p_lo + capacity), where
-- p_lo is the caller's lower bound of the lowest unfinished number. Take (state 0) or lease (state 2)
-- them. Rows: the messages, then one last row (r_id NULL) with the next lower bound and, when the
-- lowest unfinished number is issued but not written, that number, the issued position and a
-- snapshot: the caller passes them back (p_gap...) on its next pop, which skips every number up to that
-- position still unwritten once every transaction of that snapshot has finished (their holders are
-- gone: a push takes an xid before its numbers) or when p_force is set (the caller's gap timeout).
-- p_own: the pop runs in the caller's transaction, which may roll back, so the bound never passes the
-- messages it took.
-- Plans are generic (the ring's table never changes size, so its statistics never mislead) and never
-- bitmap scans: the claim must walk the primary key in slot order and stop after n rows, where a
-- bitmap scan reads the whole window and sorts it.
CREATE FUNCTION {schema}.ring_pop(
    p_queue_id integer, p_cap integer, p_lo bigint, p_n integer, p_lease boolean,
    p_vt double precision, p_consumer text, p_own boolean,
    p_gap bigint, p_gap_issued bigint, p_gap_snap pg_snapshot, p_force boolean)
RETURNS TABLE (r_id bigint, r_attempts integer, r_deliveries integer, r_enqueued_at timestamptz,
               r_lease_until timestamptz, r_payload bytea, r_next_lo bigint, r_gap bigint,
               r_issued bigint, r_snap pg_snapshot)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off AS $$
DECLARE
    v_a integer := (p_lo % p_cap)::integer;
    v_from integer;
    v_to integer;
    v_base bigint;
    v_k integer := 0;
    v_tids tid[];
    v_seqs bigint[];
    v_pls bytea[];
    v_taken bigint[] := ARRAY[]::bigint[];
    v_lo bigint;
    v_seqrel regclass;
    v_issued bigint;
    v_gap bigint;
    v_span integer := 0;
BEGIN
    -- 1. Skip abandoned numbers (gaps) that the caller saw at the head of its last pop: the numbers
    --    from p_gap up to p_gap_issued (at most 4096) still unwritten, whose predecessor is finished
    --    and that nobody holds locked.
    --    Without the proof (p_force: the caller's gap timeout ran out) only the head number itself is
    --    given up: a holder alive but slow has written (and locks) its first numbers, while the rest of
    --    the range may belong to pushes still writing.
    IF p_gap IS NOT NULL AND NOT p_own AND EXISTS (
            SELECT 1 FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot = (p_gap % p_cap)::integer AND t.seq < p_gap) THEN
        v_span := CASE
            WHEN NOT EXISTS (
                SELECT 1 FROM pg_snapshot_xip(p_gap_snap) AS x(xid)
                WHERE pg_xact_status(x.xid) = 'in progress') THEN least(p_gap_issued - p_gap + 1, 4096, p_cap)
            WHEN p_force THEN 1
            ELSE 0 END;
    END IF;
    IF v_span > 0 THEN
        FOR part IN 1 .. 2 LOOP
            v_k := v_span;
            IF part = 1 THEN
                v_from := (p_gap % p_cap)::integer; v_to := least(p_cap, v_from + v_k);
                v_base := p_gap - v_from;
            ELSE
                v_from := 0; v_to := greatest(0, (p_gap % p_cap)::integer + v_k - p_cap);
                v_base := p_gap + p_cap - (p_gap % p_cap)::integer;
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
            END IF;
        END LOOP;
    END IF;

    -- 2. Claim: the window [p_lo, p_lo + capacity) is slots v_a .. capacity - 1, then 0 .. v_a - 1;
    --    within each part slot order is id order, so the primary key serves the scan, without a sort.
    FOR part IN 1 .. 2 LOOP
        EXIT WHEN cardinality(v_taken) >= p_n;
        IF part = 1 THEN
            v_from := v_a; v_to := p_cap; v_base := p_lo - v_a;
        ELSE
            v_from := 0; v_to := v_a; v_base := p_lo + p_cap - v_a;
        END IF;
        CONTINUE WHEN v_to <= v_from;
        SELECT array_agg(q.tid), array_agg(q.seq), array_agg(q.payload)
        INTO v_tids, v_seqs, v_pls
        FROM (
            SELECT t.ctid AS tid, t.seq, t.payload
            FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot >= v_from AND t.slot < v_to
              AND t.seq = v_base + t.slot AND t.state = 1 AND t.due_at <= now()
            ORDER BY t.slot
            LIMIT p_n - cardinality(v_taken)
            FOR UPDATE SKIP LOCKED) q;
        CONTINUE WHEN v_tids IS NULL;
        RETURN QUERY
        WITH claimed AS (
            UPDATE {schema}.ring_slots s
            SET state = CASE WHEN p_lease THEN 2 ELSE 0 END,
                attempts = s.attempts + 1, deliveries = s.deliveries + 1,
                due_at = CASE WHEN p_lease THEN now() + make_interval(secs => p_vt) ELSE s.due_at END,
                consumer = CASE WHEN p_lease THEN p_consumer END,
                payload = CASE WHEN p_lease THEN s.payload END
            WHERE s.ctid = ANY (v_tids)
            RETURNING s.seq, s.attempts, s.deliveries, s.enqueued_at, s.due_at
        )
        SELECT c.seq, c.attempts, c.deliveries, c.enqueued_at,
               CASE WHEN p_lease THEN c.due_at END, u.pl,
               NULL::bigint, NULL::bigint, NULL::bigint, NULL::pg_snapshot
        FROM claimed c JOIN unnest(v_seqs, v_pls) AS u(seq, pl) ON u.seq = c.seq
        ORDER BY c.seq;
        v_taken := v_taken || v_seqs;
    END LOOP;

    -- 3. The next lower bound: the first number of the window not finished (unwritten, ready or
    --    leased; and, in the caller's transaction, taken by this pop).
    FOR part IN 1 .. 2 LOOP
        IF part = 1 THEN
            v_from := v_a; v_to := p_cap; v_base := p_lo - v_a;
        ELSE
            v_from := 0; v_to := v_a; v_base := p_lo + p_cap - v_a;
        END IF;
        CONTINUE WHEN v_to <= v_from;
        SELECT v_base + t.slot INTO v_lo
        FROM {schema}.ring_slots t
        WHERE t.queue_id = p_queue_id AND t.slot >= v_from AND t.slot < v_to
          AND (t.seq < v_base + t.slot
               OR (t.seq = v_base + t.slot AND (t.state IN (1, 2) OR (p_own AND t.seq = ANY (v_taken)))))
        ORDER BY t.slot
        LIMIT 1;
        EXIT WHEN v_lo IS NOT NULL;
    END LOOP;
    IF v_lo IS NULL THEN
        v_lo := {schema}.ring_head(p_queue_id);  -- every number of the window was finished
    END IF;

    -- 4. Is the head issued but unwritten (a push in progress, or a gap)? The issued position is read
    --    before the snapshot, so every number up to it was taken by a transaction older than it.
    IF EXISTS (
            SELECT 1 FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot = (v_lo % p_cap)::integer AND t.seq < v_lo) THEN
        SELECT push_seq INTO v_seqrel FROM {schema}.rings WHERE queue_id = p_queue_id;
        v_issued := coalesce(pg_sequence_last_value(v_seqrel), 0);
        IF v_lo <= v_issued THEN
            v_gap := v_lo;
        END IF;
    END IF;
    RETURN QUERY SELECT NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz, NULL::timestamptz,
        NULL::bytea, v_lo, v_gap, v_issued, CASE WHEN v_gap IS NOT NULL THEN pg_current_snapshot() END;
END
$$;
