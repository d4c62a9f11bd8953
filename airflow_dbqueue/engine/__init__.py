"""The queue engine: queues inside PostgreSQL (and SQL Server), without Airflow.

>>> from airflow_dbqueue.engine import DbQueue
>>> with DbQueue("postgresql://localhost/app") as dbq:          # doctest: +SKIP
...     dbq.install()
...     q = dbq.create_queue("orders")
...     q.push({"order": 1})
...     [m] = q.pop(semantics="at-least-once")
...     q.ack([m])
"""

from airflow_dbqueue.engine.client import DSN_ENV, DbQueue
from airflow_dbqueue.engine.errors import (
    BatchNotFoundError,
    BatchStateError,
    ConfigurationError,
    DatabaseError,
    DatabaseUnavailableError,
    DbQueueError,
    DeadlockError,
    ForeignObjectsError,
    GroupExistsError,
    GroupNotFoundError,
    InvalidNameError,
    LeaseExpiredError,
    LockTimeoutError,
    LoginError,
    NotSupportedError,
    PayloadError,
    PayloadTooLargeError,
    PayloadTypeError,
    PermissionDeniedError,
    QueueExistsError,
    QueueFullError,
    QueueNotFoundError,
    SchemaError,
    StatementTimeoutError,
    TransactionRequiredError,
    TransientDatabaseError,
)
from airflow_dbqueue.engine.maintenance import Maintenance, MaintenanceConfig
from airflow_dbqueue.engine.models import (
    Batch,
    BatchState,
    Design,
    FailedMessage,
    GroupInfo,
    Message,
    NotifyMode,
    PayloadType,
    QueueSettings,
    QueueStats,
    RingLayout,
    Semantics,
)
from airflow_dbqueue.engine.queue import Queue

__all__ = [
    "DSN_ENV",
    "Batch",
    "BatchNotFoundError",
    "BatchState",
    "BatchStateError",
    "ConfigurationError",
    "DatabaseError",
    "DatabaseUnavailableError",
    "DbQueue",
    "DbQueueError",
    "DeadlockError",
    "Design",
    "FailedMessage",
    "ForeignObjectsError",
    "GroupExistsError",
    "GroupInfo",
    "GroupNotFoundError",
    "InvalidNameError",
    "LeaseExpiredError",
    "LockTimeoutError",
    "LoginError",
    "Maintenance",
    "MaintenanceConfig",
    "Message",
    "NotSupportedError",
    "NotifyMode",
    "PayloadError",
    "PayloadTooLargeError",
    "PayloadType",
    "PayloadTypeError",
    "PermissionDeniedError",
    "Queue",
    "QueueExistsError",
    "QueueFullError",
    "QueueNotFoundError",
    "QueueSettings",
    "QueueStats",
    "RingLayout",
    "SchemaError",
    "Semantics",
    "StatementTimeoutError",
    "TransactionRequiredError",
    "TransientDatabaseError",
]
