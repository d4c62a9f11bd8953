-- Migration 14: the table design keeps a payload of up to 1900 bytes in its message's meta row (and,
-- once finished, in its done row) instead of a row of data: a push of a small payload writes one heap
-- row and two index entries instead of two rows and three entries, and a pop deletes from one table.
-- Larger payloads stay in data. Readers take meta.payload (or done.payload) and fall back to data, so
-- the messages of existing queues, whose payloads are all in data, are read and archived as before.
-- Adding a nullable column without a default rewrites nothing.

-- name: migrate
ALTER TABLE {schema}.meta ADD COLUMN payload bytea;
ALTER TABLE {schema}.done ADD COLUMN payload bytea;

-- The table design's push: n messages into queue p_queue_id in one call, ids in payload order; none
-- when the queue does not exist (a dropped queue's handle writes nothing). It first takes the queue's
-- push lock in shared mode, held to the end of the transaction: drop_queue takes it exclusively, so a
-- drop waits for every push in progress, and a push that comes during a drop waits for it. Then it
-- reads queues with a snapshot taken after the lock (each statement of a function in READ COMMITTED
-- gets its own), so a push that waited for a drop finds the queue gone. Under REPEATABLE READ or
-- SERIALIZABLE the transaction's snapshot may predate the drop: there the queue's row is locked FOR KEY
-- SHARE, which fails with a serialization error when a drop committed meanwhile (the caller runs its
-- transaction again and finds the queue gone).
-- Ids come from the sequence in payload order; meta and data rows are written by one statement. A
-- payload of up to 1900 bytes goes into the meta row, a larger one into data (see meta).
-- p_notify: 0 never, 1 when the queue had no ready message before (the statement's one snapshot does not
-- see this push's own rows), 2 always.
-- A function with generic plans: its statements are planned once a session, where the statement this
-- replaces was planned on every push (a third of a push of one's server time). No sequential scans:
-- the ready check must probe meta_ready_idx whatever the statistics said when the plan was made.
CREATE OR REPLACE FUNCTION {schema}.table_push(
    p_queue_id integer, p_payloads bytea[], p_priority smallint, p_delay_s double precision,
    p_notify integer, p_channel text)
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
    IF p_notify = 0 THEN
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
