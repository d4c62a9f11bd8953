"""Short version of benchmarks/depth_count.py: server instructions a pop of the engine's queue and of the
naive queue at depth, with pops since the last VACUUM, counted by cachegrind in a PostgreSQL server of
its own. No cost is asserted: only that both sides are counted, that every popped payload was checked,
and that the claims' explained pages are there (the engine's for each of its eight partitions), with the
what-if claim bounded below by the first ready message's process-at time counted and explained too, and
the what-if pop whose claim is so bounded counted, every payload it took checked; the engine's own floor
raised after the fill, and pushes of both sides counted."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import require, run_benchmark

pytestmark = pytest.mark.integration


def test_short_run_counts_both_sides_at_depth() -> None:
    require(None if shutil.which("valgrind") else "valgrind is not installed", "apt-get install valgrind")
    depth, batch, calls = 4000, 10, 1
    [r] = run_benchmark(
        "depth_count", *("--depth", str(depth), "--batch", str(batch), "--calls", str(calls), "--json")
    )
    assert (r["depth"], r["popped_since_vacuum"], r["batch"]) == (depth, depth // 2, batch)
    # a message costs the server thousands of instructions: a count near zero would mean the sessions'
    # backends were not the ones counted
    assert r["engine_pop_instructions"] > 1000 and r["naive_pop_instructions"] > 1000, r
    # the fill's pops, then a session of one pop, one of calls and one of 4 x calls on each side, every
    # payload checked against its header
    popped = depth // 2 + (1 + calls + 4 * calls) * batch
    assert r["payloads_ok"] and r["engine_popped"] == r["naive_popped"] == popped, r
    assert sorted(r["engine_claim_pages_by_partition"]) == [f"meta_{g}" for g in range(8)], r
    assert r["engine_claim_pages"] >= sum(r["engine_claim_pages_by_partition"].values()) > 0
    assert r["naive_claim_pages"] > 0 and r["engine_claim_index_searches"] >= 8
    assert r["engine_bounded_claim_pages"] > 0 and r["engine_bounded_claim_instructions"] > 1000, r
    # the what-if's pop (a claim bounded by a floor) after the engine's: a session of one pop, one of calls
    # and one of 4 x calls, each payload checked
    assert r["floor_pop_instructions"] > 1000 and r["floor_popped"] == (1 + calls + 4 * calls) * batch, r
    # the engine's floor raised after the fill (its claim explained and counted with it), and its pushes
    # counted beside the naive queue's
    assert r["floor"] is not None, r
    assert r["engine_push_instructions"] > 1000 and r["naive_push_instructions"] > 1000, r
