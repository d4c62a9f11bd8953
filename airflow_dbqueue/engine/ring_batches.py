"""A ring's batches (:mod:`airflow_dbqueue.engine.batches`): an at-least-once pop of a consumer group
recorded in the batch ledger under an id, read elsewhere by number range.

A claim is the group's pop at least once (its leases: one ``ring_leases`` row for the numbers taken from
the lanes, a ``ring_retry`` row leased for each message delivered again) and the ledger row naming its
receipts, in one transaction. The batch's messages hold the ring's floor as any lease does, so no push
overwrites their slots until the batch is acked, released, or its lease expires and its messages are
delivered and finished elsewhere. A batch's numbers were all held at once, so they lie within one
capacity of each other: its reader (:meth:`RingBatches.batch_query`) reads the slots of that range (one
run of slots, or two where it wraps), each matched to its number by slot and ``seq``, and takes a
slot's payload only while it still holds the batch's number: a slot overwritten since reads as no
payload, as a message no longer held does on the table design. The ledger's key is the group's
(:attr:`RingBase._gid`), so each group has batches of its own.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine.batches import BatchLedger
from airflow_dbqueue.engine.errors import DatabaseError
from airflow_dbqueue.engine.models import Batch, Message, Semantics
from airflow_dbqueue.engine.queue import DEFAULT_CONSUMER, RECLAIM_LIMIT, _check_batch_size
from airflow_dbqueue.engine.ring_base import RingBase

if TYPE_CHECKING:
    from airflow_dbqueue.engine.dialects.base import DbConnection


class RingBatches(RingBase, BatchLedger):
    """Claiming, reading, acking, releasing and extending a ring group's batches."""

    if TYPE_CHECKING:  # the pops of RingQueue (ring.py), which a claim runs

        def _take(
            self, n: int, semantics: Semantics, vt: float, consumer: str, conn: DbConnection | None
        ) -> list[Message]: ...

        def _pop_slow(self, params: dict[str, Any], n: int, conn: DbConnection | None) -> list[Message]: ...

        def _reclaim(self, limit: int, conn: DbConnection | None) -> int: ...

    @property
    def _ledger_key(self) -> int:
        return self._gid

    def claim_batch(
        self,
        n: int,
        *,
        visibility_timeout: float | None = None,
        consumer: str | None = None,
        conn: DbConnection | None = None,
    ) -> Batch | None:
        vt = self._visibility_timeout(visibility_timeout)
        n = _check_batch_size(n)
        who = consumer or DEFAULT_CONSUMER
        batch = self._claim(n, vt, who, conn)
        if batch is None and conn is None:
            with self._or_gone():  # a gap's pops fail on a group dropped meanwhile
                if self._pass_gap(who):
                    batch = self._claim(n, vt, who, conn)
        if batch is None and self._gid != self._qid:
            self._raise_if_gone(conn)  # a group dropped meanwhile takes nothing
        return batch

    def _pass_gap(self, consumer: str) -> bool:
        """Give up the numbers of a push that rolled back or died at the head of the group's lanes, as a
        pop does; return whether one was given up. A claim runs in a transaction, where a pop neither
        reports nor gives up such a gap: pops of none of the group outside it do, one to see the gap,
        one to list its holders and one to give it up once they are gone (or after gap_timeout)."""
        params = {**self._help_params, "queue_id": self._gid, "consumer": consumer}
        for _ in range(3):
            with self._lock:
                before = self._gap
            self._pop_slow(params, 0, None)
            with self._lock:
                after = self._gap
            if after is None:
                return before is not None
            if after == before:
                return False  # a holder is still alive: the gap stays until it ends or gap_timeout
        return False

    def _claim(self, n: int, vt: float, consumer: str, conn: DbConnection | None) -> Batch | None:
        try:
            with self._db.transaction(conn) as c:
                receipts, until = self._take_receipts(n, vt, consumer, c)
                if not receipts:
                    return None
                receipts.sort()
                assert until is not None, "a lease taken has an end"
                params = {
                    "batch_id": uuid.uuid4(),
                    "group": self._gid,
                    "ids": [r[0] for r in receipts],
                    "deliveries": [r[1] for r in receipts],
                    "consumer": consumer,
                    "lease_until": until,
                }
                row = self._db.fetchone("ring_record_batch", params, c)
        except DatabaseError:
            self._raise_if_gone()
            raise
        assert row is not None
        return self._batch(row)

    def _take_receipts(
        self, n: int, vt: float, consumer: str, conn: DbConnection
    ) -> tuple[list[tuple[int, int]], dt.datetime | None]:
        """A claim's pop at least once in ``conn``: the receipts taken and their lease's end.

        Messages on their first delivery come from the lanes by ``ring_take_lease_ids``, whose rows
        carry no payload where the dialect can leave it out (PostgreSQL: (id, lease_until), the end on
        the first row only; SQL Server sends ring_take's whole rows, lease_until fifth); the batch's
        reader fetches the payloads. When that takes nothing (messages to deliver again are due, or the
        lanes stop at a number not written yet), the group's pop takes them as any pop does.
        """
        now = time.monotonic()
        if now - self._last_reclaim >= self.reclaim_every:  # as every pop does: expired leases first
            self._last_reclaim = now
            self._reclaim(RECLAIM_LIMIT, conn)
        params = {
            "queue_id": self._gid,
            "capacity": self.capacity,
            "lanes": self.lanes,
            "n": n,
            "visibility_timeout_s": vt,
            "consumer": consumer,
        }
        rows = self._db.fetchall("ring_take_lease_ids", params, conn)
        if rows:
            at = 1 if len(rows[0]) == 2 else 4
            until = next((r[at] for r in rows if r[at] is not None), None)
            return [(int(r[0]), 1) for r in rows], until
        msgs = self._take(n, Semantics.AT_LEAST_ONCE, vt, consumer, conn)
        ends = [m.lease_until for m in msgs if m.lease_until is not None]
        return [(m.id, m.delivery) for m in msgs], min(ends, default=None)

    def batch_query(self, batch_id: str) -> str:
        batch = self.get_batch(batch_id)
        ids = [r[0] for r in batch.receipts]
        lo, hi = min(ids) % self.capacity, max(ids) % self.capacity
        # The slots of the batch's numbers: lo..hi, or lo..the last slot and 0..hi where the range wraps
        # (an empty second range, 1..0, where it does not).
        if lo <= hi:
            ranges = {"a_lo": lo, "a_hi": hi, "b_lo": 1, "b_hi": 0}
        else:
            ranges = {"a_lo": lo, "a_hi": self.capacity - 1, "b_lo": 0, "b_hi": hi}
        params = {
            "batch_id": uuid.UUID(batch.batch_id),
            "queue_id": self._qid,
            "group": self._gid,
            "capacity": self.capacity,
            **ranges,
        }
        return self._db.render("ring_batch_rows", params)

    def _batch_receipt_params(self, receipts: Sequence[tuple[int, int]]) -> dict[str, Any]:
        return {
            "ids": [r[0] for r in receipts],
            "deliveries": [r[1] for r in receipts],
            "capacity": self.capacity,
            "lanes": self.lanes,
            "queue_id": self._qid,
            "group": self._gid,
        }

    def _held(self, receipts: Sequence[tuple[int, int]], conn: DbConnection) -> list[tuple[int, int]]:
        rows = self._db.fetchall("ring_held_receipts", self._batch_receipt_params(receipts), conn)
        return [(int(r[0]), int(r[1])) for r in rows]

    def _extend(self, receipts: Sequence[tuple[int, int]], seconds: float, conn: DbConnection) -> dt.datetime:
        params = self._batch_receipt_params(receipts)
        row = self._db.fetchone("ring_extend_batch", {**params, "secs": seconds}, conn)
        assert row is not None
        if int(row[0]) != len(receipts):
            self._raise_lost(params, conn)
        until: dt.datetime = row[1]
        return until
