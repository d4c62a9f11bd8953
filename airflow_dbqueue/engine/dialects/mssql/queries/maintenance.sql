-- Named queries of the SQL Server dialect: maintenance: its lock, timeouts, archiving, VACUUM and statistics, index and table health, rebuilds.
-- The conventions of every file of this folder are in queues.sql's opening lines.

-- name: maintenance_try_lock
-- Maintenance (engine/maintenance/, and this dialect's maintenance.py) from here on.
-- One maintenance run a schema at a time: an application lock owned by the session (not a transaction)
-- of the run's own connection, so it holds across the run's transactions and goes when the connection
-- closes, whatever happened. @LockTimeout = 0: answer at once (the caller polls up to lock_wait_s).
-- Only the first 32 characters of a lock's name can be read back (sys.dm_tran_locks), so the name is
-- 'dbqueue.maint.' and 18 hex digits of the SHA-256 of the schema name: unique per schema and findable.
SET NOCOUNT ON;
DECLARE @resource nvarchar(32) = N'dbqueue.maint.'
    + LEFT(CONVERT(nvarchar(64), HASHBYTES('SHA2_256', CAST(%(schema)s AS nvarchar(128))), 2), 18);
DECLARE @got int;
EXEC @got = sys.sp_getapplock @Resource = @resource, @LockMode = N'Exclusive', @LockOwner = N'Session',
    @LockTimeout = 0, @DbPrincipal = N'public';
SELECT CASE WHEN @got >= 0 THEN 1 ELSE 0 END

-- name: maintenance_unlock
SET NOCOUNT ON;
DECLARE @resource nvarchar(32) = N'dbqueue.maint.'
    + LEFT(CONVERT(nvarchar(64), HASHBYTES('SHA2_256', CAST(%(schema)s AS nvarchar(128))), 2), 18);
DECLARE @released int;
EXEC @released = sys.sp_releaseapplock @Resource = @resource, @LockOwner = N'Session', @DbPrincipal = N'public';
SELECT CASE WHEN @released = 0 THEN 1 ELSE 0 END

-- name: maintenance_lock_holder
-- Who holds a schema's maintenance lock (for the log line of a run that skips or waits). Needs VIEW
-- SERVER STATE to see other sessions; without it the run says "holder unknown" and skips all the same.
SET NOCOUNT ON;
DECLARE @resource nvarchar(32) = N'dbqueue.maint.'
    + LEFT(CONVERT(nvarchar(64), HASHBYTES('SHA2_256', CAST(%(schema)s AS nvarchar(128))), 2), 18);
SELECT TOP (1) s.session_id, s.program_name, c.client_net_address,
       DATEDIFF_BIG(millisecond, s.login_time, GETDATE()) / 1e3 AS connected_s, s.status
FROM sys.dm_tran_locks l
JOIN sys.dm_exec_sessions s ON s.session_id = l.request_session_id
LEFT JOIN sys.dm_exec_connections c ON c.session_id = s.session_id AND c.parent_connection_id IS NULL
WHERE l.resource_type = N'APPLICATION' AND l.resource_database_id = DB_ID()
  AND l.request_owner_type = N'SESSION' AND l.request_status = N'GRANT'
  AND CHARINDEX(@resource, l.resource_description) > 0

-- name: set_timeouts
-- SET LOCK_TIMEOUT takes a constant: neither a variable nor a bound parameter. And a SET run inside
-- dynamic SQL (sp_executesql) is undone when that batch returns, and a batch with parameters reaches
-- the server the same way (sp_executesql or a prepared statement). So the dialect writes lock_ms into this text as an integer it has validated
-- (MssqlDatabase.statement, never a caller's string), and the text goes as a plain batch without
-- parameters: the setting then holds for the rest of the session, the maintenance run's own connection. The statement timeout is the driver's query timeout
-- (SQL_ATTR_QUERY_TIMEOUT, whole seconds), set on the connection by MssqlDatabase.set_timeouts.
SET LOCK_TIMEOUT %(lock_ms)s

-- name: reset_timeouts
-- Back to the session's default (wait for locks without limit); the query timeout goes back to 0 with it.
SET LOCK_TIMEOUT -1

-- name: archive_batch
-- Continuous archiving, one bounded batch a round trip, in one short transaction (the dialect's): up to n
-- finished messages older than older_than_s leave done (oldest first: done is clustered on finished_at)
-- with ROWLOCK, READPAST, UPDLOCK, so rows other sessions hold are skipped and never waited for, and the
-- rows push, pop and ack write are the newest ones, at the other end. Their payloads move from data into
-- archive with them; a done row whose payload is missing is archived with an empty one rather than lost,
-- and one of a queue that no longer exists is deleted, not archived. Returns (rows taken, rows archived).
-- (T-SQL could write DELETE ... OUTPUT ... INTO {schema}.archive (...) straight from data, but the
-- offline check cannot parse a schema-qualified OUTPUT INTO target, so the rows go through @batch.)
-- older_than_s is capped at 6e10 s (1,900 years, older than any row) so that DATEADD cannot overflow.
SET NOCOUNT ON;
DECLARE @s float = CASE WHEN %(older_than_s)s > 6e10 THEN 6e10 ELSE %(older_than_s)s END;
DECLARE @days int = FLOOR(@s / 86400);
DECLARE @rest float = @s - 86400.0 * @days;
DECLARE @cutoff datetime2(6) = DATEADD(microsecond, -CAST(1e6 * (@rest - FLOOR(@rest)) AS int),
    DATEADD(second, -CAST(FLOOR(@rest) AS int), DATEADD(day, -@days, SYSUTCDATETIME())));
DECLARE @all bit = %(all_queues)s;
DECLARE @queues TABLE (queue_id int PRIMARY KEY);
INSERT INTO @queues (queue_id) SELECT DISTINCT CAST([value] AS int) FROM OPENJSON(%(queue_ids)s);
DECLARE @batch TABLE (
    id bigint PRIMARY KEY, queue_id int, priority smallint, attempts int, enqueued_at datetime2(6),
    finished_at datetime2(6), outcome tinyint, payload varbinary(1900));
WITH old AS (
    SELECT TOP (%(n)s) id, queue_id, priority, attempts, enqueued_at, finished_at, outcome, payload
    FROM {schema}.done WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE finished_at < @cutoff AND (@all = 1 OR queue_id IN (SELECT queue_id FROM @queues))
    ORDER BY finished_at)
DELETE FROM old
OUTPUT deleted.id, deleted.queue_id, deleted.priority, deleted.attempts, deleted.enqueued_at,
       deleted.finished_at, deleted.outcome, deleted.payload
INTO @batch;
INSERT INTO {schema}.archive (id, queue_id, priority, attempts, enqueued_at, finished_at, outcome, payload)
SELECT b.id, b.queue_id, b.priority, b.attempts, b.enqueued_at, b.finished_at, b.outcome,
       coalesce(CONVERT(varbinary(max), b.payload), x.payload, 0x)
FROM @batch b LEFT JOIN {schema}.data x ON x.id = b.id
WHERE EXISTS (SELECT 1 FROM {schema}.queues q WHERE q.queue_id = b.queue_id);
DECLARE @archived int = @@ROWCOUNT;
DELETE x FROM {schema}.data x WHERE x.id IN (SELECT id FROM @batch WHERE payload IS NULL);
SELECT count(*), @archived FROM @batch

-- name: purge_archive_batch
-- Archive retention, one bounded batch a round trip: delete up to n archived messages older than
-- older_than_s, oldest first (archive is clustered on archived_at), skipping rows other sessions hold.
SET NOCOUNT ON;
DECLARE @s float = CASE WHEN %(older_than_s)s > 6e10 THEN 6e10 ELSE %(older_than_s)s END;
DECLARE @days int = FLOOR(@s / 86400);
DECLARE @rest float = @s - 86400.0 * @days;
DECLARE @cutoff datetime2(6) = DATEADD(microsecond, -CAST(1e6 * (@rest - FLOOR(@rest)) AS int),
    DATEADD(second, -CAST(FLOOR(@rest) AS int), DATEADD(day, -@days, SYSUTCDATETIME())));
DECLARE @all bit = %(all_queues)s;
DECLARE @queues TABLE (queue_id int PRIMARY KEY);
INSERT INTO @queues (queue_id) SELECT DISTINCT CAST([value] AS int) FROM OPENJSON(%(queue_ids)s);
WITH old AS (
    SELECT TOP (%(n)s) id FROM {schema}.archive WITH (ROWLOCK, READPAST, UPDLOCK)
    WHERE archived_at < @cutoff AND (@all = 1 OR queue_id IN (SELECT queue_id FROM @queues))
    ORDER BY archived_at)
DELETE FROM old;
SELECT @@ROWCOUNT

-- name: vacuum_table
-- SQL Server has no VACUUM: the rows a DELETE leaves (ghost records) are removed by the server's own
-- ghost cleanup task, and there is nothing for a client to run. What VACUUM (ANALYZE) also does, fresh
-- statistics, is UPDATE STATISTICS (default sampling). This and the next three take a table or index name
-- as an identifier placeholder, bracket-quoted after validation: utility statements take no parameters.
UPDATE STATISTICS {schema}.{table}

-- name: analyze_table
UPDATE STATISTICS {schema}.{table}

-- name: reindex_concurrently
-- Rebuild one index of the schema without blocking the queue. online = 1 (the maintenance code decides
-- from SERVERPROPERTY('EngineEdition'), read at run time by index_health: 3 Enterprise/Developer,
-- 5 Azure SQL Database, 8 Managed Instance): ALTER INDEX ... REBUILD WITH (ONLINE = ON), whose short
-- schema lock at the end waits at low priority, so that pushes and pops do not queue behind it, for at
-- most max_duration_min minutes, and then gives up (ABORT_AFTER_WAIT = SELF). online = 0: REORGANIZE,
-- which every edition runs online (page locks only). Returns the statement run, or NULL when the index
-- is not on that table of the schema (nothing run).
SET NOCOUNT ON;
DECLARE @schema sysname = PARSENAME(N'{schema}', 1);
DECLARE @table sysname = PARSENAME(N'{table}', 1);
DECLARE @index sysname = PARSENAME(N'{index}', 1);
DECLARE @online bit = %(online)s;
DECLARE @minutes int = %(max_duration_min)s;
DECLARE @found int = (
    SELECT count(*) FROM sys.indexes i
    WHERE i.object_id = OBJECT_ID(QUOTENAME(@schema) + N'.' + QUOTENAME(@table)) AND i.name = @index);
DECLARE @sql nvarchar(max) = N'ALTER INDEX ' + QUOTENAME(@index) + N' ON ' + QUOTENAME(@schema) + N'.'
    + QUOTENAME(@table) + CASE WHEN @online = 1
        THEN N' REBUILD WITH (ONLINE = ON (WAIT_AT_LOW_PRIORITY (MAX_DURATION = '
             + CAST(@minutes AS nvarchar(10)) + N' MINUTES, ABORT_AFTER_WAIT = SELF)))'
        ELSE N' REORGANIZE' END;
IF @found = 1 BEGIN EXEC sys.sp_executesql @sql END;
SELECT CASE WHEN @found = 1 THEN @sql END AS statement

-- name: drop_index_concurrently
-- Not run by maintenance on SQL Server: PostgreSQL needs it for the INVALID index a failed REINDEX
-- CONCURRENTLY leaves, but a failed ALTER INDEX ... REBUILD rolls back and leaves no half-built index,
-- so there is nothing to clean (the rebuild report says so). Here under the same name for the parity
-- of names, as the plain statement an operator would run.
DROP INDEX IF EXISTS {index} ON {schema}.{table}

-- name: index_health
-- Every index of the schema's tables (rowstore: clustered and nonclustered) with its size (used pages,
-- all levels, LOB included), the leaf level's page density and logical fragmentation, entries and page
-- count from sys.dm_db_index_physical_stats in SAMPLED mode (every page below 10,000 pages, 1% above),
-- its fill factor, the engine edition (whether ONLINE rebuilds exist), and whether an index operation
-- (CREATE or ALTER INDEX, REORGANIZE and other DBCC) runs in this database or a resumable one is paused
-- on the table: never start a rebuild next to one. Needs VIEW DATABASE STATE (VIEW SERVER STATE to see
-- other sessions' index operations).
SET NOCOUNT ON;
DECLARE @edition int = CAST(SERVERPROPERTY('EngineEdition') AS int);
DECLARE @operations int = (
    SELECT count(*) FROM sys.dm_exec_requests r
    WHERE r.database_id = DB_ID() AND r.session_id <> @@SPID
      AND r.command IN (N'CREATE INDEX', N'ALTER INDEX', N'DBCC'));
SELECT i.name, t.name AS table_name, lower(i.type_desc) AS method,
       CASE WHEN i.is_disabled = 1 THEN 0 ELSE 1 END AS valid,
       coalesce((SELECT sum(p.used_page_count) FROM sys.dm_db_partition_stats p
                 WHERE p.object_id = i.object_id AND p.index_id = i.index_id), 0) * CAST(8192 AS bigint) AS size_bytes,
       ps.entries, ps.leaf_pages, ps.fragmentation_pct, ps.page_density_pct,
       CASE WHEN i.fill_factor = 0 THEN 100 ELSE i.fill_factor END AS fill_factor,
       @edition AS engine_edition,
       CASE WHEN @operations > 0 OR EXISTS (
                SELECT 1 FROM sys.index_resumable_operations o WHERE o.object_id = i.object_id)
            THEN 1 ELSE 0 END AS build_running
FROM sys.indexes i
JOIN sys.tables t ON t.object_id = i.object_id
OUTER APPLY (
    SELECT sum(s.record_count) AS entries, sum(s.page_count) AS leaf_pages,
           max(s.avg_fragmentation_in_percent) AS fragmentation_pct,
           max(s.avg_page_space_used_in_percent) AS page_density_pct
    FROM sys.dm_db_index_physical_stats(DB_ID(), i.object_id, i.index_id, NULL, 'SAMPLED') s
    WHERE s.index_level = 0 AND s.alloc_unit_type_desc = N'IN_ROW_DATA') ps
WHERE t.schema_id = SCHEMA_ID(%(schema)s) AND i.type IN (1, 2)
ORDER BY t.name, i.name

-- name: table_health
-- Size and row count of every table of the schema (sys.dm_db_partition_stats: the table is its heap or
-- clustered index, LOB pages included; indexes are the others). SQL Server keeps no count of dead rows
-- (ghost records are its cleanup task's business) and has no VACUUM: those columns are NULL. last_analyze
-- is the newest statistics update of the table, converted from the server's local time to UTC.
SET NOCOUNT ON;
DECLARE @tz int = DATEPART(TZOFFSET, SYSDATETIMEOFFSET());
SELECT t.name,
       sum(CASE WHEN p.index_id IN (0, 1) THEN p.used_page_count ELSE 0 END) * CAST(8192 AS bigint) AS table_bytes,
       sum(CASE WHEN p.index_id > 1 THEN p.used_page_count ELSE 0 END) * CAST(8192 AS bigint) AS index_bytes,
       sum(p.used_page_count) * CAST(8192 AS bigint) AS total_bytes,
       sum(CASE WHEN p.index_id IN (0, 1) THEN p.row_count ELSE 0 END) AS live_rows,
       CAST(NULL AS bigint) AS dead_rows,
       CAST(NULL AS datetime2(6)) AS last_vacuum,
       (SELECT DATEADD(minute, -@tz, max(STATS_DATE(st.object_id, st.stats_id)))
          FROM sys.stats st WHERE st.object_id = t.object_id) AS last_analyze,
       CAST(NULL AS bigint) AS autovacuum_count,
       CAST(NULL AS bigint) AS vacuum_count
FROM sys.tables t
JOIN sys.dm_db_partition_stats p ON p.object_id = t.object_id
WHERE t.schema_id = SCHEMA_ID(%(schema)s)
GROUP BY t.object_id, t.name
ORDER BY t.name

-- name: xmin_holders
-- What holds back cleanup on SQL Server (there is no xmin horizon): transactions open longer than
-- min_age_s that touched this database (the log cannot be truncated past them, and the rows they hold
-- stay), and snapshot transactions of any database older than that (with snapshot isolation or RCSI,
-- row versions and the ghost records they need stay while one runs). Same columns as PostgreSQL's; xid_age
-- is NULL (SQL Server has no transaction-id age, so min_xid_age is not used). Times are converted from
-- the server's local time to UTC. Needs VIEW SERVER STATE to see other sessions.
SET NOCOUNT ON;
DECLARE @min_age_ms float = 1000 * %(min_age_s)s;
DECLARE @tz int = DATEPART(TZOFFSET, SYSDATETIMEOFFSET());
SELECT CASE WHEN v.transaction_id IS NULL THEN N'transaction' ELSE N'snapshot transaction' END AS kind,
       s.session_id, coalesce(s.program_name, N'') AS name, s.login_name, s.status,
       DATEDIFF_BIG(millisecond, a.transaction_begin_time, GETDATE()) / 1e3 AS age_s,
       CAST(NULL AS bigint) AS xid_age,
       DATEADD(minute, -@tz, a.transaction_begin_time) AS xact_start,
       DATEADD(minute, -@tz, s.last_request_start_time) AS query_start,
       LEFT(q.text, 200) AS query,
       DATEDIFF_BIG(millisecond, s.login_time, GETDATE()) / 1e3 AS backend_age_s
FROM sys.dm_tran_session_transactions x
JOIN sys.dm_tran_active_transactions a ON a.transaction_id = x.transaction_id
JOIN sys.dm_exec_sessions s ON s.session_id = x.session_id
LEFT JOIN sys.dm_tran_active_snapshot_database_transactions v ON v.transaction_id = x.transaction_id
LEFT JOIN sys.dm_exec_connections c ON c.session_id = s.session_id AND c.parent_connection_id IS NULL
OUTER APPLY sys.dm_exec_sql_text(c.most_recent_sql_handle) q
WHERE x.session_id <> @@SPID
  AND DATEDIFF_BIG(millisecond, a.transaction_begin_time, GETDATE()) >= @min_age_ms
  AND (v.transaction_id IS NOT NULL OR EXISTS (
        SELECT 1 FROM sys.dm_tran_database_transactions d
        WHERE d.transaction_id = x.transaction_id AND d.database_id = DB_ID()))
ORDER BY 6 DESC

-- name: queue_rates
-- Messages pushed and finished in the last window_s seconds, counted from the tables as on PostgreSQL: a
-- message pushed in the window is in meta, done or archive with a recent enqueued_at (finished_at and
-- archived_at are later still, and done and archive are clustered on them, which narrows the scans).
SET NOCOUNT ON;
DECLARE @queue_id int = %(queue_id)s;
DECLARE @s float = CASE WHEN %(window_s)s > 6e10 THEN 6e10 ELSE %(window_s)s END;
DECLARE @days int = FLOOR(@s / 86400);
DECLARE @rest float = @s - 86400.0 * @days;
DECLARE @since datetime2(6) = DATEADD(microsecond, -CAST(1e6 * (@rest - FLOOR(@rest)) AS int),
    DATEADD(second, -CAST(FLOOR(@rest) AS int), DATEADD(day, -@days, SYSUTCDATETIME())));
SELECT
    (SELECT count_big(*) FROM {schema}.meta WHERE queue_id = @queue_id AND enqueued_at > @since)
    + (SELECT count_big(*) FROM {schema}.done
        WHERE queue_id = @queue_id AND finished_at > @since AND enqueued_at > @since)
    + (SELECT count_big(*) FROM {schema}.archive
        WHERE queue_id = @queue_id AND archived_at > @since AND enqueued_at > @since) AS pushed,
    (SELECT count_big(*) FROM {schema}.done
      WHERE queue_id = @queue_id AND finished_at > @since AND outcome = 1)
    + (SELECT count_big(*) FROM {schema}.archive
        WHERE queue_id = @queue_id AND archived_at > @since AND finished_at > @since AND outcome = 1)
      AS finished
