-- Migration 10: the ring's gap proof lists the possible holders of a number from pg_locks (every
-- transaction with an xid holds the lock on its transactionid until it ends) instead of reading a
-- snapshot's in-progress list, which names only xids below its xmax (one past the latest completed xid):
-- a newer transaction still running was missing from it, so a live push's number could be given up.
-- Pops list the holders only for a head that stays unwritten (a push writing it is the usual case), and
-- keep one list until it is gone; a push waiting on a full ring keeps the list it took first. After the
-- gap timeout a pop gives up the whole run of unwritten numbers at the head (up to the first written
-- or locked one), not the first alone: one number per timeout stalled pushes behind a rolled-back batch
-- while waiting pushers kept the proof from holding (a 10M-message soak on a loaded machine failed with
-- QueueFullError after 30 s). ring_pop, ring_skip_gap and ring_skip_abandoned take and return xid[]
-- where they had pg_snapshot. ring_push takes the ring's capacity, finds its sequences by name and
-- runs every step but the UPDATE as an assignment (no query of its own), and ring_pop reads the push
-- position the same way: each query they no longer run cost about 25 us at a push or pop of one.
-- ring_pop waits at most 200 ms for a row lock (lock_timeout): SKIP LOCKED does not cover the update
-- chain, and a claim that followed one onto a push in progress could wait for a push that waited for it.
-- ring_create lays a new ring's slots out with fillers of 5/4 of the payload limit, so that a new ring
-- starts at about the size the old layout grew to in its first wraps (existing rings keep theirs).

-- name: migrate
DROP FUNCTION {schema}.ring_push(integer, bytea[], double precision, integer, text);
DROP FUNCTION {schema}.ring_pop(integer, integer, bigint, integer, boolean, double precision, text, boolean,
    bigint, bigint, pg_snapshot, boolean);
DROP FUNCTION {schema}.ring_skip_gap(integer, integer, bigint, bigint, pg_snapshot, boolean);
DROP FUNCTION {schema}.ring_skip_abandoned(integer, bigint, pg_snapshot);

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

CREATE FUNCTION {schema}.ring_push(
    p_queue_id integer, p_cap integer, p_payloads bytea[], p_timeout_s double precision, p_notify integer,
    p_channel text)
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
    -- Give this transaction an xid before it holds any number: the gap proof in ring_pop relies on it.
    v_xid := pg_current_xact_id();
    -- n contiguous numbers: a batch never spans more than the capacity, so it never waits on itself,
    -- and every wait points at lower numbers (no cycle). Every push takes its numbers under this
    -- session lock, so nextval then setval to the batch's last number is a range of its own; the lock
    -- is held only for those two calls and released on error too.
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

CREATE OR REPLACE FUNCTION {schema}.ring_create(p_schema text, p_queue_id integer, p_capacity integer, p_slot_bytes integer)
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
