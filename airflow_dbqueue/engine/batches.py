"""The batch ledger that every design's batches share: claimed together under one lease and one id, read
elsewhere by id (a Spark job), acked or released whole.

A design records a claim in the ledger (``batches``, keyed by the batch id and the key of whoever owns
the batch: a table queue's id, a ring group's key) and says how its receipts are held, extended and read;
the ledger's states, their checks and the exactly-once ack in the caller's transaction are the same for
every design.
"""

from __future__ import annotations

import abc
import datetime as dt
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine.errors import BatchNotFoundError, BatchStateError, ConfigurationError
from airflow_dbqueue.engine.models import Batch, BatchState
from airflow_dbqueue.engine.queue import Queue, _check_batch_size, check_seconds

if TYPE_CHECKING:
    from airflow_dbqueue.engine.dialects.base import DbConnection


class BatchLedger(Queue):
    """The batch calls of :class:`Queue` over the ledger; a design supplies the parts marked abstract."""

    #: Seconds a finished batch stays in the ledger before the upkeep deletes it.
    batch_retention_s = 7 * 24 * 3600.0

    @property
    @abc.abstractmethod
    def _ledger_key(self) -> int:
        """The key of this handle's batches in the ledger (the ``queue_id`` column)."""

    @abc.abstractmethod
    def _held(self, receipts: Sequence[tuple[int, int]], conn: DbConnection) -> list[tuple[int, int]]:
        """The receipts of ``receipts`` whose lease is still held."""

    @abc.abstractmethod
    def _extend(self, receipts: Sequence[tuple[int, int]], seconds: float, conn: DbConnection) -> dt.datetime:
        """Push the leases of ``receipts`` out to ``seconds`` from now and return their end; raise
        :class:`LeaseExpiredError` when any of them was lost (the caller's transaction then rolls back)."""

    def _batch(self, row: tuple[Any, ...]) -> Batch:
        batch_id, state, ids, deliveries, consumer, claimed_at, lease_until, finished_at, error = row
        return Batch(
            batch_id=str(batch_id),
            queue=self.name,
            state=BatchState.from_code(state),
            receipts=tuple(zip(ids, deliveries, strict=True)),
            claimed_at=claimed_at,
            lease_until=lease_until,
            consumer=consumer,
            finished_at=finished_at,
            last_error=error,
        )

    def _found_nothing(self, conn: DbConnection | None = None) -> None:
        """Called where a batch call found none of this handle's batches: raise the error of its consumer
        group dropped meanwhile when that is why (a ring group's handle checks; a queue's own ledger
        rows outlive nothing it names)."""

    def _batch_key(self, batch_id: str) -> dict[str, Any]:
        try:
            key = uuid.UUID(str(batch_id))
        except ValueError:
            raise ConfigurationError(f"queue {self.name!r}: a batch id is a UUID, got {batch_id!r}") from None
        return {"batch_id": key, "queue_id": self._ledger_key}

    def get_batch(self, batch_id: str) -> Batch:
        row = self._db.fetchone("get_batch", self._batch_key(batch_id))
        if row is None:
            self._found_nothing()
            raise BatchNotFoundError(self.name, str(batch_id))
        return self._batch(row)

    def open_batches(self, limit: int = 100, *, consumer_prefix: str | None = None) -> list[Batch]:
        rows = self._db.fetchall(
            "open_batches",
            {
                "queue_id": self._ledger_key,
                "limit": _check_batch_size(limit),
                "consumer_prefix": consumer_prefix,
            },
        )
        if not rows:
            self._found_nothing()
        return [self._batch(r) for r in rows]

    def _purge_batches(self, limit: int) -> int:
        """Forget up to ``limit`` batches finished more than :attr:`batch_retention_s` ago."""
        params = {"queue_id": self._ledger_key, "older_than_s": self.batch_retention_s, "n": limit}
        return len(self._db.fetchall("purge_batches", params))

    def _locked_batch(self, batch_id: str, conn: DbConnection) -> Batch:
        row = self._db.fetchone("lock_batch", self._batch_key(batch_id), conn)
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
        params = {**self._batch_key(batch.batch_id), "state": state.code, "lease_until": lease_until}
        self._db.execute("finish_batch", {**params, "error": error}, conn)

    def ack_batch(self, batch_id: str, *, conn: DbConnection | None = None) -> int:
        with self._db.transaction(conn) as c:
            batch = self._locked_batch(batch_id, c)
            if batch.state is BatchState.ACKED:
                return 0
            if batch.state is BatchState.RELEASED:
                raise BatchStateError(
                    f"queue {self.name!r}: batch {batch.batch_id} was released ({batch.last_error}); "
                    "its messages are delivered again, so it cannot be acked"
                )
            done = self.ack_receipts(batch.receipts, conn=c)
            self._set_batch_state(batch, BatchState.ACKED, c)
            return done

    def release_batch(
        self,
        batch_id: str,
        *,
        delay: float | None = None,
        error: str | None = None,
        conn: DbConnection | None = None,
    ) -> int:
        with self._db.transaction(conn) as c:
            batch = self._locked_batch(batch_id, c)
            if batch.state is not BatchState.CLAIMED:
                return 0
            # Receipts locked by nack below; one reclaimed between these statements would make
            # nack raise, so only what is held now is released, and the rest was already returned.
            held = self._held(batch.receipts, c)
            released = self.nack_receipts(held, delay=delay, error=error, conn=c) if held else 0
            self._set_batch_state(batch, BatchState.RELEASED, c, error=error)
            return released

    def extend_batch(self, batch_id: str, visibility_timeout: float) -> dt.datetime:
        visibility_timeout = check_seconds(
            f"queue {self.name!r}: visibility_timeout", visibility_timeout, positive=True
        )
        with self._db.transaction() as c:
            batch = self._locked_batch(batch_id, c)
            if batch.state is not BatchState.CLAIMED:
                raise BatchStateError(
                    f"queue {self.name!r}: batch {batch.batch_id} is {batch.state.value}; only a "
                    "claimed batch can be extended"
                )
            until = self._extend(batch.receipts, float(visibility_timeout), c)
            self._set_batch_state(batch, BatchState.CLAIMED, c, lease_until=until)
            return until
