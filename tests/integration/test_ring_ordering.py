"""Ordering per key on a ring of the rows layout (design="ring", ordering="per_key"): a key maps to a
lane, a lane's FIFO gives the key's order, and at least once a lane is held while a message taken from
it is leased; a nack, a reclaim or a release puts it back at the lane's front.

Every test counts what went in and what came out, and compares checksums of the payloads.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest

from airflow_dbqueue.engine.errors import ConfigurationError, NotSupportedError
from tests.helpers import checksum, drained

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue, Message
    from airflow_dbqueue.engine.ring_rows import RowsRingQueue

pytestmark = pytest.mark.integration


def payloads(msgs: list[Message]) -> list[Any]:
    return [m.payload for m in msgs]


def keyed_ring(dbq: DbQueue, name: str = "o", **kw: Any) -> RowsRingQueue:
    kw.setdefault("capacity", 64)
    kw.setdefault("lanes", 4)
    q = dbq.create_queue(name, design="ring", layout="rows", ordering="per_key", **kw)
    return q  # type: ignore[return-value]


def keys_in_lanes(q: RowsRingQueue) -> dict[int, str]:
    """One key a lane (the first found), so that a test can place messages in lanes of its choosing."""
    out: dict[int, str] = {}
    i = 0
    while len(out) < q.lanes:
        out.setdefault(q.lane_of(f"k{i}"), f"k{i}")
        i += 1
    return out


def test_smoke(dbq: DbQueue) -> None:
    q = keyed_ring(dbq, retry_backoff=0, max_attempts=10)
    lk = keys_in_lanes(q)
    a, b = lk[0], lk[1]
    q.push_batch(["a1", "a2", "a3"], keys=[a, a, a])
    q.push_batch(["b1", "x", "b2"], keys=[b, None, b])
    q.push("a4", key=a)
    first = q.pop(10, semantics="at-least-once")
    print(payloads(first))
