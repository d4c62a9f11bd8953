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
from typing import Self, cast

from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    DatabaseError,
    GroupExistsError,
    GroupNotFoundError,
)
from airflow_dbqueue.engine.models import DEFAULT_GROUP, RING_DEFAULT_LAG_TIMEOUT_S, GroupInfo, OnLag
from airflow_dbqueue.engine.queue import Queue, check_seconds
from airflow_dbqueue.engine.ring_base import _GROUP_NAME, _ON_LAG_CODE, group_infos, log


class RowsRingGroups(Queue):
    """Adding, finding, listing and dropping the consumer groups of a ring of the rows layout, and
    acting on those nobody pops."""

    _qid: int
    _root: Self
    push_timeout: float

    def _raise_if_gone(self) -> None:
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

    def group(self, name: str | None) -> Self:
        """Return the handle of this ring's consumer group ``name`` (``None`` or :data:`DEFAULT_GROUP`:
        the default group's); raise :class:`GroupNotFoundError` when the ring has no such group."""
        root = self._default()
        if name is None or name == DEFAULT_GROUP:
            return root
        with root._lock:
            got = root._groups.get(name)
        if got is not None:
            return got
        for row in self._db.fetchall("ring_rows_group_ids", {"queue_id": self._qid}):
            if row[1] == name:
                handle = type(self)(self._db, self.settings, group=name, gid=int(row[0]))  # type: ignore[call-arg]
                handle._root = root
                handle._may = root._may  # what the role may do to the ring, it may do to its groups
                handle.push_timeout = root.push_timeout
                with root._lock:
                    return root._groups.setdefault(name, handle)
        self._raise_if_gone()
        raise GroupNotFoundError(self.name, name)

    def add_group(
        self,
        name: str,
        *,
        start: str = "now",
        on_lag: OnLag | str = OnLag.BLOCK,
        lag_timeout: float = RING_DEFAULT_LAG_TIMEOUT_S,
    ) -> Self:
        """Add a consumer group to this ring and return its handle (as on the slots layout:
        :meth:`airflow_dbqueue.engine.ring_groups.RingGroups.add_group`)."""
        if not isinstance(name, str) or not _GROUP_NAME.fullmatch(name) or name == DEFAULT_GROUP:
            raise ConfigurationError(
                f"queue {self.name!r}: a group name is 1 to 63 letters, digits and _ . : - "
                f"(not starting with . : -), other than {DEFAULT_GROUP!r}; got {name!r}"
            )
        if start not in ("now", "earliest"):
            raise ConfigurationError(f"queue {self.name!r}: start must be 'now' or 'earliest', got {start!r}")
        lag = OnLag.parse(on_lag)
        timeout = check_seconds(f"queue {self.name!r}: lag_timeout", lag_timeout, positive=True)
        if any(g.name == name for g in self.groups()):
            raise GroupExistsError(f"queue {self.name!r} has a consumer group {name!r} already")
        params = {
            "queue_id": self._qid,
            "name": name,
            "earliest": start == "earliest",
            "on_lag": _ON_LAG_CODE[lag],
            "lag_timeout_s": timeout,
        }
        try:
            with self._db.transaction() as conn:  # the group's own tables go to the ring's roles with it
                row = self._db.fetchone("ring_add_group", params, conn)
                if row is not None and row[0] is not None:
                    self._db.grant_new_ring(conn, self._qid)
        except DatabaseError:
            if any(g.name == name for g in self.groups()):
                raise GroupExistsError(f"queue {self.name!r} has a consumer group {name!r} already") from None
            raise
        if row is None or row[0] is None:
            self._raise_if_gone()
        return self.group(name)

    def drop_group(self, name: str, *, missing_ok: bool = False) -> bool:
        """Drop a consumer group: its positions, leases, messages to deliver again and failed messages
        (its own tables). The ring's segments are then emptied as the other groups pass them. Returns
        whether it existed; raises :class:`GroupNotFoundError` when it did not, unless ``missing_ok``."""
        if name == DEFAULT_GROUP:
            raise ConfigurationError(f"queue {self.name!r}: the {DEFAULT_GROUP!r} group cannot be dropped")
        try:
            handle = self.group(name)
        except GroupNotFoundError:
            if missing_ok:
                return False
            raise
        root = self._default()
        with root._lock:
            root._groups.pop(name, None)
        row = self._db.fetchone("ring_drop_group", {"queue_id": self._qid, "group": handle._gid})
        return bool(row and row[0])

    def groups(self) -> list[GroupInfo]:
        """List this ring's consumer groups, the default one first, then by name."""
        out = group_infos(self._db.fetchall("ring_rows_groups", {"queue_id": self._qid}), self._qid)
        if not out:
            self._raise_if_gone()
        return out

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

    def _raise_if_group_gone(self) -> None:
        """Raise :class:`GroupNotFoundError` when this handle's group was dropped (its own functions and
        tables went with it)."""
        if self._gid == self._qid:
            return
        if not any(
            int(r[0]) == self._gid for r in self._db.fetchall("ring_rows_group_ids", {"queue_id": self._qid})
        ):
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

    def watch_groups(self) -> dict[str, int]:
        """Note which consumer groups moved since the last call, and act on each that has not moved for
        its lag timeout while it has messages to take: warn (``on_lag="block"``: it holds the ring's
        segments, so pushes wait for it once the ring is full) or drop it (``"drop_group"``).
        Maintenance calls it through :meth:`maintain`. Returns ``{"groups_lagging": n,
        "groups_dropped": m}``."""
        lagging = dropped = 0
        for row in self._db.fetchall("ring_rows_groups", {"queue_id": self._qid}):
            if row[0] == self._qid:
                continue  # the default group is not watched: it is the ring's own
            gid, name, on_lag, timeout, min_pos, sum_pos, issued = (
                int(row[0]),
                str(row[1]),
                int(row[3]),
                float(row[4]),
                int(row[7]),
                int(row[8]),
                int(row[9]),
            )
            moved = self._db.fetchone(
                "ring_group_moved", {"queue_id": self._qid, "group": gid, "moved_pos": sum_pos}
            )
            idle = float(moved[0]) if moved else 0.0
            if idle < timeout or min_pos > issued:
                continue  # it moved within its timeout, or has nothing to take
            lagging += 1
            behind = ((issued >> 16) - (min_pos >> 16)) + 1  # pushes (rows) it has not passed
            if on_lag == _ON_LAG_CODE[OnLag.DROP_GROUP]:
                log.warning(
                    "queue %s: consumer group %s has not popped for %.0fs with %d pushes to take; "
                    "dropping it (on_lag=drop_group)",
                    self.name,
                    name,
                    idle,
                    behind,
                )
                if self.drop_group(name, missing_ok=True):
                    dropped += 1
            else:
                log.warning(
                    "queue %s: consumer group %s has not popped for %.0fs with %d pushes to take; it holds "
                    "the ring's segments, so pushes wait for it once the ring is full (on_lag=block: pop "
                    "it, or drop it with drop_group)",
                    self.name,
                    name,
                    idle,
                    behind,
                )
        return {"groups_lagging": lagging, "groups_dropped": dropped}
