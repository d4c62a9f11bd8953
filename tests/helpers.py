"""Checks shared by the test suites, defined once so that they cannot drift apart.

:func:`checksum` is the order-independent digest of a multiset of JSON payloads (the example DAG
``dbqueue_produce_consume`` computes the same one, so a test can compare its result with this).
:func:`payload_hash` is a per-payload hash for checks that add up what many processes report.
:func:`drained` says whether a queue has nothing left to deliver. :func:`require` turns a missing
system requirement into a skip, or into a failure under ``scripts/test``, which installs them all.
:func:`load_benchmark` imports a script of benchmarks/ to test its own checks, :func:`run_benchmark`
runs one and reads the JSON it prints. :func:`held_horizon`
opens a session that holds the xmin horizon, as a report job left idle in its transaction would;
:func:`horizon_watch` records what held it while a block ran. :func:`peek_then_pop` checks that a ring's
peek shows what its next pop takes.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from benchmarks.bench.forkserver import forkserver_context

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext

    from airflow_dbqueue.engine import Queue

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

CHILD_PRELOAD = ["tests.dialects", "tests.helpers"]
"""What the children's fork server imports once (with them the engine, both dialects, psycopg and
pytest): about a second of a child's start, which each child of a spawn spent importing them again."""


def child_processes() -> ForkServerContext:
    """The multiprocessing context of a test's child processes: ``forkserver`` (the benchmarks' own,
    :func:`~benchmarks.bench.forkserver.forkserver_context`). Each child is forked from a server process
    that started as a fresh interpreter and only imported :data:`CHILD_PRELOAD`: it never opened a
    connection, and each child builds its own :class:`DbQueue` from what it is passed. The server starts
    with the repository on ``$PYTHONPATH``, so that it and its children import tests.* wherever pytest
    was started; its environment is the test process's when it started (the first child of the
    process): a child does not see a variable set afterwards."""
    return forkserver_context(CHILD_PRELOAD, BENCHMARKS.parent)


STRICT_ENV = "DBQUEUE_TEST_STRICT"
"""Set by ``scripts/test``: every system requirement of the suite was installed, so a missing one is a
failure rather than a skip."""


def checksum(payloads: Iterable[Any]) -> str:
    """Order-independent checksum of a multiset of JSON payloads: a lost, extra, duplicated or changed
    payload changes it (the JSON texts hold no newline, so the joined text names the multiset)."""
    return hashlib.sha256(
        "\n".join(sorted(json.dumps(p, sort_keys=True) for p in payloads)).encode()
    ).hexdigest()


def payload_hash(payload: Any) -> int:
    """A stable 56-bit hash of one JSON payload: it fits a bigint column on both dialects, and the sum of
    many can be reported by each process and added up."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")


def drained(q: Queue) -> bool:
    """Whether ``q`` has nothing ready, delayed or in flight."""
    st = q.stats()
    return bool(st.ready == 0 and st.delayed == 0 and st.in_flight == 0)


def strict() -> bool:
    """Whether the suite runs under ``scripts/test`` (see :data:`STRICT_ENV`)."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def require(missing: str | None, hint: str) -> None:
    """Stop a test whose system requirement is ``missing`` (None: nothing is): fail under
    ``scripts/test``, which installs every requirement, else skip; ``hint`` says how to install it."""
    if missing is None:
        return
    message = f"{missing} ({hint})"
    if strict():
        pytest.fail(f"{message}; ${STRICT_ENV} is set, so this fails instead of skipping", pytrace=False)
    pytest.skip(message)


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` (a folder of scripts that import each other by bare name)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while it runs
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def run_benchmark(name: str, *args: str) -> list[Any]:
    """Run ``benchmarks/<name>.py`` with ``args`` (a ``--json`` among them) in this Python, which must
    succeed. Return what it printed, a JSON value a line."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def notified_so_far(listener: psycopg.Connection[Any], dsn: str, channel: str, timeout: float = 30.0) -> int:
    """How many notifications ``listener`` (autocommit, LISTENing on ``channel``) gets from the
    transactions committed before this call: it sends a NOTIFY of its own on ``channel`` (a payload no
    other sender uses) from a connection to ``dsn`` of its own, and counts what comes before that one.
    PostgreSQL delivers the notifications of different transactions to a listener in the order they
    committed, so no notification of an earlier transaction can come after it: no fixed time is waited
    for one that may come late. Fails when the sentinel itself does not arrive within ``timeout``."""
    sentinel = f"sentinel-{uuid.uuid4().hex}"
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SELECT pg_notify(%s, %s)", (channel, sentinel))
    for got, n in enumerate(listener.notifies(timeout=timeout)):
        if n.channel == channel and n.payload == sentinel:
            return got
    raise AssertionError(f"the sentinel NOTIFY on {channel!r} did not come within {timeout} s")


def push_holding_the_waiters_lock(dsn: str, schema: str, queue_id: int) -> psycopg.Connection[Any]:
    """A connection whose open transaction holds the queue's waiters' lock exclusively, as a table-design
    push that found nobody waiting does until it commits: a notify="auto" push meanwhile cannot tell
    whether somebody waits and asks whether the queue had a ready message (table_push in
    functions.sql). Close it to end the transaction."""
    c = psycopg.connect(dsn)
    c.execute(
        "SELECT pg_advisory_xact_lock(hashtext('dbqueue.waiters.' || %s), %s::integer)",
        (psycopg.sql.Identifier(schema).as_string(None), queue_id),
    )
    return c


def held_horizon(
    dsn: str, *, application_name: str = "report-job", xid: bool = False
) -> psycopg.Connection[Any]:
    """A REPEATABLE READ transaction with its snapshot taken (a read of ``pg_class``, so that it locks none
    of the queue's tables), left open: it holds the xmin horizon until the caller closes it. ``xid``: it
    also takes a transaction id, as a transaction that wrote would."""
    conn = psycopg.connect(dsn, application_name=application_name)
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.execute("SELECT txid_current(), count(*) FROM pg_class" if xid else "SELECT count(*) FROM pg_class")
    return conn


def release_horizon(conn: psycopg.Connection[Any], dsn: str, timeout: float = 10.0) -> None:
    """Close a :func:`held_horizon` connection and wait until its server process has gone: the server
    ends the session after the client's close returns, and until then it still holds the horizon."""
    pid = conn.info.backend_pid
    conn.close()
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as probe:
        while probe.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
            assert time.monotonic() < deadline, f"session {pid} still open {timeout}s after its close"
            time.sleep(0.05)


@contextlib.contextmanager
def horizon_watch(dsn: str, exclude_pids: Iterable[int] = (), every: float = 0.01) -> Iterator[list[str]]:
    """Sample, every ``every`` seconds until the block ends, the sessions of ``dsn``'s database (other
    than ``exclude_pids``) that hold a snapshot or a transaction id, autovacuum's ANALYZE included, and
    the replication slots and prepared transactions that hold an xmin. Yields the list it fills with
    one line for each holder seen: a test whose premise is that nothing holds the horizon can tell an
    expected consequence of a holder from a defect."""
    seen: list[str] = []
    stop = threading.Event()
    skip = [*exclude_pids]

    def sample() -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            while not stop.is_set():
                rows = c.execute(
                    "SELECT format('%%s %%s %%s: %%s', backend_type, pid, state, left(query, 80)) "
                    "FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND pid <> ALL(%s) "
                    "AND datname = current_database() "
                    "AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) "
                    "UNION ALL SELECT format('slot %%s', slot_name) FROM pg_replication_slots "
                    "WHERE xmin IS NOT NULL "
                    "UNION ALL SELECT format('prepared %%s', gid) FROM pg_prepared_xacts",
                    [skip],
                ).fetchall()
                seen.extend(r[0] for r in rows if r[0] not in seen)
                stop.wait(every)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield seen
    finally:
        stop.set()
        t.join(10)


def engine_sessions(dsn: str) -> int:
    """Sessions the engine's pools opened on ``dsn``'s database (they name themselves
    ``airflow-dbqueue``; listening connections and PgBouncer's server connections carry other names)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'airflow-dbqueue' "
            "AND datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


def peek_then_pop(q: Any, shape: str, *, total: int, deep: int) -> None:
    """Push ``total`` messages through ring ``q`` (a ring of the slots layout, on either dialect) in
    pushes of 1 to 40, at least ``deep`` waiting once the ring has them, and pop them through a reader
    (the ring itself, or with ``shape`` "group" a consumer group from the earliest message, while the
    ring's default group pops ahead of it at its own pace): before each pop of n, peek(n) must show
    exactly what the pop takes, in its order, each with its deliveries so far. Leases stay open a few
    pops (their messages are left out of what the peek shows), some messages are nacked (delivered
    again, first). The ring must have 4 lanes at most (a pop of n, n >= 4, locks up to n of them).
    Every message is acked once by the reader (and taken once by the default group), counted and
    checksummed, and the ids must have gone round the ring's slots twice."""
    from airflow_dbqueue.engine import QueueFullError

    rng = random.Random(f"peek-then-pop-{shape}")
    q.push_timeout = 0.0  # a full ring answers at once: the pushes wait for the pops of the loop
    reader = q.add_group("g", start="earliest") if shape == "group" else q
    sent: list[Any] = []

    def push_some() -> None:
        while len(sent) < total:
            size = min(rng.randint(1, 40), total - len(sent))
            batch = [{"i": len(sent) + i, "pad": "p" * rng.randrange(200)} for i in range(size)]
            try:
                q.push_batch(batch)
            except QueueFullError:
                return
            sent.extend(batch)
            if len(sent) > deep and rng.random() < 0.3:
                return

    acked: list[Any] = []
    taken: list[Any] = []  # the default group's, on a group
    open_leases: list[list[Any]] = []
    pops = 0
    while pops < 20 * total:
        push_some()
        if shape == "group":
            taken += q.pop(rng.randint(10, 60))
        n = rng.randint(4, 30)
        shown = reader.peek(n)
        got = reader.pop(n, semantics="at-least-once")
        assert [(m.id, m.payload, m.delivery + 1) for m in shown] == [
            (m.id, m.payload, m.delivery) for m in got
        ]
        pops += 1
        if not got and not open_leases and len(sent) == total:
            break
        again = [m for m in got if m.delivery < 3 and rng.random() < 0.1]
        if again:
            assert reader.nack(again, delay=0) == len(again)
        rest = [m for m in got if m not in again]
        if rest:
            open_leases.append(rest)
        while open_leases and (not got or rng.random() < 0.5):  # leases stay open a few pops
            done = open_leases.pop(0)
            assert reader.ack(done) == len(done)
            acked += done
    assert pops > total // 30 and len(acked) == len(sent) == total == len({m.id for m in acked})
    assert max(m.id for m in acked) > 2 * q.settings.capacity  # the window went round the slots
    assert checksum(m.payload for m in acked) == checksum(sent)
    assert reader.peek() == [] and reader.count_ready() == 0
    if shape == "group":
        while batch := q.pop(100):
            taken += batch
        assert len(taken) == total == len({m.id for m in taken})
        assert checksum(m.payload for m in taken) == checksum(sent)
