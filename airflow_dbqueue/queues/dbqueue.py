"""The common-messaging queue provider: ``MessageQueueTrigger(scheme="dbqueue", ...)`` runs DbQueueTrigger.

.. code-block:: python

    trigger = MessageQueueTrigger(scheme="dbqueue", queue_name="orders", dbqueue_conn_id="dbqueue_default")
    asset = Asset("orders", watchers=[AssetWatcher(name="orders_watcher", trigger=trigger)])

Every keyword besides ``scheme`` goes to :class:`~airflow_dbqueue.triggers.dbqueue.DbQueueTrigger`
(``queue_name``, ``group``, ``dbqueue_conn_id``, ``min_messages``, ``min_priority``, ``poll_interval``,
...): ``group`` watches a consumer group of a ring, so that each group's DAG starts on its own messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow.providers.common.messaging.providers.base_provider import BaseMessageQueueProvider

if TYPE_CHECKING:
    from airflow.triggers.base import BaseEventTrigger

DBQUEUE_SCHEME = "dbqueue"


class DbQueueMessageQueueProvider(BaseMessageQueueProvider):  # type: ignore[misc]
    """Match the ``dbqueue`` scheme of ``MessageQueueTrigger`` to :class:`DbQueueTrigger`."""

    scheme = DBQUEUE_SCHEME

    def trigger_class(self) -> type[BaseEventTrigger]:
        """Return the trigger that watches a dbqueue queue."""
        from airflow_dbqueue.triggers.dbqueue import DbQueueTrigger

        return DbQueueTrigger
