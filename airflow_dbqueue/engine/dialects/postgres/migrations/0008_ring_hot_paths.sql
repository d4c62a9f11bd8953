-- Migration 8: the ring's hot paths. A push takes its n numbers with nextval and one setval (under the
-- same lock) instead of n nextvals. A pop scans its window only up to the push position, so an empty or
-- short pop reads what was pushed rather than every slot of the ring, claims its rows with one UPDATE
-- that returns their payloads, and finds the next bound and the head gap with one more statement.
-- Skipping gaps moves to ring_skip_gap. Signatures are unchanged. Maintenance gives up the numbers that
-- pushes took and will never write (ring_skip_abandoned), so a ring nobody pops recovers its gaps too.

-- name: migrate
-- Maintenance's gap recovery: give up every number of a ring up to p_issued that a push took and never
-- wrote, wherever it lies (the head or past it), once every transaction of p_snap has finished. p_snap
-- must be taken after p_issued was read: each such number was taken by a transaction that had an xid
-- before it (ring_push takes one first), so its holder was finished then or listed in p_snap, and is
-- gone now. A number x is unwritten while its slot holds x - capacity, finished; slots locked by a push
-- writing them are passed over. Returns how many numbers were given up, or -1 while some transaction
-- of p_snap is still in progress (the caller waits and asks again).
CREATE FUNCTION {schema}.ring_skip_abandoned(p_queue_id integer, p_issued bigint, p_snap pg_snapshot)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_cap integer;
    v_gaps regclass;
    v_k integer;
    v_total integer := 0;
BEGIN
    IF EXISTS (
            SELECT 1 FROM pg_snapshot_xip(p_snap) AS x(xid)
            WHERE pg_xact_status(x.xid) = 'in progress') THEN
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

-- Give up abandoned numbers (gaps) of a ring, as pops and maintenance do: the numbers from p_gap up to
-- p_issued (at most 4096) still unwritten, whose predecessor is finished and that nobody holds locked,
-- once every transaction of p_snap has finished (p_snap was taken after those numbers were issued, and
-- a push takes an xid before its numbers, so their holders were among its transactions: they are gone).
-- Without that proof, p_force (a gap timeout ran out) gives up the number p_gap alone: a holder alive
-- but slow has written (and locks) its first numbers, while the rest of the range may belong to pushes
-- still writing. Nothing happens unless p_gap is still unwritten. Returns how many numbers it gave up.
CREATE FUNCTION {schema}.ring_skip_gap(
    p_queue_id integer, p_cap integer, p_gap bigint, p_issued bigint, p_snap pg_snapshot, p_force boolean)
RETURNS integer LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off AS $$
DECLARE
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
        v_span := CASE
            WHEN p_snap IS NOT NULL AND p_issued IS NOT NULL AND NOT EXISTS (
                SELECT 1 FROM pg_snapshot_xip(p_snap) AS x(xid)
                WHERE pg_xact_status(x.xid) = 'in progress') THEN least(p_issued - p_gap + 1, 4096, p_cap)
            WHEN p_force THEN 1
            ELSE 0 END;
    END IF;
    IF v_span <= 0 THEN
        RETURN 0;
    END IF;
    FOR part IN 1 .. 2 LOOP
        IF part = 1 THEN
            v_from := (p_gap % p_cap)::integer; v_to := least(p_cap, v_from + v_span);
            v_base := p_gap - v_from;
        ELSE
            v_from := 0; v_to := greatest(0, (p_gap % p_cap)::integer + v_span - p_cap);
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
            v_skipped := v_skipped + v_k;
        END IF;
    END LOOP;
    RETURN v_skipped;
END
$$;

-- Pop up to p_n ready messages in id order from the window of numbers [p_lo, p_lo + capacity), where
-- p_lo is the caller's lower bound of the lowest unfinished number. Take (state 0) or lease (state 2)
-- them. Rows: the messages, then one last row (r_id NULL) with the next lower bound and, when the
-- lowest unfinished number is issued but not written, that number, the issued position and a
-- snapshot: the caller passes them back (p_gap...) on its next pop, which skips every number up to that
-- position still unwritten once every transaction of that snapshot has finished (their holders are
-- gone: a push takes an xid before its numbers) or when p_force is set (the caller's gap timeout).
-- Only numbers up to the issued position (read first) can be ready, so the claim and the bound scan
-- the window only that far: an empty or short pop reads what was pushed, not the whole ring.
-- p_own: the pop runs in the caller's transaction, which may roll back: the caller keeps no bound and
-- skips no gap then, so the last row carries p_lo unchanged and nothing else.
-- Plans are generic (the ring's table never changes size, so its statistics never mislead) and never
-- bitmap scans: the claim must walk the primary key in slot order and stop after n rows, where a
-- bitmap scan reads the whole window and sorts it.
CREATE OR REPLACE FUNCTION {schema}.ring_pop(
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
    SELECT coalesce(pg_sequence_last_value(r.push_seq), 0) INTO v_issued
    FROM {schema}.rings r WHERE r.queue_id = p_queue_id;
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
            NULL::bigint, NULL::bigint, NULL::bigint, NULL::pg_snapshot;
        GET DIAGNOSTICS v_k = ROW_COUNT;
        v_got := v_got + v_k;
    END LOOP;
    IF p_own THEN
        RETURN QUERY SELECT NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz,
            NULL::timestamptz, NULL::bytea, p_lo, NULL::bigint, NULL::bigint, NULL::pg_snapshot;
        RETURN;
    END IF;

    -- 4. The next lower bound: the first issued number of the window not finished (unwritten, ready or
    --    leased); past the issued ones when all of them are. When that number is issued but unwritten
    --    (a push in progress, or a gap), it is reported with the issued position and a snapshot taken
    --    after that position was read. Each part's scan stops at its first row, and the lower number
    --    of the two parts is the head.
    RETURN QUERY
    SELECT NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz, NULL::timestamptz, NULL::bytea,
           coalesce(h.num, p_lo + v_span), CASE WHEN h.unwritten THEN h.num END, v_issued,
           CASE WHEN h.unwritten THEN pg_current_snapshot() END
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

-- Push a batch: take n contiguous numbers and write them into their slots, all or nothing, in the
-- caller's transaction. Returns the first number (the ids are first .. first + n - 1).
-- A slot whose previous occupant is not finished yet (the ring is full there) is waited for with
-- backoff up to p_timeout_s, then SQLSTATE DQ001. Slots already written stay locked meanwhile (nothing
-- is visible before commit). If a consumer gave one of our numbers up as a gap (only when it proved
-- every transaction that could hold it finished, or after its gap timeout), SQLSTATE DQ002: the
-- statement fails whole and the caller retries with new numbers.
-- p_notify: 0 never, 1 when the message before ours is no longer ready (consumers caught up), 2 always.
CREATE OR REPLACE FUNCTION {schema}.ring_push(
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
    -- and every wait points at lower numbers (no cycle). Every push takes its numbers under this
    -- session lock, so nextval then setval to the batch's last number is a range of its own; the lock
    -- is held only for those two calls and released on error too.
    PERFORM pg_advisory_lock(1685221713, (v_seq::oid::bigint - 2147483648)::integer);
    BEGIN
        v_first := nextval(v_seq);
        IF v_n > 1 THEN
            PERFORM setval(v_seq, v_first + v_n - 1);
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
