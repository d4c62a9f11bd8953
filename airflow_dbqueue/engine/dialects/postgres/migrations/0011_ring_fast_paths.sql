-- Migration 11: fast paths of the ring for one message, and for pops while they come back full.
-- ring_push_one pushes one message in a single statement (one number under the push lock in shared
-- mode, one UPDATE of its slot), and ring_claim claims from the first part of a pop's window in a single
-- statement: both are SQL functions with generic plans, where ring_push and ring_pop are PL/pgSQL loops
-- of several queries. ring_push takes p_first, the numbers already taken by ring_push_one when it found
-- the slot not free yet, to write them waiting as it waits for new ones.

-- name: migrate
DROP FUNCTION {schema}.ring_push(integer, integer, bytea[], double precision, integer, text);

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
