-- Migration 4: storage settings for continuous maintenance (no maintenance window, as in Al Zabir's queue for orders and tasks).
-- meta and done are small and hot: their autovacuum runs unthrottled (cost delay 0), so it finishes
-- before the next wave of dead rows. done now shrinks too (the archiver deletes from it), and archive
-- takes a steady stream of inserts and, with an archive retention, of deletes: both get thresholds
-- scaled for that instead of the server defaults (20% of the table). Settings of the shared tables
-- hold for every queue of the schema.

-- name: migrate
ALTER TABLE {schema}.meta SET (autovacuum_vacuum_cost_delay = 0);
ALTER TABLE {schema}.done SET (autovacuum_vacuum_cost_delay = 0, autovacuum_vacuum_insert_scale_factor = 0.05,
                               autovacuum_analyze_scale_factor = 0.05);
ALTER TABLE {schema}.archive SET (autovacuum_vacuum_scale_factor = 0.05, autovacuum_vacuum_threshold = 1000,
                                  autovacuum_vacuum_insert_scale_factor = 0.1,
                                  autovacuum_analyze_scale_factor = 0.05);
