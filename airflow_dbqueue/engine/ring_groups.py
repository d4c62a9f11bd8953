"""A ring's consumer groups: each sees every message at its own pace (:mod:`airflow_dbqueue.engine.ring`)."""

from __future__ import annotations

from typing import Self

from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    DatabaseError,
    GroupExistsError,
    GroupNotFoundError,
)
from airflow_dbqueue.engine.models import (
    DEFAULT_GROUP,
    RING_DEFAULT_LAG_TIMEOUT_S,
    GroupInfo,
    OnLag,
)
from airflow_dbqueue.engine.queue import check_seconds
from airflow_dbqueue.engine.ring_base import (
    _GROUP_NAME,
    _ON_LAG_CODE,
    RingBase,
    group_infos,
    log,
)


class RingGroups(RingBase):
    """Adding, finding, listing and dropping a ring's consumer groups, and acting on those nobody pops."""

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
        for row in self._db.fetchall("ring_groups", {"queue_id": self._qid}):
            if row[0] != self._qid and row[1] == name:
                handle = type(self)(self._db, self.settings, group=name, gid=int(row[0]))
                handle._root = root
                handle._may = root._may  # what the role may do to the ring, it may do to its groups
                handle.push_timeout, handle.gap_timeout = root.push_timeout, root.gap_timeout
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
            row = self._db.fetchone("ring_add_group", params)
        except DatabaseError:
            if any(g.name == name for g in self.groups()):
                raise GroupExistsError(f"queue {self.name!r} has a consumer group {name!r} already") from None
            raise
        if row is None or row[0] is None:
            self._raise_if_gone()
        return self.group(name)

    def drop_group(self, name: str, *, missing_ok: bool = False) -> bool:
        """Drop a consumer group: its positions, leases and failed messages. The ring's floor rises to
        what the other groups still need. Returns whether it existed; raises
        :class:`GroupNotFoundError` when it did not, unless ``missing_ok``."""
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
        out = group_infos(self._db.fetchall("ring_groups", {"queue_id": self._qid}), self._qid)
        if not out:
            self._raise_if_gone()
        return out

    def watch_groups(self) -> dict[str, int]:
        """Note which consumer groups moved since the last call, and act on each that has not moved for
        its lag timeout while it has messages to take: warn (``on_lag="block"``: it holds the ring's
        floor, so pushes wait for it once the ring is full) or drop it (``"drop_group"``). Maintenance
        calls it through :meth:`maintain`. Returns ``{"groups_lagging": n, "groups_dropped": m}``."""
        lagging = dropped = 0
        for row in self._db.fetchall("ring_groups", {"queue_id": self._qid}):
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
            if on_lag == _ON_LAG_CODE[OnLag.DROP_GROUP]:
                log.warning(
                    "queue %s: consumer group %s has not popped for %.0fs with %d numbers to take; "
                    "dropping it (on_lag=drop_group)",
                    self.name,
                    name,
                    idle,
                    issued - min_pos + 1,
                )
                if self.drop_group(name, missing_ok=True):
                    dropped += 1
            else:
                log.warning(
                    "queue %s: consumer group %s has not popped for %.0fs with %d numbers to take; it holds "
                    "the ring's floor, so pushes wait for it once the ring is full (on_lag=block: pop it, "
                    "or drop it with drop_group)",
                    self.name,
                    name,
                    idle,
                    issued - min_pos + 1,
                )
        return {"groups_lagging": lagging, "groups_dropped": dropped}
