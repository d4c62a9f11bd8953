-- Migration 16: the table design's pops and ack as functions with generic plans (table_take,
-- table_lease, table_ack), as the push is: planned once a session instead of on every call. Tables and
-- messages are unchanged.

-- name: migrate
-- The table design's pop at most once (and exactly once, in the caller's transaction): up to p_n ready
-- messages of queue p_queue_id in claim order (priority DESC, process_at, id), skipping rows other pops
-- hold, locked and deleted by one statement; kept in done for the archiver (p_archive), or deleted with
-- their payloads. attempts and deliveries come back counting this delivery. A payload in data is read
-- by a scalar subquery keyed on id, never by a join (see pop_lease in queries/table.sql).
-- A function with generic plans: its statements are planned once a session, not on every pop (custom
-- plans cost 0.12-0.22 ms of planning a call). No sequential or bitmap scans: the claim walks
-- meta_ready_idx in claim order and payloads are probed by id, whatever the statistics said when the
-- plan was made (a queue's are often those of an empty table).
CREATE FUNCTION {schema}.table_take(p_queue_id integer, p_n integer, p_archive boolean)
RETURNS TABLE (r_id bigint, r_priority smallint, r_attempts integer, r_deliveries integer,
               r_enqueued_at timestamptz, r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off AS $$
BEGIN
    IF p_archive THEN
        RETURN QUERY
        WITH taken AS (
            DELETE FROM {schema}.meta m
            WHERE m.ctid = ANY (ARRAY(
                SELECT s.ctid FROM {schema}.meta s
                WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now()
                ORDER BY s.priority DESC, s.process_at, s.id
                LIMIT p_n
                FOR UPDATE SKIP LOCKED))
            RETURNING m.id, m.queue_id, m.priority, m.attempts + 1 AS attempts,
                      m.deliveries + 1 AS deliveries, m.process_at, m.enqueued_at, m.payload
        ), kept AS (
            INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload)
            SELECT t.id, t.queue_id, t.priority, t.attempts, t.enqueued_at, 1, t.payload FROM taken t
        )
        SELECT t.id, t.priority, t.attempts, t.deliveries, t.enqueued_at, NULL::timestamptz,
               coalesce(t.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = t.id))
        FROM taken t
        ORDER BY t.priority DESC, t.process_at, t.id;
    ELSE
        RETURN QUERY
        WITH taken AS (
            DELETE FROM {schema}.meta m
            WHERE m.ctid = ANY (ARRAY(
                SELECT s.ctid FROM {schema}.meta s
                WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now()
                ORDER BY s.priority DESC, s.process_at, s.id
                LIMIT p_n
                FOR UPDATE SKIP LOCKED))
            RETURNING m.id, m.priority, m.attempts + 1 AS attempts, m.deliveries + 1 AS deliveries,
                      m.process_at, m.enqueued_at, m.payload
        ), dropped AS (
            DELETE FROM {schema}.data d
            WHERE d.id = ANY (ARRAY(SELECT t.id FROM taken t WHERE t.payload IS NULL))
        )
        SELECT t.id, t.priority, t.attempts, t.deliveries, t.enqueued_at, NULL::timestamptz,
               coalesce(t.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = t.id))
        FROM taken t
        ORDER BY t.priority DESC, t.process_at, t.id;
    END IF;
END
$$;

-- The table design's pop at least once: up to p_n ready messages of queue p_queue_id in claim order,
-- skipping rows other pops hold, leased to p_consumer for p_vt seconds, by one statement. Generic
-- plans, without sequential or bitmap scans, as table_take().
CREATE FUNCTION {schema}.table_lease(
    p_queue_id integer, p_n integer, p_vt double precision, p_consumer text)
RETURNS TABLE (r_id bigint, r_priority smallint, r_attempts integer, r_deliveries integer,
               r_enqueued_at timestamptz, r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off AS $$
BEGIN
    RETURN QUERY
    WITH claimed AS (
        UPDATE {schema}.meta m
        SET state = 1, attempts = m.attempts + 1, deliveries = m.deliveries + 1, consumer = p_consumer,
            lease_until = now() + make_interval(secs => p_vt)
        WHERE m.ctid = ANY (ARRAY(
            SELECT s.ctid FROM {schema}.meta s
            WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now()
            ORDER BY s.priority DESC, s.process_at, s.id
            LIMIT p_n
            FOR UPDATE SKIP LOCKED))
        RETURNING m.id, m.priority, m.attempts, m.deliveries, m.process_at, m.enqueued_at,
                  m.lease_until, m.payload
    )
    SELECT c.id, c.priority, c.attempts, c.deliveries, c.enqueued_at, c.lease_until,
           coalesce(c.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = c.id))
    FROM claimed c
    ORDER BY c.priority DESC, c.process_at, c.id;
END
$$;

-- The table design's ack: finish the leased messages of the receipts (p_ids, p_deliveries), all or
-- nothing, without locking them first, as queries/table.sql's ack says; returns their ids. Generic plans,
-- without sequential or bitmap scans: each receipt probes meta_pkey, whatever the statistics.
CREATE FUNCTION {schema}.table_ack(
    p_ids bigint[], p_deliveries integer[], p_queue_id integer, p_archive boolean)
RETURNS SETOF bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off AS $$
BEGIN
    IF p_archive THEN
        RETURN QUERY
        WITH acked AS (
            DELETE FROM {schema}.meta m
            WHERE m.ctid = ANY (ARRAY(
                SELECT h.tid
                FROM unnest(p_ids, p_deliveries) AS r(id, delivery)
                CROSS JOIN LATERAL (
                    SELECT s.ctid AS tid FROM {schema}.meta s
                    WHERE s.id = r.id AND s.deliveries = r.delivery AND s.queue_id = p_queue_id
                      AND s.lease_until > now()
                    OFFSET 0) h))
            RETURNING m.id, m.queue_id, m.priority, m.attempts, m.enqueued_at, m.payload
        ), kept AS (
            INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload)
            SELECT a.id, a.queue_id, a.priority, a.attempts, a.enqueued_at, 1, a.payload FROM acked a
        ), checked AS (
            SELECT CASE WHEN count(*) = cardinality(p_ids) THEN count(*)
                        ELSE {schema}.receipts_not_held(cardinality(p_ids), count(*)) END AS n
            FROM acked
        )
        SELECT a.id FROM acked a CROSS JOIN checked c;
    ELSE
        RETURN QUERY
        WITH acked AS (
            DELETE FROM {schema}.meta m
            WHERE m.ctid = ANY (ARRAY(
                SELECT h.tid
                FROM unnest(p_ids, p_deliveries) AS r(id, delivery)
                CROSS JOIN LATERAL (
                    SELECT s.ctid AS tid FROM {schema}.meta s
                    WHERE s.id = r.id AND s.deliveries = r.delivery AND s.queue_id = p_queue_id
                      AND s.lease_until > now()
                    OFFSET 0) h))
            RETURNING m.id, m.payload
        ), dropped AS (
            DELETE FROM {schema}.data d
            WHERE d.id = ANY (ARRAY(SELECT a.id FROM acked a WHERE a.payload IS NULL))
        ), checked AS (
            SELECT CASE WHEN count(*) = cardinality(p_ids) THEN count(*)
                        ELSE {schema}.receipts_not_held(cardinality(p_ids), count(*)) END AS n
            FROM acked
        )
        SELECT a.id FROM acked a CROSS JOIN checked c;
    END IF;
END
$$;
