"""The SQL Server dialect's unit tests are pure Python but for a few: they run without pyodbc.

pytest runs tests/unit/test_mssql_*.py in a child process where ``import pyodbc`` fails, as on a machine
without the mssql extra or unixODBC. Nothing may fail there, the tests that need the driver skip naming
it, and the pure ones run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import STRICT_ENV

ROOT = Path(__file__).resolve().parents[2]

RUN_WITHOUT_PYODBC = """
import sys
sys.modules["pyodbc"] = None  # `import pyodbc` raises ImportError, as if it were not installed
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""

PURE = [
    "test_mssql_dialect.py::test_every_tsql_query_parses_as_tsql",
    "test_mssql_dialect.py::test_urls_and_odbc_strings_parse_without_leaking_credentials",
    "test_mssql_dialect.py::test_the_conformance_suites_own_sql_on_a_fake_sql_server",
    "test_mssql_dialect.py::test_gap_recovery_waits_on_the_lanes_still_locked_on_a_fake_sql_server",
    "test_mssql_maintenance.py::test_a_full_run_on_a_fake_sql_server",
    "test_mssql_maintenance.py::test_rebuild_indexes_on_a_fake_sql_server",
    "test_mssql_ownership.py::test_a_fresh_install_creates_its_schema_and_records_all_it_made_on_a_fake_sql_server",
    "test_mssql_ownership.py::test_a_push_to_a_dropped_queue_raises_on_a_fake_sql_server",
    "test_mssql_ring_procedures.py::test_a_pop_of_none_only_gives_the_gap_up_and_reports_the_head",
]
"""Tests of each kind (T-SQL parses, DSN parsing, the fake server) that must pass without the driver."""


def test_the_sql_server_unit_tests_run_without_pyodbc() -> None:
    env = {k: v for k, v in os.environ.items() if k != STRICT_ENV}  # here a missing driver skips
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            RUN_WITHOUT_PYODBC,
            "tests/unit/test_mssql_dialect.py",
            "tests/unit/test_mssql_maintenance.py",
            "tests/unit/test_mssql_ownership.py",
            "tests/unit/test_mssql_ring_procedures.py",
            "-rA",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    passed = re.findall(r"^PASSED tests/unit/(\S+)", out, re.MULTILINE)
    skips = re.findall(r"^SKIPPED \[\d+\] \S+: (.*)$", out, re.MULTILINE)
    assert skips and all(s.startswith("pyodbc cannot be imported") for s in skips), skips
    for name in PURE:
        assert any(p == name or p.startswith(name + "[") for p in passed), (
            f"{name} did not pass:\n{out[-3000:]}"
        )
    assert len(passed) > 100, f"only {len(passed)} tests passed without pyodbc"
