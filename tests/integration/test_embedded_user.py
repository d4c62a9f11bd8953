"""The embedded server's system user (as root the server runs as one, created when missing): processes
that start servers at once, as pytest-xdist workers do on a fresh machine, all get the one user.

The test creates a system user of its own (a fresh name, deleted afterwards) and needs root."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import uuid
from typing import Any

import pytest

from airflow_dbqueue.engine.embedded import _ensure_user

PROCESSES = 6

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="creates a system user: needs root"
)


def _racer(name: str, barrier: Any, results: Any) -> None:
    barrier.wait()
    try:
        results.put(("ok", _ensure_user(name).pw_uid))
    except Exception as e:  # reported to the test, which names it
        results.put(("error", f"{type(e).__name__}: {e} {getattr(e, 'stderr', b'')!r}"))


def test_processes_creating_the_user_at_once_all_get_it() -> None:
    """Six processes find the user missing at the same moment and ask for it: each gets the same uid,
    none fails (without the lock, every ``useradd`` but one fails: the user exists, or /etc/passwd is
    locked by another ``useradd``)."""
    name = f"dbq-race-{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(name, barrier, results)) for _ in range(PROCESSES)]
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        assert [kind for kind, _ in got] == ["ok"] * PROCESSES, got
        assert len({uid for _, uid in got}) == 1, got
        assert _ensure_user(name).pw_uid == got[0][1]
    finally:
        subprocess.run(["userdel", name], capture_output=True, check=False)
