-- Migration 21: meta without a primary key. Ids come from one sequence (message_id_seq) and only
-- table_push inserts, so they are unique without meta_pkey, which every push wrote an entry into (a
-- fifth of a push's server instructions at 100 messages a call). Lookups by id name what they expect
-- instead: receipts and a batch's messages (leased, lease_until set) probe a partial index of leased
-- messages by id, failed messages (state 2) meta_failed_idx (queue_id, id); ready messages are never
-- looked up by id. Every message stays where it is: no row is rewritten. The index is built while the
-- migration holds its lock on meta (pushes and pops wait for it): one read of the table, and an entry
-- for each leased message only.
-- REPLICA IDENTITY FULL: without a primary key, logical replication could not replicate meta's
-- updates and deletes otherwise; the old row is written to WAL only at wal_level = logical.

-- name: migrate
CREATE INDEX meta_leased_id_idx ON {schema}.meta (id) WHERE lease_until IS NOT NULL;
ALTER TABLE {schema}.meta DROP CONSTRAINT meta_pkey, REPLICA IDENTITY FULL;
