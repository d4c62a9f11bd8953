"""How ``scripts/test`` spreads the suite over pytest-xdist workers (``-n 2 --dist loadgroup``).

Each file of ``tests/airflow`` is one unit of work, run whole on one worker: its module-scoped fixtures
(a migrated Airflow home, an api-server) are then made once rather than once on each worker. The files
whose tests take the session's Spark Connect server (the fixture ``connect_server``, a JVM that takes
about 20 s of both cores to start and then stays up until the worker ends) are one unit together, so
that one worker starts that server and the other never does. Every other test is a unit of its own,
sent to whichever worker is free, except the tests of a file of :data:`GROUPED_FILES`, which share a
module-scoped fixture that makes one long run for several of them (a server under valgrind), and are one
unit of their own too. pytest-xdist's own groups (the ``xdist_group`` mark) count as well,
but pytest 9 items report their ids without the group that pytest-xdist 3.8 adds to them, so the files
are grouped here, from the ids, and not by marks.

pytest-xdist hands out the units with the most tests first (``--loadscope-reorder``, its default), so
the files of ``tests/airflow`` and the Connect server's unit go out before the single tests, which then
fill both workers up to the end: neither worker is left with a queue of long files while the other
idles.

Loaded by ``tests/conftest.py`` only when pytest-xdist is installed (it imports pytest-xdist).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from xdist.scheduler import LoadGroupScheduling
from xdist.workermanage import Producer

GROUPED_DIRS = ("tests/airflow/",)
"""Folders each of whose files runs whole on one worker."""

GROUPED_FILES = ("tests/integration/test_instructions_smoke.py",)
"""Files outside :data:`GROUPED_DIRS` that run whole on one worker: several of their tests look at the
rows of one module-scoped run, which a second worker would make again."""

CONNECT_SERVER_UNIT = "spark-connect-server"
"""The unit of the files whose tests take the session's Spark Connect server."""

ROOT = Path(__file__).resolve().parents[1]


def connect_server_files(root: Path = ROOT) -> frozenset[str]:
    """The test files (as node ids name them) under :data:`GROUPED_DIRS` that name the fixture
    ``connect_server``: the session's Spark Connect server."""
    return frozenset(
        path.relative_to(root).as_posix()
        for folder in GROUPED_DIRS
        for path in sorted((root / folder).glob("test_*.py"))
        if "connect_server" in path.read_text(encoding="utf-8")
    )


def work_unit(nodeid: str, connect_files: frozenset[str]) -> str | None:
    """The unit a test runs in with others (None: a unit of its own): its file's, for a file under
    :data:`GROUPED_DIRS` or of :data:`GROUPED_FILES`, or :data:`CONNECT_SERVER_UNIT` for a file of
    ``connect_files``."""
    path = nodeid.split("::", 1)[0]
    if path in GROUPED_FILES:
        return path
    if not nodeid.startswith(GROUPED_DIRS):
        return None
    return CONNECT_SERVER_UNIT if path in connect_files else path


class FilesOfAirflowTogether(LoadGroupScheduling):
    """``--dist loadgroup``, with each file under :data:`GROUPED_DIRS` or of :data:`GROUPED_FILES` one
    unit, and the files that take the Spark Connect server one unit together."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        super().__init__(config, log)
        self.connect_files = connect_server_files(Path(str(config.rootpath)))

    def _split_scope(self, nodeid: str) -> str:
        unit = work_unit(nodeid, self.connect_files)
        return unit if unit is not None else super()._split_scope(nodeid)


class Plugin:
    """Registered by ``tests/conftest.py`` on the controller's plugin manager."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Producer) -> LoadGroupScheduling | None:
        if config.getvalue("dist") == "loadgroup":
            return FilesOfAirflowTogether(config, log)
        return None
