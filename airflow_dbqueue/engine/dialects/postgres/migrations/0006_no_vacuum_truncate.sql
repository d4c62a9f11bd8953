-- Migration 6: VACUUM never truncates the queue tables. Truncating the empty tail of a table takes an
-- ACCESS EXCLUSIVE lock, which stalls every push, pop and ack of every queue of the schema while it is
-- held (and, on a hot standby, cancels queries when it is replayed). A queue table churns: the pages
-- freed by one minute's consumers are filled by the next minute's producers, so the space is better
-- kept than handed back and extended again under the relation extension lock.

-- name: migrate
ALTER TABLE {schema}.meta SET (vacuum_truncate = false);
ALTER TABLE {schema}.data SET (vacuum_truncate = false);
ALTER TABLE {schema}.done SET (vacuum_truncate = false);
