"""How ``scripts/test`` spreads the suite over pytest-xdist workers (``-n 2 --dist loadgroup``).

Each file of ``tests/airflow`` is one unit of work, run whole on one worker: its module-scoped fixtures
(a migrated Airflow home, an api-server) are then made once rather than once on each worker. Every
other test is a unit of its own, sent to whichever worker is free. pytest-xdist's own groups (the
``xdist_group`` mark) count as well, but pytest 9 items report their ids without the group that
pytest-xdist 3.8 adds to them, so the files are grouped here, from the ids, and not by marks.

Loaded by ``tests/conftest.py`` only when pytest-xdist is installed (it imports pytest-xdist).
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadGroupScheduling
from xdist.workermanage import Producer

GROUPED_DIRS = ("tests/airflow/",)
"""Folders each of whose files runs whole on one worker."""


class FilesOfAirflowTogether(LoadGroupScheduling):
    """``--dist loadgroup``, with each file under :data:`GROUPED_DIRS` one group."""

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.startswith(GROUPED_DIRS):
            return nodeid.split("::", 1)[0]
        return super()._split_scope(nodeid)


class Plugin:
    """Registered by ``tests/conftest.py`` on the controller's plugin manager."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Producer) -> LoadGroupScheduling | None:
        if config.getvalue("dist") == "loadgroup":
            return FilesOfAirflowTogether(config, log)
        return None
