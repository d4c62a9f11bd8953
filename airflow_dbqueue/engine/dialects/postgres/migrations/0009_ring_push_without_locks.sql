-- Migration 9: a ring push writes its slots with a plain UPDATE of their committed version instead of
-- locking them first with SELECT ... FOR UPDATE SKIP LOCKED, which wrote a lock record and dirtied each
-- tuple once more per message (ring WAL per message at 2x2 batch 1000: 739 -> 682 bytes). Signature
-- unchanged.

-- name: migrate
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
