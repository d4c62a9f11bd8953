-- Named queries of the PostgreSQL dialect. {schema} is the quoted schema name; every value is a
-- bound parameter (%(name)s). The SQL Server dialect keeps the same names.
-- This file: the schema (install, versions, owned objects) and the queues themselves (create, look up, drop). The folder's other files hold the rest, by concern.

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
-- schema; a partition goes with its partitioned table). A partitioned table's internal dependency on
-- itself (its partition key) does not make it belong to another object. kind is pg_identify_object's
-- type ('table', 'sequence', 'function', 'view' ...).
SELECT i.type, a.object_names[array_upper(a.object_names, 1)], i.identity
FROM pg_catalog.pg_depend d
CROSS JOIN LATERAL pg_catalog.pg_identify_object(d.classid, d.objid, d.objsubid) i
CROSS JOIN LATERAL pg_catalog.pg_identify_object_as_address(d.classid, d.objid, d.objsubid) a
WHERE d.refclassid = 'pg_catalog.pg_namespace'::regclass AND d.deptype = 'n'
  AND d.refobjid = (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s)
  AND NOT EXISTS (
      SELECT 1 FROM pg_catalog.pg_depend o
      WHERE o.classid = d.classid AND o.objid = d.objid AND o.deptype IN ('a', 'i')
        AND o.refclassid = 'pg_catalog.pg_class'::regclass AND o.refobjid <> d.objid)
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

-- name: functions_applied
-- The SHA-256 of the functions.sql that install() last applied.
SELECT name FROM {schema}.owned_objects WHERE kind = 'functions'

-- name: forget_owned
DELETE FROM {schema}.owned_objects WHERE kind = %(kind)s AND name = %(name)s

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
    retry_backoff_s, retry_backoff_max_s, notify, archive, dedup_window_s, ttl_s, on_expiry, ordering)
VALUES (
    %(name)s, %(design)s, %(payload_type)s, %(max_payload_bytes)s, %(max_attempts)s,
    %(visibility_timeout_s)s, %(retry_backoff_s)s, %(retry_backoff_max_s)s, %(notify)s, %(archive)s,
    %(dedup_window_s)s, %(ttl_s)s, %(on_expiry)s, %(ordering)s)
ON CONFLICT (name) DO NOTHING
RETURNING queue_id

-- name: table_make_floor
-- A new table-design queue's floor sequence (functions.sql's table_make_floor), in the transaction that
-- inserts its row.
SELECT {schema}.table_make_floor(%(queue_id)s::integer)

-- name: get_queue
SELECT queue_id, name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
       retry_backoff_s, retry_backoff_max_s, notify, archive,
       coalesce((SELECT r.capacity FROM {schema}.rings r WHERE r.queue_id = q.queue_id),
                (SELECT w.capacity FROM {schema}.ring_rows w WHERE w.queue_id = q.queue_id)) AS capacity,
       coalesce((SELECT r.lanes FROM {schema}.rings r WHERE r.queue_id = q.queue_id),
                (SELECT w.lanes FROM {schema}.ring_rows w WHERE w.queue_id = q.queue_id)) AS lanes,
       dedup_window_s, ttl_s, on_expiry, ordering,
       CASE WHEN q.design <> 'ring' THEN NULL
            WHEN EXISTS (SELECT 1 FROM {schema}.ring_rows w WHERE w.queue_id = q.queue_id) THEN 'rows'
            ELSE 'slots' END AS layout,
       {schema}.actions_on(q.queue_id, current_user) AS actions
FROM {schema}.queues q WHERE name = %(name)s

-- name: list_queues
SELECT queue_id, name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
       retry_backoff_s, retry_backoff_max_s, notify, archive,
       coalesce((SELECT r.capacity FROM {schema}.rings r WHERE r.queue_id = q.queue_id),
                (SELECT w.capacity FROM {schema}.ring_rows w WHERE w.queue_id = q.queue_id)) AS capacity,
       coalesce((SELECT r.lanes FROM {schema}.rings r WHERE r.queue_id = q.queue_id),
                (SELECT w.lanes FROM {schema}.ring_rows w WHERE w.queue_id = q.queue_id)) AS lanes,
       dedup_window_s, ttl_s, on_expiry, ordering,
       CASE WHEN q.design <> 'ring' THEN NULL
            WHEN EXISTS (SELECT 1 FROM {schema}.ring_rows w WHERE w.queue_id = q.queue_id) THEN 'rows'
            ELSE 'slots' END AS layout
FROM {schema}.queues q ORDER BY name

-- name: drop_queue_lock
-- A drop runs in one transaction, in four statements, each with a snapshot taken after the one before
-- finished: first the queue's push lock, exclusively (table_push() takes it shared), so it waits for the
-- pushes in progress and keeps new ones out until it commits.
SELECT pg_advisory_xact_lock(hashtext('dbqueue.queue.' || '{schema}'), %(queue_id)s)

-- name: drop_queue_messages
-- Then the queue's messages with their payloads (and the meta_opt rows of those with a ttl or a key). Rows a pop, ack, nack or claim holds are waited for,
-- so when this statement ends every transaction that finished one of them (writing a done row or a
-- batch) has committed, and the next statement sees what it wrote.
-- Payload deletes here and below match ids with = ANY (ARRAY(...)), not a join: with the statistics of
-- an empty table the planner made the join a nested loop over all of data_pkey (O(n^2): 14 s for 20k).
WITH m AS (DELETE FROM {schema}.meta WHERE queue_id = %(queue_id)s RETURNING id),
o AS (DELETE FROM {schema}.meta_opt WHERE queue_id = %(queue_id)s)
DELETE FROM {schema}.data WHERE id = ANY (ARRAY(SELECT id FROM m))

-- name: drop_queue_finished
-- Then its finished messages and their payloads. An archiver batch that holds some of them is waited
-- for, so its archive rows are committed before the last statement reads archive.
WITH f AS (DELETE FROM {schema}.done WHERE queue_id = %(queue_id)s RETURNING id)
DELETE FROM {schema}.data WHERE id = ANY (ARRAY(SELECT id FROM f))

-- name: drop_queue
WITH a AS (DELETE FROM {schema}.archive WHERE queue_id = %(queue_id)s),
     b AS (DELETE FROM {schema}.batches WHERE queue_id = %(queue_id)s),
     k AS (DELETE FROM {schema}.dedup WHERE queue_id = %(queue_id)s)
DELETE FROM {schema}.queues WHERE queue_id = %(queue_id)s RETURNING queue_id

-- name: role_exists
SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = %(role)s

-- name: grants_add
-- Record what a role may do (queue_id NULL: every queue); returns the rows it added.
INSERT INTO {schema}.grants (role, queue_id, action)
SELECT %(role)s, %(queue_id)s::integer, a FROM unnest(%(actions)s::text[]) a
ON CONFLICT DO NOTHING
RETURNING action

-- name: grants_remove
DELETE FROM {schema}.grants
WHERE role = %(role)s AND queue_id IS NOT DISTINCT FROM %(queue_id)s::integer AND action = ANY (%(actions)s::text[])
RETURNING action

-- name: grants_list
-- Every grant: (role, queue name or NULL for every queue, action).
SELECT g.role, q.name, g.action
FROM {schema}.grants g LEFT JOIN {schema}.queues q ON q.queue_id = g.queue_id
ORDER BY g.role, q.name NULLS FIRST, g.action

-- name: grants_of_role
SELECT count(*) FROM {schema}.grants WHERE role = %(role)s

-- name: grants_roles_of_queue
-- The roles that hold an action on a queue (or on every queue): a new ring's sequences go to them.
SELECT {schema}.grantees(%(queue_id)s::integer)

-- name: actions_on
-- What the session's role may do to a queue (NULL: to every queue).
SELECT {schema}.actions_on(%(queue_id)s::integer, current_user)

-- name: ring_sequences_of
-- The rings' sequences (two a ring, in the schema), by name.
SELECT c.relname
FROM {schema}.rings r JOIN pg_catalog.pg_class c ON c.oid IN (r.push_seq, r.gap_seq)
WHERE r.queue_id = ANY (%(queue_ids)s::integer[])

-- name: ring_rows_objects_of
-- The own tables, views and sequences of the rings of the rows layout among queue_ids (every one when
-- NULL) and of their consumer groups: (queue_id, name, kind 'r'/'v'/'S', what: the name past the prefix
-- of the ring or group, e.g. q0, pos2, b, rows, posgen).
SELECT w.queue_id, c.relname, c.relkind::text, substr(c.relname, length(o.p) + 1)
FROM {schema}.ring_rows w
CROSS JOIN LATERAL (
    SELECT {schema}.ring_rows_own(w.queue_id) AS p
    UNION ALL
    SELECT {schema}.ring_rows_own(g.gid) FROM {schema}.ring_groups g WHERE g.queue_id = w.queue_id) o
JOIN pg_catalog.pg_class c ON left(c.relname, length(o.p)) = o.p AND c.relkind IN ('r', 'v', 'S')
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace AND n.nspname = %(schema)s
WHERE %(queue_ids)s::integer[] IS NULL OR w.queue_id = ANY (%(queue_ids)s::integer[])
ORDER BY 1, 2

-- name: role_actions_on
-- What role p_role may do to each of queues queue_ids: (queue_id, actions).
SELECT q, {schema}.actions_on(q, %(role)s) FROM unnest(%(queue_ids)s::integer[]) q

-- name: owned_tables
-- The engine's tables of this schema, by name (its catalogue).
SELECT name FROM {schema}.owned_objects WHERE kind = 'table' ORDER BY name

-- name: server_version_num
SELECT current_setting('server_version_num')::integer

-- name: list_ring_ids
SELECT queue_id FROM {schema}.rings ORDER BY queue_id

-- name: sees_all_activity
-- Whether the session's role sees every session's transaction in pg_stat_activity.
SELECT pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')
    OR (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname = current_user)
