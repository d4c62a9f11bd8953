-- Named queries of the PostgreSQL dialect: the table design: push, the pops, ack and nack, leases, inspection and failed messages.
-- The conventions of every file of this folder are in queues.sql's opening lines.

-- name: push
-- One round trip a batch, through table_push() (schema.sql): no row and no id when the queue was
-- dropped. notify: 0 never, 1 while somebody waits (the queue's waiters' lock; when another push holds
-- it, when the queue had no ready message before), 2 always. inline: every
-- payload fits in its meta row (at most inline_payload_bytes).
SELECT * FROM {schema}.table_push(
    %(queue_id)s::integer, %(payloads)b::bytea[], %(priority)s::smallint, %(delay_s)s::double precision,
    %(notify)s::integer, %(channel)s::text, %(inline)s::boolean)

-- name: push_with
-- A push with deduplication keys (keys: one a payload, distinct; NULL: none), ordering keys (okeys: one
-- a payload; NULL: none) or a time to live (ttl_s; NULL: none), through table_push_with() (functions.sql): (id, new) in payload order, where new is false
-- for a key pushed within the queue's dedup window (id is then the first push's message); no row when
-- the queue was dropped.
SELECT * FROM {schema}.table_push_with(
    %(queue_id)s::integer, %(payloads)b::bytea[], %(keys)s::text[], %(okeys)s::text[], %(priority)s::smallint,
    %(delay_s)s::double precision, %(ttl_s)s::double precision, %(notify)s::integer, %(channel)s::text)

-- name: pop_lease
-- at-least-once: claim up to n ready messages (skipping rows other consumers hold) and lease them,
-- through table_lease() (schema.sql), whose plans are made once a session. Payloads are fetched by a
-- scalar subquery keyed on id, never by a join: a queue's statistics are often those of an empty table
-- (a drained queue, a dropped one), and then the planner joined the claimed rows to data by walking all
-- of data_pkey per row (2.6M rows filtered, 305 ms per pop). A subquery with only d.id = outer id can
-- use the index only as a probe.
SELECT * FROM {schema}.table_lease(
    %(queue_id)s::integer, %(n)s::integer, %(visibility_timeout_s)s::double precision, %(consumer)s::text)

-- name: pop_take
-- at-most-once and exactly-once: claim up to n ready messages and finish them in the same statement
-- (kept in done for the archiver, or deleted with their payloads when the queue does not archive),
-- through table_take() (schema.sql), whose plans are made once a session.
SELECT * FROM {schema}.table_take(%(queue_id)s::integer, %(n)s::integer, %(archive)s::boolean)

-- name: pop_take_payloads
-- pop_take for a pop of payloads only (Queue.pop_payloads): one column a message, in the claim's order.
SELECT r_payload FROM {schema}.table_take(%(queue_id)s::integer, %(n)s::integer, %(archive)s::boolean)

-- name: pop_lease_with
-- pop_lease for a queue whose messages may expire (created with a ttl) or that is ordered per key,
-- through table_lease_with() (functions.sql).
SELECT * FROM {schema}.table_lease_with(
    %(queue_id)s::integer, %(n)s::integer, %(visibility_timeout_s)s::double precision, %(consumer)s::text,
    %(expiring)s::boolean, %(per_key)s::boolean)

-- name: pop_take_with
-- pop_take for such a queue, through table_take_with() (functions.sql).
SELECT * FROM {schema}.table_take_with(
    %(queue_id)s::integer, %(n)s::integer, %(archive)s::boolean, %(expiring)s::boolean, %(per_key)s::boolean)

-- name: pop_take_payloads_with
-- pop_take_payloads for such a queue.
SELECT r_payload FROM {schema}.table_take_with(
    %(queue_id)s::integer, %(n)s::integer, %(archive)s::boolean, %(expiring)s::boolean, %(per_key)s::boolean)

-- name: ack
-- Receipt lookups (ack, nack, held_receipts, leased, extend_leases) say "lease_until > now()" and not
-- "state = 1": meta keeps them equivalent (schema.sql), and leaving state = 1 out keeps the planner from
-- walking every lease through meta_leased_idx (it did, with statistics from when the queue was empty).
-- The comparison implies lease_until IS NOT NULL, the predicate of meta_leased_id_idx (meta has no
-- primary key): each receipt probes that index once, by id, from a LATERAL subquery the planner cannot
-- flatten (FOR UPDATE or OFFSET 0): a plain join of meta to the receipts became, under the statistics
-- of a fresh queue, a nested loop that compared every row with every receipt (n^2: 1.4 of 1.5 ms of an
-- ack of 100).
-- Finish leased messages, all or nothing, in one statement, without locking them first: the receipts
-- (id, delivery) whose lease is valid name row versions by ctid, and the DELETE takes exactly those. A
-- version that a concurrent reclaim or nack replaced is not deleted (the DELETE waits for it, and the
-- new version has another ctid), so a lost lease leaves fewer rows than receipts, and then
-- receipts_not_held() raises, which rolls the whole statement back. (Locking with FOR UPDATE first
-- cost a row lock and a WAL record per message: an ack of 1000 took 12.5 ms against 7.5 ms without.)
-- Through table_ack() (schema.sql), whose plans are made once a session.
SELECT * FROM {schema}.table_ack(
    %(ids)b::bigint[], %(deliveries)b::integer[], %(queue_id)s::integer, %(archive)s::boolean)

-- name: ack_with
-- ack for a queue whose messages may expire (created with a ttl) or that is ordered per key, through
-- table_ack_with() (functions.sql), which deletes the messages' meta_opt rows too.
SELECT * FROM {schema}.table_ack_with(
    %(ids)b::bigint[], %(deliveries)b::integer[], %(queue_id)s::integer, %(archive)s::boolean)

-- name: nack
-- Return leased messages for another try after delay_s (NULL: the queue's exponential backoff,
-- backoff_s * 2^(attempts - 1) capped at backoff_max_s), or to the failed state after max_attempts;
-- all or nothing, like ack. Never before the message's own process-at time, which was the earliest it
-- could be leased (so a nack in a transaction older than the lease still keeps the queue's floor,
-- table_floor in functions.sql: a raise counts leased messages, so their times are never below it).
WITH held AS (
    SELECT h.gen, h.tid
    FROM unnest(%(ids)b::bigint[], %(deliveries)b::integer[]) AS r(id, delivery)
    CROSS JOIN LATERAL (
        SELECT m.gen, m.ctid AS tid FROM {schema}.meta m
        WHERE m.id = r.id AND m.deliveries = r.delivery AND m.queue_id = %(queue_id)s
          AND m.lease_until > now()
        FOR UPDATE) h
)
UPDATE {schema}.meta m
SET state = CASE WHEN m.attempts >= %(max_attempts)s THEN 2 ELSE 0 END,
    process_at = CASE WHEN m.attempts >= %(max_attempts)s THEN m.process_at
                      ELSE greatest(m.process_at, now() + make_interval(secs => coalesce(%(delay_s)s::float8, least(
                          %(backoff_max_s)s::float8,
                          %(backoff_s)s::float8 * power(2, greatest(m.attempts - 1, 0))))))
                      END,
    lease_until = NULL, consumer = NULL, last_error = %(error)s
WHERE m.ctid = ANY (ARRAY(SELECT tid FROM held))
  AND ((m.gen, m.ctid) IN (SELECT gen, tid FROM held)) IS TRUE
  AND (SELECT count(*) FROM held) = cardinality(%(ids)b::bigint[])
RETURNING m.id, m.state

-- name: nack_with
-- nack for a queue whose messages may expire or that is ordered per key: a message made ready again gets
-- its new process_at in its meta_opt row too (schema.sql: the expiry sweep finds the meta row by it).
WITH held AS (
    SELECT h.gen, h.tid
    FROM unnest(%(ids)b::bigint[], %(deliveries)b::integer[]) AS r(id, delivery)
    CROSS JOIN LATERAL (
        SELECT m.gen, m.ctid AS tid FROM {schema}.meta m
        WHERE m.id = r.id AND m.deliveries = r.delivery AND m.queue_id = %(queue_id)s
          AND m.lease_until > now()
        FOR UPDATE) h
), nacked AS (
    UPDATE {schema}.meta m
    SET state = CASE WHEN m.attempts >= %(max_attempts)s THEN 2 ELSE 0 END,
        process_at = CASE WHEN m.attempts >= %(max_attempts)s THEN m.process_at
                          ELSE greatest(m.process_at, now() + make_interval(secs => coalesce(%(delay_s)s::float8, least(
                              %(backoff_max_s)s::float8,
                              %(backoff_s)s::float8 * power(2, greatest(m.attempts - 1, 0))))))
                          END,
        lease_until = NULL, consumer = NULL, last_error = %(error)s
    WHERE m.ctid = ANY (ARRAY(SELECT tid FROM held))
      AND ((m.gen, m.ctid) IN (SELECT gen, tid FROM held)) IS TRUE
      AND (SELECT count(*) FROM held) = cardinality(%(ids)b::bigint[])
    RETURNING m.id, m.state, m.process_at
), opt AS (
    UPDATE {schema}.meta_opt o SET process_at = n.process_at
    FROM nacked n
    WHERE o.queue_id = %(queue_id)s AND o.id = n.id
)
SELECT n.id, n.state FROM nacked n

-- name: held_receipts
-- Which of the receipts still hold a valid lease (to name the lost ones in an error).
SELECT m.id, m.deliveries
FROM unnest(%(ids)b::bigint[], %(deliveries)b::integer[]) AS r(id, delivery)
CROSS JOIN LATERAL (
    SELECT * FROM {schema}.meta m
    WHERE m.id = r.id AND m.deliveries = r.delivery AND m.queue_id = %(queue_id)s AND m.lease_until > now()
    OFFSET 0) m

-- name: reclaim_expired
-- Expired leases go back to ready, keeping their place (process_at), or to failed after max_attempts.
-- Rows are named by (gen, ctid): meta is partitioned (schema.sql), and a ctid names a row only within
-- its partition. The ctids alone make each partition's scan a TID scan; the pairs keep only the rows
-- that were picked, through a hashed subplan (IS TRUE keeps the planner from turning the IN into a
-- join, which it may make a hash join over whole partitions; a = ANY over an array of pairs instead
-- compared every fetched row with every pair: 155 ms against 2.3 ms for a batch of 1000).
WITH picked AS (
    SELECT gen, ctid AS tid FROM {schema}.meta
    WHERE queue_id = %(queue_id)s AND state = 1 AND lease_until <= now()
    ORDER BY lease_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.meta m
SET state = CASE WHEN m.attempts >= %(max_attempts)s THEN 2 ELSE 0 END,
    lease_until = NULL, consumer = NULL,
    last_error = 'lease expired (held by ' || coalesce(m.consumer, '?') || ')'
WHERE m.ctid = ANY (ARRAY(SELECT tid FROM picked))
  AND ((m.gen, m.ctid) IN (SELECT gen, tid FROM picked)) IS TRUE
RETURNING m.id, m.state

-- name: expire_fail
-- Ready messages of the queue whose time to live has passed (up to limit, oldest expiry first, through
-- meta_opt_expiring_idx, each meta row found through meta_ready_idx by the priority, process_at and id
-- its meta_opt row holds) go to the failed state with last_error 'expired' (on_expiry 'fail'). expires_at
-- is cleared, so a failed message leaves the index and requeue_failed makes it deliverable again. Leased
-- messages are left to their consumer: a nack or an expired lease makes them ready, and then this
-- finds them. Rows are named by (gen, ctid), as in reclaim_expired.
WITH picked AS (
    SELECT r.gen, r.tid FROM {schema}.meta_opt o
    CROSS JOIN LATERAL (
        SELECT m.gen, m.ctid AS tid FROM {schema}.meta m
        WHERE m.queue_id = o.queue_id AND m.state = 0 AND m.priority = o.priority
          AND m.process_at = o.process_at AND m.id = o.id
        FOR UPDATE SKIP LOCKED) r
    WHERE o.queue_id = %(queue_id)s AND o.expires_at <= now()
    ORDER BY o.expires_at
    LIMIT %(limit)s
), failed AS (
    UPDATE {schema}.meta m
    SET state = 2, last_error = 'expired'
    WHERE m.ctid = ANY (ARRAY(SELECT tid FROM picked))
      AND ((m.gen, m.ctid) IN (SELECT gen, tid FROM picked)) IS TRUE
    RETURNING m.id
), opt AS (
    UPDATE {schema}.meta_opt o SET expires_at = NULL
    WHERE o.queue_id = %(queue_id)s AND o.id = ANY (ARRAY(SELECT f.id FROM failed f))
)
SELECT f.id FROM failed f

-- name: expire_drop
-- As expire_fail, for on_expiry 'drop': the messages are deleted with their payloads and meta_opt rows,
-- or kept in done as discarded (outcome 2, as delete_failed does) where the queue archives.
WITH picked AS (
    SELECT r.gen, r.tid FROM {schema}.meta_opt o
    CROSS JOIN LATERAL (
        SELECT m.gen, m.ctid AS tid FROM {schema}.meta m
        WHERE m.queue_id = o.queue_id AND m.state = 0 AND m.priority = o.priority
          AND m.process_at = o.process_at AND m.id = o.id
        FOR UPDATE SKIP LOCKED) r
    WHERE o.queue_id = %(queue_id)s AND o.expires_at <= now()
    ORDER BY o.expires_at
    LIMIT %(limit)s
), gone AS (
    DELETE FROM {schema}.meta m
    WHERE m.ctid = ANY (ARRAY(SELECT tid FROM picked))
      AND ((m.gen, m.ctid) IN (SELECT gen, tid FROM picked)) IS TRUE
    RETURNING m.id, m.queue_id, m.priority, m.attempts, m.enqueued_at, m.payload, m.gen
), opt AS (
    DELETE FROM {schema}.meta_opt o
    WHERE o.queue_id = %(queue_id)s AND o.id = ANY (ARRAY(SELECT id FROM gone))
), kept AS (
    INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload, gen)
    SELECT id, queue_id, priority, attempts, enqueued_at, 2, payload, gen FROM gone WHERE %(archive)s
), dropped AS (
    DELETE FROM {schema}.data d
    WHERE NOT %(archive)s AND d.id = ANY (ARRAY(SELECT id FROM gone WHERE payload IS NULL))
)
SELECT id FROM gone

-- name: count_expired
-- Failed messages of the queue that failed by expiry, counted up to a cap (stats().extra["expired"]).
SELECT count(*) FROM (
    SELECT 1 FROM {schema}.meta
    WHERE queue_id = %(queue_id)s AND state = 2 AND last_error = 'expired'
    LIMIT %(cap)s) s

-- name: peek
SELECT m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until,
       coalesce(m.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id AND d.gen = m.gen)) AS payload
FROM {schema}.meta m
WHERE m.queue_id = %(queue_id)s AND m.state = 0 AND m.process_at <= now()
  AND m.process_at >= (SELECT {schema}.table_floor(%(queue_id)s::integer))
  AND (NOT %(opts)s OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
      WHERE o.queue_id = m.queue_id AND o.id = m.id
        AND (o.expires_at <= now() OR (o.okey IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
            WHERE e.queue_id = o.queue_id AND e.okey = o.okey AND e.id < o.id
              AND NOT EXISTS (SELECT 1 FROM {schema}.meta f
                  WHERE f.queue_id = e.queue_id AND f.id = e.id AND f.state = 2))))))
ORDER BY m.priority DESC, m.process_at, m.id
LIMIT %(n)s

-- name: count_ready
-- Messages a pop could take now, of at least min_priority, counted up to a cap (a sensor needs "at
-- least k", not a total): those ready, and those whose lease expired with attempts left, which a pop
-- reclaims first (back to ready in their place). An expired lease out of attempts goes to failed.
SELECT count(*) FROM (
    (SELECT 1 FROM {schema}.meta
     WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now() AND priority >= %(min_priority)s
       AND process_at >= (SELECT {schema}.table_floor(%(queue_id)s::integer))
       AND (NOT %(opts)s OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
           WHERE o.queue_id = meta.queue_id AND o.id = meta.id
             AND (o.expires_at <= now() OR (o.okey IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                 WHERE e.queue_id = o.queue_id AND e.okey = o.okey AND e.id < o.id
                   AND NOT EXISTS (SELECT 1 FROM {schema}.meta f
                       WHERE f.queue_id = e.queue_id AND f.id = e.id AND f.state = 2))))))
     LIMIT %(cap)s)
    UNION ALL
    (SELECT 1 FROM {schema}.meta
     WHERE queue_id = %(queue_id)s AND state = 1 AND lease_until <= now() AND attempts < %(max_attempts)s
       AND priority >= %(min_priority)s
       AND (NOT %(opts)s OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
           WHERE o.queue_id = meta.queue_id AND o.id = meta.id AND o.expires_at <= now()))
     LIMIT %(cap)s)
    LIMIT %(cap)s) s

-- name: next_due
-- Seconds until the earliest delayed message becomes ready (NULL when none is delayed).
SELECT extract(epoch FROM min(process_at) - now())::float8 FROM {schema}.meta
WHERE queue_id = %(queue_id)s AND state = 0 AND process_at > now()

-- name: pushing
-- Whether a push into the queue may be in progress, for a waiting pop about to look: table_push() holds
-- the queue's push lock shared until its transaction ends, and decides whether to NOTIFY
-- (notify="auto") while it holds it. An exclusive try fails while any push is in progress; when it
-- succeeds it holds the lock only for this statement's instant (pushes wait that instant).
SELECT NOT pg_try_advisory_xact_lock(hashtext('dbqueue.queue.' || '{schema}'), %(queue_id)s)

-- name: waiters_hold
-- The listening connection's registration of waiters of the queue (hub.py): the queue's waiters' lock
-- held shared by this session from the first waiter's arrival until none has waited for a while, so that
-- a push with notify="auto" (table_push in functions.sql, which tries it exclusively) notifies while
-- somebody waits and asks nothing otherwise. A try: false while a push holds it exclusively (one that
-- decided that nobody waits, until it commits); the hub tries again before its waiters' next wait.
SELECT pg_try_advisory_lock_shared(hashtext('dbqueue.waiters.' || '{schema}'), %(queue_id)s::integer)

-- name: waiters_release
SELECT pg_advisory_unlock_shared(hashtext('dbqueue.waiters.' || '{schema}'), %(queue_id)s::integer)

-- name: stats
-- Through table_stats() (functions.sql): each state counted on its own index up to cap entries, and a
-- state that reaches the cap estimated from a sample (the last column says whether any was).
SELECT * FROM {schema}.table_stats(%(queue_id)s::integer, %(cap)s::bigint)

-- name: list_failed
SELECT m.id, m.priority, m.attempts, m.enqueued_at, m.last_error,
       coalesce(m.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id AND d.gen = m.gen)) AS payload
FROM {schema}.meta m
WHERE m.queue_id = %(queue_id)s AND m.state = 2 AND m.id > %(after_id)s
ORDER BY m.id
LIMIT %(limit)s

-- name: requeue_failed
-- A requeued message is ready now, with its attempts reset and no time to live (one that failed by
-- expiry would otherwise expire again at once): its meta_opt row, if any, gets the new process_at and
-- loses its expiry.
-- Its process-at time is not below the queue's floor, read with the queue's push lock taken shared
-- (table_floor_locked in functions.sql): no raise of the floor comes before this transaction commits.
WITH requeued AS (
    UPDATE {schema}.meta
    SET state = 0, attempts = 0, last_error = NULL,
        process_at = greatest(now(), (SELECT {schema}.table_floor_locked(%(queue_id)s::integer)))
    WHERE queue_id = %(queue_id)s AND state = 2 AND (%(all)s OR id = ANY (%(ids)s::bigint[]))
    RETURNING id, process_at
), opt AS (
    UPDATE {schema}.meta_opt o SET process_at = r.process_at, expires_at = NULL
    FROM requeued r
    WHERE o.queue_id = %(queue_id)s AND o.id = r.id
)
SELECT id FROM requeued

-- name: delete_failed
WITH gone AS (
    DELETE FROM {schema}.meta
    WHERE queue_id = %(queue_id)s AND state = 2 AND (%(all)s OR id = ANY (%(ids)s::bigint[]))
    RETURNING id, queue_id, priority, attempts, enqueued_at, payload, gen
), opt AS (
    DELETE FROM {schema}.meta_opt o
    WHERE o.queue_id = %(queue_id)s AND o.id = ANY (ARRAY(SELECT id FROM gone))
), kept AS (
    INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload, gen)
    SELECT id, queue_id, priority, attempts, enqueued_at, 2, payload, gen FROM gone WHERE %(archive)s
), dropped AS (
    DELETE FROM {schema}.data d
    WHERE NOT %(archive)s AND d.id = ANY (ARRAY(SELECT id FROM gone WHERE payload IS NULL))
)
SELECT id FROM gone

-- name: ready_head
-- For observers (sensor, trigger): what a pop could take now (as count_ready: ready messages and
-- expired leases with attempts left) of at least min_priority, counted up to a cap, and the
-- (id, deliveries) of the message a pop would take first (the head: it changes when the queue is
-- consumed, and a message returned by nack or by an expired lease comes back with one more delivery
-- than it had as the head before). head_id is NULL when nothing is ready. A reclaim keeps a message's
-- place (process_at) and deliveries, so an expired lease is the head it will be once reclaimed.
SELECT r.ready, h.id AS head_id, h.deliveries AS head_deliveries
FROM (SELECT count(*) AS ready FROM (
        (SELECT 1 FROM {schema}.meta
         WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now()
           AND priority >= %(min_priority)s AND process_at >= (SELECT {schema}.table_floor(%(queue_id)s::integer))
           AND (NOT %(opts)s OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
               WHERE o.queue_id = meta.queue_id AND o.id = meta.id
                 AND (o.expires_at <= now() OR (o.okey IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                     WHERE e.queue_id = o.queue_id AND e.okey = o.okey AND e.id < o.id
                       AND NOT EXISTS (SELECT 1 FROM {schema}.meta f
                           WHERE f.queue_id = e.queue_id AND f.id = e.id AND f.state = 2))))))
         LIMIT %(cap)s)
        UNION ALL
        (SELECT 1 FROM {schema}.meta
         WHERE queue_id = %(queue_id)s AND state = 1 AND lease_until <= now()
           AND attempts < %(max_attempts)s AND priority >= %(min_priority)s
           AND (NOT %(opts)s OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
               WHERE o.queue_id = meta.queue_id AND o.id = meta.id AND o.expires_at <= now()))
         LIMIT %(cap)s)
        LIMIT %(cap)s) s) r
LEFT JOIN LATERAL (
    SELECT c.id, c.deliveries FROM (
        (SELECT id, deliveries, priority, process_at FROM {schema}.meta
         WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now()
           AND process_at >= (SELECT {schema}.table_floor(%(queue_id)s::integer))
           AND (NOT %(opts)s OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
               WHERE o.queue_id = meta.queue_id AND o.id = meta.id
                 AND (o.expires_at <= now() OR (o.okey IS NOT NULL AND EXISTS (SELECT 1 FROM {schema}.meta_opt e
                     WHERE e.queue_id = o.queue_id AND e.okey = o.okey AND e.id < o.id
                       AND NOT EXISTS (SELECT 1 FROM {schema}.meta f
                           WHERE f.queue_id = e.queue_id AND f.id = e.id AND f.state = 2))))))
         ORDER BY priority DESC, process_at, id
         LIMIT 1)
        UNION ALL
        (SELECT id, deliveries, priority, process_at FROM {schema}.meta
         WHERE queue_id = %(queue_id)s AND state = 1 AND lease_until <= now() AND attempts < %(max_attempts)s
           AND (NOT %(opts)s OR NOT EXISTS (SELECT 1 FROM {schema}.meta_opt o
               WHERE o.queue_id = meta.queue_id AND o.id = meta.id AND o.expires_at <= now()))
         ORDER BY priority DESC, process_at, id
         LIMIT 1)) c
    ORDER BY c.priority DESC, c.process_at, c.id
    LIMIT 1) h ON true

-- name: leased
-- The leased messages of the given receipts (id, delivery) whose lease is still held, with payloads:
-- a task that was handed only receipts (through XCom) reads its batch here.
SELECT m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until,
       coalesce(m.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id AND d.gen = m.gen)) AS payload
FROM unnest(%(ids)b::bigint[], %(deliveries)b::integer[]) AS r(id, delivery)
CROSS JOIN LATERAL (
    SELECT * FROM {schema}.meta m
    WHERE m.id = r.id AND m.deliveries = r.delivery AND m.queue_id = %(queue_id)s AND m.lease_until > now()
    OFFSET 0) m
ORDER BY m.priority DESC, m.process_at, m.id

-- name: extend_leases
-- Push the lease of held receipts out to now() + secs (a long job keeps its claim); all or nothing.
WITH held AS (
    SELECT h.gen, h.tid
    FROM unnest(%(ids)b::bigint[], %(deliveries)b::integer[]) AS r(id, delivery)
    CROSS JOIN LATERAL (
        SELECT m.gen, m.ctid AS tid FROM {schema}.meta m
        WHERE m.id = r.id AND m.deliveries = r.delivery AND m.queue_id = %(queue_id)s
          AND m.lease_until > now()
        FOR UPDATE) h
)
UPDATE {schema}.meta m
SET lease_until = now() + make_interval(secs => %(secs)s)
WHERE m.ctid = ANY (ARRAY(SELECT tid FROM held))
  AND ((m.gen, m.ctid) IN (SELECT gen, tid FROM held)) IS TRUE
  AND (SELECT count(*) FROM held) = cardinality(%(ids)b::bigint[])
RETURNING m.id, m.lease_until

-- name: stats_all
-- The stats of the table design's queues among queue_ids, each as stats gives them, in one pass over meta
-- and one over done instead of a statement a queue (maintenance's samples and metrics): a queue with no
-- rows gets zeros. Under row-level security a role counts the rows of the queues it may see, as in stats.
-- After the oldest age: whether a count is estimated (never here: every row is counted) and the failed
-- messages that failed by expiry (stats().extra["expired"]).
SELECT q.queue_id, coalesce(m.ready, 0), coalesce(m.delayed, 0), coalesce(m.in_flight, 0),
       coalesce(m.failed, 0), coalesce(d.finished, 0), extract(epoch FROM now() - m.oldest)::float8,
       false, coalesce(m.expired, 0)
FROM {schema}.queues q
LEFT JOIN (
    SELECT queue_id,
           count(*) FILTER (WHERE state = 0 AND process_at <= now()) AS ready,
           count(*) FILTER (WHERE state = 0 AND process_at > now()) AS delayed,
           count(*) FILTER (WHERE state = 1) AS in_flight,
           count(*) FILTER (WHERE state = 2) AS failed,
           count(*) FILTER (WHERE state = 2 AND last_error = 'expired') AS expired,
           min(enqueued_at) FILTER (WHERE state = 0 AND process_at <= now()) AS oldest
    FROM {schema}.meta
    WHERE queue_id = ANY (%(queue_ids)s::integer[])
    GROUP BY queue_id) m ON m.queue_id = q.queue_id
LEFT JOIN (
    SELECT queue_id, count(*) AS finished FROM {schema}.done
    WHERE queue_id = ANY (%(queue_ids)s::integer[])
    GROUP BY queue_id) d ON d.queue_id = q.queue_id
WHERE q.design = 'table' AND q.queue_id = ANY (%(queue_ids)s::integer[])

-- name: forget_dedup
-- Deduplication keys of the queue older than its window (window_s), up to n: a push would take them over
-- anyway, so forgetting them changes no push's outcome and keeps the table at about a window of keys.
-- The condition is checked again on the row version the DELETE finds, so a key a push has just taken
-- over (a newer pushed_at) stays.
DELETE FROM {schema}.dedup d
WHERE d.ctid = ANY (ARRAY(
    SELECT ctid FROM {schema}.dedup
    WHERE queue_id = %(queue_id)s AND pushed_at <= now() - make_interval(secs => %(window_s)s)
    LIMIT %(n)s))
  AND d.queue_id = %(queue_id)s AND d.pushed_at <= now() - make_interval(secs => %(window_s)s)
RETURNING d.dedup_key

-- name: upkeep_due
-- The table design's queues whose upkeep has something to do: a lease expired (reclaim_expired), a
-- batch finished more than older_than_s ago (purge_batches), a deduplication key older than the
-- queue's window (forget_dedup: one probe of dedup_pushed_idx a queue), or a message whose time to live
-- passed (expire_fail, expire_drop: a walk of meta_opt_expiring_idx, which holds only such messages). One walk of the leases' index and one of
-- the finished batches for the schema, so that maintenance runs a queue's upkeep statements only where
-- they find work.
SELECT m.queue_id FROM {schema}.meta m WHERE m.state = 1 AND m.lease_until <= now()
UNION
SELECT b.queue_id FROM {schema}.batches b
WHERE b.state <> 0 AND b.finished_at < now() - make_interval(secs => %(older_than_s)s)
UNION
SELECT q.queue_id FROM {schema}.queues q
WHERE q.design = 'table' AND EXISTS (
    SELECT 1 FROM {schema}.dedup d
    WHERE d.queue_id = q.queue_id AND d.pushed_at <= now() - make_interval(secs => q.dedup_window_s))
UNION
SELECT o.queue_id FROM {schema}.meta_opt o WHERE o.expires_at <= now() AND EXISTS (
    SELECT 1 FROM {schema}.meta m
    WHERE m.queue_id = o.queue_id AND m.state = 0 AND m.priority = o.priority AND m.process_at = o.process_at
      AND m.id = o.id)
