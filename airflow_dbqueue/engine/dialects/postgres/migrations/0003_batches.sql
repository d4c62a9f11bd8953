-- Migration 3: the batch ledger. A batch is a set of messages claimed together under one lease and
-- one id, so that a job outside this process (a Spark application) can read exactly that set from
-- the database by id, and the claimer can ack or release it as a whole.

-- name: migrate
CREATE TABLE {schema}.batches (
    batch_id uuid NOT NULL,
    queue_id integer NOT NULL,
    state smallint NOT NULL DEFAULT 0,
    ids bigint[] NOT NULL,
    deliveries integer[] NOT NULL,
    consumer text,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    lease_until timestamptz NOT NULL,
    finished_at timestamptz,
    last_error text,
    CONSTRAINT batches_pkey PRIMARY KEY (batch_id),
    CONSTRAINT batches_state_valid CHECK (state IN (0, 1, 2)),
    CONSTRAINT batches_receipts_valid CHECK (cardinality(ids) = cardinality(deliveries) AND cardinality(ids) > 0)
);
CREATE INDEX batches_open_idx ON {schema}.batches (queue_id, claimed_at) WHERE state = 0;
