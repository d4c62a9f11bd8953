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

-- name: schema_exists
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s)

-- name: create_schema
CREATE SCHEMA {schema}

-- name: schema_objects
-- Everything in the schema, as DROP SCHEMA ... CASCADE would find it: each object that a schema holds
-- depends on it (deptype 'n'). Objects that belong to another one go with their owner and are left out
-- (an identity column's sequence, a table's row type; indexes and constraints never depend on the
-- schema). kind is pg_identify_object's type ('table', 'sequence', 'function', 'view' ...).
SELECT i.type, a.object_names[array_upper(a.object_names, 1)], i.identity
FROM pg_catalog.pg_depend d
CROSS JOIN LATERAL pg_catalog.pg_identify_object(d.classid, d.objid, d.objsubid) i
CROSS JOIN LATERAL pg_catalog.pg_identify_object_as_address(d.classid, d.objid, d.objsubid) a
WHERE d.refclassid = 'pg_catalog.pg_namespace'::regclass AND d.deptype = 'n'
  AND d.refobjid = (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s)
  AND NOT EXISTS (
      SELECT 1 FROM pg_catalog.pg_depend o
      WHERE o.classid = d.classid AND o.objid = d.objid AND o.deptype IN ('a', 'i')
        AND o.refclassid = 'pg_catalog.pg_class'::regclass)
ORDER BY 1, 2

-- name: owned_ring_sequences
-- The sequences of the schema's rings (ring_create makes two a ring), by name.
SELECT c.relname
FROM {schema}.rings r
JOIN pg_catalog.pg_class c ON c.oid IN (r.push_seq, r.gap_seq)
WHERE c.relnamespace = (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s)
ORDER BY 1

-- name: owned_objects
SELECT kind, name FROM {schema}.owned_objects ORDER BY kind, name

-- name: record_owned
INSERT INTO {schema}.owned_objects (kind, name)
SELECT k, n FROM unnest(%(kinds)s::text[], %(names)s::text[]) AS o(k, n)
ON CONFLICT DO NOTHING

-- name: drop_owned_table
-- This and the next three drop one object the engine's catalogue lists, without CASCADE: when an object
-- that is not the engine's depends on it (a view over meta, a foreign key to queues), the statement
-- fails and the uninstall with it, dropping nothing.
DROP TABLE {schema}.{table}

-- name: drop_owned_sequence
DROP SEQUENCE IF EXISTS {schema}.{sequence}

-- name: drop_owned_routine
-- By name alone: if someone else added a function of the same name, the name is not unique and this
-- fails rather than choose.
DROP FUNCTION {schema}.{routine}

-- name: drop_owned_schema
DROP SCHEMA {schema}

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
       (SELECT r.capacity FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS capacity,
       (SELECT r.lanes FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS lanes
FROM {schema}.queues q WHERE name = %(name)s

-- name: list_queues
SELECT queue_id, name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
       retry_backoff_s, retry_backoff_max_s, notify, archive,
       (SELECT r.capacity FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS capacity,
       (SELECT r.lanes FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS lanes
FROM {schema}.queues q ORDER BY name

-- name: drop_queue_lock
-- A drop runs in one transaction, in four statements, each with a snapshot taken after the one before
-- finished: first the queue's push lock, exclusively (table_push() takes it shared), so it waits for the
-- pushes in progress and keeps new ones out until it commits.
SELECT pg_advisory_xact_lock(hashtext('dbqueue.queue.' || '{schema}'), %(queue_id)s)

-- name: drop_queue_messages
-- Then the queue's messages with their payloads. Rows a pop, ack, nack or claim holds are waited for,
-- so when this statement ends every transaction that finished one of them (writing a done row or a
-- batch) has committed, and the next statement sees what it wrote.
-- Payload deletes here and below match ids with = ANY (ARRAY(...)), not a join: with the statistics of
-- an empty table the planner made the join a nested loop over all of data_pkey (O(n^2): 14 s for 20k).
WITH m AS (DELETE FROM {schema}.meta WHERE queue_id = %(queue_id)s RETURNING id)
DELETE FROM {schema}.data WHERE id = ANY (ARRAY(SELECT id FROM m))

-- name: drop_queue_finished
-- Then its finished messages and their payloads. An archiver batch that holds some of them is waited
-- for, so its archive rows are committed before the last statement reads archive.
WITH f AS (DELETE FROM {schema}.done WHERE queue_id = %(queue_id)s RETURNING id)
DELETE FROM {schema}.data WHERE id = ANY (ARRAY(SELECT id FROM f))

-- name: drop_queue
WITH a AS (DELETE FROM {schema}.archive WHERE queue_id = %(queue_id)s),
     b AS (DELETE FROM {schema}.batches WHERE queue_id = %(queue_id)s)
DELETE FROM {schema}.queues WHERE queue_id = %(queue_id)s RETURNING queue_id

-- name: push
-- One round trip a batch, through table_push() (schema.sql): no row and no id when the queue was
-- dropped. notify: 0 never, 1 when the queue had no ready message before, 2 always. inline: every
-- payload fits in its meta row (at most inline_payload_bytes).
SELECT * FROM {schema}.table_push(
    %(queue_id)s::integer, %(payloads)b::bytea[], %(priority)s::smallint, %(delay_s)s::double precision,
    %(notify)s::integer, %(channel)s::text, %(inline)s::boolean)

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

-- name: ack
-- Receipt lookups (ack, nack, held_receipts, leased, extend_leases) say "lease_until > now()" and not
-- "state = 1": meta_lease_valid makes them equivalent, and leaving state = 1 out keeps the planner from
-- walking every lease through meta_leased_idx (it did, with statistics from when the queue was empty).
-- Each receipt probes meta_pkey once, from a LATERAL subquery the planner cannot flatten (FOR UPDATE or
-- OFFSET 0): a plain join of meta to the receipts became, under the statistics of a fresh queue, a
-- nested loop that compared every row with every receipt (n^2: 1.4 of 1.5 ms of an ack of 100).
-- Finish leased messages, all or nothing, in one statement, without locking them first: the receipts
-- (id, delivery) whose lease is valid name row versions by ctid, and the DELETE takes exactly those. A
-- version that a concurrent reclaim or nack replaced is not deleted (the DELETE waits for it, and the
-- new version has another ctid), so a lost lease leaves fewer rows than receipts, and then
-- receipts_not_held() raises, which rolls the whole statement back. (Locking with FOR UPDATE first
-- cost a row lock and a WAL record per message: an ack of 1000 took 12.5 ms against 7.5 ms without.)
-- Through table_ack() (schema.sql), whose plans are made once a session.
SELECT * FROM {schema}.table_ack(
    %(ids)b::bigint[], %(deliveries)b::integer[], %(queue_id)s::integer, %(archive)s::boolean)

-- name: nack
-- Return leased messages for another try after delay_s (NULL: the queue's exponential backoff,
-- backoff_s * 2^(attempts - 1) capped at backoff_max_s), or to the failed state after max_attempts;
-- all or nothing, like ack.
WITH held AS (
    SELECT h.tid
    FROM unnest(%(ids)b::bigint[], %(deliveries)b::integer[]) AS r(id, delivery)
    CROSS JOIN LATERAL (
        SELECT m.ctid AS tid FROM {schema}.meta m
        WHERE m.id = r.id AND m.deliveries = r.delivery AND m.queue_id = %(queue_id)s
          AND m.lease_until > now()
        FOR UPDATE) h
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
  AND (SELECT count(*) FROM held) = cardinality(%(ids)b::bigint[])
RETURNING m.id, m.state

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
       coalesce(m.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id)) AS payload
FROM {schema}.meta m
WHERE m.queue_id = %(queue_id)s AND m.state = 0 AND m.process_at <= now()
ORDER BY m.priority DESC, m.process_at, m.id
LIMIT %(n)s

-- name: count_ready
-- Messages a pop could take now, of at least min_priority, counted up to a cap (a sensor needs "at
-- least k", not a total): those ready, and those whose lease expired with attempts left, which a pop
-- reclaims first (back to ready in their place). An expired lease out of attempts goes to failed.
SELECT count(*) FROM (
    (SELECT 1 FROM {schema}.meta
     WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now() AND priority >= %(min_priority)s
     LIMIT %(cap)s)
    UNION ALL
    (SELECT 1 FROM {schema}.meta
     WHERE queue_id = %(queue_id)s AND state = 1 AND lease_until <= now() AND attempts < %(max_attempts)s
       AND priority >= %(min_priority)s
     LIMIT %(cap)s)
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
       coalesce(m.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id)) AS payload
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
    RETURNING id, queue_id, priority, attempts, enqueued_at, payload
), kept AS (
    INSERT INTO {schema}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload)
    SELECT id, queue_id, priority, attempts, enqueued_at, 2, payload FROM gone WHERE %(archive)s
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
           AND priority >= %(min_priority)s
         LIMIT %(cap)s)
        UNION ALL
        (SELECT 1 FROM {schema}.meta
         WHERE queue_id = %(queue_id)s AND state = 1 AND lease_until <= now()
           AND attempts < %(max_attempts)s AND priority >= %(min_priority)s
         LIMIT %(cap)s)
        LIMIT %(cap)s) s) r
LEFT JOIN LATERAL (
    SELECT c.id, c.deliveries FROM (
        (SELECT id, deliveries, priority, process_at FROM {schema}.meta
         WHERE queue_id = %(queue_id)s AND state = 0 AND process_at <= now()
         ORDER BY priority DESC, process_at, id
         LIMIT 1)
        UNION ALL
        (SELECT id, deliveries, priority, process_at FROM {schema}.meta
         WHERE queue_id = %(queue_id)s AND state = 1 AND lease_until <= now() AND attempts < %(max_attempts)s
         ORDER BY priority DESC, process_at, id
         LIMIT 1)) c
    ORDER BY c.priority DESC, c.process_at, c.id
    LIMIT 1) h ON true

-- name: leased
-- The leased messages of the given receipts (id, delivery) whose lease is still held, with payloads:
-- a task that was handed only receipts (through XCom) reads its batch here.
SELECT m.id, m.priority, m.attempts, m.deliveries, m.enqueued_at, m.lease_until,
       coalesce(m.payload, (SELECT d.payload FROM {schema}.data d WHERE d.id = m.id)) AS payload
FROM unnest(%(ids)b::bigint[], %(deliveries)b::integer[]) AS r(id, delivery)
CROSS JOIN LATERAL (
    SELECT * FROM {schema}.meta m
    WHERE m.id = r.id AND m.deliveries = r.delivery AND m.queue_id = %(queue_id)s AND m.lease_until > now()
    OFFSET 0) m
ORDER BY m.priority DESC, m.process_at, m.id

-- name: extend_leases
-- Push the lease of held receipts out to now() + secs (a long job keeps its claim); all or nothing.
WITH held AS (
    SELECT h.tid
    FROM unnest(%(ids)b::bigint[], %(deliveries)b::integer[]) AS r(id, delivery)
    CROSS JOIN LATERAL (
        SELECT m.ctid AS tid FROM {schema}.meta m
        WHERE m.id = r.id AND m.deliveries = r.delivery AND m.queue_id = %(queue_id)s
          AND m.lease_until > now()
        FOR UPDATE) h
)
UPDATE {schema}.meta m
SET lease_until = now() + make_interval(secs => %(secs)s)
WHERE m.ctid = ANY (ARRAY(SELECT tid FROM held))
  AND (SELECT count(*) FROM held) = cardinality(%(ids)b::bigint[])
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
SELECT r.ord, r.id, r.delivery,
       coalesce((SELECT m.payload FROM {schema}.meta m WHERE m.id = r.id),
                (SELECT d.payload FROM {schema}.data d WHERE d.id = r.id)) AS payload
FROM {schema}.batches b
CROSS JOIN LATERAL unnest(b.ids, b.deliveries) WITH ORDINALITY AS r(id, delivery, ord)
WHERE b.batch_id = %(batch_id)s AND b.queue_id = %(queue_id)s
-- name: maintenance_try_lock
-- Maintenance (engine/maintenance/, and this dialect's maintenance.py) from here on.
-- One maintenance run a schema at a time: a session-level advisory lock on the run's own connection.
SELECT pg_try_advisory_lock(hashtext('dbqueue.maintenance'), hashtext(%(schema)s))

-- name: maintenance_unlock
SELECT pg_advisory_unlock(hashtext('dbqueue.maintenance'), hashtext(%(schema)s))

-- name: maintenance_lock_holder
-- Who holds a schema's maintenance lock (for the log line of a run that skips or waits).
SELECT a.pid, a.application_name, a.client_addr::text,
       extract(epoch FROM now() - a.backend_start)::float8 AS connected_s, a.state
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = hashtext('dbqueue.maintenance')::oid AND l.objid = hashtext(%(schema)s)::oid

-- name: set_timeouts
-- statement_timeout and lock_timeout in milliseconds (as text); local = true: for this transaction only.
SELECT set_config('statement_timeout', %(statement_ms)s, %(local)s),
       set_config('lock_timeout', %(lock_ms)s, %(local)s)

-- name: reset_timeouts
-- Back to the session's defaults after set_timeouts with local = false.
SELECT set_config(name, reset_val, false) FROM pg_settings WHERE name IN ('statement_timeout', 'lock_timeout')

-- name: archive_batch
-- Continuous archiving, one bounded batch a statement: up to n finished messages older than
-- older_than_s move from done (their payloads from data) into archive. Rows another session holds are
-- skipped, so the statement never waits on a row, and it touches no row that push, pop or ack use.
-- Payloads are matched by id = ANY (ARRAY(...)), not a join (see drop_queue); a done row whose payload
-- is missing is archived with an empty payload rather than lost. A done row of a queue that no longer
-- exists is deleted with its payload, not archived: nothing is archived for a dropped queue. (drop_queue
-- waits for a batch holding its queue's rows, and deletes its archive rows after; such rows come only
-- from older versions.) Returns (rows taken, rows archived).
WITH batch AS (
    DELETE FROM {schema}.done d
    WHERE d.ctid = ANY (ARRAY(
        SELECT ctid FROM {schema}.done
        WHERE finished_at < now() - make_interval(secs => %(older_than_s)s)
          AND (%(all_queues)s OR queue_id = ANY (%(queue_ids)s::integer[]))
        LIMIT %(n)s
        FOR UPDATE SKIP LOCKED))
    RETURNING d.id, d.queue_id, d.priority, d.attempts, d.enqueued_at, d.finished_at, d.outcome, d.payload
), payloads AS (
    DELETE FROM {schema}.data x WHERE x.id = ANY (ARRAY(SELECT id FROM batch WHERE payload IS NULL))
    RETURNING x.id, x.payload
), moved AS (
    INSERT INTO {schema}.archive (id, queue_id, priority, attempts, enqueued_at, finished_at, outcome, payload)
    SELECT b.id, b.queue_id, b.priority, b.attempts, b.enqueued_at, b.finished_at, b.outcome,
           coalesce(b.payload, p.payload, '\x'::bytea)
    FROM batch b LEFT JOIN payloads p ON p.id = b.id
    WHERE EXISTS (SELECT 1 FROM {schema}.queues q WHERE q.queue_id = b.queue_id)
    RETURNING id
)
SELECT (SELECT count(*) FROM batch), (SELECT count(*) FROM moved)

-- name: purge_archive_batch
-- Archive retention, one bounded batch a statement: delete up to n archived messages older than
-- older_than_s (by archived_at, which the BRIN index archive_archived_brin covers).
WITH gone AS (
    DELETE FROM {schema}.archive a
    WHERE a.ctid = ANY (ARRAY(
        SELECT ctid FROM {schema}.archive
        WHERE archived_at < now() - make_interval(secs => %(older_than_s)s)
          AND (%(all_queues)s OR queue_id = ANY (%(queue_ids)s::integer[]))
        LIMIT %(n)s
        FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT count(*) FROM gone

-- name: vacuum_table
-- This and the next three take a table or index name as an identifier placeholder, composed and quoted
-- like the schema's (after validation): utility statements take no bound parameters.
VACUUM (ANALYZE, SKIP_LOCKED) {schema}.{table}

-- name: analyze_table
ANALYZE (SKIP_LOCKED) {schema}.{table}

-- name: vacuum_full_table
-- A rewrite of the table into new files holding only its live rows, under an ACCESS EXCLUSIVE lock
-- for its whole run (Maintenance.compact_rings).
VACUUM (FULL, ANALYZE) {schema}.{table}

-- name: compact_relation_size
SELECT pg_relation_size(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relname = %(table)s

-- name: compact_ring_layouts
-- Each ring's capacity and the payload size its slots were laid out for (its queue's max_payload_bytes).
SELECT r.queue_id, r.capacity, q.max_payload_bytes
FROM {schema}.rings r JOIN {schema}.queues q ON q.queue_id = r.queue_id

-- name: compact_ring_tables
-- The heap size, fillfactor and live bytes (each live row's size plus its page line pointer and header
-- overhead) of the ring's tables.
SELECT t.name, pg_relation_size(c.oid),
       coalesce((SELECT substring(o from 'fillfactor=([0-9]+)')::integer FROM unnest(c.reloptions) AS o
                 WHERE o LIKE 'fillfactor=%%'), 100),
       t.live
FROM (SELECT 'ring_slots' AS name, NULL::bigint AS live
      UNION ALL SELECT 'ring_lanes', (SELECT coalesce(sum(pg_column_size(x.*) + 28), 0) FROM {schema}.ring_lanes x)
      UNION ALL SELECT 'ring_leases', (SELECT coalesce(sum(pg_column_size(x.*) + 28), 0) FROM {schema}.ring_leases x)
      UNION ALL SELECT 'ring_retry', (SELECT coalesce(sum(pg_column_size(x.*) + 28), 0) FROM {schema}.ring_retry x)) t
JOIN pg_class c ON c.relname = t.name AND c.relkind = 'r'
JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = %(schema)s

-- name: reindex_concurrently
REINDEX INDEX CONCURRENTLY {schema}.{index}

-- name: drop_index_concurrently
DROP INDEX CONCURRENTLY IF EXISTS {schema}.{index}

-- name: index_health
-- Every index of the schema with what a bloat estimate needs: its size, entries (reltuples, from the
-- last VACUUM or ANALYZE; -1 when never counted), the summed width of its key columns (fixed-width types
-- by their length, others by the column statistics' average width), its fillfactor and the page size;
-- and whether an index build is running on its table right now (never touch a build in progress).
SELECT ic.relname, t.relname, am.amname, i.indisvalid, pg_relation_size(ic.oid), ic.reltuples::float8,
       (SELECT coalesce(sum(coalesce(nullif(a.attlen, -1)::integer, s.avg_width, 32)), 0)::integer
          FROM unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) AS k(attnum)
          JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
          LEFT JOIN pg_stats s ON s.schemaname = n.nspname AND s.tablename = t.relname
                              AND s.attname = a.attname) AS key_width,
       coalesce((SELECT split_part(o, '=', 2)::integer FROM unnest(ic.reloptions) AS o
                  WHERE o LIKE 'fillfactor=%%'), 90) AS fillfactor,
       current_setting('block_size')::integer,
       EXISTS (SELECT 1 FROM pg_stat_progress_create_index p WHERE p.relid = t.oid) AS build_running
FROM pg_index i
JOIN pg_class ic ON ic.oid = i.indexrelid
JOIN pg_class t ON t.oid = i.indrelid
JOIN pg_namespace n ON n.oid = t.relnamespace
JOIN pg_am am ON am.oid = ic.relam
WHERE n.nspname = %(schema)s
ORDER BY t.relname, ic.relname

-- name: table_health
-- Size and vacuum state of every table of the schema.
SELECT c.relname, pg_relation_size(c.oid), pg_indexes_size(c.oid), pg_total_relation_size(c.oid),
       coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0),
       greatest(s.last_vacuum, s.last_autovacuum), greatest(s.last_analyze, s.last_autoanalyze),
       coalesce(s.autovacuum_count, 0), coalesce(s.vacuum_count, 0)
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE n.nspname = %(schema)s AND c.relkind = 'r'
ORDER BY c.relname

-- name: xmin_holders
-- What holds back the xmin horizon (so VACUUM cannot remove dead rows anywhere in the database): open
-- transactions older than min_age_s, replication slots holding an xmin more than min_xid_age
-- transactions old, and prepared transactions older than min_age_s.
SELECT 'transaction' AS kind, a.pid, coalesce(a.application_name, '') AS name, a.usename::text,
       a.state, extract(epoch FROM now() - a.xact_start)::float8 AS age_s,
       greatest(age(a.backend_xmin), age(a.backend_xid)) AS xid_age,
       a.xact_start, a.query_start, left(a.query, 200) AS query
FROM pg_stat_activity a
WHERE a.pid <> pg_backend_pid() AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
  AND a.xact_start < now() - make_interval(secs => %(min_age_s)s)
UNION ALL
SELECT 'replication slot', r.active_pid, r.slot_name::text, NULL, CASE WHEN r.active THEN 'active' ELSE 'inactive' END,
       NULL, greatest(age(r.xmin), age(r.catalog_xmin)), NULL, NULL, r.slot_type
FROM pg_replication_slots r
WHERE greatest(age(r.xmin), age(r.catalog_xmin)) > %(min_xid_age)s
UNION ALL
SELECT 'prepared transaction', NULL, p.gid, p.owner::text, p.database::text,
       extract(epoch FROM now() - p.prepared)::float8, age(p.transaction), p.prepared, NULL, NULL
FROM pg_prepared_xacts p
WHERE p.prepared < now() - make_interval(secs => %(min_age_s)s)
ORDER BY 7 DESC NULLS LAST

-- name: queue_rates
-- Messages pushed and finished in the last window_s seconds, counted from the tables: a message
-- pushed in the window is in meta, done or archive with a recent enqueued_at (finished_at and
-- archived_at are later still, which lets the BRIN indexes of done and archive narrow the scans).
-- Queues that do not archive delete finished messages, so only their pushes still waiting are seen.
WITH w AS (SELECT now() - make_interval(secs => %(window_s)s) AS since)
SELECT
    (SELECT count(*) FROM {schema}.meta, w WHERE queue_id = %(queue_id)s AND enqueued_at > w.since)
    + (SELECT count(*) FROM {schema}.done, w
        WHERE queue_id = %(queue_id)s AND finished_at > w.since AND enqueued_at > w.since)
    + (SELECT count(*) FROM {schema}.archive, w
        WHERE queue_id = %(queue_id)s AND archived_at > w.since AND enqueued_at > w.since) AS pushed,
    (SELECT count(*) FROM {schema}.done, w
      WHERE queue_id = %(queue_id)s AND finished_at > w.since AND outcome = 1)
    + (SELECT count(*) FROM {schema}.archive, w
        WHERE queue_id = %(queue_id)s AND archived_at > w.since AND finished_at > w.since AND outcome = 1)
      AS finished

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
SELECT {schema}.ring_push(
    %(queue_id)s::integer, %(capacity)s::integer, %(payloads)b::bytea[], %(timeout_s)s::float8,
    %(notify)s::integer, %(channel)s, %(first)s::bigint)

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

-- name: ring_take_lease
-- ring_take at least once: its rows are ring_pop's messages, leased until r_lease_until.
SELECT r_id, r_attempts, r_deliveries, r_enqueued_at, r_lease_until, r_payload
FROM {schema}.ring_take(
    %(queue_id)s::integer, %(capacity)s::integer, %(lanes)s::integer, %(n)s::integer, %(lease)s::boolean,
    %(visibility_timeout_s)s::float8, %(consumer)s::text, true, %(wait)s::boolean)

-- name: ring_pop
-- Rows come back in binary (statements.BINARY_RESULTS): the holders (xid[]) as text.
SELECT r_id, r_attempts, r_deliveries, r_enqueued_at, r_lease_until, r_payload, r_gap, r_issued, r_snap::text
FROM {schema}.ring_pop(
    %(queue_id)s::integer, %(capacity)s::integer, %(lanes)s::integer, %(n)s::integer, %(lease)s::boolean,
    %(visibility_timeout_s)s::float8, %(consumer)s::text, %(own)s::boolean,
    %(gap)s::bigint, %(gap_issued)s::bigint, %(gap_snap)s::xid[], %(force)s::boolean)

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
-- The ack of whole leases, the usual one: receipts naming every message of one ring_leases row or
-- more (first deliveries; a pop writes one row, or two when it ran past the end of the ring's slots),
-- in one statement. A candidate lease lies within the receipts' range and is whole when as many
-- receipts fall in its range and lanes as it holds messages; the leases are deleted only when the
-- whole ones hold every receipt (each message is in one lease at most). Rows: the n of each lease
-- deleted, none otherwise (the caller settles the receipts with ring_settle).
WITH r AS (
    SELECT min(u.id) AS lo, max(u.id) AS hi, count(*) AS n, bool_and(u.d = 1) AS first
    FROM unnest(%(ids)b::bigint[], %(deliveries)b::integer[]) AS u(id, d)
), c AS (
    SELECT e.ctid AS tid, e.n
    FROM {schema}.ring_leases e, r
    WHERE e.queue_id = %(group)s AND e.lo >= r.lo AND e.lo <= r.hi AND e.hi <= r.hi AND r.first
      AND e.lease_until > now()
      AND (SELECT count(*) FROM unnest(%(ids)b::bigint[]) AS i(id)
           WHERE i.id BETWEEN e.lo AND e.hi AND e.starts[mod(i.id, %(lanes)s)::integer + 1] <= i.id) = e.n
    FOR UPDATE OF e
)
DELETE FROM {schema}.ring_leases e
WHERE e.ctid = ANY (ARRAY(SELECT tid FROM c)) AND (SELECT sum(n) FROM c) = (SELECT n FROM r)
RETURNING e.n

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
-- What pops would take first: the messages due again, then the lanes', each in id order.
SELECT r_id, r_attempts, r_deliveries, r_enqueued_at, NULL::timestamptz AS lease_until, r_payload
FROM {schema}.ring_ready(%(queue_id)s::integer, %(group)s::integer)
WHERE r_due <= now()
ORDER BY r_attempts = 0, r_id
LIMIT %(n)s

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
    h.r_id AS head_id, h.r_deliveries AS head_deliveries
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
-- numbers given up as gaps.
WITH rd AS MATERIALIZED (
    SELECT r_enqueued_at, r_due FROM {schema}.ring_ready(%(queue_id)s::integer, %(group)s::integer)
), g AS (
    SELECT r.lanes, coalesce(pg_sequence_last_value(r.push_seq), 0) AS issued,
           coalesce(pg_sequence_last_value(r.gap_seq), 0) AS gaps
    FROM {schema}.rings r WHERE r.queue_id = %(queue_id)s
)
SELECT (SELECT count(*) FROM rd WHERE r_due <= now()) AS ready,
       (SELECT count(*) FROM rd WHERE r_due > now()) AS delayed,
       (SELECT coalesce(sum(e.n), 0) FROM {schema}.ring_leases e WHERE e.queue_id = %(group)s)
       + (SELECT count(*) FROM {schema}.ring_retry t WHERE t.queue_id = %(group)s AND t.state = 2)
           AS in_flight,
       (SELECT count(*) FROM {schema}.ring_failed f WHERE f.queue_id = %(group)s) AS failed,
       extract(epoch FROM now() - (SELECT min(r_enqueued_at) FROM rd WHERE r_due <= now()))::float8
           AS oldest_ready_age_s,
       g.issued AS push_position,
       (SELECT min(l.pos) FROM {schema}.ring_lanes l WHERE l.queue_id = %(group)s) AS pop_position,
       {schema}.ring_floor(%(queue_id)s::integer) AS floor,
       g.gaps AS gaps_skipped,
       g.lanes
FROM g

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
