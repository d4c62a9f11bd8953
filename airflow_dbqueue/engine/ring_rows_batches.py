"""Batches on a ring of the rows layout (:mod:`airflow_dbqueue.engine.ring_rows`): claimed together under
one id, read elsewhere by that id, acked or released whole, with the calls and states of every design's
(:class:`~airflow_dbqueue.engine.batches.BatchLedger`), and only inserts on the way.

A claim is a pop at least once (its lease row, and a leased retry row for each message delivered again)
and one row naming its receipts in the ring's own ledger table (``ring_<queue_id>_rb``), in one
statement. The batch's messages hold their segments as any lease does, so no push empties a segment
under an open batch; once the batch is acked or released, or its lease expired and its messages were
finished elsewhere, the segment can be emptied and reused. Each later state of the batch (acked,
released, claimed with a lease extended) is a new row of ``ring_<queue_id>_rbs``, the highest ``ver``
its state; an ack in the caller's transaction writes the done row of its lease and that row together
(exactly once). Extending a batch splits its lease and writes one leased retry row a message.

The ledger is not segmented: a finished batch is remembered until the upkeep forgets it
(:attr:`BatchLedger.batch_retention_s`), which deletes its rows, the one statement on these tables that
does. The batch's reader (:meth:`RowsRingBatches.batch_query`) calls the ring's own function, which reads
each row of the batch once, by its number, in the segment of that number: row numbers are never issued
twice, so a segment emptied and reused since gives no payload for the batch's messages.

Each consumer group has a ledger of its own: a group besides the default one has its own copy of the
ledger tables and of the functions of batches (``ring_g<n>_rb*``, with its other objects,
:mod:`airflow_dbqueue.engine.ring_rows_groups`), over its own leases and retry log, so its claims, acks
and extensions only insert too, its open batches hold the ring's segments as its pops' leases do (a
segment is emptied only when no group needs it), and dropping the group drops its batches. Rows are
also keyed by the group (:attr:`RowsRingBatches._ledger_key`).
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine.batches import BatchLedger
from airflow_dbqueue.engine.errors import (
    BatchNotFoundError,
    DatabaseError,
    LeaseExpiredError,
    NotSupportedError,
    SchemaError,
)
from airflow_dbqueue.engine.models import Batch, BatchState, Message
from airflow_dbqueue.engine.queue import DEFAULT_CONSUMER, RECLAIM_LIMIT, _check_batch_size
from airflow_dbqueue.engine.ring_base import waiting_out_locks

if TYPE_CHECKING:
    from airflow_dbqueue.engine.dialects.base import DbConnection


class RowsRingBatches(BatchLedger):
    """Claiming, reading, acking, releasing and extending the batches of a ring of the rows layout."""

    if TYPE_CHECKING:  # RowsRingQueue's (ring_rows.py, ring_rows_groups.py)
        _qid: int
        _gid: int
        group_name: str
        _last_reclaim: float
        reclaim_every: float
        lane_timeout: float

        def _reclaim(self, limit: int, conn: DbConnection | None) -> int: ...

        def _give_up_gaps(self, *, force: bool = False) -> int: ...

        def _raise_if_gone(self, conn: DbConnection | None = None) -> None: ...

        def _messages(self, rows: Sequence[Sequence[Any]]) -> list[Message]: ...

        def _receipt_params(self, messages: Sequence[Message]) -> dict[str, Any]: ...

        def _own(self) -> str: ...

    _has_batches: bool | None = None  # whether the ring has the functions of batches (read once)

    @property
    def _ledger_key(self) -> int:
        """The key of this handle's consumer group in its ledger: the ring's queue id (its default group)
        or the group's gid."""
        return self._gid

    def _own_fn(self, fn: str) -> dict[str, str]:
        """The identifiers of a call of the group's own function ``fn``."""
        return {"fn": self._own() + fn}

    def _batches_made(self) -> bool:
        """Whether the ring has the functions of batches: a ring made by a build without them (its
        functions are made at its creation) lacks them. Read once a handle."""
        if self._has_batches is None:
            row = self._db.fetchone(
                "ring_rows_has_function", {"schema": self._db.schema, "fn": self._own_fn("bclaim")["fn"]}
            )
            if row is None or not row[0]:
                self._raise_if_gone()
            self._has_batches = bool(row and row[0])
        return self._has_batches

    def _need_batches(self) -> None:
        if self._batches_made():
            return
        if self._gid != self._qid:
            raise NotSupportedError(
                f"queue {self.name!r}: consumer group {self.group_name!r} of this ring of the rows layout "
                "was added by an earlier build, without batches; drop the group and add it again for them"
            )
        raise NotSupportedError(
            f"queue {self.name!r}: this ring of the rows layout was made by an earlier build, without "
            "batches; drop it and create it again for them"
        )

    def _found_nothing(self, conn: DbConnection | None = None) -> None:
        if self._gid != self._qid:  # the default group's calls fail on a ring dropped: its functions went
            self._raise_if_gone(conn)

    def _batch_params(self, batch_id: str) -> dict[str, Any]:
        return {"batch_id": self._batch_key(batch_id)["batch_id"], "group": self._ledger_key}

    # -- claim -------------------------------------------------------------------------------------

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
        self._need_batches()
        params = {
            "group": self._ledger_key,
            "n": n,
            # when other pops hold every lane with messages, wait for one (not in a caller's transaction,
            # which may hold lanes of its own), as a pop does
            "wait": conn is None,
            "visibility_timeout_s": vt,
            "consumer": consumer or DEFAULT_CONSUMER,
        }
        if conn is not None:
            return self._claim(params, conn)

        def claim() -> Batch | None:
            batch = self._claim(params, None)
            if batch is None and self._give_up_gaps():
                batch = self._claim(params, None)
            return batch

        # A claim that found the lanes with rows held by other transactions fails with LockTimeoutError,
        # having taken nothing, as a pop does: it is tried again for up to lane_timeout.
        return waiting_out_locks(claim, None, self.lane_timeout)

    def _claim(self, params: dict[str, Any], conn: DbConnection | None) -> Batch | None:
        now = time.monotonic()
        if now - self._last_reclaim >= self.reclaim_every:  # as every pop does: expired leases first
            self._last_reclaim = now
            self._reclaim(RECLAIM_LIMIT, conn)
        try:
            row = self._db.fetchone(
                "ring_rows_claim_batch",
                {**params, "batch_id": uuid.uuid4()},
                conn,
                identifiers=self._own_fn("bclaim"),
            )
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        return None if row is None else self._batch(row)

    # -- the ledger ----------------------------------------------------------------------------------

    def get_batch(self, batch_id: str) -> Batch:
        return self._ledger_row(batch_id, lock=False, conn=None)

    def _locked_batch(self, batch_id: str, conn: DbConnection) -> Batch:
        return self._ledger_row(batch_id, lock=True, conn=conn)

    def _ledger_row(self, batch_id: str, *, lock: bool, conn: DbConnection | None) -> Batch:
        params = self._batch_params(batch_id)
        self._need_batches()
        try:
            row = self._db.fetchone(
                "ring_rows_get_batch", {**params, "lock": lock}, conn, identifiers=self._own_fn("bget")
            )
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        if row is None:
            self._found_nothing(conn)
            raise BatchNotFoundError(self.name, str(batch_id))
        return self._batch(row)

    def _set_batch_state(
        self,
        batch: Batch,
        state: BatchState,
        conn: DbConnection,
        *,
        lease_until: dt.datetime | None = None,
        error: str | None = None,
    ) -> None:
        params = {
            **self._batch_params(batch.batch_id),
            "state": state.code,
            "lease_until": lease_until,
            "error": error,
        }
        self._db.fetchone("ring_rows_set_batch", params, conn, identifiers=self._own_fn("bset"))

    def open_batches(self, limit: int = 100, *, consumer_prefix: str | None = None) -> list[Batch]:
        self._need_batches()
        params = {
            "group": self._ledger_key,
            "limit": _check_batch_size(limit),
            "consumer_prefix": consumer_prefix,
        }
        try:
            rows = self._db.fetchall("ring_rows_open_batches", params, identifiers=self._own_fn("bopen"))
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        return [self._batch(r) for r in rows]

    def _purge_batches(self, limit: int) -> int:
        if not self._batches_made():
            return 0
        params = {"group": self._ledger_key, "older_than_s": self.batch_retention_s, "n": limit}
        return len(self._db.fetchall("ring_rows_purge_batches", params, identifiers=self._own_fn("bpurge")))

    # -- read, hold, extend ----------------------------------------------------------------------------

    def batch_query(self, batch_id: str) -> str:
        batch = self.get_batch(batch_id)
        params = {"batch_id": uuid.UUID(batch.batch_id), "group": self._ledger_key}
        return self._db.render("ring_rows_batch_rows", params, identifiers=self._own_fn("brows"))

    def leased(self, receipts: Sequence[tuple[int, int]]) -> list[Message]:
        stubs = self._receipt_messages(receipts)
        if not stubs:
            return []
        self._need_batches()
        params = self._receipt_params(stubs)
        try:
            rows = self._db.fetchall("ring_rows_leased", params, identifiers=self._own_fn("leased"))
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        return self._messages(rows) if rows else []

    def _held(self, receipts: Sequence[tuple[int, int]], conn: DbConnection) -> list[tuple[int, int]]:
        params = self._receipt_params(self._receipt_messages(receipts))
        return [(int(r[0]), int(r[1])) for r in self._db.fetchall("ring_rows_held", params, conn)]

    def _extend(self, receipts: Sequence[tuple[int, int]], seconds: float, conn: DbConnection) -> dt.datetime:
        params = self._receipt_params(self._receipt_messages(receipts))
        row = self._db.fetchone(
            "ring_rows_extend", {**params, "secs": seconds}, conn, identifiers=self._own_fn("bextend")
        )
        assert row is not None
        if int(row[0]) != len(params["ids"]):
            held = set(self._held(receipts, conn))
            lost = [i for i, d in zip(params["ids"], params["deliveries"], strict=True) if (i, d) not in held]
            raise LeaseExpiredError(self.name, lost or list(params["ids"]))
        until: dt.datetime = row[1]
        return until
