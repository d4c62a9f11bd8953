"""The consumer-group calls a ring's two layouts share: a group's handle, adding, listing and dropping
groups, and acting on those nobody pops (:mod:`airflow_dbqueue.engine.ring_groups` for the slots layout,
:mod:`airflow_dbqueue.engine.ring_rows_groups` for the rows layout). Each layout names the statement
that lists its groups and says what a lagging group holds; the SQL behind ``ring_add_group`` and
``ring_drop_group`` serves either layout."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, ClassVar, Self

from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    DatabaseError,
    GroupExistsError,
    GroupNotFoundError,
)
from airflow_dbqueue.engine.models import DEFAULT_GROUP, RING_DEFAULT_LAG_TIMEOUT_S, GroupInfo, OnLag
from airflow_dbqueue.engine.queue import Queue, check_seconds
from airflow_dbqueue.engine.ring_base import _GROUP_NAME, _ON_LAG_CODE, group_infos, log

if TYPE_CHECKING:
    from airflow_dbqueue.engine.dialects.base import DbConnection


class RingGroupCalls(Queue):
    """A ring's consumer groups: each one's handle; adding, listing and dropping them, and acting on
    those nobody pops."""

    if TYPE_CHECKING:  # the layout's handle's
        _qid: int
        _gid: int
        _groups: dict[str, Self]
        _lock: threading.Lock
        _root: Self

        def _default(self) -> Self: ...

        def _raise_if_gone(self, conn: DbConnection | None = None) -> None: ...

    _GROUPS_QUERY: ClassVar[str]
    """The statement that lists the ring's groups and their positions: ``ring_groups`` (slots),
    ``ring_rows_groups`` (rows)."""
    _LAG_UNIT: ClassVar[str]
    """What a lagging group's count counts in the lag warning: ``numbers`` (slots), ``pushes`` (rows)."""
    _LAG_HOLDS: ClassVar[str]
    """What a lagging group holds of the ring, in the warning: its ``floor`` (slots), ``segments`` (rows)."""
    _GROUP_IDS_QUERY: ClassVar[str]
    """The statement that names the ring's groups, ``(gid, name, ...)`` rows: ``ring_groups`` (slots, the
    default group's row among them), ``ring_rows_group_ids`` (rows, the other groups only)."""
    _GROUP_INHERITS: ClassVar[tuple[str, ...]] = ("push_timeout", "lane_timeout")
    """The settings of the default group's handle that a group's handle takes on when made: a push
    through a group's handle is a push into the ring, and its pops wait for locks as the ring's."""
    _GROUP_OWN_TABLES: ClassVar[bool] = False
    """Whether a group is made of tables of its own (rows), which the ring's per-queue grants must reach
    as it is made; a slots ring's groups are rows in the ring's tables."""

    @staticmethod
    def _behind(min_pos: int, issued: int) -> int:
        """How many units (:attr:`_LAG_UNIT`) a group whose lowest position is ``min_pos`` has to take
        up to ``issued``, the last one issued."""
        return issued - min_pos + 1

    def group(self, name: str | None) -> Self:
        """Return the handle of this ring's consumer group ``name`` (``None`` or :data:`DEFAULT_GROUP`:
        the default group's); raise :class:`GroupNotFoundError` when the ring has no such group. A
        group's handle is made once and kept by the default group's handle; it may do to the group what
        the role may do to the ring."""
        root = self._default()
        if name is None or name == DEFAULT_GROUP:
            return root
        with root._lock:
            got = root._groups.get(name)
        if got is not None:
            return got
        for row in self._db.fetchall(self._GROUP_IDS_QUERY, {"queue_id": self._qid}):
            if row[0] != self._qid and row[1] == name:
                handle = type(self)(self._db, self.settings, group=name, gid=int(row[0]))  # type: ignore[call-arg]
                handle._root = root
                handle._may = root._may  # what the role may do to the ring, it may do to its groups
                for setting in self._GROUP_INHERITS:
                    setattr(handle, setting, getattr(root, setting))
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
        """Add a consumer group to this ring and return its handle.

        :param start: ``"now"``: the group sees the messages pushed from now on; ``"earliest"``: also
            every message still in the ring that some group has not taken yet (messages that other
            groups hold leased or to deliver again are not delivered to it).
        :param on_lag: what maintenance does when nobody pops the group for ``lag_timeout`` seconds while
            it has messages to take: ``"block"`` (keep it, with a warning: it holds the ring's floor, so
            pushes wait for it once the ring is full) or ``"drop_group"`` (drop it).
        """
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
            with self._db.transaction() as conn:
                row = self._db.fetchone("ring_add_group", params, conn)
                if self._GROUP_OWN_TABLES and row is not None and row[0] is not None:
                    self._db.grant_new_ring(conn, self._qid)
        except DatabaseError:
            if any(g.name == name for g in self.groups()):
                raise GroupExistsError(f"queue {self.name!r} has a consumer group {name!r} already") from None
            raise
        if row is None or row[0] is None:
            self._raise_if_gone()
        return self.group(name)

    def drop_group(self, name: str, *, missing_ok: bool = False) -> bool:
        """Drop a consumer group: its positions, leases, messages to deliver again, failed messages and
        batches (on the rows layout, its own tables with them). What the ring holds for it is then
        freed as the other groups pass it (the slots layout's floor rises, the rows layout's segments are
        emptied). Returns whether it existed; raises :class:`GroupNotFoundError` when it did not, unless
        ``missing_ok``."""
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
        out = group_infos(self._db.fetchall(self._GROUPS_QUERY, {"queue_id": self._qid}), self._qid)
        if not out:
            self._raise_if_gone()
        return out

    def watch_groups(self) -> dict[str, int]:
        """Note which consumer groups moved since the last call, and act on each that has not moved for
        its lag timeout while it has messages to take: warn (``on_lag="block"``: it holds the ring's
        floor, or segments, so pushes wait for it once the ring is full) or drop it (``"drop_group"``).
        Maintenance calls it through :meth:`maintain`. Returns ``{"groups_lagging": n,
        "groups_dropped": m}``."""
        lagging = dropped = 0
        for row in self._db.fetchall(self._GROUPS_QUERY, {"queue_id": self._qid}):
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
            behind = self._behind(min_pos, issued)
            if on_lag == _ON_LAG_CODE[OnLag.DROP_GROUP]:
                log.warning(
                    "queue %s: consumer group %s has not popped for %.0fs with %d %s to take; "
                    "dropping it (on_lag=drop_group)",
                    self.name,
                    name,
                    idle,
                    behind,
                    self._LAG_UNIT,
                )
                if self.drop_group(name, missing_ok=True):
                    dropped += 1
            else:
                log.warning(
                    "queue %s: consumer group %s has not popped for %.0fs with %d %s to take; it holds "
                    "the ring's %s, so pushes wait for it once the ring is full (on_lag=block: pop it, "
                    "or drop it with drop_group)",
                    self.name,
                    name,
                    idle,
                    behind,
                    self._LAG_UNIT,
                    self._LAG_HOLDS,
                )
        return {"groups_lagging": lagging, "groups_dropped": dropped}
