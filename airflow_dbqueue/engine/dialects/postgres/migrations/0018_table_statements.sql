-- Migration 18: cheaper statements for the table design, and nothing of a queue's data changes.
-- A push whose payloads all fit in their meta rows writes them with one plain INSERT (table_push takes a
-- seventh argument that says so); the pops return their rows in claim order without sorting them
-- again (table_take, table_lease). Counted with cachegrind on the server at batch 100: a push from
-- about 37,200 instructions a message to 33,300, a pop at most once from 24,500 to 22,600. The push's
-- query passes the new argument, so code older than this version cannot push into a schema at this
-- version (see docs/limits.md).

-- name: migrate
DROP FUNCTION {schema}.table_push(integer, bytea[], smallint, double precision, integer, text);

-- The table design's push: n messages into queue p_queue_id in one call, ids in payload order; none
-- when the queue does not exist (a dropped queue's handle writes nothing). It first takes the queue's
-- push lock in shared mode, held to the end of the transaction: drop_queue takes it exclusively, so a
-- drop waits for every push in progress, and a push that comes during a drop waits for it. Then it
-- reads queues with a snapshot taken after the lock (each statement of a function in READ COMMITTED
-- gets its own), so a push that waited for a drop finds the queue gone. Under REPEATABLE READ or
-- SERIALIZABLE the transaction's snapshot may predate the drop: there the queue's row is locked FOR KEY
-- SHARE, which fails with a serialization error when a drop committed meanwhile (the caller runs its
-- transaction again and finds the queue gone).
-- Ids come from the sequence in payload order. A payload of up to 1900 bytes goes into the meta row, a
-- larger one into data (see meta). p_inline says that every payload is small (the caller knows their
-- sizes): then one INSERT writes the meta rows and returns their ids in the order it inserted them,
-- which is the order unnest() yields the payloads (a scan of a function without ORDER BY is not
-- reordered). Otherwise one statement writes meta and data rows from a materialized, numbered input
-- and sorts the ids back into payload order: at 100 payloads a message that form cost the server
-- about 4,000 more instructions than the single INSERT (cachegrind).
-- p_notify: 0 never, 1 when the queue had no ready message before (the statement's one snapshot does not
-- see this push's own rows), 2 always.
-- A function with generic plans: its statements are planned once a session, where a statement run by
-- itself is planned on every push (a third of a push of one's server time). No sequential scans:
-- the ready check must probe meta_ready_idx whatever the statistics said when the plan was made.
CREATE FUNCTION {schema}.table_push(
    p_queue_id integer, p_payloads bytea[], p_priority smallint, p_delay_s double precision,
    p_notify integer, p_channel text, p_inline boolean)
RETURNS SETOF bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('dbqueue.queue.' || '{schema}'), p_queue_id);
    IF current_setting('transaction_isolation') = 'read committed' THEN
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

-- The table design's pop at most once (and exactly once, in the caller's transaction): up to p_n ready
-- messages of queue p_queue_id in claim order (priority DESC, process_at, id), skipping rows other pops
-- hold, locked and deleted by one statement; kept in done for the archiver (p_archive), or deleted with
-- their payloads. attempts and deliveries come back counting this delivery. A payload in data is read
-- by a scalar subquery keyed on id, never by a join (see pop_lease in queries/table.sql).
-- A function with generic plans: its statements are planned once a session, not on every pop (custom
-- plans cost 0.12-0.22 ms of planning a call). No sequential or bitmap scans: the claim walks
-- meta_ready_idx in claim order and payloads are probed by id, whatever the statistics said when the
-- plan was made (a queue's are often those of an empty table).
-- The rows come back in claim order without a sort: the claim yields them in index order, the join
-- visits them in that order (a nested loop probing each row by its ctid; hash and merge joins are off,
-- so no other join can be chosen), and DELETE ... RETURNING returns each row as it deletes it. (Sorting
-- the returned rows again cost about 3,000 instructions a message at batch 100.)
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
            RETURNING m.id, m.priority, m.attempts + 1 AS attempts, m.deliveries + 1 AS deliveries,
                      m.enqueued_at, m.payload
        ), dropped AS (
            DELETE FROM {schema}.data d
            WHERE d.id = ANY (ARRAY(SELECT t.id FROM taken t WHERE t.payload IS NULL))
        )
        SELECT t.id, t.priority, t.attempts, t.deliveries, t.enqueued_at, NULL::timestamptz,
               coalesce(t.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = t.id))
        FROM taken t;
    END IF;
END
$$;

-- The table design's pop at least once: up to p_n ready messages of queue p_queue_id in claim order,
-- skipping rows other pops hold, leased to p_consumer for p_vt seconds, by one statement. Generic
-- plans, without sequential or bitmap scans, and rows in claim order without a sort, as table_take().
CREATE OR REPLACE FUNCTION {schema}.table_lease(
    p_queue_id integer, p_n integer, p_vt double precision, p_consumer text)
RETURNS TABLE (r_id bigint, r_priority smallint, r_attempts integer, r_deliveries integer,
               r_enqueued_at timestamptz, r_lease_until timestamptz, r_payload bytea)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off AS $$
BEGIN
    RETURN QUERY
    WITH claimed AS (
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
        RETURNING m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until, m.payload
    )
    SELECT c.id, c.priority, c.attempts, c.deliveries, c.enqueued_at, c.lease_until,
           coalesce(c.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = c.id))
    FROM claimed c;
END
$$;
