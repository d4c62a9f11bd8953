-- The order pipeline's tables and statements (PostgreSQL). {schema} is the results schema.

-- name: install
CREATE SCHEMA IF NOT EXISTS {schema};
-- EUR value of one unit of each currency; the job rejects a batch with a currency missing here.
CREATE TABLE IF NOT EXISTS {schema}.fx_rates (
    currency text PRIMARY KEY,
    rate_to_eur numeric(18, 8) NOT NULL CHECK (rate_to_eur > 0)
);
-- The results: orders per customer, product and window, summed over every published batch.
CREATE TABLE IF NOT EXISTS {schema}.rollup (
    customer_id text NOT NULL,
    product_id text NOT NULL,
    window_start timestamptz NOT NULL,
    orders bigint NOT NULL,
    quantity bigint NOT NULL,
    amount_eur numeric(20, 4) NOT NULL,
    first_order_at timestamptz NOT NULL,
    last_order_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (customer_id, product_id, window_start)
);
-- What the Spark job wrote for one batch, waiting to be published with the batch's ack. The key
-- makes a Spark task that re-runs after committing its rows fail, instead of writing them twice.
CREATE TABLE IF NOT EXISTS {schema}.rollup_staging (
    batch_id uuid NOT NULL,
    customer_id text NOT NULL,
    product_id text NOT NULL,
    window_start timestamptz NOT NULL,
    orders bigint NOT NULL,
    quantity bigint NOT NULL,
    amount_eur numeric(20, 4) NOT NULL,
    first_order_at timestamptz NOT NULL,
    last_order_at timestamptz NOT NULL,
    staged_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (batch_id, customer_id, product_id, window_start)
);
-- The job's last write for a batch: its totals, proof that all its staging rows are there.
CREATE TABLE IF NOT EXISTS {schema}.batch_staging (
    batch_id uuid PRIMARY KEY,
    messages bigint NOT NULL,
    orders bigint NOT NULL,
    amount_eur numeric(20, 4) NOT NULL,
    groups bigint NOT NULL,
    written_at timestamptz NOT NULL DEFAULT now()
);
-- Published batches (one row each, committed with the ack): the audit trail of the results.
CREATE TABLE IF NOT EXISTS {schema}.batches (
    batch_id uuid PRIMARY KEY,
    messages bigint NOT NULL,
    orders bigint NOT NULL,
    amount_eur numeric(20, 4) NOT NULL,
    groups bigint NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now()
);

-- name: set_rate
INSERT INTO {schema}.fx_rates (currency, rate_to_eur) VALUES (%(currency)s, %(rate)s)
ON CONFLICT (currency) DO UPDATE SET rate_to_eur = EXCLUDED.rate_to_eur

-- name: staged_summary
SELECT messages, orders, amount_eur, groups FROM {schema}.batch_staging WHERE batch_id = %(batch_id)s

-- name: staged_groups
SELECT count(*), coalesce(sum(orders), 0), coalesce(sum(amount_eur), 0)
FROM {schema}.rollup_staging WHERE batch_id = %(batch_id)s

-- name: publish_rollup
INSERT INTO {schema}.rollup AS r (customer_id, product_id, window_start, orders, quantity, amount_eur,
                                  first_order_at, last_order_at)
SELECT customer_id, product_id, window_start, orders, quantity, amount_eur, first_order_at, last_order_at
FROM {schema}.rollup_staging WHERE batch_id = %(batch_id)s
ORDER BY customer_id, product_id, window_start
ON CONFLICT (customer_id, product_id, window_start) DO UPDATE
SET orders = r.orders + EXCLUDED.orders,
    quantity = r.quantity + EXCLUDED.quantity,
    amount_eur = r.amount_eur + EXCLUDED.amount_eur,
    first_order_at = least(r.first_order_at, EXCLUDED.first_order_at),
    last_order_at = greatest(r.last_order_at, EXCLUDED.last_order_at),
    updated_at = now()

-- name: record_batch
INSERT INTO {schema}.batches (batch_id, messages, orders, amount_eur, groups)
SELECT batch_id, messages, orders, amount_eur, groups FROM {schema}.batch_staging WHERE batch_id = %(batch_id)s

-- name: discard_staged
-- Staging rows of this batch, and leftovers older than a day (of batches whose claimer died: they are
-- never published, since publishing takes only the publisher's own batch).
WITH a AS (DELETE FROM {schema}.rollup_staging
           WHERE batch_id = %(batch_id)s OR staged_at < now() - interval '1 day')
DELETE FROM {schema}.batch_staging WHERE batch_id = %(batch_id)s OR written_at < now() - interval '1 day'

-- name: totals
SELECT (SELECT count(*) FROM {schema}.batches), (SELECT coalesce(sum(messages), 0) FROM {schema}.batches),
       coalesce(sum(orders), 0), coalesce(sum(quantity), 0), coalesce(sum(amount_eur), 0), count(*)
FROM {schema}.rollup

-- name: top_groups
SELECT customer_id, product_id, window_start, orders, quantity, amount_eur
FROM {schema}.rollup ORDER BY amount_eur DESC, customer_id, product_id, window_start LIMIT %(n)s

-- name: warm_up_batch
-- A batch of {size} made-up order events generated here, in the rows the job reads from a queue
-- (ord, id, delivery, payload), for warming a Spark server up with the job's own plan; every event
-- is in the lowest currency that has a rate, so the job accepts the batch.
SELECT g AS ord, g AS id, 1 AS delivery,
       convert_to(json_build_object(
           'order_id', 'warm-up-' || g,
           'customer_id', 'c-' || lpad((g % 200)::text, 4, '0'),
           'product_id', 'p-' || lpad((g % 40)::text, 3, '0'),
           'quantity', 1 + g % 3,
           'unit_price', 9.99,
           'currency', (SELECT min(currency) FROM {schema}.fx_rates),
           'ordered_at', to_char(timestamptz '2026-01-01 00:00:00+00' + g * interval '1 second',
                                 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
       )::text, 'UTF8') AS payload
FROM generate_series(1::bigint, {size}::bigint) AS g
