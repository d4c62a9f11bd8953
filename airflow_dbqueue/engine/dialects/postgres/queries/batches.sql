-- Named queries of the PostgreSQL dialect: claimed batches (a Spark batch's messages, claimed, published and acked or released as one).
-- The conventions of every file of this folder are in queues.sql's opening lines.

-- name: claim_batch
-- at-least-once claim of up to n ready messages under one lease, recorded in the batch ledger in the
-- same statement; no payload leaves the database (the batch's reader fetches them by batch id).
-- Rows are named by (gen, ctid), as in reclaim_expired (queries/table.sql). The claim starts at the
-- queue's floor, as table_take's (functions.sql).
WITH picked AS (
    SELECT gen, ctid AS tid FROM {schema}.meta
    WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now()
      AND process_at >= (SELECT {schema}.table_floor(%(queue_id)s::integer))
    ORDER BY priority DESC, process_at, id
    LIMIT %(n)s
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE {schema}.meta m
    SET state = 1, attempts = m.attempts + 1, deliveries = m.deliveries + 1, consumer = %(consumer)s,
        lease_until = now() + make_interval(secs => %(visibility_timeout_s)s)
    WHERE m.ctid = ANY (ARRAY(SELECT tid FROM picked))
      AND ((m.gen, m.ctid) IN (SELECT gen, tid FROM picked)) IS TRUE
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

-- name: claim_batch_with
-- claim_batch for a queue whose messages may expire (created with a ttl) or that is ordered per key: it
-- passes over expired messages and those whose key has an earlier message ready, delayed or in flight,
-- as the pops do (table_take_with in functions.sql), so a batch holds at most the head of each key.
WITH picked AS (
    SELECT s.gen, s.ctid AS tid FROM {schema}.meta s
    WHERE s.queue_id = %(queue_id)s AND s.state = 0 AND s.process_at <= now()
      AND s.process_at >= (SELECT {schema}.table_floor(%(queue_id)s::integer))
      AND NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
          WHERE o.queue_id = s.queue_id AND o.id = s.id
            AND ((%(expiring)s AND o.expires_at <= now())
                 OR (%(per_key)s AND o.okey IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                     WHERE e.queue_id = o.queue_id AND e.okey = o.okey AND e.id < o.id
                       AND NOT EXISTS (SELECT 1 FROM {schema}.meta f
                           WHERE f.queue_id = e.queue_id AND f.id = e.id AND f.state = 2)))))
    ORDER BY s.priority DESC, s.process_at, s.id
    LIMIT %(n)s
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE {schema}.meta m
    SET state = 1, attempts = m.attempts + 1, deliveries = m.deliveries + 1, consumer = %(consumer)s,
        lease_until = now() + make_interval(secs => %(visibility_timeout_s)s)
    WHERE m.ctid = ANY (ARRAY(SELECT tid FROM picked))
      AND ((m.gen, m.ctid) IN (SELECT gen, tid FROM picked)) IS TRUE
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

-- name: purge_batches
-- The ledger rows of batches finished (acked or released) more than older_than_s ago, up to n.
DELETE FROM {schema}.batches b
WHERE b.ctid = ANY (ARRAY(
    SELECT ctid FROM {schema}.batches
    WHERE queue_id = %(queue_id)s AND state <> 0
      AND finished_at < now() - make_interval(secs => %(older_than_s)s)
    LIMIT %(n)s))
RETURNING b.batch_id

-- name: open_batches
-- Batches still claimed, oldest first (for operators of the platform and for cleanup), of every
-- consumer or of those whose consumer starts with consumer_prefix (a task's earlier tries).
SELECT batch_id, state, ids, deliveries, consumer, claimed_at, lease_until, finished_at, last_error
FROM {schema}.batches
WHERE queue_id = %(queue_id)s AND state = 0
  AND (%(consumer_prefix)s::text IS NULL
       OR left(consumer, length(%(consumer_prefix)s::text)) = %(consumer_prefix)s::text)
ORDER BY claimed_at
LIMIT %(limit)s

-- name: batch_rows
-- The messages of one batch with their payloads, numbered 1..n in claim order (ord: a Spark JDBC
-- reader partitions on it). Rendered to text with its parameters for readers in other processes.
-- A claimed batch's messages are leased (lease_until set): their meta rows are probed by id through
-- meta_leased_id_idx. A message no longer leased (its lease expired and it was reclaimed, or it was
-- finished) has a NULL payload here, unless its payload is in data; its batch cannot be acked anyway.
SELECT r.ord, r.id, r.delivery,
       coalesce((SELECT m.payload FROM {schema}.meta m WHERE m.id = r.id AND m.lease_until IS NOT NULL),
                (SELECT d.payload FROM {schema}.data d WHERE d.id = r.id)) AS payload
FROM {schema}.batches b
CROSS JOIN LATERAL unnest(b.ids, b.deliveries) WITH ORDINALITY AS r(id, delivery, ord)
WHERE b.batch_id = %(batch_id)s AND b.queue_id = %(queue_id)s
