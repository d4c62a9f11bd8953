"""Short version of benchmarks/layout_count.py: server instructions a message of a push of a batch into
a few of the ladder's tables and through the engine's table_push(), counted by cachegrind in a PostgreSQL
server of its own. No cost is asserted: only that each rung asked for is counted once, in order, with
its ids (or count) checked by the script, and that the counts are a message's, not a session's."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import require, run_benchmark

pytestmark = pytest.mark.integration


def test_short_run_counts_each_rung() -> None:
    require(None if shutil.which("valgrind") else "valgrind is not installed", "apt-get install valgrind")
    rungs = ["a0", "e", "g", "f_noids", "f_auto"]
    lines = run_benchmark("layout_count", "--rungs", *rungs, "--calls", "1", "--batch", "10", "--json")
    assert [r["rung"] for r in lines] == rungs, lines
    for r in lines:
        assert (r["batch"], r["calls"], r["depth"]) == (10, 1, 0), r
        # a message costs the server thousands of instructions: near zero would mean the sessions'
        # backends were not the ones counted; millions, that a session's set-up was counted as a message's
        assert 1000 < r["instructions"] < 1_000_000, r
