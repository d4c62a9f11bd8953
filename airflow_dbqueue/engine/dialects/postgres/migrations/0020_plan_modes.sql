-- Migration 20: the ring's functions that read tables whose size changes (leases, messages due again,
-- failed messages, consumer groups) plan their statements for their arguments on every call, and
-- nothing of a ring's data changes. The engine's pooled sessions leave plan_cache_mode at PostgreSQL's
-- default (auto) so that its prepared calls of the schema's functions run generic plans; the session
-- setting no longer decides these functions' statements, so they say it themselves, as the pops and
-- pushes already do (force_generic_plan on tables that never change size).

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
