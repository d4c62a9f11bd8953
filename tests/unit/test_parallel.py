"""The suite under pytest-xdist, as ``scripts/test`` runs it (``-n 2 --dist loadgroup``).

Each worker starts an embedded server of its own; a server named by ``$DBQUEUE_TEST_DSN`` or
``$DBQUEUE_TEST_MSSQL_DSN`` would be shared, so ``-n`` is refused with one (``tests/conftest.py``), and
without ``-n`` it is used as before. Each file of ``tests/airflow`` runs on one worker.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE_FILE = "tests/unit/test_models.py"
"""Tests that need no server: what runs does not depend on the DSN given."""


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("DBQUEUE_TEST_DSN", "DBQUEUE_TEST_MSSQL_DSN")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("variable", ["DBQUEUE_TEST_DSN", "DBQUEUE_TEST_MSSQL_DSN"])
def test_workers_on_one_shared_server_are_refused(variable: str) -> None:
    """With a shared server named, ``-n 2`` stops before any test runs (pytest's usage error, exit code
    4), naming the variable; without ``-n`` the same tests run (checked for one variable: the check
    is the same for both, and each run starts a Python with the suite's imports)."""
    refused = _pytest("-n", "2", PURE_FILE, **{variable: "host=127.0.0.1 port=1 dbname=nowhere"})
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert f"${variable} names one server" in refused.stderr and "run without -n" in refused.stderr
    assert " passed" not in refused.stdout
    if variable != "DBQUEUE_TEST_DSN":
        return
    alone = _pytest("-q", PURE_FILE, **{variable: "host=127.0.0.1 port=1 dbname=nowhere"})
    assert alone.returncode == 0 and re.search(r"\b\d+ passed", alone.stdout), alone.stdout + alone.stderr


def test_each_airflow_file_runs_on_one_worker() -> None:
    """Under ``--dist loadgroup`` every test of a tests/airflow file runs on the same worker (without the
    groups, the scheduler hands its tests out one by one to whichever worker is free)."""
    airflow_file = "tests/airflow/test_vocabulary.py"
    proc = _pytest("-n", "2", "--dist", "loadgroup", "-v", airflow_file, PURE_FILE)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ran = re.findall(r"^\[(gw\d+)\] \[ *\d+%\] PASSED (\S+?)::", proc.stdout, re.MULTILINE)
    by_file: dict[str, set[str]] = {}
    for worker, path in ran:
        by_file.setdefault(path, set()).add(worker)
    counts = {path: sum(1 for _, p in ran if p == path) for path in by_file}
    assert counts[airflow_file] >= 10 and counts[PURE_FILE] >= 10, proc.stdout[-4000:]
    assert len(by_file[airflow_file]) == 1, by_file


def test_the_files_that_take_the_spark_connect_server_are_one_unit() -> None:
    """The files of tests/airflow whose tests take the session's Spark Connect server (a JVM a worker
    starts once and keeps) run on one worker together, so that only one worker starts that server;
    every other file of tests/airflow is a unit of its own, and any other test too."""
    from tests.xdist_scheduling import CONNECT_SERVER_UNIT, connect_server_files, work_unit

    files = connect_server_files()
    assert {
        "tests/airflow/test_spark_pipeline.py",
        "tests/airflow/test_spark_operator.py",
        "tests/airflow/test_spark_paths_benchmark.py",
        "tests/airflow/test_spark_connect_server.py",
    } <= files
    assert "tests/airflow/test_spark_submit.py" not in files and "tests/airflow/conftest.py" not in files
    for path in files:
        assert work_unit(f"{path}::test_x[connect]", files) == CONNECT_SERVER_UNIT
    vocabulary = "tests/airflow/test_vocabulary.py"
    assert work_unit(f"{vocabulary}::test_x", files) == vocabulary
    assert work_unit("tests/integration/test_ring.py::test_x[rows]", files) is None


def test_the_instructions_smoke_file_is_one_unit() -> None:
    """The tests of test_instructions_smoke.py that look at the rows of one module-scoped counted run (a
    server under valgrind, minutes long) run on one worker, which makes that run once; the tests of
    any other file of tests/integration are units of their own."""
    from tests.xdist_scheduling import GROUPED_FILES, connect_server_files, work_unit

    smoke = "tests/integration/test_instructions_smoke.py"
    assert smoke in GROUPED_FILES and (ROOT / smoke).is_file()
    files = connect_server_files()
    for test in (
        "test_short_run_counts_ordering_keys_on_both_designs",
        "test_short_run_counts_with_the_horizon_held",
    ):
        assert work_unit(f"{smoke}::{test}", files) == smoke
    assert work_unit("tests/integration/test_conformance.py::test_x[table-sync]", files) is None
