"""A ring's consumer groups: each sees every message at its own pace (:mod:`airflow_dbqueue.engine.ring`)."""

from __future__ import annotations

from typing import Self

from airflow_dbqueue.engine.errors import GroupNotFoundError
from airflow_dbqueue.engine.models import DEFAULT_GROUP
from airflow_dbqueue.engine.ring_base import RingBase
from airflow_dbqueue.engine.ring_group_calls import RingGroupCalls


class RingGroups(RingGroupCalls, RingBase):
    """Finding a ring's consumer groups; adding, listing and dropping them, and acting on those nobody
    pops (:class:`~airflow_dbqueue.engine.ring_group_calls.RingGroupCalls`): a lagging group holds the
    ring's floor, so many numbers behind."""

    _GROUPS_QUERY = "ring_groups"
    _LAG_UNIT = "numbers"
    _LAG_HOLDS = "floor"

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
