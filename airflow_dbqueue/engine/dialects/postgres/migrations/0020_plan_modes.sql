-- Migration 20: the ring's functions that read tables whose size changes (leases, messages due again,
-- failed messages, consumer groups) plan their statements for their arguments on every call, and
-- nothing of a ring's data changes. The engine's pooled sessions leave plan_cache_mode at PostgreSQL's
-- default (auto) so that its prepared calls of the schema's functions run generic plans; the session
-- setting no longer decides these functions' statements, so they say it themselves, as the pops and
-- pushes already do (force_generic_plan on tables that never change size). The ack of whole leases
-- becomes a function (ring_ack), whose plan is made once a session: sent as a statement, it was
-- planned on every call.

-- name: migrate
ALTER FUNCTION {schema}.ring_pass(integer, integer, integer) SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION {schema}.ring_skip_abandoned(integer, bigint, xid[]) SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION {schema}.ring_split_leases(integer, integer, integer, bigint[], text, integer)
    SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION {schema}.ring_settle(
    integer, integer, integer, bigint[], integer[], boolean, double precision, double precision, double precision,
    integer, text, integer)
    SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION {schema}.ring_reclaim_expired(integer, integer, integer, integer, integer, integer)
    SET plan_cache_mode = force_custom_plan;

-- The ack of whole leases, the usual one (queries/ring.sql's ring_ack): receipts naming every message
-- of one ring_leases row or more (first deliveries; a pop writes one row, or two when it ran past the
-- end of the ring's slots). A candidate lease lies within the receipts' range and is whole when as many
-- receipts fall in its range and lanes as it holds messages; the leases are deleted only when the whole
-- ones hold every receipt (each message is in one lease at most). Returns the n of each lease deleted,
-- nothing otherwise (the caller then settles the receipts with ring_settle). A function so that its
-- plan is made once a session, generic, on the leases' key, whatever the table's size when it is made.
CREATE FUNCTION {schema}.ring_ack(p_group integer, p_lanes integer, p_ids bigint[], p_deliveries integer[])
RETURNS TABLE (r_n integer)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET enable_bitmapscan = off
AS $$
BEGIN
    RETURN QUERY
    WITH r AS (
        SELECT min(u.id) AS lo, max(u.id) AS hi, count(*) AS k, bool_and(u.d = 1) AS first
        FROM unnest(p_ids, p_deliveries) AS u(id, d)
    ), c AS (
        SELECT e.ctid AS tid, e.n
        FROM {schema}.ring_leases e, r
        WHERE e.queue_id = p_group AND e.lo >= r.lo AND e.lo <= r.hi AND e.hi <= r.hi AND r.first
          AND e.lease_until > now()
          AND (SELECT count(*) FROM unnest(p_ids) AS i(id)
               WHERE i.id BETWEEN e.lo AND e.hi AND e.starts[mod(i.id, p_lanes)::integer + 1] <= i.id) = e.n
        FOR UPDATE OF e
    )
    DELETE FROM {schema}.ring_leases e
    WHERE e.ctid = ANY (ARRAY(SELECT c.tid FROM c)) AND (SELECT sum(c.n) FROM c) = (SELECT r.k FROM r)
    RETURNING e.n;
END
$$;
