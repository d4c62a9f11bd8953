"""The engine's own transactions run at READ COMMITTED whatever the database's default; a caller's own
transaction keeps its level.

Every claim is written for READ COMMITTED: a pop skips what others locked and takes what committed
before its statement began. A database whose ``default_transaction_isolation`` is ``serializable`` (set
on a database of the test's own) made concurrent pops fail with serialization failures of the engine's
own statements.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.conninfo
import pytest

from airflow_dbqueue.engine import TransientDatabaseError
from tests.conftest import installed_dbq
from tests.helpers import checksum
from tests.pgbouncer import PgBouncer

pytestmark = pytest.mark.integration


@pytest.fixture
def serializable_db(pg_dsn: str) -> Iterator[str]:
    """A database of the test's own whose default isolation is SERIALIZABLE; its name."""
    name = f"dbq_ser_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
        c.execute(f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'serializable'")
    try:
        yield name
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _on(pg_dsn: str, dbname: str) -> str:
    return psycopg.conninfo.make_conninfo(pg_dsn, dbname=dbname)


@pytest.mark.parametrize("design", ["table", "ring"])
@pytest.mark.parametrize("topology", ["direct", "pgbouncer-transaction"])
def test_concurrent_pops_on_a_serializable_database(
    pg_dsn: str, serializable_db: str, design: str, topology: str, request: pytest.FixtureRequest
) -> None:
    """Eight threads push and pop at least once and exactly once (in ``DbQueue.transaction()``) on a
    database whose default is SERIALIZABLE: no error, every message once."""
    server = _on(pg_dsn, serializable_db)
    with psycopg.connect(server) as c:  # the database's default is what the test says it is
        assert c.execute("SHOW transaction_isolation").fetchone() == ("serializable",)
    kw: dict[str, Any] = {}
    dsn = server
    if topology != "direct":
        bouncer: PgBouncer = request.getfixturevalue("pgbouncer")
        dsn = bouncer.dsn("transaction", dbname=serializable_db)
        kw = {"pooler": "transaction", "listen_dsn": server}
    with installed_dbq(dsn, "q", **kw) as dbq:
        ring = {"capacity": 400} if design == "ring" else {}
        q = dbq.create_queue("q", design=design, **ring)
        pushed: list[Any] = []
        got: list[Any] = []
        errors: list[str] = []
        lock = threading.Lock()

        def worker(k: int) -> None:
            try:
                for i in range(40):
                    batch = [{"k": k, "i": i, "j": j} for j in range(5)]
                    q.push_batch(batch)
                    with lock:
                        pushed.extend(batch)
                    if k % 2:
                        msgs = q.pop(5, semantics="at-least-once")
                        q.ack(msgs)
                    else:
                        with dbq.transaction() as conn:
                            msgs = q.pop(5, semantics="exactly-once", conn=conn)
                    with lock:
                        got.extend(m.payload for m in msgs)
            except Exception as exc:  # every thread's errors are reported below
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert errors == []
        while rest := q.pop(100, semantics="at-most-once"):
            got.extend(m.payload for m in rest)
        assert len(got) == len(pushed) == 8 * 40 * 5
        assert len({(p["k"], p["i"], p["j"]) for p in got}) == len(got)
        assert checksum(got) == checksum(pushed)


@pytest.mark.parametrize("design", ["table", "ring"])
def test_exactly_once_in_a_callers_repeatable_read_transaction(
    pg_dsn: str, schema_name: str, design: str
) -> None:
    """A caller's own transaction keeps its level. At REPEATABLE READ a pop sees the snapshot of the
    transaction's first statement: a message another consumer took and committed since then cannot be
    taken again, and the pop raises ``TransientDatabaseError`` (a serialization failure); the caller runs
    its transaction again and gets the next message. Nothing is lost or taken twice."""
    with installed_dbq(pg_dsn, schema_name) as dbq:
        ring = {"capacity": 100} if design == "ring" else {}
        q = dbq.create_queue("q", design=design, **ring)
        q.push_batch(["m1", "m2"])
        with psycopg.connect(pg_dsn) as caller:
            caller.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            caller.execute("SELECT 1")  # the transaction's snapshot is taken here
            with dbq.transaction() as other:  # another consumer takes m1 and commits
                assert [m.payload for m in q.pop(1, semantics="exactly-once", conn=other)] == ["m1"]
            with pytest.raises(TransientDatabaseError, match="serializ"):
                q.pop(1, semantics="exactly-once", conn=caller)
            caller.rollback()
            got = q.pop(1, semantics="exactly-once", conn=caller)
            assert caller.execute("SHOW transaction_isolation").fetchone() == ("repeatable read",)
            caller.commit()
        assert [m.payload for m in got] == ["m2"]
        assert q.pop(10, semantics="at-most-once") == []
