-- Migration 24: a ring's push of a batch (ring_push) takes a floor its caller read earlier (p_floor)
-- and reads the ring's own only when that one leaves no room for the batch; it returns the floor it
-- read, if any, beside the first number (r_first, r_floor). A floor never goes down, so any floor once
-- read is a safe bound. Code older than this migration calls the function it replaces, and fails.
-- No data changes.

-- name: migrate
DROP FUNCTION {schema}.ring_push(integer, integer, bytea[], double precision, integer, text, bigint);

CREATE FUNCTION {schema}.ring_push(
    p_queue_id integer, p_cap integer, p_payloads bytea[], p_timeout_s double precision, p_notify integer,
    p_channel text, p_first bigint, p_floor bigint, OUT r_first bigint, OUT r_floor bigint)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_bitmapscan = off AS $$
DECLARE
    v_n integer := coalesce(cardinality(p_payloads), 0);
    v_cap integer := p_cap;
    v_seq regclass := to_regclass('{schema}.ring_' || p_queue_id || '_seq');
    v_first bigint;
    v_floor bigint := p_floor;
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
    v_xid xid8;
    v_ok boolean;
BEGIN
    IF v_seq IS NULL THEN
        RAISE EXCEPTION 'ring % does not exist', p_queue_id USING ERRCODE = 'DQ004';
    END IF;
    IF v_n < 1 OR v_n > v_cap THEN
        RAISE EXCEPTION 'a ring batch holds 1 to % (the capacity) messages, got %', v_cap, v_n
            USING ERRCODE = 'DQ003';
    END IF;
    -- Room first, before this transaction has an xid or any number: when the number a capacity before
    -- the highest this batch would take is not below the floor (the ring is full there), return NULL,
    -- having taken nothing; the caller waits and calls again. A transaction with an xid holds back the
    -- pruning of every row version newer than it, so a push that waited here for consumers would keep
    -- the ring's old versions from being pruned while it waited, and the heap would grow.
    -- A lane stopped at a gap (a number issued and never written) holds the floor down too: the caller
    -- helps to give it up between its calls (ring_pop of none), outside this transaction.
    -- The floor given (p_floor) is asked first: reading the ring's own costs a push of 100 about a
    -- tenth of its server instructions.
    IF p_first IS NULL AND (v_floor IS NULL
            OR coalesce(pg_sequence_last_value(v_seq), 0) + v_n - v_cap >= v_floor) THEN
        v_floor := {schema}.ring_floor(p_queue_id);
        r_floor := v_floor;
        IF v_floor IS NULL THEN  -- no lanes: the ring was dropped
            RAISE EXCEPTION 'ring % does not exist', p_queue_id USING ERRCODE = 'DQ004';
        END IF;
        IF coalesce(pg_sequence_last_value(v_seq), 0) + v_n - v_cap >= v_floor THEN
            RETURN;
        END IF;
    END IF;
    -- Give this transaction an xid before it holds any number: the gap proof relies on it.
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
        -- A floor read before the numbers were taken still bounds the first write (a floor never goes
        -- down); each later attempt reads it again.
        IF v_floor IS NULL THEN
            v_floor := {schema}.ring_floor(p_queue_id);
            r_floor := v_floor;
            IF v_floor IS NULL THEN
                RAISE EXCEPTION 'ring % does not exist', p_queue_id USING ERRCODE = 'DQ004';
            END IF;
        END IF;
        FOR part IN 1 .. 2 LOOP
            IF part = 1 THEN
                v_from := v_a; v_to := v_b1; v_base := v_first - v_a;
            ELSE
                v_from := 0; v_to := v_b2; v_base := v_first + v_cap - v_a;
            END IF;
            CONTINUE WHEN v_to <= v_from;
            UPDATE {schema}.ring_slots s
            SET seq = v_base + s.slot, enqueued_at = now(),
                payload = p_payloads[(v_base + s.slot - v_first + 1)::integer]
            WHERE s.queue_id = p_queue_id AND s.slot >= v_from AND s.slot < v_to
              AND s.seq = v_base + s.slot - v_cap AND s.seq < v_floor;
            GET DIAGNOSTICS v_k = ROW_COUNT;
            v_written := v_written + v_k;
        END LOOP;
        EXIT WHEN v_written >= v_n;
        IF EXISTS (
            SELECT 1 FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot >= v_a AND t.slot < v_b1
              AND t.seq = v_first - v_a + t.slot AND t.payload IS NULL
            UNION ALL
            SELECT 1 FROM {schema}.ring_slots t
            WHERE t.queue_id = p_queue_id AND t.slot < v_b2
              AND t.seq = v_first + v_cap - v_a + t.slot AND t.payload IS NULL) THEN
            RAISE EXCEPTION 'ring %: numbers % .. % were given up as gaps before this push wrote them',
                p_queue_id, v_first, v_first + v_n - 1 USING ERRCODE = 'DQ002';
        END IF;
        IF clock_timestamp() >= v_deadline THEN
            RAISE EXCEPTION 'ring % stayed full for % s (capacity %)', p_queue_id, p_timeout_s, v_cap
                USING ERRCODE = 'DQ001';
        END IF;
        PERFORM pg_sleep(v_pause);
        v_pause := least(v_pause * 2, 0.05);
        v_floor := NULL;
    END LOOP;
    IF p_notify > 0 THEN  -- a condition with a subquery is a query of its own: only when it can notify
        IF p_notify = 2 OR NOT EXISTS (
                SELECT 1 FROM {schema}.ring_lanes l WHERE l.queue_id = p_queue_id AND l.pos < v_first)
            OR EXISTS (
                SELECT 1 FROM {schema}.ring_groups g
                WHERE g.queue_id = p_queue_id AND NOT EXISTS (
                    SELECT 1 FROM {schema}.ring_lanes l WHERE l.queue_id = g.gid AND l.pos < v_first)) THEN
            PERFORM pg_notify(p_channel, '');
        END IF;
    END IF;
    r_first := v_first;
END
$$;
