"""How the PostgreSQL dialect sends its named statements (queries/): which it prepares, and which
return their rows in binary."""

# The statements that only call a function of the schema (queries/): prepared on first use, they
# run generic plans (dialect._configure_connection says why). So does ring_take_one, a statement over
# the ring's tables of constant size (lanes, slots) and the index of its messages due again, whose
# generic plan tests/integration/test_plans.py checks, and ring_rows_ask, a waiting pop's question (one
# call of the ring's own function and two sequence reads). Every other statement is sent unprepared.
GENERIC_PLANS = frozenset(
    {
        "push",
        "pop_lease",
        "pop_take",
        "pop_take_payloads",
        "ack",
        "ack_with",
        "stats",
        "ring_push",
        "ring_push_one",
        "ring_floor",
        "ring_take",
        "ring_take_payloads",
        "ring_take_one",
        "ring_take_lease",
        "ring_take_lease_ids",
        "ring_pop",
        "ring_ack",
        "ring_settle",
        "ring_reclaim_expired",
        "ring_peek",
        "ring_rows_push",
        "ring_rows_push_ttl",
        "ring_rows_push_keys",
        "ring_rows_take",
        "ring_rows_pop_payloads",
        "ring_rows_take_one",
        "ring_rows_pop_payload_one",
        "ring_rows_ack",
        "ring_rows_claim_batch",
        "ring_rows_ask",
    }
)

BINARY_RESULTS = frozenset(
    {
        "push",
        "pop_lease",
        "pop_take",
        "pop_take_payloads",
        "ack",
        "ack_with",
        "nack",
        "nack_with",
        "leased",
        "peek",
        "ring_pop",
        "ring_take",
        "ring_take_payloads",
        "ring_take_one",
        "ring_take_lease",
        "ring_take_lease_ids",
        "ring_ack",
        "ring_settle",
        "ring_leased",
        "ring_peek",
        "ring_rows_take",
        "ring_rows_pop_payloads",
        "ring_rows_take_one",
        "ring_rows_pop_payload_one",
        "ring_rows_leased",
        "ring_rows_look",
    }
)
