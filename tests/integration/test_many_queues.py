"""Many queues in one schema: a queue's stats read what that queue holds, and a maintenance run's steps
send as many statements for forty queues as for four (PostgreSQL, where the dialect counts a schema at
once). Every message moved is counted and checksummed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from tests.helpers import checksum
from tests.integration.test_plans import scans

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue

pytestmark = pytest.mark.integration


def counting(dbq: DbQueue) -> Counter[str]:
    """Count the named statements ``dbq`` sends from now on, by name (the real database object, its
    three ways of running a named statement wrapped)."""
    sent: Counter[str] = Counter()
    db: Any = dbq.db
    for method in ("fetchall", "fetchone", "execute"):
        real = getattr(db, method)

        def wrapped(name: str, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            sent[name] += 1
            return _real(name, *args, **kwargs)

        setattr(db, method, wrapped)
    return sent


def fill(dbq: DbQueue, n: int, start: int) -> Iterator[tuple[str, list[Any], list[Any]]]:
    """n table queues, each pushed 6 messages and popped 2; the first two of them also lease one
    message each, with a lease that expires at once."""
    for i in range(start, start + n):
        q = dbq.create_queue(f"mq_{i}", visibility_timeout=0.05)
        payloads = [{"q": i, "k": k} for k in range(6)]
        q.push_batch(payloads)
        out = [m.payload for m in q.pop(2)]
        if i < start + 2:
            q.pop(1, semantics="at-least-once")
        yield q.name, payloads, out


def run_steps(dbq: DbQueue) -> Counter[str]:
    sent = counting(dbq)
    m = dbq.maintenance()
    m.recover()
    m.sample()
    m.metrics()
    return sent


def test_maintenance_steps_send_as_many_statements_for_forty_queues_as_for_four(
    pg_dsn: str, dbq: DbQueue
) -> None:
    """recover(), sample() and metrics() over 4 and over 44 table queues (two with an expired lease each
    time): the same statements, as many of each; the two leases are reclaimed, and every message comes
    out once."""
    import time

    from airflow_dbqueue.engine import DbQueue as Client

    moved: dict[str, tuple[list[Any], list[Any]]] = {}
    counts = []
    for n, start in ((4, 0), (40, 4)):
        moved.update({name: (p, out) for name, p, out in fill(dbq, n, start)})
        dbq.maintenance().sample()  # every queue has a previous sample: the next one counts its flow
        time.sleep(0.1)  # the leases expire
        with Client(pg_dsn, schema=dbq.schema) as fresh:  # handles opened by the run itself
            counts.append(run_steps(fresh))
    assert counts[0] == counts[1], (counts[0], counts[1])
    assert counts[1]["stats_all"] == 2 and "stats" not in counts[1], counts[1]
    assert counts[1]["reclaim_expired"] == 2 and counts[1]["table_flow_all"] == 1, counts[1]
    # every message once: what came out before, then the rest now (the reclaimed ones ready again)
    for name, (payloads, out) in moved.items():
        q = dbq.queue(name)
        stats = q.stats()
        assert (stats.ready, stats.in_flight, stats.finished) == (4, 0, 2), (name, stats)
        rest = [m.payload for m in q.pop(10)]
        assert len(rest) == 4 and checksum(out + rest) == checksum(payloads), name
    recorded = dbq.maintenance().sample()  # its counts since the last sample: the pops just above
    assert (
        recorded["queues"]["mq_0"]
        == recorded["queues"]["mq_43"]
        == {
            "pushed": 0,
            "popped": 4,
            "push_total": None,
            "pop_total": None,
        }
    )


def test_a_queues_stats_read_only_its_own_finished_messages(dbq: DbQueue) -> None:
    """With 20,000 finished messages of another queue in done, a small queue's stats read its own
    entries of done's queue index, never a whole partition."""
    big = dbq.create_queue("mq_big")
    small = dbq.create_queue("mq_small")
    payloads = [{"i": i} for i in range(20000)]
    big.push_batch(payloads)
    got = [m.payload for m in big.pop(20000)]
    small.push_batch([{"s": s} for s in range(3)])
    one = [m.payload for m in small.pop(1)]
    with dbq.db.connection() as c:  # type: ignore[attr-defined]
        read = scans(c, dbq.schema, small.stats)
    stats = small.stats()
    assert (stats.ready, stats.finished) == (2, 1), stats
    assert read["done"][0] == 0, read  # no sequential scan of done
    assert read["done_queue_idx"][1] <= 5, read
    assert big.stats().finished == 20000 and checksum(got) == checksum(payloads)
    assert one == [{"s": 0}]


def test_stats_above_the_cap_are_estimated_and_say_so(dbq: DbQueue) -> None:
    """A state with more messages than the table design counts exactly is estimated from a sample, and
    the stats say so; below the cap, or with exact=True, every figure is exact and nothing says
    estimated."""
    from airflow_dbqueue.engine.table import STATS_EXACT_CAP

    q = dbq.create_queue("mq_deep", payload_type="bytes")
    n = STATS_EXACT_CAP + 10_000
    for start in range(0, n, 10_000):
        q.push_batch([i.to_bytes(4, "big") * 75 for i in range(start, start + 10_000)])
    stats = q.stats()
    assert stats.extra.get("estimated") is True and stats.as_dict()["estimated"] is True
    assert 0.8 * n <= stats.ready <= 1.2 * n, stats
    assert stats.delayed == stats.in_flight == stats.failed == 0
    assert stats.oldest_ready_age_s is not None and stats.oldest_ready_age_s >= 0
    counted = q.stats(exact=True)  # asked for: every message counted, nothing estimated
    assert "estimated" not in counted.extra and counted.ready == n, counted
    taken = 0
    while batch := q.pop_payloads(1000):
        taken += len(batch)
        if taken >= 30_000:
            break
    exact = q.stats()
    assert "estimated" not in exact.extra and exact.ready == n - taken, exact
    rest = 0
    while batch := q.pop_payloads(1000):
        rest += len(batch)
    assert taken + rest == n
