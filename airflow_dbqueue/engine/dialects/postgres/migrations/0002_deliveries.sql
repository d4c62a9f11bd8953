-- Migration 2: meta.deliveries, a count of every hand-out of a message that requeue_failed never
-- resets. Receipts become (id, deliveries): with (id, attempts), a receipt from before a requeue matched
-- the next delivery. Existing rows start at their attempts, so receipts handed out by version 1 code
-- (which carried attempts) still match their leases.

-- name: migrate
ALTER TABLE {schema}.meta ADD COLUMN deliveries integer NOT NULL DEFAULT 0;
UPDATE {schema}.meta SET deliveries = attempts WHERE attempts <> 0;
