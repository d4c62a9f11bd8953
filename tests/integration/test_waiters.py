"""Many threads of one process waiting on one queue: one listening connection serves them all.

A waiting pop holds no pooled connection while it waits, so fifty waiters work on a pool of ten; each
notification wakes one waiter (which passes the wake on once it took something), not all of them; and
no message waits for a waiter's poll, even after the listening connection was killed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.dialects.postgres import hub
from tests.helpers import checksum

pytestmark = pytest.mark.integration

WAITERS = 50
MESSAGES = 150
POLL_S = 60.0
"""The waiters' poll: far longer than the test, so a message found only by a poll would be late by
tens of seconds."""


def _run(dbq: DbQueue, q: Any, kill_listener_at: int | None = None) -> tuple[list[Any], list[float], int]:
    wakes = 0
    lock = threading.Lock()
    real_wait = hub.Waiter.wait

    def counting_wait(self: hub.Waiter, timeout: float) -> bool:
        nonlocal wakes
        got = real_wait(self, timeout)
        if got:
            with lock:
                wakes += 1
        return got

    got: list[Any] = []
    latencies: list[float] = []
    errors: list[str] = []
    stop = threading.Event()

    def waiter() -> None:
        try:
            while not stop.is_set():
                for m in q.pop(1, wait=5, poll_interval=POLL_S):
                    with lock:
                        got.append(m.payload)
                        latencies.append(time.time() - m.payload["at"])
        except Exception as exc:  # reported below
            errors.append(f"{type(exc).__name__}: {exc}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hub.Waiter, "wait", counting_wait)
        threads = [threading.Thread(target=waiter) for _ in range(WAITERS)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # every thread is waiting
        sent = []
        for i in range(MESSAGES):
            if i == kill_listener_at:
                with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
                    killed = c.execute(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = 'airflow-dbqueue-listen'"
                    ).fetchone()
                assert killed == (1,), "one listening connection serves every waiter"
            payload = {"i": i, "at": time.time()}
            q.push(payload)
            sent.append(payload)
            time.sleep(0.02)
        deadline = time.monotonic() + 20
        while len(got) < MESSAGES and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(30)
    assert errors == []
    assert checksum(got) == checksum(sent) and len(got) == MESSAGES
    return got, latencies, wakes


def test_fifty_waiters_on_a_pool_of_ten(pg_dsn: str, schema_name: str) -> None:
    """Every message once, none waited for a poll, and about one wake a message (the NOTIFY's, and
    the one passed on), where waking every waiter would make fifty."""
    with DbQueue(pg_dsn, schema=schema_name, pool_size=10) as dbq:
        dbq.install()
        try:
            q = dbq.create_queue("q")  # notify="auto"
            _, latencies, wakes = _run(dbq, q)
            assert max(latencies) < POLL_S / 4, (
                f"a message waited {max(latencies):.1f}s: it was found by a poll"
            )
            assert wakes <= 3 * MESSAGES, f"{wakes} wakes for {MESSAGES} messages"
        finally:
            dbq.uninstall()


def test_waiters_go_on_after_the_listening_connection_is_killed(pg_dsn: str, schema_name: str) -> None:
    with DbQueue(pg_dsn, schema=schema_name, pool_size=10) as dbq:
        dbq.install()
        try:
            q = dbq.create_queue("r", design="ring", capacity=500, notify="always")
            _, latencies, _ = _run(dbq, q, kill_listener_at=MESSAGES // 2)
            assert max(latencies) < POLL_S / 4, (
                f"a message waited {max(latencies):.1f}s: it was found by a poll"
            )
        finally:
            dbq.uninstall()
