"""A queue handle that outlives its queue (table design): a push after drop_queue raises
QueueNotFoundError and writes nothing, whoever holds the handle, and a push and a drop of its queue
serialize, so no row of a dropped queue is left behind whatever the interleaving. On a real PostgreSQL,
and on SQL Server given $DBQUEUE_TEST_MSSQL_DSN (skipped otherwise; never run yet) but for the two
tests that hold a PostgreSQL transaction open by hand."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from airflow_dbqueue.engine import DbQueue, QueueNotFoundError, TransientDatabaseError
from tests.dialects import dialect_dbq, postgres_only, run_sql  # noqa: F401 - dialect_dbq is the fixture "dbq"

pytestmark = pytest.mark.integration


def leftovers(dbq: DbQueue, queue_id: int) -> dict[str, int]:
    """Rows of ``queue_id`` in every table of the table design (data: payloads without a meta or done
    row, which only a push that outlived its queue would leave)."""
    out = {}
    for table in ("meta", "done", "archive", "batches", "queues"):
        [(n,)] = run_sql(
            dbq, f"SELECT count(*) FROM {{schema}}.{table} WHERE queue_id = %(q)s", {"q": queue_id}
        )
        out[table] = int(n)
    [(n,)] = run_sql(
        dbq,
        "SELECT count(*) FROM {schema}.data d "
        "WHERE NOT EXISTS (SELECT 1 FROM {schema}.meta m WHERE m.id = d.id) "
        "AND NOT EXISTS (SELECT 1 FROM {schema}.done f WHERE f.id = d.id)",
    )
    out["data"] = int(n)
    return out


NOTHING = {"meta": 0, "done": 0, "archive": 0, "batches": 0, "queues": 0, "data": 0}


@pytest.mark.parametrize("notify", ["auto", "never"])
def test_a_push_through_a_handle_of_a_dropped_queue_raises_and_writes_nothing(
    dbq: DbQueue, notify: str
) -> None:
    orders = dbq.create_queue("orders", notify=notify)
    qid = orders.settings.queue_id
    orders.push({"n": 1})
    other = DbQueue(dbq.db.dsn, schema=dbq.schema, dialect=dbq.dialect)  # another client holding a handle
    try:
        theirs = other.queue("orders")
        assert dbq.drop_queue("orders")
        for q in (orders, theirs):
            with pytest.raises(
                QueueNotFoundError, match=rf"queue 'orders' does not exist in schema '{dbq.schema}'"
            ):
                q.push({"n": 2})
            with pytest.raises(QueueNotFoundError):
                q.push_batch([{"n": 3}, {"n": 4}], delay=5)
        with dbq.transaction() as conn:  # inside a caller's transaction: raised, and the transaction goes on
            with pytest.raises(QueueNotFoundError):
                orders.push({"n": 5}, conn=conn)
            assert run_sql(dbq, "SELECT 1", conn=conn) == [(1,)]
    finally:
        other.close()
    assert leftovers(dbq, qid) == NOTHING
    # a queue created again under the name is another queue: the old handle still writes nothing
    again = dbq.create_queue("orders")
    with pytest.raises(QueueNotFoundError):
        orders.push({"n": 6})
    assert again.stats().ready == 0


def test_a_drop_waits_for_a_push_in_progress_and_leaves_nothing(dbq: DbQueue) -> None:
    q = dbq.create_queue("orders")
    qid = q.settings.queue_id
    dropped = threading.Event()
    with dbq.transaction() as conn:
        ids = q.push_batch([{"n": i} for i in range(50)], conn=conn)  # holds the queue's push lock
        t = threading.Thread(target=lambda: (dbq.drop_queue("orders"), dropped.set()))
        t.start()
        time.sleep(0.5)
        assert not dropped.is_set(), "the drop did not wait for the push in progress"
    t.join(timeout=30)
    assert dropped.is_set() and len(ids) == 50
    assert leftovers(dbq, qid) == NOTHING  # the push committed first, and was dropped


def test_a_push_that_waited_for_a_drop_finds_the_queue_gone(dbq: DbQueue, pg_dsn: str) -> None:
    """The push's statement begins (its snapshot still shows the queue) while a drop holds the queue's
    lock; the drop commits; the push must see that and write nothing."""
    postgres_only(dbq, "holds a drop open on a psycopg connection")
    q = dbq.create_queue("orders")
    qid = q.settings.queue_id
    result: list[Any] = []
    with psycopg.connect(pg_dsn) as dropper:  # a drop in progress, as drop_queue runs it, held open
        for name in ("drop_queue_lock", "drop_queue_messages", "drop_queue_finished", "drop_queue"):
            dropper.execute(dbq.db.query(name), {"queue_id": qid})  # type: ignore[attr-defined]

        def push() -> None:
            try:
                result.append(q.push({"n": 1}))
            except Exception as exc:
                result.append(exc)

        t = threading.Thread(target=push)
        t.start()
        time.sleep(0.5)
        assert not result, f"the push did not wait for the drop in progress: {result}"
        dropper.commit()
    t.join(timeout=30)
    assert len(result) == 1 and isinstance(result[0], QueueNotFoundError), result
    assert leftovers(dbq, qid) == NOTHING


def test_a_repeatable_read_push_after_a_drop_fails_as_transient(dbq: DbQueue, pg_dsn: str) -> None:
    """A snapshot taken before the drop still shows the queue: the push's row lock on it fails as a
    serialization error (transient: run the transaction again), and nothing is written."""
    postgres_only(dbq, "REPEATABLE READ on a psycopg connection")
    q = dbq.create_queue("orders")
    qid = q.settings.queue_id
    with psycopg.connect(pg_dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.execute("SELECT 1")  # the transaction's snapshot, taken now
        dbq.drop_queue("orders")
        with pytest.raises(TransientDatabaseError, match="serializ"):
            q.push({"n": 1}, conn=conn)
        conn.rollback()
        with pytest.raises(QueueNotFoundError):  # run again: the queue is gone
            q.push({"n": 1}, conn=conn)
    assert leftovers(dbq, qid) == NOTHING


def test_pushers_racing_a_drop_leave_no_row_behind(dbq: DbQueue) -> None:
    """Pushers push to a queue, one at a time and in batches, in their own transactions and in callers'
    ones, until it is dropped under them; each push either went in before the drop (and was dropped with
    the queue) or raised QueueNotFoundError. Several rounds: the interleaving differs each time."""
    for round_no in range(5):
        q = dbq.create_queue(f"race_{round_no}")
        qid = q.settings.queue_id
        stop = threading.Event()
        outcomes: list[str] = []
        errors: list[BaseException] = []

        def pusher(
            k: int,
            q: Any = q,
            stop: threading.Event = stop,
            outcomes: list[str] = outcomes,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                while not stop.is_set():
                    try:
                        if k % 2:
                            q.push_batch([{"k": k, "i": i} for i in range(20)])
                        else:
                            with dbq.transaction() as conn:
                                q.push({"k": k}, conn=conn)
                                q.push({"k": k}, conn=conn)
                        outcomes.append("pushed")
                    except QueueNotFoundError:
                        outcomes.append("not found")
                        return
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=pusher, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        assert dbq.drop_queue(f"race_{round_no}")
        time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        assert not errors, errors
        assert "pushed" in outcomes
        assert leftovers(dbq, qid) == NOTHING, f"round {round_no}: {outcomes.count('pushed')}"
