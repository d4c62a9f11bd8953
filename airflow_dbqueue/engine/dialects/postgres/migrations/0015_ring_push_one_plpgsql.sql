-- Migration 15: a push of one message (ring_push_one) is a PL/pgSQL function with a generic plan that
-- returns its number as a scalar (negative: taken but not written), instead of a set-returning SQL
-- function whose statement, a CTE, was run through the SQL-function executor on every call. Measured
-- with cachegrind on the server: 324,000 instructions a push of one against 372,000 (the naive
-- queue's INSERT: 100,000). Its callers read the pair (number, written) through the query of the same
-- name, so nothing else changes, and a ring's messages are not touched.

-- name: migrate
DROP FUNCTION {schema}.ring_push_one(integer, integer, bytea, integer, text);

-- Push one message in one statement: the path of a push of one outside a caller's transaction (the
-- usual call at batch 1). ring_push is a PL/pgSQL loop that can wait; this tries once. It takes one
-- number, under the push lock in shared mode until its transaction ends (a batch takes a range under it
-- in exclusive mode, so that no single number lands inside the range), and writes the slot if it is
-- free. Returns the number when it was written, minus the number when its slot was not free yet (the
-- ring is full there: the caller writes the number with ring_push(p_first => number), which waits for
-- the slot; in between, the number is issued and unwritten, as a push in progress is), and NULL when
-- the ring does not exist. The number is taken before this transaction has an xid (the gap proof
-- relies on a push having one first), so a pop could give it up as a gap in that instant: the UPDATE
-- then finds the slot moved on and writes nothing, and ring_push fails with DQ002 (new numbers).
-- p_notify as in ring_push. PL/pgSQL with a generic plan, so that its UPDATE is planned once a
-- session, and a scalar result, which costs the server less than a set's.
CREATE FUNCTION {schema}.ring_push_one(
    p_queue_id integer, p_cap integer, p_payload bytea, p_notify integer, p_channel text)
RETURNS bigint LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_seq regclass := to_regclass('{schema}.ring_' || p_queue_id || '_seq');
    v_num bigint;
    v_ok boolean;
BEGIN
    IF v_seq IS NULL THEN
        RETURN NULL;
    END IF;
    v_ok := pg_advisory_xact_lock_shared(1685221713, (v_seq::oid::bigint - 2147483648)::integer) IS NULL;
    v_num := nextval(v_seq);
    UPDATE {schema}.ring_slots s
    SET seq = v_num, enqueued_at = now(), payload = p_payload
    WHERE s.queue_id = p_queue_id AND s.slot = (v_num % p_cap)::integer
      AND s.seq = v_num - p_cap AND s.seq < {schema}.ring_floor(p_queue_id);
    IF NOT FOUND THEN
        RETURN -v_num;
    END IF;
    IF p_notify > 0 THEN  -- a condition with a subquery is a query of its own: only when it can notify
        IF p_notify = 2 OR NOT EXISTS (
                SELECT 1 FROM {schema}.ring_lanes l WHERE l.queue_id = p_queue_id AND l.pos < v_num) THEN
            PERFORM pg_notify(p_channel, '');
        END IF;
    END IF;
    RETURN v_num;
END
$$;
