"""Consumer groups of a ring of the rows layout (:mod:`airflow_dbqueue.engine.ring_rows`): each group
sees every message at its own pace, as on the slots layout (:mod:`airflow_dbqueue.engine.ring_groups`).

A group other than the default one has its own copy of the ring's per-consumer objects (lane position
logs, leases, done rows, retry log, and the functions that take, ack, settle, reclaim, peek and count),
named ``ring_g<n>_r*``, over the ring's segment tables: its pops, acks and nacks only insert rows of its
own, as the default group's do. A segment is emptied only when every group's lanes, leases and messages
to deliver again are past it, so a group that lags holds the ring (pushes wait, then raise
:class:`QueueFullError`) until it pops or is dropped. SQL: ``ring_rows_add_group``,
``ring_rows_drop_group`` and ``ring_rows_rotate_groups`` in the dialect's ``functions.sql``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Self, cast

from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    GroupNotFoundError,
)
from airflow_dbqueue.engine.models import DEFAULT_GROUP
from airflow_dbqueue.engine.ring_group_calls import RingGroupCalls

if TYPE_CHECKING:
    from airflow_dbqueue.engine.dialects.base import DbConnection


class RowsRingGroups(RingGroupCalls):
    """Finding the consumer groups of a ring of the rows layout; adding, listing and dropping them, and
    acting on those nobody pops (:class:`~airflow_dbqueue.engine.ring_group_calls.RingGroupCalls`): a
    lagging group holds the ring's segments, so many pushes (rows) behind."""

    _GROUPS_QUERY = "ring_rows_groups"
    _GROUP_IDS_QUERY = "ring_rows_group_ids"
    _LAG_UNIT = "pushes"
    _LAG_HOLDS = "segments"
    _GROUP_OWN_TABLES = True

    _qid: int
    _root: Self
    push_timeout: float

    @staticmethod
    def _behind(min_pos: int, issued: int) -> int:
        return ((issued >> 16) - (min_pos >> 16)) + 1  # positions and the last issued are ids: rows

    def _raise_if_gone(self, conn: DbConnection | None = None) -> None:
        """Raise :class:`QueueNotFoundError` or :class:`GroupNotFoundError` when the ring or this
        handle's group was dropped (the ring's handle defines it)."""
        raise NotImplementedError

    def _init_group(self, group: str, gid: int | None) -> None:
        """Set the handle's group: the default one (``gid`` None, its rows keyed by the ring's queue_id)
        or a group's (its negative gid, ring_groups)."""
        self.group_name = group
        self._gid = self._qid if gid is None else gid
        self._groups: dict[str, Self] = {}  # the handles of other groups (the default group's only)
        self._lock = threading.Lock()
        self._root = cast("Self", self)  # a group's handle: its ring's default handle (group())

    def _own(self) -> str:
        """The prefix of the group's own functions (functions.sql's ring_rows_own)."""
        return f"ring_g{-self._gid}_r" if self._gid < 0 else f"ring_{self._gid}_r"

    def _default(self) -> Self:
        return self if self._gid == self._qid else self._root

    def _group_handles(self) -> list[Self]:
        """The handles of the ring's groups besides the default one (those dropped meanwhile left out)."""
        root = self._default()
        out = []
        for row in self._db.fetchall("ring_rows_group_ids", {"queue_id": self._qid}):
            try:
                out.append(root.group(str(row[1])))
            except GroupNotFoundError:
                continue
        return out

    def _raise_if_group_gone(self, conn: DbConnection | None = None) -> None:
        """Raise :class:`GroupNotFoundError` when this handle's group was dropped (its own functions and
        tables went with it)."""
        if self._gid == self._qid:
            return
        groups = self._db.fetchall("ring_rows_group_ids", {"queue_id": self._qid}, conn)
        if not any(int(r[0]) == self._gid for r in groups):
            root = self._default()
            with root._lock:  # group(name) looks the name up again (it may name a new group now)
                if root._groups.get(self.group_name) is self:
                    del root._groups[self.group_name]
            raise GroupNotFoundError(self.name, self.group_name) from None

    def _refuse_requeue_with_groups(self) -> None:
        """A requeued message is pushed again, which every group sees: refused on a ring with groups."""
        if self._db.fetchall("ring_rows_group_ids", {"queue_id": self._qid}):
            raise ConfigurationError(
                f"queue {self.name!r} has consumer groups besides {DEFAULT_GROUP!r}: a requeued message "
                "would be pushed again to every group; list_failed and push what the group needs, "
                "or delete_failed"
            )
