-- Named queries of the SQL Server dialect, under the names of the PostgreSQL dialect (a test checks the
-- parity; dialect.POSTGRES_ONLY names those this dialect has no use for). {schema} is the bracket-quoted schema
-- name; values are bound parameters, written %(name)s as on PostgreSQL and sent to pyodbc as ? in order.
-- Each named query runs as one transaction (or inside the caller's), with XACT_ABORT ON: an error rolls
-- all of it back. A batch of several statements starts with SET NOCOUNT ON so that only its last
-- SELECT returns rows. Lists (receipts, payloads) arrive as JSON arrays read with OPENJSON, whose [key]
-- is the element's position. Times are UTC datetime2(6).
-- This file: the schema (install, versions, owned objects) and the queues themselves (create, look up, drop). The folder's other files hold the rest, by concern.

-- name: install_lock
-- Held until the install transaction ends; concurrent installs of one schema queue up here.
EXEC sys.sp_getapplock @Resource = %(schema)s, @LockMode = 'Exclusive', @LockOwner = 'Transaction'

-- name: schema_installed
SELECT CASE WHEN OBJECT_ID(QUOTENAME(%(schema)s) + N'.schema_version', N'U') IS NULL THEN 0 ELSE 1 END

-- name: schema_version
SELECT coalesce(max(version), 0) FROM {schema}.schema_version

-- name: record_version
INSERT INTO {schema}.schema_version (version)
SELECT %(version)s WHERE NOT EXISTS (SELECT 1 FROM {schema}.schema_version WHERE version = %(version)s)

-- name: schema_exists
SELECT CASE WHEN SCHEMA_ID(%(schema)s) IS NULL THEN 0 ELSE 1 END

-- name: create_schema
-- CREATE SCHEMA must be alone in its batch, hence sp_executesql.
EXEC sys.sp_executesql N'CREATE SCHEMA {schema}'

-- name: schema_objects
-- Everything in the schema that DROP SCHEMA would refuse to leave: objects with no parent (constraints
-- and triggers belong to their table), user-defined types and XML schema collections. kind is 'table',
-- 'sequence', 'procedure', 'function', 'view', or SQL Server's own description in lower case.
SELECT CASE o.type WHEN 'U' THEN 'table' WHEN 'SO' THEN 'sequence' WHEN 'P' THEN 'procedure'
                   WHEN 'FN' THEN 'function' WHEN 'IF' THEN 'function' WHEN 'TF' THEN 'function'
                   WHEN 'V' THEN 'view' ELSE lower(o.type_desc) END AS kind,
       o.name, QUOTENAME(s.name) + N'.' + QUOTENAME(o.name) AS identity
FROM sys.objects o JOIN sys.schemas s ON s.schema_id = o.schema_id
WHERE s.name = %(schema)s AND o.parent_object_id = 0
UNION ALL
SELECT 'type', t.name, QUOTENAME(s.name) + N'.' + QUOTENAME(t.name)
FROM sys.types t JOIN sys.schemas s ON s.schema_id = t.schema_id
WHERE s.name = %(schema)s AND t.is_user_defined = 1 AND t.is_table_type = 0
UNION ALL
SELECT 'xml schema collection', x.name, QUOTENAME(s.name) + N'.' + QUOTENAME(x.name)
FROM sys.xml_schema_collections x JOIN sys.schemas s ON s.schema_id = x.schema_id
WHERE s.name = %(schema)s
ORDER BY 1, 2

-- name: owned_ring_sequences
-- The sequences of the schema's rings (ring_create makes two a ring), by name.
SELECT o.name
FROM {schema}.rings r
JOIN sys.objects o ON o.object_id IN (r.push_seq_id, r.gap_seq_id)
WHERE o.schema_id = SCHEMA_ID(%(schema)s)
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
SELECT k.[value], n.[value]
FROM OPENJSON(%(kinds)s) k
JOIN OPENJSON(%(names)s) n ON n.[key] = k.[key]
WHERE NOT EXISTS (SELECT 1 FROM {schema}.owned_objects w WHERE w.kind = k.[value] AND w.name = n.[value])

-- name: drop_owned_table
-- This and the next three drop one object the engine's catalogue lists. SQL Server drops a table under
-- a view or function that refers to it without schema binding, so those (and foreign keys from other
-- tables) are looked for first: if anything outside the engine's own objects refers to the table, the
-- statement raises [DQ006] and the uninstall fails whole, dropping nothing. The engine's procedures and
-- functions are dropped before its tables.
SET NOCOUNT ON;
DECLARE @found nvarchar(max) = N'';
SELECT @found = @found + N'; ' + QUOTENAME(OBJECT_SCHEMA_NAME(d.referencing_id)) + N'.'
    + QUOTENAME(OBJECT_NAME(d.referencing_id))
FROM sys.sql_expression_dependencies d
WHERE d.referenced_id = OBJECT_ID(N'{schema}.{table}') AND d.referencing_id <> d.referenced_id;
SELECT @found = @found + N'; ' + QUOTENAME(OBJECT_SCHEMA_NAME(f.parent_object_id)) + N'.'
    + QUOTENAME(OBJECT_NAME(f.parent_object_id)) + N' (foreign key ' + QUOTENAME(f.name) + N')'
FROM sys.foreign_keys f
WHERE f.referenced_object_id = OBJECT_ID(N'{schema}.{table}') AND f.parent_object_id <> f.referenced_object_id;
IF @found = N''
    DROP TABLE {schema}.{table};
ELSE
    RAISERROR (N'[DQ006] objects that are not the engine''s refer to %s: %s; nothing was dropped', 16, 1,
        N'{schema}.{table}', @found);

-- name: drop_owned_sequence
DROP SEQUENCE IF EXISTS {schema}.{sequence}

-- name: drop_owned_routine
-- A stored procedure, or a function (the ring's inline table-valued functions), by what it is.
IF OBJECT_ID(N'{schema}.{routine}', N'P') IS NOT NULL
    DROP PROCEDURE {schema}.{routine};
ELSE
    DROP FUNCTION {schema}.{routine};

-- name: drop_owned_schema
-- DROP SCHEMA refuses a schema that still holds anything.
DROP SCHEMA {schema}

-- name: create_queue
-- UPDLOCK, HOLDLOCK on the name: two concurrent creates of one queue serialize instead of failing.
INSERT INTO {schema}.queues (
    name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
    retry_backoff_s, retry_backoff_max_s, notify, archive, dedup_window_s, ttl_s, on_expiry, ordering)
OUTPUT inserted.queue_id
SELECT %(name)s, %(design)s, %(payload_type)s, %(max_payload_bytes)s, %(max_attempts)s,
       %(visibility_timeout_s)s, %(retry_backoff_s)s, %(retry_backoff_max_s)s, %(notify)s, %(archive)s,
       %(dedup_window_s)s, %(ttl_s)s, %(on_expiry)s, %(ordering)s
WHERE NOT EXISTS (SELECT 1 FROM {schema}.queues WITH (UPDLOCK, HOLDLOCK) WHERE name = %(name)s)

-- name: get_queue
-- The columns of client._SETTINGS_COLUMNS, in order (a unit test checks both dialects).
SELECT queue_id, name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
       retry_backoff_s, retry_backoff_max_s, notify, archive,
       (SELECT r.capacity FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS capacity,
       (SELECT r.lanes FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS lanes,
       dedup_window_s, ttl_s, on_expiry, ordering,
       CASE WHEN q.design = 'ring' THEN 'slots' END AS layout
FROM {schema}.queues q WHERE name = %(name)s

-- name: list_queues
SELECT queue_id, name, design, payload_type, max_payload_bytes, max_attempts, visibility_timeout_s,
       retry_backoff_s, retry_backoff_max_s, notify, archive,
       (SELECT r.capacity FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS capacity,
       (SELECT r.lanes FROM {schema}.rings r WHERE r.queue_id = q.queue_id) AS lanes,
       dedup_window_s, ttl_s, on_expiry, ordering,
       CASE WHEN q.design = 'ring' THEN 'slots' END AS layout
FROM {schema}.queues q ORDER BY name

-- name: drop_queue_lock
-- A drop runs in one transaction, in four statements, as on PostgreSQL: first the queue's push lock,
-- exclusively (a push takes it shared), so it waits for the pushes in progress and keeps new ones out
-- until it commits.
SET NOCOUNT ON;
DECLARE @resource nvarchar(255) = N'dbqueue.queue.{schema}.' + CAST(%(queue_id)s AS nvarchar(11));
DECLARE @locked int;
EXEC @locked = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Transaction',
    @LockTimeout = -1;
IF @locked < 0
    RAISERROR (N'[DQ007] the push lock of queue %s was not granted (sp_getapplock returned %d: a deadlock victim)',
        16, 1, @resource, @locked)

-- name: drop_queue_messages
-- Then the queue's messages with their payloads and the meta_opt rows of those with a ttl or a key (rows a
-- pop, ack, nack or claim holds are waited for).
SET NOCOUNT ON;
DECLARE @queue_id int = %(queue_id)s;
DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM {schema}.meta WHERE queue_id = @queue_id);
DELETE FROM {schema}.meta WHERE queue_id = @queue_id;
DELETE FROM {schema}.meta_opt WHERE queue_id = @queue_id

-- name: drop_queue_finished
-- Then its finished messages and their payloads (an archiver batch holding some is waited for).
SET NOCOUNT ON;
DECLARE @queue_id int = %(queue_id)s;
DELETE d FROM {schema}.data d WHERE d.id IN (SELECT id FROM {schema}.done WHERE queue_id = @queue_id);
DELETE FROM {schema}.done WHERE queue_id = @queue_id

-- name: drop_queue
SET NOCOUNT ON;
DECLARE @queue_id int = %(queue_id)s;
DELETE FROM {schema}.archive WHERE queue_id = @queue_id;
DELETE i FROM {schema}.batch_items i
WHERE i.batch_id IN (SELECT batch_id FROM {schema}.batches WHERE queue_id = @queue_id);
DELETE FROM {schema}.batches WHERE queue_id = @queue_id;
DELETE FROM {schema}.dedup WHERE queue_id = @queue_id;
DELETE q OUTPUT deleted.queue_id FROM {schema}.queues q WHERE q.queue_id = @queue_id
