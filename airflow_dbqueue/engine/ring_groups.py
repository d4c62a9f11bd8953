"""A ring's consumer groups: each sees every message at its own pace (:mod:`airflow_dbqueue.engine.ring`)."""

from __future__ import annotations

from airflow_dbqueue.engine.ring_base import RingBase
from airflow_dbqueue.engine.ring_group_calls import RingGroupCalls


class RingGroups(RingGroupCalls, RingBase):
    """Finding a ring's consumer groups; adding, listing and dropping them, and acting on those nobody
    pops, and each group's handle (:class:`~airflow_dbqueue.engine.ring_group_calls.RingGroupCalls`): a
    lagging group holds the ring's floor, so many numbers behind."""

    _GROUPS_QUERY = "ring_groups"
    _GROUP_IDS_QUERY = "ring_groups"
    _GROUP_INHERITS = ("push_timeout", "gap_timeout", "lane_timeout")
    _LAG_UNIT = "numbers"
    _LAG_HOLDS = "floor"
