-- Migration 7: the ring's pop scans its window only up to the push position, so an empty or short pop
-- reads what was pushed rather than every slot of the ring, and claims its rows with one statement that
-- returns their payloads. Skipping gaps moves to ring_skip_gap, which maintenance calls too.

-- name: migrate
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
    v_lo bigint;
    v_unwritten boolean;
    v_gap bigint;
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
    --    returns their payloads.
    FOR part IN 1 .. 2 LOOP
        EXIT WHEN v_got >= p_n;
        IF part = 1 THEN
            v_from := v_a; v_to := least(p_cap, v_a + v_span); v_base := p_lo - v_a;
        ELSE
            v_from := 0; v_to := v_a + v_span - p_cap; v_base := p_lo + p_cap - v_a;
        END IF;
        CONTINUE WHEN v_to <= v_from;
        RETURN QUERY
        WITH claimed AS (
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
            RETURNING s.seq, s.attempts, s.deliveries, s.enqueued_at, s.due_at, q.payload
        )
        SELECT c.seq, c.attempts, c.deliveries, c.enqueued_at, CASE WHEN p_lease THEN c.due_at END, c.payload,
               NULL::bigint, NULL::bigint, NULL::bigint, NULL::pg_snapshot
        FROM claimed c
        ORDER BY c.seq;
        GET DIAGNOSTICS v_k = ROW_COUNT;
        v_got := v_got + v_k;
    END LOOP;
    IF p_own THEN
        RETURN QUERY SELECT NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz,
            NULL::timestamptz, NULL::bytea, p_lo, NULL::bigint, NULL::bigint, NULL::pg_snapshot;
        RETURN;
    END IF;

    -- 4. The next lower bound: the first issued number of the window not finished (unwritten, ready or
    --    leased); past the issued ones when all of them are.
    FOR part IN 1 .. 2 LOOP
        IF part = 1 THEN
            v_from := v_a; v_to := least(p_cap, v_a + v_span); v_base := p_lo - v_a;
        ELSE
            v_from := 0; v_to := v_a + v_span - p_cap; v_base := p_lo + p_cap - v_a;
        END IF;
        CONTINUE WHEN v_to <= v_from;
        SELECT v_base + t.slot, t.seq < v_base + t.slot INTO v_lo, v_unwritten
        FROM {schema}.ring_slots t
        WHERE t.queue_id = p_queue_id AND t.slot >= v_from AND t.slot < v_to
          AND (t.seq < v_base + t.slot OR (t.seq = v_base + t.slot AND t.state IN (1, 2)))
        ORDER BY t.slot
        LIMIT 1;
        EXIT WHEN v_lo IS NOT NULL;
    END LOOP;

    -- 5. Is the head issued but unwritten (a push in progress, or a gap)? Then report it with the
    --    issued position and a snapshot taken after that position was read.
    IF v_lo IS NULL THEN
        v_lo := p_lo + v_span;
    ELSIF v_unwritten THEN
        v_gap := v_lo;
    END IF;
    RETURN QUERY SELECT NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz, NULL::timestamptz,
        NULL::bytea, v_lo, v_gap, v_issued, CASE WHEN v_gap IS NOT NULL THEN pg_current_snapshot() END;
END
$$;
