-- Named queries of the PostgreSQL dialect: the ring design: push, take and pop, settle, gaps, inspection, failed messages and consumer groups.
-- The conventions of every file of this folder are in queues.sql's opening lines.

-- name: ring_create
-- The ring design. Push and pop are server-side functions (schema.sql); the statements below call them
-- or are the slower paths. Number x of a ring lives in slot x mod capacity, so a receipt finds its slot
-- without an index on seq. group: the key (gid) of a consumer group's rows in ring_lanes, ring_leases,
-- ring_retry and ring_failed, which is the ring's queue_id for its default group (ring_groups).
SELECT {schema}.ring_create(
    %(schema)s, %(queue_id)s::integer, %(capacity)s::integer, %(slot_bytes)s::integer, %(lanes)s::integer)

-- name: ring_drop
SELECT {schema}.ring_drop(%(queue_id)s::integer)

-- name: ring_push
-- (first, floor): the first number, NULL when the ring had no room for the batch, and the ring's floor
-- when the push read it (schema.sql). floor: one this handle read earlier, or NULL.
SELECT r_first, r_floor FROM {schema}.ring_push(
    %(queue_id)s::integer, %(capacity)s::integer, %(payloads)b::bytea[], %(timeout_s)s::float8,
    %(notify)s::integer, %(channel)s, %(first)s::bigint, %(floor)s::bigint)

-- name: ring_push_one
-- The number when it was written, negated when its slot was not free yet, NULL when the ring does not
-- exist (schema.sql); so on SQL Server. floor: one this handle read earlier (ring_floor), or NULL. A
-- scalar call in the select list, which PostgreSQL plans for 30,000 fewer instructions than a call in
-- FROM (the first calls of a session; later ones reuse a generic plan: statements.GENERIC_PLANS).
SELECT {schema}.ring_push_one(
    %(queue_id)s::integer, %(capacity)s::integer, %(payload)b::bytea, %(notify)s::integer, %(channel)s,
    %(floor)s::bigint)

-- name: ring_floor
-- The ring's floor (schema.sql), which pushes of one pass back to ring_push_one: it never goes down.
SELECT {schema}.ring_floor(%(queue_id)s::integer)

-- name: ring_take
-- The fast path of a pop at most once (schema.sql): messages from the lanes, nothing when messages to
-- deliver again are due (ring_pop serves those first). wait: when other pops hold every lane, wait for
-- them (not in a caller's transaction). Each message taken here is on its first delivery and unleased,
-- so only (id, enqueued_at, payload) are sent: the other three columns cost the server about 550
-- instructions a message at batch 100 to send and the client about 700 to read.
SELECT r_id, r_enqueued_at, r_payload
FROM {schema}.ring_take(
    %(queue_id)s::integer, %(capacity)s::integer, %(lanes)s::integer, %(n)s::integer, %(lease)s::boolean,
    %(visibility_timeout_s)s::float8, %(consumer)s::text, true, %(wait)s::boolean)

-- name: ring_take_payloads
-- ring_take for a pop of payloads only (Queue.pop_payloads): one column a message.
SELECT r_payload
FROM {schema}.ring_take(
    %(queue_id)s::integer, %(capacity)s::integer, %(lanes)s::integer, %(n)s::integer, %(lease)s::boolean,
    %(visibility_timeout_s)s::float8, %(consumer)s::text, true, %(wait)s::boolean)

-- name: ring_take_one
-- A pop of one at most once outside a caller's transaction, as one statement (ring_take's first path
-- without the function around it): the lowest lane not held by another pop whose next number is
-- written, moved on, and that number's message; nothing when messages to deliver again are due, every
-- lane is held or no lane's next number is written (the caller then calls ring_take, which waits for
-- held lanes, and ring_pop). group: the key of the group's lanes and retry rows (the ring's queue_id
-- for its default group); queue_id: the ring's. Each slot is read through the slots' key by the
-- lane's number (a LATERAL subquery with a LIMIT, which the planner cannot flatten: a plain join of
-- the slots made the generic plan read every slot of the ring and hash them).
WITH l AS (
    SELECT k.lane, k.pos FROM (
        SELECT t.lane, t.pos FROM {schema}.ring_lanes t
        WHERE t.queue_id = %(group)s::integer AND NOT EXISTS (
            SELECT 1 FROM {schema}.ring_retry r
            WHERE r.queue_id = %(group)s::integer AND r.state = 1 AND r.due_at <= now())
        ORDER BY t.pos
        FOR UPDATE SKIP LOCKED) k
    WHERE EXISTS (
        SELECT 1 FROM {schema}.ring_slots s
        WHERE s.queue_id = %(queue_id)s::integer AND s.slot = mod(k.pos, %(capacity)s::integer)::integer
          AND s.seq = k.pos)
    LIMIT 1
), u AS (
    UPDATE {schema}.ring_lanes t SET pos = t.pos + %(lanes)s::integer
    FROM l WHERE t.queue_id = %(group)s::integer AND t.lane = l.lane
    RETURNING l.pos
)
SELECT s.seq, s.enqueued_at, s.payload
FROM u CROSS JOIN LATERAL (
    SELECT t.seq, t.enqueued_at, t.payload FROM {schema}.ring_slots t
    WHERE t.queue_id = %(queue_id)s::integer AND t.slot = mod(u.pos, %(capacity)s::integer)::integer
      AND t.payload IS NOT NULL
    LIMIT 1) s

-- name: ring_take_lease
-- ring_take at least once: (id, enqueued_at, payload, lease_until), each message on its first delivery
-- and all of them under one lease, whose end only the first row carries (NULL on the others).
SELECT r_id, r_enqueued_at, r_payload, r_lease_until
FROM {schema}.ring_take(
    %(queue_id)s::integer, %(capacity)s::integer, %(lanes)s::integer, %(n)s::integer, %(lease)s::boolean,
    %(visibility_timeout_s)s::float8, %(consumer)s::text, true, %(wait)s::boolean)

-- name: ring_take_lease_ids
-- ring_take at least once for a claimed batch, whose payloads its reader fetches elsewhere: (id,
-- lease_until) only, the lease's end on the first row (NULL on the others). The payloads are read in
-- the server and not sent: at a batch of 20,000 orders they were most of a claim's time.
SELECT r_id, r_lease_until
FROM {schema}.ring_take(
    %(queue_id)s::integer, %(capacity)s::integer, %(lanes)s::integer, %(n)s::integer, true,
    %(visibility_timeout_s)s::float8, %(consumer)s::text, true, false)

-- name: ring_pop
-- Rows come back in binary (statements.BINARY_RESULTS): the holders (xid[]) as text.
SELECT r_id, r_attempts, r_deliveries, r_enqueued_at, r_lease_until, r_payload, r_gap, r_issued, r_snap::text
FROM {schema}.ring_pop(
    %(queue_id)s::integer, %(capacity)s::integer, %(lanes)s::integer, %(n)s::integer, %(lease)s::boolean,
    %(visibility_timeout_s)s::float8, %(consumer)s::text, %(own)s::boolean,
    %(gap)s::bigint, %(gap_issued)s::bigint, %(gap_snap)s::xid[], %(force)s::boolean)

-- name: ring_pushing
-- Whether a push into the ring may be in progress, for a waiting pop (of group %(group)s) that found
-- nothing: a number is issued at or above the group's pop position (its lowest lane position), which
-- it did not find written. That is a push that has not committed yet (it may not NOTIFY, having seen an
-- earlier message ready), a lane another pop holds, or a gap not given up yet: the pop looks again soon.
SELECT coalesce(pg_sequence_last_value(r.push_seq), 0)
       >= (SELECT min(l.pos) FROM {schema}.ring_lanes l WHERE l.queue_id = %(group)s)
FROM {schema}.rings r WHERE r.queue_id = %(queue_id)s

-- name: ring_unwritten
-- Maintenance's gap recovery, first step: the push position, and whether any number up to it is issued
-- but unwritten while its slot is free for it (the slot holds the number a capacity before it, below the
-- floor). A full scan of the ring's slots. The holders (ring_snapshot) are listed by a later statement.
SELECT i.issued, EXISTS (
    SELECT 1 FROM {schema}.ring_slots t
    WHERE t.queue_id = r.queue_id AND t.seq + r.capacity <= i.issued AND t.seq < {schema}.ring_floor(r.queue_id))
FROM {schema}.rings r
CROSS JOIN LATERAL (SELECT coalesce(pg_sequence_last_value(r.push_seq), 0) AS issued) i
WHERE r.queue_id = %(queue_id)s

-- name: ring_snapshot
SELECT {schema}.ring_holders()::text

-- name: ring_skip_abandoned
SELECT {schema}.ring_skip_abandoned(%(queue_id)s::integer, %(issued)s::bigint, %(snap)s::xid[])

-- name: ring_pass
-- Lanes moved over given-up numbers at their heads (schema.sql), after maintenance gave gaps up.
SELECT {schema}.ring_pass(%(queue_id)s::integer, %(capacity)s::integer, %(lanes)s::integer)

-- name: ring_ack
-- The ack of whole leases, the usual one (schema.sql): the n of each lease deleted, none otherwise (the
-- caller settles the receipts with ring_settle).
SELECT r_n
FROM {schema}.ring_ack(%(group)s::integer, %(lanes)s::integer, %(ids)b::bigint[], %(deliveries)b::integer[])

-- name: ring_settle
-- Ack (nack false) or nack receipts, all or nothing (schema.sql): (id, state) of each, none when some
-- receipt no longer holds its lease.
SELECT r_id, r_state FROM {schema}.ring_settle(
    %(queue_id)s::integer, %(capacity)s::integer, %(lanes)s::integer, %(ids)b::bigint[],
    %(deliveries)b::integer[], %(nack)s::boolean, %(delay_s)s::float8, %(backoff_s)s::float8,
    %(backoff_max_s)s::float8, %(max_attempts)s::integer, %(error)s::text, %(group)s::integer)

-- name: ring_held_receipts
SELECT r_id, r_delivery
FROM {schema}.ring_held(
    %(queue_id)s::integer, %(lanes)s::integer, %(ids)b::bigint[], %(deliveries)b::integer[], %(group)s::integer)

-- name: ring_reclaim_expired
-- Expired leases go back to ready in place (keeping their id) or, after max_attempts, to ring_failed.
-- Pops run it at most once a second.
SELECT r_id, r_state FROM {schema}.ring_reclaim_expired(
    %(queue_id)s::integer, %(capacity)s::integer, %(lanes)s::integer, %(max_attempts)s::integer,
    %(limit)s::integer, %(group)s::integer)

-- name: ring_peek
-- What pops would take first: the messages due again, then the lanes', each in id order (ring_look reads
-- those it shows, in that order).
SELECT r_id, r_attempts, r_deliveries, r_enqueued_at, NULL::timestamptz AS lease_until, r_payload
FROM {schema}.ring_look(%(queue_id)s::integer, %(group)s::integer, %(n)s::integer)

-- name: ring_count_ready
-- What a pop could take now, counted up to a cap: ring_ready()'s due messages, and those whose lease
-- expired with attempts left, which a pop reclaims first (ring_reclaim_expired): the n messages of each
-- expired ring_leases row (first deliveries, attempt 1: attempts left when max_attempts > 1) and each
-- expired leased retry row with attempts left. An expired lease out of attempts goes to ring_failed.
SELECT least(%(cap)s::bigint,
    (SELECT count(*) FROM (
        SELECT 1 FROM {schema}.ring_ready(%(queue_id)s::integer, %(group)s::integer) WHERE r_due <= now() LIMIT %(cap)s) s)
    + (SELECT count(*) FROM {schema}.ring_retry t
       WHERE t.queue_id = %(group)s AND t.state = 2 AND t.due_at <= now() AND t.attempts < %(max_attempts)s)
    + (SELECT coalesce(sum(e.n), 0) FROM {schema}.ring_leases e
       WHERE e.queue_id = %(group)s AND e.lease_until <= now() AND %(max_attempts)s > 1))

-- name: ring_ready_head
-- For observers: ring_count_ready's count and the (id, delivery) a pop would take first. Pops serve the
-- messages to deliver again first, in id order (an expired lease among them once reclaimed: a retry row
-- keeps its deliveries, and a ring_leases row's lowest message is its lo, delivered once), then the
-- lanes' messages in id order.
SELECT least(%(cap)s::bigint,
    (SELECT count(*) FROM (
        SELECT 1 FROM {schema}.ring_ready(%(queue_id)s::integer, %(group)s::integer) WHERE r_due <= now() LIMIT %(cap)s) s)
    + (SELECT count(*) FROM {schema}.ring_retry t
       WHERE t.queue_id = %(group)s AND t.state = 2 AND t.due_at <= now() AND t.attempts < %(max_attempts)s)
    + (SELECT coalesce(sum(e.n), 0) FROM {schema}.ring_leases e
       WHERE e.queue_id = %(group)s AND e.lease_until <= now() AND %(max_attempts)s > 1)) AS ready,
    h.r_id AS head_id, h.r_deliveries AS head_deliveries,
    -- alive: the ring and the group still exist (a queue id and a gid are never used twice), so that
    -- an observer tells an empty ring from a dropped one in this one trip. (The tests find a trigger's
    -- check by head_deliveries in pg_stat_activity, which keeps the first 1 kB of a statement.)
    EXISTS (SELECT 1 FROM {schema}.queues q WHERE q.queue_id = %(queue_id)s)
      AND (%(group)s = %(queue_id)s OR EXISTS (SELECT 1 FROM {schema}.ring_groups g WHERE g.gid = %(group)s))
      AS alive
FROM (SELECT 1) one
LEFT JOIN LATERAL (
    SELECT c.r_id, c.r_deliveries FROM (
        SELECT r_id, r_deliveries, r_attempts = 0 AS fresh FROM {schema}.ring_ready(%(queue_id)s::integer, %(group)s::integer)
        WHERE r_due <= now()
        UNION ALL
        SELECT t.id, t.deliveries, false FROM {schema}.ring_retry t
        WHERE t.queue_id = %(group)s AND t.state = 2 AND t.due_at <= now()
          AND t.attempts < %(max_attempts)s
        UNION ALL
        SELECT e.lo, 1, false FROM {schema}.ring_leases e
        WHERE e.queue_id = %(group)s AND e.lease_until <= now() AND %(max_attempts)s > 1) c
    ORDER BY c.fresh, c.r_id
    LIMIT 1) h ON true

-- name: ring_stats
-- Depth by state of one consumer group, plus the ring's own figures: the push position (last number
-- issued), the group's pop position (its lowest lane position: the next number none of its pops has
-- taken), the floor (the lowest number a consumer of any group may still need), its lanes, and the
-- numbers given up as gaps. depth: the numbers issued that the group's lanes have not passed, by
-- arithmetic over its lanes (lane l holds (issued - pos) / lanes + 1 of them), which counts gaps and
-- pushes in progress too. Up to %(cap)s of them the lanes' messages are counted in their slots
-- (ring_ready reads only those), above it the depth stands for them (estimated) and the oldest ready
-- message is the oldest at a lane's head: a stats() of a deep ring reads one slot a lane.
WITH g AS (
    SELECT r.lanes, r.capacity, coalesce(pg_sequence_last_value(r.push_seq), 0) AS issued,
           coalesce(pg_sequence_last_value(r.gap_seq), 0) AS gaps
    FROM {schema}.rings r WHERE r.queue_id = %(queue_id)s
), d AS (
    SELECT coalesce(sum((g.issued - l.pos) / g.lanes + 1), 0)::bigint AS depth
    FROM g JOIN {schema}.ring_lanes l ON l.queue_id = %(group)s AND l.pos <= g.issued
), rd AS MATERIALIZED (
    SELECT r_enqueued_at, r_due FROM {schema}.ring_ready(%(queue_id)s::integer, %(group)s::integer)
    WHERE (SELECT depth FROM d) <= %(cap)s
), rt AS MATERIALIZED (
    SELECT t.due_at FROM {schema}.ring_retry t
    WHERE t.queue_id = %(group)s AND t.state = 1 AND (SELECT depth FROM d) > %(cap)s
), e AS (
    SELECT (SELECT depth FROM d) > %(cap)s AS estimated
)
SELECT CASE WHEN e.estimated
            THEN (SELECT depth FROM d) + (SELECT count(*) FROM rt WHERE due_at <= now())
            ELSE (SELECT count(*) FROM rd WHERE r_due <= now()) END AS ready,
       CASE WHEN e.estimated
            THEN (SELECT count(*) FROM rt WHERE due_at > now())
            ELSE (SELECT count(*) FROM rd WHERE r_due > now()) END AS delayed,
       (SELECT coalesce(sum(e.n), 0) FROM {schema}.ring_leases e WHERE e.queue_id = %(group)s)
       + (SELECT count(*) FROM {schema}.ring_retry t WHERE t.queue_id = %(group)s AND t.state = 2)
           AS in_flight,
       (SELECT count(*) FROM {schema}.ring_failed f WHERE f.queue_id = %(group)s) AS failed,
       extract(epoch FROM now() - CASE WHEN e.estimated
           THEN (SELECT min(s.enqueued_at) FROM {schema}.ring_lanes l
                 JOIN {schema}.ring_slots s
                   ON s.queue_id = %(queue_id)s AND s.slot = mod(l.pos, g.capacity::bigint)::integer AND s.seq = l.pos
                 WHERE l.queue_id = %(group)s AND s.payload IS NOT NULL)
           ELSE (SELECT min(r_enqueued_at) FROM rd WHERE r_due <= now()) END)::float8
           AS oldest_ready_age_s,
       g.issued AS push_position,
       (SELECT min(l.pos) FROM {schema}.ring_lanes l WHERE l.queue_id = %(group)s) AS pop_position,
       {schema}.ring_floor(%(queue_id)s::integer) AS floor,
       g.gaps AS gaps_skipped,
       g.lanes,
       e.estimated
FROM g CROSS JOIN e

-- name: ring_list_failed
SELECT id, attempts, enqueued_at, last_error, payload
FROM {schema}.ring_failed
WHERE queue_id = %(group)s AND id > %(after_id)s
ORDER BY id
LIMIT %(limit)s

-- name: ring_take_failed
-- requeue_failed: the failed messages leave ring_failed and are pushed again (new ids) in the same
-- transaction.
DELETE FROM {schema}.ring_failed
WHERE queue_id = %(group)s AND (%(all)s OR id = ANY (%(ids)s::bigint[]))
RETURNING id, payload

-- name: ring_delete_failed
DELETE FROM {schema}.ring_failed
WHERE queue_id = %(group)s AND (%(all)s OR id = ANY (%(ids)s::bigint[]))
RETURNING id

-- name: ring_leased
-- The held receipts' messages with their payloads, in id order.
SELECT h.r_id, coalesce(t.attempts, 1), h.r_delivery, s.enqueued_at, h.r_until, s.payload
FROM {schema}.ring_held(
    %(queue_id)s::integer, %(lanes)s::integer, %(ids)b::bigint[], %(deliveries)b::integer[], %(group)s::integer) h
JOIN {schema}.ring_slots s ON s.queue_id = %(queue_id)s AND s.slot = mod(h.r_id, %(capacity)s)::integer
LEFT JOIN {schema}.ring_retry t ON t.queue_id = %(group)s AND t.id = h.r_id
ORDER BY h.r_id

-- name: ring_add_group
-- A new consumer group's gid (schema.sql), NULL when the ring does not exist.
SELECT {schema}.ring_add_group(
    %(queue_id)s::integer, %(name)s::text, %(earliest)s::boolean, %(on_lag)s::smallint,
    %(lag_timeout_s)s::float8)

-- name: ring_drop_group
SELECT {schema}.ring_drop_group(%(queue_id)s::integer, %(group)s::integer)

-- name: ring_groups
-- The ring's consumer groups, the default one first (gid: the ring's queue_id; no ring_groups row), with
-- the figures of each: its lowest lane position, the sum of its lane positions (which moves whenever it
-- takes), when maintenance last saw that sum move, and the ring's push position.
SELECT k.gid, g.name, g.created_at, g.on_lag, g.lag_timeout_s, g.moved_pos, g.moved_at,
       (SELECT min(l.pos) FROM {schema}.ring_lanes l WHERE l.queue_id = k.gid),
       (SELECT sum(l.pos)::bigint FROM {schema}.ring_lanes l WHERE l.queue_id = k.gid),
       coalesce(pg_sequence_last_value(r.push_seq), 0)
FROM {schema}.rings r
CROSS JOIN LATERAL (
    SELECT r.queue_id AS gid
    UNION ALL
    SELECT x.gid FROM {schema}.ring_groups x WHERE x.queue_id = r.queue_id) k
LEFT JOIN {schema}.ring_groups g ON g.queue_id = r.queue_id AND g.gid = k.gid
WHERE r.queue_id = %(queue_id)s
ORDER BY k.gid = r.queue_id DESC, g.name

-- name: ring_group_moved
-- Maintenance saw the group's lanes at moved_pos (the sum of their positions): when that differs from
-- what it saw last, the group moved now. Returns the time it last moved.
UPDATE {schema}.ring_groups
SET moved_at = CASE WHEN moved_pos IS DISTINCT FROM %(moved_pos)s::bigint THEN now() ELSE moved_at END,
    moved_pos = %(moved_pos)s::bigint
WHERE queue_id = %(queue_id)s AND gid = %(group)s
RETURNING extract(epoch FROM now() - moved_at)::float8

-- name: ring_record_batch
-- A claimed batch of a consumer group in the batch ledger (batches, keyed by the group's key): the
-- receipts of the pop at least once that took its messages, in the same transaction.
INSERT INTO {schema}.batches (batch_id, queue_id, ids, deliveries, consumer, lease_until)
VALUES (%(batch_id)s, %(group)s, %(ids)s::bigint[], %(deliveries)s::integer[], %(consumer)s, %(lease_until)s)
RETURNING batch_id, state, ids, deliveries, consumer, claimed_at, lease_until, finished_at, last_error

-- name: ring_batch_rows
-- The messages of one batch of a consumer group with their payloads, numbered 1..n in claim order (ord:
-- a Spark JDBC reader partitions on it). Rendered to text with its parameters for readers in other
-- processes. The slots read are those of the range of the batch's numbers (a_lo..a_hi, and b_lo..b_hi
-- where it wraps past the last slot), each matched to its number by its slot (number mod capacity) and
-- its seq: a slot gives its payload only while it holds the batch's number, and one overwritten since
-- (the batch's lease expired, and its message was delivered and finished elsewhere) reads as a NULL
-- payload; that batch cannot be acked anyway. The slot's equality lets either plan run fast: a hash
-- join of the range, or, where a reader's filter on ord leaves the planner expecting few numbers, a
-- probe of the slots' key a number (a join on seq alone then scanned the range once a number: 95 s
-- for half a batch of 20,000).
SELECT r.ord, r.id, r.delivery, s.payload
FROM {schema}.batches b
CROSS JOIN LATERAL unnest(b.ids, b.deliveries) WITH ORDINALITY AS r(id, delivery, ord)
LEFT JOIN {schema}.ring_slots s
  ON s.queue_id = %(queue_id)s AND s.slot = mod(r.id, %(capacity)s)::integer AND s.seq = r.id
 AND (s.slot BETWEEN %(a_lo)s AND %(a_hi)s OR s.slot BETWEEN %(b_lo)s AND %(b_hi)s)
WHERE b.batch_id = %(batch_id)s AND b.queue_id = %(group)s

-- name: ring_extend_batch
-- Push the leases of a batch's receipts out to secs from now: the ring_leases rows holding them and
-- their leased retry rows. Returns (the receipts held and extended, the new end); the caller rolls back
-- unless every receipt was. A lease row holds only messages of the pop that wrote it, so the n of the
-- rows extended counts receipts.
WITH h AS MATERIALIZED (
    SELECT h.r_id, h.r_lease
    FROM {schema}.ring_held(
        %(queue_id)s::integer, %(lanes)s::integer, %(ids)b::bigint[], %(deliveries)b::integer[], %(group)s::integer) h
), e AS (
    UPDATE {schema}.ring_leases e SET lease_until = now() + make_interval(secs => %(secs)s::float8)
    WHERE e.queue_id = %(group)s::integer AND e.lease_until > now()
      AND e.lo IN (SELECT h.r_lease FROM h WHERE h.r_lease IS NOT NULL)
    RETURNING e.n
), t AS (
    UPDATE {schema}.ring_retry t SET due_at = now() + make_interval(secs => %(secs)s::float8)
    WHERE t.queue_id = %(group)s::integer AND t.state = 2 AND t.due_at > now()
      AND t.id IN (SELECT h.r_id FROM h WHERE h.r_lease IS NULL)
    RETURNING t.id
)
SELECT least((SELECT count(*) FROM h), (SELECT coalesce(sum(e.n), 0) FROM e) + (SELECT count(*) FROM t)),
       now() + make_interval(secs => %(secs)s::float8)

-- name: ring_rows_create
-- A ring of the rows layout (functions.sql, ring_rows_template): its tables, sequences and functions.
SELECT {schema}.ring_rows_create(%(queue_id)s::integer, %(capacity)s::integer, %(lanes)s::integer)

-- name: ring_rows_drop_all
-- Every ring of the rows layout's own objects (uninstall, before the tables they are registered in).
SELECT {schema}.ring_rows_drop(queue_id) FROM {schema}.ring_rows

-- name: ring_rows_push
-- (first id, NULL) when the batch was pushed as one row; (NULL, generation) when that generation's
-- segment must be rotated in first (ring_rows_rotate), nothing pushed. {fn}: the ring's own push function
-- (ring_<queue_id>_rpush, functions.sql's ring_rows_template), called by its name: a function of the
-- schema that ran it by its queue_id would plan that call again (EXECUTE) on every push.
SELECT r_first, r_need FROM {schema}.{fn}(%(payloads)b::bytea[], %(notify)s::integer, %(channel)s)

-- name: ring_rows_push_ttl
-- ring_rows_push for a push whose messages expire %(ttl)s seconds from now (a ring created with a ttl);
-- {fn}: the ring's ring_<queue_id>_rpushx.
SELECT r_first, r_need FROM {schema}.{fn}(%(payloads)b::bytea[], %(notify)s::integer, %(channel)s, %(ttl)s::double precision)

-- name: ring_rows_push_keys
-- ring_rows_push for a push with deduplication keys (one a payload, distinct): (each payload's id, NULL),
-- a known key's being its first push's and only the others' payloads pushed, as one row; or (NULL,
-- generation) as ring_rows_push's, nothing pushed. %(ttl)s: the messages' time to live, or NULL. {fn}: the
-- ring's ring_<queue_id>_rpushk.
SELECT r_ids, r_need FROM {schema}.{fn}(%(payloads)b::bytea[], %(keys)s::text[], %(notify)s::integer,
    %(channel)s, %(ttl)s::double precision)

-- name: ring_rows_push_ordered
-- ring_rows_push for a ring ordered per key: payloads sorted by lane (each lane's in push order), counts
-- one a lane; (the block's first row, NULL), the push a block of one row a lane; or (NULL, generation)
-- as ring_rows_push's, nothing pushed. %(ttl)s: the messages' time to live, or NULL. {fn}: the ring's
-- ring_<queue_id>_rpusho.
SELECT r_first, r_need FROM {schema}.{fn}(%(payloads)b::bytea[], %(counts)s::integer[], %(notify)s::integer,
    %(channel)s, %(ttl)s::double precision)

-- name: ring_rows_forget_keys
-- Forget up to %(n)s deduplication keys of the ring older than its window; how many. {fn}: the ring's
-- ring_<queue_id>_rforget.
SELECT {schema}.{fn}(%(n)s::integer)

-- name: ring_rows_take
-- A pop: messages due again first, then the lanes'. lease: at least once (one lease row for what the lanes
-- gave, until now + visibility_timeout_s); otherwise at most once (in the caller's transaction: exactly
-- once). wait: when other pops hold every lane with messages, wait for one of them (at most 1 s). {fn}:
-- the ring's own pop function (ring_<queue_id>_rtake).
SELECT r_id, r_attempts, r_deliveries, r_enqueued_at, r_lease_until, r_payload FROM {schema}.{fn}(
    %(n)s::integer, %(wait)s::boolean, %(lease)s::boolean, %(visibility_timeout_s)s::float8, %(consumer)s::text)

-- name: ring_rows_pop_payloads
SELECT r_payload FROM {schema}.{fn}(%(n)s::integer, %(wait)s::boolean, false, 0, NULL)

-- name: ring_rows_take_one
-- A pop of one (ring_rows_take's columns): {fn} is the ring's own function for it (ring_<queue_id>_rtake1),
-- which takes the lowest lane's next message in statements of its own (usually two), and hands over to the pop
-- of ring_rows_take when messages to deliver again may be due or it finds no lane to take from.
SELECT r_id, r_attempts, r_deliveries, r_enqueued_at, r_lease_until, r_payload FROM {schema}.{fn}(
    %(wait)s::boolean, %(lease)s::boolean, %(visibility_timeout_s)s::float8, %(consumer)s::text)

-- name: ring_rows_pop_payload_one
SELECT r_payload FROM {schema}.{fn}(%(wait)s::boolean, false, 0, NULL)

-- name: ring_rows_has_function
-- Whether the ring has its own function fn: a ring made from an older template (its functions are made
-- once, at its creation) lacks those added since.
SELECT EXISTS (
    SELECT 1 FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
    WHERE n.nspname = %(schema)s AND p.proname = %(fn)s)

-- name: ring_rows_ack
-- The usual ack, of one whole lease: the messages acked (all the receipts), or 0 (then ring_rows_settle).
-- {fn}: the ring's own ack function (ring_<queue_id>_rack).
SELECT {schema}.{fn}(%(ids)s::bigint[], %(deliveries)s::integer[])

-- name: ring_rows_ack_notify
-- ring_rows_ack on a ring ordered per key: the done row frees the lease's lanes, and wakes a waiting pop
-- on %(channel)s when one of them may have something to take (%(notify)s: the ring's notify setting).
SELECT {schema}.{fn}(%(ids)s::bigint[], %(deliveries)s::integer[], %(notify)s::integer, %(channel)s::text)

-- name: ring_rows_settle_notify
-- ring_rows_settle on a ring ordered per key, calling the group's own settle function ({fn}) by name: a
-- lane of the receipts freed with something to take wakes a waiting pop on %(channel)s (%(notify)s: the
-- ring's notify setting).
SELECT r_id, r_state FROM {schema}.{fn}(
    %(ids)s::bigint[], %(deliveries)s::integer[], %(nack)s::boolean, %(delay_s)s::float8,
    %(backoff_s)s::float8, %(backoff_max_s)s::float8, %(max_attempts)s::integer, %(error)s::text,
    %(notify)s::integer, %(channel)s::text)

-- name: ring_rows_settle
-- Ack or nack receipts, all or nothing: (id, state) of each, none when some receipt lost its lease.
SELECT r_id, r_state FROM {schema}.ring_rows_settle(
    %(queue_id)s::integer, %(ids)s::bigint[], %(deliveries)s::integer[], %(nack)s::boolean,
    %(delay_s)s::float8, %(backoff_s)s::float8, %(backoff_max_s)s::float8, %(max_attempts)s::integer,
    %(error)s::text)

-- name: ring_rows_held
-- The receipts (id, delivery) that still hold their lease.
SELECT r_id, r_delivery FROM {schema}.ring_rows_held(
    %(queue_id)s::integer, %(ids)s::bigint[], %(deliveries)s::integer[])

-- name: ring_rows_reclaim
-- Expired leases back to ready, or failed after max_attempts: (id, state) of each message moved.
SELECT r_id, r_state FROM {schema}.ring_rows_reclaim(
    %(queue_id)s::integer, %(max_attempts)s::integer, %(limit)s::integer)

-- name: ring_rows_look
-- Up to n ready messages in the order pops take them, taking nothing: (id, attempts, deliveries so far,
-- enqueued_at, lease_until NULL, payload), as ring_peek shows a slots ring's.
SELECT r_id, r_attempts, r_deliveries, r_enqueued_at, NULL::timestamptz AS lease_until, r_payload
FROM {schema}.ring_rows_look(%(queue_id)s::integer, %(n)s::integer)

-- name: ring_rows_ready_head
-- For observers (count_ready, readiness): what a pop could take now, counted up to cap (leases past their
-- end with an attempt left included, as ring_ready_head counts a slots ring's), and the (id, deliveries)
-- of the message a pop would take first (NULL when none). (The tests find a trigger's check by
-- head_deliveries in pg_stat_activity.)
SELECT r_ready AS ready, r_head_id AS head_id, r_head_deliveries AS head_deliveries
FROM {schema}.ring_rows_ready(%(queue_id)s::integer, %(cap)s::bigint, %(max_attempts)s::integer)

-- name: ring_rows_rotate
-- Empty the segment that generation gen needs (TRUNCATE under a 50 ms lock_timeout), once every lane is
-- past what it holds: whether it is empty or gen's now. Then, in a transaction of its own,
-- ring_rows_label.
SELECT {schema}.ring_rows_rotate(%(queue_id)s::integer, %(gen)s::bigint)

-- name: ring_rows_label
-- Label the segment that ring_rows_rotate emptied with generation gen: pushes write into it from now on.
SELECT {schema}.ring_rows_label(%(queue_id)s::integer, %(gen)s::bigint)

-- name: ring_rows_rotate_ahead
-- The generation after the newest row's when its segment is empty now (to label), else NULL.
SELECT {schema}.ring_rows_rotate_ahead(%(queue_id)s::integer)

-- name: ring_rows_gaps
-- Give up the gaps proven since (xmax, last) were returned; returns the next (xmax, last) and how many
-- rows were given up.
SELECT r_xmax, r_last, r_skipped FROM {schema}.ring_rows_gaps(
    %(queue_id)s::integer, %(xmax)s::bigint, %(last)s::bigint)

-- name: ring_rows_xmin
-- The oldest transaction id still running, as this statement's snapshot sees it (ring_rows_gaps gives up
-- what a look returned once it is at least that look's xmax).
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint

-- name: ring_rows_depth
-- (ready, delayed, in flight, failed, age of the oldest ready in seconds, rows held, each segment's
-- generation, failed by expiry, lapsed: past their time to live and not reached by a pop yet, the ring's
-- push total in messages; the last three NULL for a ring made by a build that did not count them; and on
-- a ring ordered per key, the part of ready that waits behind a lane a pop may not take now, NULL on other
-- rings and on one made by a build that did not count it)
SELECT r_ready, r_delayed, r_in_flight, r_failed, extract(epoch FROM now() - r_oldest)::float8, r_rows, r_gens,
       r_expired, r_lapsed, r_pushed, r_blocked
FROM {schema}.ring_rows_tally(%(queue_id)s::integer)

-- name: ring_rows_group_ids
-- The groups of a ring of the rows layout besides its default one: (gid, name).
SELECT g.gid, g.name FROM {schema}.ring_groups g WHERE g.queue_id = %(queue_id)s ORDER BY g.name

-- name: ring_rows_pushing
-- Whether a push into a ring of the rows layout may be in progress, for a waiting pop of group %(group)s
-- that found nothing: a row is issued (the ring's row sequence) with ids at or above the group's lowest
-- lane position, so not all taken. That is a push that has not committed yet (it may not NOTIFY under
-- notify="auto", having seen an earlier message ready), a lane another pop holds, or a row rolled back
-- and not given up yet: the pop looks again soon, as on the slots layout (ring_pushing). Asked only on a
-- ring made by a build without the ring's own pop of one; the others ask ring_rows_ask.
SELECT ((coalesce(pg_sequence_last_value(('{schema}.' || {schema}.ring_rows_own(%(queue_id)s::integer) || 'rows')::regclass), -1) << 16) | 65535)
       >= (SELECT min(x) FROM unnest({schema}.ring_rows_positions(%(group)s::integer)) x)

-- name: ring_rows_ask
-- A waiting pop's question before each look, on a ring of the rows layout: (pushing, to_take). {lanes}:
-- the group's lane positions (its own function), {rows}: the ring's row sequence, {retrygen}: the
-- group's newest generation with a message to deliver again; %(seg_rows)s: rows a segment.
-- pushing: a row is issued at or past the group's lowest lane position, so not all are taken: a push
-- that has not committed yet (which sends no NOTIFY under notify="auto" when it saw an earlier message
-- not taken), a lane another pop holds, or a row rolled back and not given up yet (ring_rows_pushing's
-- answer); the pop looks again soon. to_take: a pop may find something: pushing, or messages to deliver
-- again may be in the segments live now (as the pops' own functions tell). The positions are read
-- before the row sequence (the lateral subquery runs for the row the aggregate gave): when every row
-- issued by then is taken, a push that takes a row later finds, reading positions after it, every lane
-- at or past its row, or an earlier such push did, and so notifies under notify="auto". A waiting pop
-- told there is nothing to take waits for that NOTIFY without popping.
SELECT s.pushing, s.pushing OR coalesce(pg_sequence_last_value('{schema}.{retrygen}'), -4) >= s.last / %(seg_rows)s::bigint - 3
FROM (SELECT min(a) AS lowest FROM unnest({schema}.{lanes}(NULL)) a) p
CROSS JOIN LATERAL (
    SELECT l.last, ((l.last << 16) | 65535) >= p.lowest AS pushing
    FROM (SELECT coalesce(pg_sequence_last_value('{schema}.{rows}'), -1) AS last, p.lowest OFFSET 0) l) s

-- name: ring_rows_next_due
-- Seconds until the earliest message of group {retries} (the group's retry log, a view over its four
-- segments) to deliver again becomes due: a newest retry row ready from a time still to come (a nack with
-- a delay, a retry's backoff); NULL when none is. Asked by a waiting pop before it waits, only when its
-- question said messages to deliver again may be in the segments live now, so that it wakes when the
-- earliest comes due rather than at its poll.
SELECT extract(epoch FROM min(r.due_at) - now())::float8 FROM {schema}.{retries} r
WHERE r.state = 1 AND r.due_at > now()
  AND NOT EXISTS (SELECT 1 FROM {schema}.{retries} x WHERE x.id = r.id AND x.ver > r.ver)

-- name: ring_rows_groups
-- The consumer groups of a ring of the rows layout, the default one first (gid: the ring's queue_id; no
-- ring_groups row), as ring_groups reads them for the slots layout: its lowest lane position (an id), the
-- sum of its lane positions (which moves whenever it takes), when maintenance last saw that sum move, and
-- the highest id the ring's rows issued so far may hold (a group whose lowest position is above it has
-- nothing to take).
SELECT k.gid, g.name, g.created_at, g.on_lag, g.lag_timeout_s, g.moved_pos, g.moved_at,
       (SELECT min(x) FROM unnest(k.at) x), (SELECT sum(x)::bigint FROM unnest(k.at) x),
       (coalesce(pg_sequence_last_value(('{schema}.' || {schema}.ring_rows_own(w.queue_id) || 'rows')::regclass), -1) << 16) | 65535
FROM {schema}.ring_rows w
CROSS JOIN LATERAL (
    SELECT x.gid, {schema}.ring_rows_positions(x.gid) AS at FROM (
        SELECT w.queue_id AS gid
        UNION ALL
        SELECT y.gid FROM {schema}.ring_groups y WHERE y.queue_id = w.queue_id) x) k
LEFT JOIN {schema}.ring_groups g ON g.queue_id = w.queue_id AND g.gid = k.gid
WHERE w.queue_id = %(queue_id)s
ORDER BY k.gid = w.queue_id DESC, g.name

-- name: ring_rows_claim_batch
-- Claim a batch of group `group`: a pop at least once of up to n messages recorded under batch_id, in the
-- caller's transaction; its ledger row (no payload), or none when nothing was taken. {fn}: the group's own
-- function for it (ring_<queue_id>_rbclaim for the default group, ring_g<n>_rbclaim for group -n; so are
-- the {fn} of the batch statements below).
SELECT r_batch, r_state, r_ids, r_deliveries, r_consumer, r_claimed_at, r_lease_until, r_finished_at, r_error
FROM {schema}.{fn}(%(batch_id)s::uuid, %(group)s::integer, %(n)s::integer, %(wait)s::boolean,
    %(visibility_timeout_s)s::float8, %(consumer)s::text)

-- name: ring_rows_get_batch
-- A batch's ledger row as it stands; with lock, its claim row locked first (ack, release and extend take
-- turns). {fn}: ring_<queue_id>_rbget.
SELECT r_batch, r_state, r_ids, r_deliveries, r_consumer, r_claimed_at, r_lease_until, r_finished_at, r_error
FROM {schema}.{fn}(%(batch_id)s::uuid, %(group)s::integer, %(lock)s::boolean)

-- name: ring_rows_set_batch
-- A batch's new state (0 claimed, 1 acked, 2 released), written as a new row. {fn}: ring_<queue_id>_rbset.
SELECT {schema}.{fn}(%(batch_id)s::uuid, %(group)s::integer, %(state)s::smallint,
    %(lease_until)s::timestamptz, %(error)s::text)

-- name: ring_rows_open_batches
-- A group's batches still claimed, oldest first. {fn}: ring_<queue_id>_rbopen.
SELECT r_batch, r_state, r_ids, r_deliveries, r_consumer, r_claimed_at, r_lease_until, r_finished_at, r_error
FROM {schema}.{fn}(%(group)s::integer, %(limit)s::integer, %(consumer_prefix)s::text)

-- name: ring_rows_purge_batches
-- Forget up to n of a group's batches finished more than older_than_s ago. {fn}: ring_<queue_id>_rbpurge.
SELECT b FROM {schema}.{fn}(%(group)s::integer, %(older_than_s)s::float8, %(n)s::integer) b

-- name: ring_rows_batch_rows
-- The messages of one batch with their payloads, numbered 1..n (ord: a Spark JDBC reader partitions on
-- it), rendered to text with its parameters for readers in other processes. {fn}: the group's own
-- function (ring_<queue_id>_rbrows), which reads each row of the batch once, in the segment of its number,
-- and gives a NULL payload for a row no longer there (its segment emptied and reused since).
SELECT r_ord AS ord, r_id AS id, r_delivery AS delivery, r_payload AS payload
FROM {schema}.{fn}(%(batch_id)s::uuid, %(group)s::integer)

-- name: ring_rows_extend
-- Push the leases of receipts out to secs from now, all or nothing: (receipts extended, their new end).
-- {fn}: ring_<queue_id>_rbextend.
SELECT r_n, r_until FROM {schema}.{fn}(%(ids)s::bigint[], %(deliveries)s::integer[], %(secs)s::float8)

-- name: ring_rows_leased
-- The messages of the receipts still holding their lease, with payloads, in id order. {fn}:
-- ring_<queue_id>_rleased.
SELECT r_id, r_attempts, r_deliveries, r_enqueued_at, r_lease_until, r_payload
FROM {schema}.{fn}(%(ids)s::bigint[], %(deliveries)s::integer[])
