-- Named queries of the PostgreSQL dialect. {schema} is the quoted schema name; every value is a
-- bound parameter (%(name)s). The SQL Server dialect keeps the same names.

-- name: install_lock
SELECT pg_advisory_xact_lock(hashtext('dbqueue.install.' || %(schema)s))

-- name: schema_installed
SELECT EXISTS (
    SELECT 1 FROM pg_catalog.pg_tables WHERE schemaname = %(schema)s AND tablename = 'schema_version')

-- name: schema_version
SELECT coalesce(max(version), 0) FROM {schema}.schema_version

-- name: record_version
INSERT INTO {schema}.schema_version (version) VALUES (%(version)s) ON CONFLICT DO NOTHING

-- name: drop_schema
DROP SCHEMA IF EXISTS {schema} CASCADE

-- name: create_queue
INSERT INTO {schema}.queues (
    name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
    retry_backoff_s, retry_backoff_max_s, notify, archive)
VALUES (
    %(name)s, %(design)s, %(payload_type)s, %(max_payload_bytes)s, %(max_attempts)s,
    %(visibility_timeout_s)s, %(retry_backoff_s)s, %(retry_backoff_max_s)s, %(notify)s, %(archive)s)
ON CONFLICT (name) DO NOTHING
RETURNING queue_id

-- name: get_queue
SELECT queue_id, name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
       retry_backoff_s, retry_backoff_max_s, notify, archive,
       (SELECT r.capacity FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS capacity
FROM {schema}.queues q WHERE name = %(name)s

-- name: list_queues
SELECT queue_id, name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
       retry_backoff_s, retry_backoff_max_s, notify, archive,
       (SELECT r.capacity FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS capacity
FROM {schema}.queues q ORDER BY name

-- name: drop_queue
-- Payload deletes here and below match ids with = ANY (ARRAY(...)), not a join: with the statistics of
-- an empty table the planner made the join a nested loop over all of data_pkey (O(n^2): 14 s for 20k).
WITH m AS (DELETE FROM {schema}.meta WHERE queue_id = %(queue_id)s RETURNING id),
     f AS (DELETE FROM {schema}.done WHERE queue_id = %(queue_id)s RETURNING id),
     d AS (DELETE FROM {schema}.data WHERE id = ANY (ARRAY(SELECT id FROM m UNION ALL SELECT id FROM f))),
     a AS (DELETE FROM {schema}.archive WHERE queue_id = %(queue_id)s)
DELETE FROM {schema}.queues WHERE queue_id = %(queue_id)s RETURNING queue_id

-- name: push
-- One round trip a batch: ids come from the sequence in payload order, meta and data rows are written
-- by one statement.
WITH input AS MATERIALIZED (
    SELECT nextval('{schema}.message_id_seq') AS id, p.payload, p.ord
    FROM unnest(%(payloads)s::bytea[]) WITH ORDINALITY AS p(payload, ord)
), m AS (
    INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at)
    SELECT id, %(queue_id)s, %(priority)s, now() + make_interval(secs => %(delay_s)s), now() FROM input
), d AS (
    INSERT INTO {schema}.data (id, payload) SELECT id, payload FROM input
)
SELECT id FROM input ORDER BY ord

-- name: push_notify
-- push, plus a NOTIFY when the queue had no ready message before it (or always, with always = true).
-- All parts of the statement share one snapshot, so the EXISTS does not see this push's own rows.
WITH input AS MATERIALIZED (
    SELECT nextval('{schema}.message_id_seq') AS id, p.payload, p.ord
    FROM unnest(%(payloads)s::bytea[]) WITH ORDINALITY AS p(payload, ord)
), m AS (
    INSERT INTO {schema}.meta (id, queue_id, priority, process_at, enqueued_at)
    SELECT id, %(queue_id)s, %(priority)s, now() + make_interval(secs => %(delay_s)s), now() FROM input
), d AS (
    INSERT INTO {schema}.data (id, payload) SELECT id, payload FROM input
), n AS (
    SELECT pg_notify(%(channel)s, '') AS sent
    WHERE %(always)s OR NOT EXISTS (
        SELECT 1 FROM {schema}.meta
        WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now())
)
-- (an inner join: the planner would remove an unused LEFT JOIN, and with it the NOTIFY)
SELECT i.id FROM input i CROSS JOIN (SELECT count(*) AS c FROM n) x ORDER BY i.ord

-- name: pop_lease
-- Payloads are fetched by a scalar subquery keyed on id, never by a join: a queue's statistics are
-- often those of an empty table (a drained queue, a dropped one), and then the planner joined the
-- claimed rows to data by walking all of data_pkey per row (2.6M rows filtered, 305 ms per pop).
-- A subquery with only d.id = outer id can use the index only as a probe.
-- at-least-once: claim up to n ready messages (skipping rows other consumers hold) and lease them.
WITH claimed AS (
    UPDATE {schema}.meta m
    SET state = 1, attempts = m.attempts + 1, deliveries = m.deliveries + 1, consumer = %(consumer)s,
        lease_until = now() + make_interval(secs => %(visibility_timeout_s)s)
    WHERE m.ctid = ANY (ARRAY(
        SELECT ctid FROM {schema}.meta
        WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now()
        ORDER BY priority DESC, process_at, id
        LIMIT %(n)s
        FOR UPDATE SKIP LOCKED))
    RETURNING m.id, m.priority, m.attempts, m.deliveries, m.process_at, m.enqueued_at, m.lease_until
)
SELECT c.id, c.priority, c.attempts, c.deliveries, c.enqueued_at, c.lease_until,
       (SELECT d.payload FROM {schema}.data d WHERE d.id = c.id) AS payload
FROM claimed c
ORDER BY c.priority DESC, c.process_at, c.id

-- name: pop_take
-- at-most-once and exactly-once: claim up to n ready messages and finish them in the same statement
-- (kept in done for the archiver, or deleted with their payloads when the queue does not archive).
WITH taken AS (
    DELETE FROM {schema}.meta m
    WHERE m.ctid = ANY (ARRAY(
        SELECT ctid FROM {schema}.meta
        WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now()
        ORDER BY priority DESC, process_at, id
        LIMIT %(n)s
        FOR UPDATE SKIP LOCKED))
    RETURNING m.id, m.queue_id, m.priority, m.attempts + 1 AS attempts, m.deliveries + 1 AS deliveries,
              m.process_at, m.enqueued_at
), kept AS (
    INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome)
    SELECT id, queue_id, priority, attempts, enqueued_at, 1 FROM taken WHERE %(archive)s
), dropped AS (
    DELETE FROM {schema}.data d WHERE NOT %(archive)s AND d.id = ANY (ARRAY(SELECT id FROM taken))
)
SELECT t.id, t.priority, t.attempts, t.deliveries, t.enqueued_at, NULL::timestamptz AS lease_until,
       (SELECT d.payload FROM {schema}.data d WHERE d.id = t.id) AS payload
FROM taken t
ORDER BY t.priority DESC, t.process_at, t.id

-- name: ack
-- Receipt lookups (ack, nack, held_receipts, leased) say "lease_until > now()" and not "state = 1":
-- meta_lease_valid makes them equivalent, and leaving state = 1 out keeps the planner from walking
-- every lease through meta_leased_idx (it did, with statistics from when the queue was empty);
-- id = ANY(...) probes meta_pkey once per receipt.
-- Finish leased messages, all or nothing, in one statement: `held` locks the receipts (id, delivery)
-- whose lease is still valid (FOR UPDATE waits for a concurrent reclaim and rechecks the row), and
-- rows are deleted only when every receipt is held. A lost lease makes the statement return no row.
WITH held AS (
    SELECT m.ctid AS tid
    FROM {schema}.meta m
    JOIN unnest(%(ids)s::bigint[], %(deliveries)s::integer[]) AS r(id, delivery)
      ON m.id = r.id AND m.deliveries = r.delivery
    WHERE m.id = ANY (%(ids)s::bigint[]) AND m.queue_id = %(queue_id)s AND m.lease_until > now()
    FOR UPDATE OF m
), acked AS (
    DELETE FROM {schema}.meta m
    WHERE m.ctid = ANY (ARRAY(SELECT tid FROM held))
      AND (SELECT count(*) FROM held) = cardinality(%(ids)s::bigint[])
    RETURNING m.id, m.queue_id, m.priority, m.attempts, m.enqueued_at
), kept AS (
    INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome)
    SELECT id, queue_id, priority, attempts, enqueued_at, 1 FROM acked WHERE %(archive)s
), dropped AS (
    DELETE FROM {schema}.data d WHERE NOT %(archive)s AND d.id = ANY (ARRAY(SELECT id FROM acked))
)
SELECT id FROM acked

-- name: nack
-- Return leased messages for another try after delay_s (NULL: the queue's exponential backoff,
-- backoff_s * 2^(attempts - 1) capped at backoff_max_s), or to the failed state after max_attempts;
-- all or nothing, like ack.
WITH held AS (
    SELECT m.ctid AS tid
    FROM {schema}.meta m
    JOIN unnest(%(ids)s::bigint[], %(deliveries)s::integer[]) AS r(id, delivery)
      ON m.id = r.id AND m.deliveries = r.delivery
    WHERE m.id = ANY (%(ids)s::bigint[]) AND m.queue_id = %(queue_id)s AND m.lease_until > now()
    FOR UPDATE OF m
)
UPDATE {schema}.meta m
SET state = CASE WHEN m.attempts >= %(max_attempts)s THEN 2 ELSE 0 END,
    process_at = CASE WHEN m.attempts >= %(max_attempts)s THEN m.process_at
                      ELSE now() + make_interval(secs => coalesce(%(delay_s)s::float8, least(
                          %(backoff_max_s)s::float8,
                          %(backoff_s)s::float8 * power(2, greatest(m.attempts - 1, 0)))))
                      END,
    lease_until = NULL, consumer = NULL, last_error = %(error)s
WHERE m.ctid = ANY (ARRAY(SELECT tid FROM held))
  AND (SELECT count(*) FROM held) = cardinality(%(ids)s::bigint[])
RETURNING m.id, m.state

-- name: held_receipts
-- Which of the receipts still hold a valid lease (to name the lost ones in an error).
SELECT m.id, m.deliveries
FROM {schema}.meta m
JOIN unnest(%(ids)s::bigint[], %(deliveries)s::integer[]) AS r(id, delivery)
  ON m.id = r.id AND m.deliveries = r.delivery
WHERE m.id = ANY (%(ids)s::bigint[]) AND m.queue_id = %(queue_id)s AND m.lease_until > now()

-- name: reclaim_expired
-- Expired leases go back to ready, keeping their place (process_at), or to failed after max_attempts.
UPDATE {schema}.meta m
SET state = CASE WHEN m.attempts >= %(max_attempts)s THEN 2 ELSE 0 END,
    lease_until = NULL, consumer = NULL,
    last_error = 'lease expired (held by ' || coalesce(m.consumer, '?') || ')'
WHERE m.ctid = ANY (ARRAY(
    SELECT ctid FROM {schema}.meta
    WHERE queue_id = %(queue_id)s AND state = 1 AND lease_until <= now()
    ORDER BY lease_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED))
RETURNING m.id, m.state

-- name: peek
SELECT m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until,
       (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id) AS payload
FROM {schema}.meta m
WHERE m.queue_id = %(queue_id)s AND m.state = 0 AND m.process_at <= now()
ORDER BY m.priority DESC, m.process_at, m.id
LIMIT %(n)s

-- name: count_ready
-- Ready messages of at least min_priority, counted up to a cap (a sensor needs "at least k", not a total).
SELECT count(*) FROM (
    SELECT 1 FROM {schema}.meta
    WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now() AND priority >= %(min_priority)s
    LIMIT %(cap)s) s

-- name: next_due
-- Seconds until the earliest delayed message becomes ready (NULL when none is delayed).
SELECT extract(epoch FROM min(process_at) - now())::float8 FROM {schema}.meta
WHERE queue_id = %(queue_id)s AND state = 0 AND process_at > now()

-- name: stats
SELECT
    (SELECT count(*) FROM {schema}.meta
      WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now()) AS ready,
    (SELECT count(*) FROM {schema}.meta
      WHERE queue_id = %(queue_id)s AND state = 0 AND process_at > now()) AS delayed,
    (SELECT count(*) FROM {schema}.meta WHERE queue_id = %(queue_id)s AND state = 1) AS in_flight,
    (SELECT count(*) FROM {schema}.meta WHERE queue_id = %(queue_id)s AND state = 2) AS failed,
    (SELECT count(*) FROM {schema}.done WHERE queue_id = %(queue_id)s) AS finished,
    (SELECT extract(epoch FROM now() - min(enqueued_at))::float8 FROM {schema}.meta
      WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now()) AS oldest_ready_age_s

-- name: list_failed
SELECT m.id, m.priority, m.attempts, m.enqueued_at, m.last_error,
       (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id) AS payload
FROM {schema}.meta m
WHERE m.queue_id = %(queue_id)s AND m.state = 2 AND m.id > %(after_id)s
ORDER BY m.id
LIMIT %(limit)s

-- name: requeue_failed
UPDATE {schema}.meta
SET state = 0, attempts = 0, process_at = now(), last_error = NULL
WHERE queue_id = %(queue_id)s AND state = 2 AND (%(all)s OR id = ANY (%(ids)s::bigint[]))
RETURNING id

-- name: delete_failed
WITH gone AS (
    DELETE FROM {schema}.meta
    WHERE queue_id = %(queue_id)s AND state = 2 AND (%(all)s OR id = ANY (%(ids)s::bigint[]))
    RETURNING id, queue_id, priority, attempts, enqueued_at
), kept AS (
    INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome)
    SELECT id, queue_id, priority, attempts, enqueued_at, 2 FROM gone WHERE %(archive)s
), dropped AS (
    DELETE FROM {schema}.data d WHERE NOT %(archive)s AND d.id = ANY (ARRAY(SELECT id FROM gone))
)
SELECT id FROM gone

-- name: ready_head
-- For observers (sensor, trigger): ready messages of at least min_priority counted up to a cap, and the
-- (id, deliveries) of the message a pop would take first (the head: it changes when the queue is consumed,
-- and a message returned by nack comes back with one more delivery). head_id is NULL when nothing is ready.
SELECT r.ready, h.id AS head_id, h.deliveries AS head_deliveries
FROM (SELECT count(*) AS ready FROM (
        SELECT 1 FROM {schema}.meta
        WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now() AND priority >= %(min_priority)s
        LIMIT %(cap)s) s) r
LEFT JOIN LATERAL (
    SELECT id, deliveries FROM {schema}.meta
    WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now()
    ORDER BY priority DESC, process_at, id
    LIMIT 1) h ON true

-- name: leased
-- The leased messages of the given receipts (id, delivery) whose lease is still held, with payloads:
-- a task that was handed only receipts (through XCom) reads its batch here.
SELECT m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until,
       (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id) AS payload
FROM {schema}.meta m
JOIN unnest(%(ids)s::bigint[], %(deliveries)s::integer[]) AS r(id, delivery)
  ON m.id = r.id AND m.deliveries = r.delivery
WHERE m.id = ANY (%(ids)s::bigint[]) AND m.queue_id = %(queue_id)s AND m.lease_until > now()
ORDER BY m.priority DESC, m.process_at, m.id

-- name: ring_create
-- The ring design. Push and pop are server-side functions (schema.sql: ring_push, ring_pop); the
-- statements below are the slower paths. Number x of a ring lives in slot x mod capacity: receipts
-- (id, delivery) find their slot without an index on seq.
SELECT {schema}.ring_create(%(schema)s, %(queue_id)s::integer, %(capacity)s::integer, %(slot_bytes)s::integer)

-- name: ring_drop
SELECT {schema}.ring_drop(%(queue_id)s::integer)

-- name: ring_push
SELECT {schema}.ring_push(
    %(queue_id)s::integer, %(payloads)s::bytea[], %(timeout_s)s::float8, %(notify)s::integer, %(channel)s)

-- name: ring_pop
SELECT * FROM {schema}.ring_pop(
    %(queue_id)s::integer, %(capacity)s::integer, %(lo)s::bigint, %(n)s::integer, %(lease)s::boolean,
    %(visibility_timeout_s)s::float8, %(consumer)s::text, %(own)s::boolean,
    %(gap)s::bigint, %(gap_issued)s::bigint, %(gap_snap)s::pg_snapshot, %(force)s::boolean)

-- name: ring_head
SELECT {schema}.ring_head(%(queue_id)s::integer)

-- name: ring_ack
-- All or nothing, as in the table design: held locks the receipts whose lease is still valid, and slots
-- are freed only when every receipt is held.
WITH held AS (
    SELECT s.ctid AS tid
    FROM {schema}.ring_slots s
    JOIN unnest(%(ids)s::bigint[], %(deliveries)s::integer[]) AS r(id, delivery)
      ON s.seq = r.id AND s.deliveries = r.delivery
    WHERE s.queue_id = %(queue_id)s AND s.slot = ANY (%(slots)s::integer[])
      AND s.state = 2 AND s.due_at > now()
    FOR UPDATE OF s
)
UPDATE {schema}.ring_slots s
SET state = 0, payload = NULL, consumer = NULL, last_error = NULL
WHERE s.ctid = ANY (ARRAY(SELECT tid FROM held))
  AND (SELECT count(*) FROM held) = cardinality(%(ids)s::bigint[])
RETURNING s.seq

-- name: ring_nack
-- Back to ready in place (the message keeps its id and its place) after delay_s or the backoff, or out
-- of the ring into ring_failed after max_attempts (its slot is freed). All or nothing, like ring_ack.
WITH held AS (
    SELECT s.ctid AS tid, s.seq, s.attempts, s.enqueued_at, s.payload
    FROM {schema}.ring_slots s
    JOIN unnest(%(ids)s::bigint[], %(deliveries)s::integer[]) AS r(id, delivery)
      ON s.seq = r.id AND s.deliveries = r.delivery
    WHERE s.queue_id = %(queue_id)s AND s.slot = ANY (%(slots)s::integer[])
      AND s.state = 2 AND s.due_at > now()
    FOR UPDATE OF s
), whole AS (
    SELECT (SELECT count(*) FROM held) = cardinality(%(ids)s::bigint[]) AS ok
), failed AS (
    INSERT INTO {schema}.ring_failed (queue_id, id, attempts, enqueued_at, last_error, payload)
    SELECT %(queue_id)s, h.seq, h.attempts, h.enqueued_at, %(error)s, h.payload
    FROM held h WHERE (SELECT ok FROM whole) AND h.attempts >= %(max_attempts)s
)
UPDATE {schema}.ring_slots s
SET state = CASE WHEN s.attempts >= %(max_attempts)s THEN 0 ELSE 1 END,
    due_at = CASE WHEN s.attempts >= %(max_attempts)s THEN s.due_at
                  ELSE now() + make_interval(secs => coalesce(%(delay_s)s::float8, least(
                      %(backoff_max_s)s::float8,
                      %(backoff_s)s::float8 * power(2, greatest(s.attempts - 1, 0)))))
                  END,
    payload = CASE WHEN s.attempts >= %(max_attempts)s THEN NULL ELSE s.payload END,
    consumer = NULL, last_error = %(error)s
WHERE s.ctid = ANY (ARRAY(SELECT tid FROM held)) AND (SELECT ok FROM whole)
RETURNING s.seq, s.state

-- name: ring_held_receipts
SELECT s.seq, s.deliveries
FROM {schema}.ring_slots s
JOIN unnest(%(ids)s::bigint[], %(deliveries)s::integer[]) AS r(id, delivery)
  ON s.seq = r.id AND s.deliveries = r.delivery
WHERE s.queue_id = %(queue_id)s AND s.slot = ANY (%(slots)s::integer[]) AND s.state = 2 AND s.due_at > now()

-- name: ring_reclaim_expired
-- Expired leases go back to ready in place (keeping their id, so their place) or, after max_attempts,
-- to ring_failed. Scans the ring's slots: pops run it at most once a second.
WITH expired AS (
    SELECT s.ctid AS tid, s.seq, s.attempts, s.enqueued_at, s.payload, s.consumer
    FROM {schema}.ring_slots s
    WHERE s.queue_id = %(queue_id)s AND s.state = 2 AND s.due_at <= now()
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), failed AS (
    INSERT INTO {schema}.ring_failed (queue_id, id, attempts, enqueued_at, last_error, payload)
    SELECT %(queue_id)s, e.seq, e.attempts, e.enqueued_at,
           'lease expired (held by ' || coalesce(e.consumer, '?') || ')', e.payload
    FROM expired e WHERE e.attempts >= %(max_attempts)s
)
UPDATE {schema}.ring_slots s
SET state = CASE WHEN s.attempts >= %(max_attempts)s THEN 0 ELSE 1 END,
    due_at = now(),
    payload = CASE WHEN s.attempts >= %(max_attempts)s THEN NULL ELSE s.payload END,
    consumer = NULL, last_error = 'lease expired (held by ' || coalesce(s.consumer, '?') || ')'
WHERE s.ctid = ANY (ARRAY(SELECT tid FROM expired))
RETURNING s.seq, s.state

-- name: ring_peek
SELECT s.seq, s.attempts, s.deliveries, s.enqueued_at, NULL::timestamptz AS lease_until, s.payload
FROM {schema}.ring_slots s
WHERE s.queue_id = %(queue_id)s AND s.state = 1 AND s.due_at <= now()
ORDER BY s.seq
LIMIT %(n)s

-- name: ring_count_ready
SELECT count(*) FROM (
    SELECT 1 FROM {schema}.ring_slots
    WHERE queue_id = %(queue_id)s AND state = 1 AND due_at <= now()
    LIMIT %(cap)s) s

-- name: ring_ready_head
SELECT r.ready, h.seq AS head_id, h.deliveries AS head_deliveries
FROM (SELECT count(*) AS ready FROM (
        SELECT 1 FROM {schema}.ring_slots
        WHERE queue_id = %(queue_id)s AND state = 1 AND due_at <= now()
        LIMIT %(cap)s) s) r
LEFT JOIN LATERAL (
    SELECT seq, deliveries FROM {schema}.ring_slots
    WHERE queue_id = %(queue_id)s AND state = 1 AND due_at <= now()
    ORDER BY seq
    LIMIT 1) h ON true

-- name: ring_stats
-- Depth by state, plus the ring's own figures: the push position (last number issued), the pop
-- position (lowest unfinished number), numbers skipped as gaps, and slots holding a skipped number.
SELECT count(*) FILTER (WHERE s.state = 1 AND s.due_at <= now()) AS ready,
       count(*) FILTER (WHERE s.state = 1 AND s.due_at > now()) AS delayed,
       count(*) FILTER (WHERE s.state = 2) AS in_flight,
       (SELECT count(*) FROM {schema}.ring_failed f WHERE f.queue_id = %(queue_id)s) AS failed,
       extract(epoch FROM now() - min(s.enqueued_at) FILTER (WHERE s.state = 1 AND s.due_at <= now()))::float8
           AS oldest_ready_age_s,
       (SELECT coalesce(pg_sequence_last_value(r.push_seq), 0) FROM {schema}.rings r
         WHERE r.queue_id = %(queue_id)s) AS push_position,
       {schema}.ring_head(%(queue_id)s::integer) AS pop_position,
       (SELECT coalesce(pg_sequence_last_value(r.gap_seq), 0) FROM {schema}.rings r
         WHERE r.queue_id = %(queue_id)s) AS gaps_skipped
FROM {schema}.ring_slots s
WHERE s.queue_id = %(queue_id)s

-- name: ring_list_failed
SELECT id, attempts, enqueued_at, last_error, payload
FROM {schema}.ring_failed
WHERE queue_id = %(queue_id)s AND id > %(after_id)s
ORDER BY id
LIMIT %(limit)s

-- name: ring_take_failed
-- requeue_failed: the failed messages leave ring_failed and are pushed again (new ids) in the same
-- transaction.
DELETE FROM {schema}.ring_failed
WHERE queue_id = %(queue_id)s AND (%(all)s OR id = ANY (%(ids)s::bigint[]))
RETURNING id, payload

-- name: ring_delete_failed
DELETE FROM {schema}.ring_failed
WHERE queue_id = %(queue_id)s AND (%(all)s OR id = ANY (%(ids)s::bigint[]))
RETURNING id

-- name: ring_leased
SELECT s.seq, s.attempts, s.deliveries, s.enqueued_at, s.due_at, s.payload
FROM {schema}.ring_slots s
JOIN unnest(%(ids)s::bigint[], %(deliveries)s::integer[]) AS r(id, delivery)
  ON s.seq = r.id AND s.deliveries = r.delivery
WHERE s.queue_id = %(queue_id)s AND s.slot = ANY (%(slots)s::integer[]) AND s.state = 2 AND s.due_at > now()
ORDER BY s.seq
