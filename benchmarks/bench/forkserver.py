"""The multiprocessing context that benchmark runs and the tests' child processes start in: one fork
server a process, set up here for both (standard library only, so that the tests import it too)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence
    from multiprocessing.context import ForkServerContext
    from pathlib import Path


def forkserver_context(preload: Sequence[str], path: Path) -> ForkServerContext:
    """The ``forkserver`` context, its server started: a fresh interpreter that imported ``preload``
    once (with them the engine and psycopg, about a second of each child's start that a spawned child
    spends importing them again) and never opened a connection, so none crosses a fork and each child
    makes its own, as a spawned one does. The server is the process's first caller's: its preload and
    environment are taken when it starts (later calls change nothing, and a child does not see a
    variable set afterwards). Python 3.11's fork server does not take this process's sys.path, so it
    starts with ``path`` (where ``preload`` is found) on ``$PYTHONPATH``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), before) if p)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx
