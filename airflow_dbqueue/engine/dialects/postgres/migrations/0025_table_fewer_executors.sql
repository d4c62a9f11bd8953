-- Migration 25: the table design's usual statements do less work a call. meta loses its two CHECK
-- constraints (the rules they checked are kept by the code that writes meta; schema.sql says why).
-- A push in READ COMMITTED of payloads that fit their rows, without a notification, is one INSERT that
-- reads the queue's row itself. A pop at most once without the archive, and a pop at least once,
-- return their rows straight from their DELETE or UPDATE, not through a CTE; the first takes a payload
-- in data with the new function data_take(). What pushes and pops return is unchanged. No data
-- changes.

-- name: migrate
ALTER TABLE {schema}.meta DROP CONSTRAINT meta_state_valid, DROP CONSTRAINT meta_lease_valid;

CREATE OR REPLACE FUNCTION {schema}.table_push(
    p_queue_id integer, p_payloads bytea[], p_priority smallint, p_delay_s double precision,
    p_notify integer, p_channel text, p_inline boolean)
RETURNS SETOF bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_locked text;
    v_at timestamptz := now() + make_interval(secs => p_delay_s);
BEGIN
    -- An assignment: PL/pgSQL evaluates it as a simple expression, where PERFORM would run a query.
    v_locked := pg_advisory_xact_lock_shared(hashtext('dbqueue.queue.' || '{schema}'), p_queue_id)::text;
    IF current_setting('transaction_isolation') = 'read committed' THEN
        IF p_inline AND p_notify = 0 THEN
            -- The usual push: one INSERT, which reads the queue's row itself (no row, nothing written),
            -- and names every column in the types of meta, so that the plan passes each row on without
            -- projecting it again. A push of one takes its payload from the array without unnest().
            IF cardinality(p_payloads) = 1 THEN
                RETURN QUERY
                INSERT INTO {schema}.meta (id, queue_id, state, priority, attempts, process_at, enqueued_at,
                    lease_until, consumer, last_error, deliveries, payload)
                SELECT nextval('{schema}.message_id_seq'), q.queue_id, 0::smallint, p_priority, 0, v_at, now(),
                       NULL::timestamptz, NULL::text, NULL::text, 0, p_payloads[1]
                FROM {schema}.queues q WHERE q.queue_id = p_queue_id
                RETURNING id;
            ELSE
                -- unnest() in a select list: its rows come one by one from the array, in order, without
                -- the store that a function scan in FROM fills first; nextval() runs above it, a row at a
                -- time in that order.
                RETURN QUERY
                INSERT INTO {schema}.meta (id, queue_id, state, priority, attempts, process_at, enqueued_at,
                    lease_until, consumer, last_error, deliveries, payload)
                SELECT nextval('{schema}.message_id_seq'), x.queue_id, 0::smallint, p_priority, 0, v_at, now(),
                       NULL::timestamptz, NULL::text, NULL::text, 0, x.payload
                FROM (SELECT q.queue_id, unnest(p_payloads) AS payload FROM {schema}.queues q
                      WHERE q.queue_id = p_queue_id) x
                RETURNING id;
            END IF;
            RETURN;
        END IF;
        IF NOT EXISTS (SELECT 1 FROM {schema}.queues WHERE queue_id = p_queue_id) THEN
            RETURN;
        END IF;
    ELSE
        PERFORM 1 FROM {schema}.queues WHERE queue_id = p_queue_id FOR KEY SHARE;
        IF NOT FOUND THEN
            RETURN;
        END IF;
    END IF;
    IF p_inline AND p_notify = 0 THEN
        RETURN QUERY
        INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at, payload)
        SELECT nextval('{schema}.message_id_seq'), p_queue_id, p_priority,
               now() + make_interval(secs => p_delay_s), now(), p.payload
        FROM unnest(p_payloads) AS p(payload)
        RETURNING id;
    ELSIF p_inline THEN
        RETURN QUERY
        WITH m AS (
            INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at, payload)
            SELECT nextval('{schema}.message_id_seq'), p_queue_id, p_priority,
                   now() + make_interval(secs => p_delay_s), now(), p.payload
            FROM unnest(p_payloads) AS p(payload)
            RETURNING id
        ), n AS (
            SELECT pg_notify(p_channel, '') AS sent
            WHERE p_notify = 2 OR NOT EXISTS (
                SELECT 1 FROM {schema}.meta r
                WHERE r.queue_id = p_queue_id AND r.state = 0 AND r.process_at <= now())
        )
        SELECT m.id FROM m CROSS JOIN (SELECT count(*) AS c FROM n) x;
    ELSIF p_notify = 0 THEN
        RETURN QUERY
        WITH input AS MATERIALIZED (
            SELECT nextval('{schema}.message_id_seq') AS id, p.payload, p.ord
            FROM unnest(p_payloads) WITH ORDINALITY AS p(payload, ord)
        ), m AS (
            INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at, payload)
            SELECT i.id, p_queue_id, p_priority, now() + make_interval(secs => p_delay_s), now(),
                   CASE WHEN octet_length(i.payload) <= 1900 THEN i.payload END
            FROM input i
        ), d AS (
            INSERT INTO {schema}.data (id, payload)
            SELECT i.id, i.payload FROM input i WHERE octet_length(i.payload) > 1900
        )
        SELECT i.id FROM input i ORDER BY i.ord;
    ELSE
        RETURN QUERY
        WITH input AS MATERIALIZED (
            SELECT nextval('{schema}.message_id_seq') AS id, p.payload, p.ord
            FROM unnest(p_payloads) WITH ORDINALITY AS p(payload, ord)
        ), m AS (
            INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at, payload)
            SELECT i.id, p_queue_id, p_priority, now() + make_interval(secs => p_delay_s), now(),
                   CASE WHEN octet_length(i.payload) <= 1900 THEN i.payload END
            FROM input i
        ), d AS (
            INSERT INTO {schema}.data (id, payload)
            SELECT i.id, i.payload FROM input i WHERE octet_length(i.payload) > 1900
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

CREATE FUNCTION {schema}.data_take(p_id bigint) RETURNS bytea
LANGUAGE sql VOLATILE AS $$
    DELETE FROM {schema}.data WHERE id = p_id RETURNING payload
$$;

CREATE OR REPLACE FUNCTION {schema}.table_take(p_queue_id integer, p_n integer, p_archive boolean)
RETURNS TABLE (r_id bigint, r_priority smallint, r_attempts integer, r_deliveries integer,
               r_enqueued_at timestamptz, r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
BEGIN
    IF p_archive THEN
        RETURN QUERY
        WITH taken AS (
            DELETE FROM {schema}.meta m
            USING (
                SELECT s.ctid AS tid FROM {schema}.meta s
                WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now()
                ORDER BY s.priority DESC, s.process_at, s.id
                LIMIT p_n
                FOR UPDATE SKIP LOCKED) c
            WHERE m.ctid = c.tid
            RETURNING m.id, m.queue_id, m.priority, m.attempts + 1 AS attempts,
                      m.deliveries + 1 AS deliveries, m.enqueued_at, m.payload
        ), kept AS (
            INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload)
            SELECT t.id, t.queue_id, t.priority, t.attempts, t.enqueued_at, 1, t.payload FROM taken t
        )
        SELECT t.id, t.priority, t.attempts, t.deliveries, t.enqueued_at, NULL::timestamptz,
               coalesce(t.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = t.id))
        FROM taken t;
    ELSE
        -- Rows straight from the DELETE: a CTE would copy each into a store and read it back (about
        -- 3,400 instructions a message at batch 100). A payload in data is taken (read and deleted) by
        -- data_take(), which coalesce() calls only for a row without a payload of its own.
        RETURN QUERY
        DELETE FROM {schema}.meta m
        USING (
            SELECT s.ctid AS tid FROM {schema}.meta s
            WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now()
            ORDER BY s.priority DESC, s.process_at, s.id
            LIMIT p_n
            FOR UPDATE SKIP LOCKED) c
        WHERE m.ctid = c.tid
        RETURNING m.id, m.priority, m.attempts + 1, m.deliveries + 1, m.enqueued_at, NULL::timestamptz,
                  coalesce(m.payload, {schema}.data_take(m.id));
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION {schema}.table_lease(
    p_queue_id integer, p_n integer, p_vt double precision, p_consumer text)
RETURNS TABLE (r_id bigint, r_priority smallint, r_attempts integer, r_deliveries integer,
               r_enqueued_at timestamptz, r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
BEGIN
    -- Rows straight from the UPDATE, not through a CTE (see table_take).
    RETURN QUERY
    UPDATE {schema}.meta m
    SET state = 1, attempts = m.attempts + 1, deliveries = m.deliveries + 1, consumer = p_consumer,
        lease_until = now() + make_interval(secs => p_vt)
    FROM (
        SELECT s.ctid AS tid FROM {schema}.meta s
        WHERE s.queue_id = p_queue_id AND s.state = 0 AND s.process_at <= now()
        ORDER BY s.priority DESC, s.process_at, s.id
        LIMIT p_n
        FOR UPDATE SKIP LOCKED) c
    WHERE m.ctid = c.tid
    RETURNING m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until,
              coalesce(m.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id));
END
$$;
