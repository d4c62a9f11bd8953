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
       retry_backoff_s, retry_backoff_max_s, notify, archive
FROM {schema}.queues WHERE name = %(name)s

-- name: list_queues
SELECT queue_id, name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
       retry_backoff_s, retry_backoff_max_s, notify, archive
FROM {schema}.queues ORDER BY name

-- name: drop_queue
-- Payload deletes here and below match ids with = ANY (ARRAY(...)), not a join: with the statistics of
-- an empty table the planner made the join a nested loop over all of data_pkey (O(n^2): 14 s for 20k).
WITH m AS (DELETE FROM {schema}.meta WHERE queue_id = %(queue_id)s RETURNING id),
     f AS (DELETE FROM {schema}.done WHERE queue_id = %(queue_id)s RETURNING id),
     d AS (DELETE FROM {schema}.data WHERE id = ANY (ARRAY(SELECT id FROM m UNION ALL SELECT id FROM f))),
     a AS (DELETE FROM {schema}.archive WHERE queue_id = %(queue_id)s),
     b AS (DELETE FROM {schema}.batches WHERE queue_id = %(queue_id)s)
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

-- name: extend_leases
-- Push the lease of held receipts out to now() + secs (a long job keeps its claim); all or nothing.
WITH held AS (
    SELECT m.ctid AS tid
    FROM {schema}.meta m
    JOIN unnest(%(ids)s::bigint[], %(deliveries)s::integer[]) AS r(id, delivery)
      ON m.id = r.id AND m.deliveries = r.delivery
    WHERE m.id = ANY (%(ids)s::bigint[]) AND m.queue_id = %(queue_id)s AND m.lease_until > now()
    FOR UPDATE OF m
)
UPDATE {schema}.meta m
SET lease_until = now() + make_interval(secs => %(secs)s)
WHERE m.ctid = ANY (ARRAY(SELECT tid FROM held))
  AND (SELECT count(*) FROM held) = cardinality(%(ids)s::bigint[])
RETURNING m.id, m.lease_until

-- name: claim_batch
-- at-least-once claim of up to n ready messages under one lease, recorded in the batch ledger in the
-- same statement; no payload leaves the database (the batch's reader fetches them by batch id).
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
    RETURNING m.id, m.deliveries, m.priority, m.process_at
)
INSERT INTO {schema}.batches (batch_id, queue_id, ids, deliveries, consumer, lease_until)
SELECT %(batch_id)s, %(queue_id)s,
       array_agg(c.id ORDER BY c.priority DESC, c.process_at, c.id),
       array_agg(c.deliveries ORDER BY c.priority DESC, c.process_at, c.id),
       %(consumer)s, now() + make_interval(secs => %(visibility_timeout_s)s)
FROM claimed c
HAVING count(*) > 0
RETURNING batch_id, state, ids, deliveries, consumer, claimed_at, lease_until, finished_at, last_error

-- name: get_batch
SELECT batch_id, state, ids, deliveries, consumer, claimed_at, lease_until, finished_at, last_error
FROM {schema}.batches
WHERE batch_id = %(batch_id)s AND queue_id = %(queue_id)s

-- name: lock_batch
-- The batch's ledger row, locked so that a concurrent ack and release of one batch serialize.
SELECT batch_id, state, ids, deliveries, consumer, claimed_at, lease_until, finished_at, last_error
FROM {schema}.batches
WHERE batch_id = %(batch_id)s AND queue_id = %(queue_id)s
FOR UPDATE

-- name: finish_batch
UPDATE {schema}.batches
SET state = %(state)s::smallint,
    finished_at = CASE WHEN %(state)s::smallint = 0 THEN NULL ELSE now() END,
    lease_until = coalesce(%(lease_until)s, lease_until), last_error = coalesce(%(error)s, last_error)
WHERE batch_id = %(batch_id)s AND queue_id = %(queue_id)s

-- name: open_batches
-- Batches still claimed, oldest first (for operators of the platform and for cleanup).
SELECT batch_id, state, ids, deliveries, consumer, claimed_at, lease_until, finished_at, last_error
FROM {schema}.batches
WHERE queue_id = %(queue_id)s AND state = 0
ORDER BY claimed_at
LIMIT %(limit)s

-- name: batch_rows
-- The messages of one batch with their payloads, numbered 1..n in claim order (ord: a Spark JDBC
-- reader partitions on it). Rendered to text with its parameters for readers in other processes.
SELECT r.ord, r.id, r.delivery, (SELECT d.payload FROM {schema}.data d WHERE d.id = r.id) AS payload
FROM {schema}.batches b
CROSS JOIN LATERAL unnest(b.ids, b.deliveries) WITH ORDINALITY AS r(id, delivery, ord)
WHERE b.batch_id = %(batch_id)s AND b.queue_id = %(queue_id)s
