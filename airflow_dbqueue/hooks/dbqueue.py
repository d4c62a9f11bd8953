"""``DbQueueHook``: the queue engine behind an Airflow connection.

The hook holds the connection and the engine made from it, and gives Airflow what it asks of a hook
(the connection form's type, its Test button, a JDBC view for Spark jobs); every queue operation is
the engine's. The connection handling is in :mod:`airflow_dbqueue.hooks.connection`, the queue
operations in :mod:`airflow_dbqueue.hooks.operations`, claims (what goes through XCom) in
:mod:`airflow_dbqueue.hooks.claims`, the maintenance steps in :mod:`airflow_dbqueue.hooks.maintenance`
and the metrics in :mod:`airflow_dbqueue.hooks.metrics`; their public names are importable from here too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from airflow.sdk import BaseHook

from airflow_dbqueue.engine import ConfigurationError, DbQueue
from airflow_dbqueue.engine.dialects.base import (
    CONNECT_TIMEOUT_S,
    DEFAULT_SCHEMA,
    DIALECTS,
    POOLER_TRANSACTION,
    POSTGRESQL,
)
from airflow_dbqueue.hooks.claims import message_to_xcom
from airflow_dbqueue.hooks.connection import (
    CONN_TYPE,
    DIALECT_EXTRA,
    SCHEMA_EXTRA,
    connection_dialect,
    connection_dsn,
    connection_target,
    mssql_url,
)
from airflow_dbqueue.hooks.maintenance import MaintenanceSteps
from airflow_dbqueue.hooks.metrics import (
    _GROUP_GAUGES,
    _HORIZON_GAUGES,
    _INDEX_GAUGES,
    _QUEUE_GAUGES,
    _TABLE_GAUGES,
    emit_metrics,
)
from airflow_dbqueue.hooks.operations import QueueOperations

if TYPE_CHECKING:
    from types import TracebackType

    from airflow_dbqueue.engine.dialects.base import DbConnection

__all__ = [
    "CONN_TYPE",
    "DEFAULT_SCHEMA",
    "DIALECTS",
    "DIALECT_EXTRA",
    "SCHEMA_EXTRA",
    # the gauges emit_metrics sends, by kind
    "_GROUP_GAUGES",
    "_HORIZON_GAUGES",
    "_INDEX_GAUGES",
    "_QUEUE_GAUGES",
    "_TABLE_GAUGES",
    "DbQueueHook",
    "connection_dialect",
    "connection_dsn",
    "emit_metrics",
    "message_to_xcom",
    "mssql_url",
]


class DbQueueHook(QueueOperations, MaintenanceSteps, BaseHook):  # type: ignore[misc]
    """Interact with airflow-dbqueue queues through an Airflow database connection.

    The connection is of the provider's own type ``dbqueue``, whose form names the dialect
    (``postgresql`` or ``mssql``) and the queue schema, or of an existing database type: ``postgres``;
    ``mssql`` and ``odbc`` for SQL Server (``pip install 'airflow-dbqueue[mssql]'``).
    The schema holding the queue tables comes from the connection extra ``dbqueue_schema`` (default
    ``dbqueue``) unless ``dbqueue_schema`` is passed here. Constructing the hook does no I/O; the
    engine and its connection pool are made on first use and closed by :meth:`close` (or by leaving
    the hook's ``with`` block).

    :param dbqueue_conn_id: the Airflow connection to the database.
    :param dbqueue_schema: schema holding the queue tables; overrides the connection extra.
    :param pool_size: most database connections the hook opens at once.
    :param connect_timeout: seconds before an unreachable database raises ``DatabaseUnavailableError``.
    """

    conn_name_attr = "dbqueue_conn_id"
    default_conn_name = "dbqueue_default"
    conn_type = CONN_TYPE
    hook_name = "DB Queue"

    def __init__(
        self,
        dbqueue_conn_id: str = default_conn_name,
        *,
        dbqueue_schema: str | None = None,
        pool_size: int = 2,
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        super().__init__()
        self.dbqueue_conn_id = dbqueue_conn_id
        self.dbqueue_schema = dbqueue_schema
        self.pool_size = pool_size
        self.connect_timeout = connect_timeout
        self._dbq: DbQueue | None = None

    # -- the engine --------------------------------------------------------------------------------

    def get_conn(self) -> DbQueue:
        """Return the engine for the connection (made on first call; does no I/O itself)."""
        if self._dbq is None:
            target = connection_target(self.get_connection(self.dbqueue_conn_id))
            self._dbq = DbQueue(
                target.dsn,
                schema=self.dbqueue_schema or target.schema,
                pool_size=self.pool_size,
                connect_timeout=self.connect_timeout,
                pooler=target.pooler,
                listen_dsn=target.listen_dsn,
            )
        return self._dbq

    @property
    def dbqueue(self) -> DbQueue:
        """The engine (see :meth:`get_conn`)."""
        return self.get_conn()

    def close(self) -> None:
        """Close the engine's connection pool, if one was opened."""
        dbq, self._dbq = self._dbq, None
        if dbq is not None:
            dbq.close()

    def __enter__(self) -> DbQueueHook:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def test_connection(self) -> tuple[bool, str]:
        """Connect, read the queue schema, and report; never raises (Airflow's Test button calls it)."""
        try:
            dbq = self.get_conn()
            names = [q.name for q in dbq.list_queues()]
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"
        finally:
            self.close()
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        return True, (
            f"connected ({dbq.dialect}); schema {dbq.schema!r} holds {len(names)} queue(s)"
            + (f": {shown}" if names else "")
        )

    def jdbc(self) -> tuple[str, str | None, str | None]:
        """Return ``(url, user, password)`` for a JDBC reader of the same database (a Spark job).

        The URL carries the host, port, database and ``sslmode``; credentials are returned apart so
        that they can travel in the environment, not on a command line.
        """
        from airflow_dbqueue.engine.dialects.factory import jdbc_options

        conn = self.get_connection(self.dbqueue_conn_id)
        if connection_dialect(conn) != POSTGRESQL:
            raise ConfigurationError(
                f"connection {conn.conn_id!r} is a SQL Server connection; Spark jobs read batches over "
                "PostgreSQL's JDBC driver, from a PostgreSQL queue database"
            )
        target = connection_target(conn)  # the same login (or token) as the hook's
        options = jdbc_options(target.dsn, transaction_pooler=target.pooler == POOLER_TRANSACTION)
        return options["url"], options.get("user"), options.get("password")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[DbConnection]:
        """Yield a connection in a transaction for exactly-once work (pop and write with ``conn=``)."""
        with self.get_conn().transaction() as conn:
            yield conn
