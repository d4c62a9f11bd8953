"""The engine examples of README.md and docs/*.md run as written against a real PostgreSQL.

Each example runs in a fresh database of the test server (so ``DbQueue()`` and the default schema
``dbqueue`` are the example's own), as a separate process with ``$DBQUEUE_DSN`` set. Airflow DAG
examples are checked in tests/airflow/test_docs_dags.py; see tests/docs_examples.py for the markers.
"""

from __future__ import annotations

import ast
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import psycopg.conninfo
import pytest

from tests.docs_examples import DOC_FILES, REPO, Example, all_examples, examples

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def fresh_database(pg_dsn: str) -> Iterator[str]:
    """A new, empty database on the test server; dropped afterwards."""
    name = f"docs_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    try:
        yield psycopg.conninfo.make_conninfo(pg_dsn, dbname=name)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def _env(dsn: str) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return dict(os.environ, DBQUEUE_DSN=dsn, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


def test_every_python_example_is_marked() -> None:
    unmarked = [where for path in DOC_FILES for where in examples(path)[1]]
    assert unmarked == [], f"python blocks without an '<!-- example: ... -->' marker: {unmarked}"
    kinds = {e.kind for path in DOC_FILES for e in examples(path)[0]}
    assert kinds <= {"run", "shell", "import", "parse", "dag"}, kinds
    assert all_examples("run") and all_examples("shell")  # the markers are found at all


@pytest.mark.parametrize("example", all_examples("run"), ids=str)
def test_engine_example_runs(pg_dsn: str, example: Example, tmp_path: Path) -> None:
    with fresh_database(pg_dsn) as dsn:
        proc = subprocess.run(
            [sys.executable, "-c", example.code],
            cwd=tmp_path,
            env=_env(dsn),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, f"{example.where}:\n{proc.stderr[-3000:]}"
        with psycopg.connect(dsn) as c:  # the example did reach this database
            installed = c.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'dbqueue'").fetchone()
        assert installed == (1,)


@pytest.mark.parametrize("example", all_examples("shell"), ids=str)
def test_shell_example_runs(pg_dsn: str, example: Example, tmp_path: Path) -> None:
    with fresh_database(pg_dsn) as dsn:
        for line in example.code.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            proc = subprocess.run(
                ["bash", "-c", f"set -o pipefail; {line}"],
                cwd=tmp_path,
                env=_env(dsn),
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert proc.returncode == 0, (
                f"{example.where}: {line}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )


@pytest.mark.parametrize("example", all_examples("import"), ids=str)
def test_example_imports_resolve(example: Example) -> None:
    tree = ast.parse(example.code)
    imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert imports, f"{example.where}: an 'import' example without imports"
    code = ast.unparse(ast.Module(body=imports, type_ignores=[]))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"{example.where}:\n{proc.stderr[-3000:]}"
