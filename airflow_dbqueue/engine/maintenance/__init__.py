"""Maintenance of a queue schema, around the clock and without a maintenance window (as Al Zabir's
"Building High Performance Queue in Database" asks of a queue of orders and tasks).

Queue tables die of bloat: every message leaves dead rows and dead index entries behind, and a
queue's indexes see inserts at one end and deletes at the other. :class:`Maintenance` keeps a
schema small and fast while producers and consumers run, through services of its own, each a module
of this package that calls the database only through the
:class:`~airflow_dbqueue.engine.dialects.base.Database` protocol:

- ``lock``: the schema's maintenance lock, on a connection of its own, so two runs never fight: the
  second waits up to ``lock_wait_s`` and then skips, saying which session holds the lock.
- ``archiver``: **continuous archiving** of finished messages into ``archive`` and the archive
  retention, in bounded batches of one statement each, with a pause between batches and a time
  budget per run; each batch skips rows other sessions hold, so push, pop and ack never wait for it.
- ``queues``: **design upkeep** of every queue (:meth:`Queue.maintain`: expired leases back to ready
  or failed; a ring's gap recovery), and the queues dropped while a run goes on.
- ``statistics``: **VACUUM / ANALYZE** of the schema's tables (``SKIP_LOCKED``; where the database
  has no VACUUM, what stands for it), and their sizes and dead rows.
- ``horizon``: what holds back cleanup (a long transaction, a replication slot, a prepared
  transaction), named in a warning, and kept from holding up an online rebuild; the horizon's figures
  now, and what a held horizon cost a run (dead rows VACUUM could not remove, work deferred).
- ``reindexer``: **online index rebuilds** of bloated indexes, and the clean-up of what a failed one
  leaves; the dialect surveys the indexes, plans the steps and supplies the statements.
- ``compactor``: **ring compaction** of ring tables that outgrew their laid-out size.
- ``samples``: one row a queue a run in the schema's ``samples`` table (depth, oldest age, pushes and
  pops since the last sample, the horizon), and its retention; the Queues page draws them.
- ``metrics``: depth by state, age of the oldest ready message, push and finish rates, table sizes,
  dead rows and index bloat, as one JSON-safe dict.
- ``runner``: :class:`Maintenance`, whose :meth:`~Maintenance.run` takes every step in the order of
  :data:`STEPS` under one hold of the lock, and whose :meth:`~Maintenance.step` takes one of them as
  ``run`` does (the maintenance DAG's tasks call it).

What each database means by a step (SQL Server's ``UPDATE STATISTICS`` for VACUUM, ``ALTER INDEX ...
REBUILD WITH (ONLINE = ON)`` or ``REORGANIZE`` by engine edition, its ``sp_getapplock``) is its
dialect's: ``dialects/<db>/maintenance.py`` and the named queries beside it.
"""

from __future__ import annotations

from airflow_dbqueue.engine.dialects.indexes import IndexHealth
from airflow_dbqueue.engine.maintenance.compactor import RING_TABLES
from airflow_dbqueue.engine.maintenance.config import MaintenanceConfig
from airflow_dbqueue.engine.maintenance.horizon import REBUILD_WAITS_FOR
from airflow_dbqueue.engine.maintenance.results import (
    APPLICATION_NAME,
    BatchResult,
    IndexAction,
    MiB,
    XminHolder,
)
from airflow_dbqueue.engine.maintenance.runner import STEPS, Maintenance

__all__ = [
    "APPLICATION_NAME",
    "REBUILD_WAITS_FOR",
    "RING_TABLES",
    "STEPS",
    "BatchResult",
    "IndexAction",
    "IndexHealth",
    "Maintenance",
    "MaintenanceConfig",
    "MiB",
    "XminHolder",
]
