"""``DbQueueHook``: the queue engine behind an Airflow connection.

The hook holds the connection and the engine made from it, and gives Airflow what it asks of a hook
(the connection form's type, its Test button); every queue operation is the engine's. The connection
handling is in :mod:`airflow_dbqueue.hooks.connection`, claims (what goes through XCom) in
:mod:`airflow_dbqueue.hooks.claims`, the maintenance steps in :mod:`airflow_dbqueue.hooks.maintenance`
and the metrics in :mod:`airflow_dbqueue.hooks.metrics`; their public names are importable from here too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

from airflow_dbqueue.engine import (
    ConfigurationError,
    DbQueue,
    FailedMessage,
    GroupInfo,
    Message,
    QueueSettings,
    Semantics,
)
from airflow_dbqueue.engine.dialects.base import CONNECT_TIMEOUT_S, DEFAULT_SCHEMA, DIALECTS
from airflow_dbqueue.engine.queue import COUNT_CAP
from airflow_dbqueue.engine.ring import RingQueue
from airflow_dbqueue.hooks.claims import (
    XCOM_MAX_MESSAGES,
    check_claimable,
    make_claim,
    message_to_xcom,
    receipt,
)
from airflow_dbqueue.hooks.connection import (
    CONN_TYPE,
    DIALECT_EXTRA,
    SCHEMA_EXTRA,
    connection_dialect,
    connection_dsn,
    mssql_url,
)
from airflow_dbqueue.hooks.maintenance import MaintenanceSteps
from airflow_dbqueue.hooks.metrics import (
    _GROUP_GAUGES,
    _INDEX_GAUGES,
    _QUEUE_GAUGES,
    _TABLE_GAUGES,
    emit_metrics,
)

if TYPE_CHECKING:
    from types import TracebackType

    from airflow_dbqueue.engine import Queue
    from airflow_dbqueue.engine.dialects.base import DbConnection

__all__ = [
    "CONN_TYPE",
    "DEFAULT_SCHEMA",
    "DIALECTS",
    "DIALECT_EXTRA",
    "SCHEMA_EXTRA",
    # the gauges emit_metrics sends, by kind
    "_GROUP_GAUGES",
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


class DbQueueHook(MaintenanceSteps, BaseHook):  # type: ignore[misc]
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
            dsn, schema = connection_dsn(self.get_connection(self.dbqueue_conn_id))
            self._dbq = DbQueue(
                dsn,
                schema=self.dbqueue_schema or schema,
                pool_size=self.pool_size,
                connect_timeout=self.connect_timeout,
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

    # -- schema and queues -------------------------------------------------------------------------

    def install(self) -> int:
        """Create or migrate the queue schema, idempotently; return its version."""
        return self.get_conn().install()

    def create_queue(self, queue_name: str, *, install: bool = True, **settings: Any) -> QueueSettings:
        """Create a queue (idempotently; installing the schema first by default) and return its settings.

        ``settings`` are those of :meth:`DbQueue.create_queue` (``design``, ``payload_type``,
        ``max_attempts``, ``visibility_timeout``, ``notify``, ``archive``, ...). An existing queue with
        other settings raises ``QueueExistsError``.
        """
        if install:
            self.install()
        return self.get_conn().create_queue(queue_name, **settings).settings

    def drop_queue(self, queue_name: str, *, missing_ok: bool = True) -> bool:
        """Drop a queue with all its messages; return whether it existed."""
        return self.get_conn().drop_queue(queue_name, missing_ok=missing_ok)

    def list_queues(self) -> list[QueueSettings]:
        """Return the settings of every queue in the schema."""
        return self.get_conn().list_queues()

    def get_queue(self, queue_name: str, group: str | None = None) -> Queue:
        """Return the engine's queue object (raises ``QueueNotFoundError`` when it does not exist), or
        with ``group`` the handle of that consumer group of a ring (``GroupNotFoundError`` when it has
        none such). Every method below that names a queue takes ``group=`` too."""
        return self.get_conn().queue(queue_name).group(group)

    def add_group(
        self,
        queue_name: str,
        group: str,
        *,
        start: str = "now",
        on_lag: str = "block",
        lag_timeout: float | None = None,
    ) -> None:
        """Add a consumer group to a ring (``start``: ``"now"`` or ``"earliest"``; see
        ``RingQueue.add_group``)."""
        queue = self._ring(queue_name)
        extra = {} if lag_timeout is None else {"lag_timeout": lag_timeout}
        queue.add_group(group, start=start, on_lag=on_lag, **extra)

    def drop_group(self, queue_name: str, group: str, *, missing_ok: bool = True) -> bool:
        """Drop a ring's consumer group; return whether it existed."""
        return self._ring(queue_name).drop_group(group, missing_ok=missing_ok)

    def groups(self, queue_name: str) -> list[GroupInfo]:
        """List a ring's consumer groups, the default one first."""
        return self._ring(queue_name).groups()

    def _ring(self, queue_name: str) -> RingQueue:
        queue = self.get_queue(queue_name)
        if not isinstance(queue, RingQueue):
            raise ConfigurationError(
                f"queue {queue_name!r} is a {queue.settings.design} queue: "
                "consumer groups need the ring design"
            )
        return queue

    # -- messages ----------------------------------------------------------------------------------

    def push(
        self,
        queue_name: str,
        payloads: Iterable[Any],
        *,
        priority: int = 0,
        delay: float = 0.0,
        conn: DbConnection | None = None,
    ) -> list[int]:
        """Push a batch in one statement (all or nothing); return the ids in payload order."""
        return self.get_queue(queue_name).push_batch(payloads, priority=priority, delay=delay, conn=conn)

    def pop(
        self,
        queue_name: str,
        n: int = 1,
        *,
        semantics: Semantics | str = Semantics.AT_LEAST_ONCE,
        visibility_timeout: float | None = None,
        wait: float = 0.0,
        consumer: str | None = None,
        conn: DbConnection | None = None,
        group: str | None = None,
    ) -> list[Message]:
        """Pop up to ``n`` messages (leased by default: at-least-once). See :meth:`Queue.pop`."""
        return self.get_queue(queue_name, group).pop(
            n,
            semantics=semantics,
            visibility_timeout=visibility_timeout,
            wait=wait,
            consumer=consumer,
            conn=conn,
        )

    def ack(
        self,
        queue_name: str,
        messages: Sequence[Message],
        *,
        conn: DbConnection | None = None,
        group: str | None = None,
    ) -> int:
        """Finish leased messages; all or nothing (``LeaseExpiredError`` if a lease was lost)."""
        return self.get_queue(queue_name, group).ack(messages, conn=conn)

    def nack(
        self,
        queue_name: str,
        messages: Sequence[Message],
        *,
        delay: float | None = None,
        error: str | None = None,
        group: str | None = None,
    ) -> int:
        """Return leased messages for another try (or to the failed state after ``max_attempts``)."""
        return self.get_queue(queue_name, group).nack(messages, delay=delay, error=error)

    def ack_receipts(
        self, queue_name: str, receipts: Sequence[Sequence[int]], *, group: str | None = None
    ) -> int:
        """Finish deliveries known by their receipts ``[id, delivery]`` (e.g. from XCom)."""
        return self.get_queue(queue_name, group).ack_receipts([receipt(r) for r in receipts])

    def nack_receipts(
        self,
        queue_name: str,
        receipts: Sequence[Sequence[int]],
        *,
        delay: float | None = None,
        error: str | None = None,
        group: str | None = None,
    ) -> int:
        """Release deliveries known by their receipts ``[id, delivery]`` for another try."""
        return self.get_queue(queue_name, group).nack_receipts(
            [receipt(r) for r in receipts], delay=delay, error=error
        )

    def leased(
        self, queue_name: str, receipts: Sequence[Sequence[int]], *, group: str | None = None
    ) -> list[Message]:
        """Return the still-leased messages of ``receipts``, with payloads."""
        return self.get_queue(queue_name, group).leased([receipt(r) for r in receipts])

    # -- claims: what the pop operator and the claiming sensor hand to the next task ---------------

    def claim(
        self,
        queue_name: str,
        n: int,
        *,
        semantics: Semantics | str = Semantics.AT_LEAST_ONCE,
        visibility_timeout: float | None = None,
        wait: float = 0.0,
        xcom_max_messages: int = XCOM_MAX_MESSAGES,
        consumer: str | None = None,
        group: str | None = None,
    ) -> dict[str, Any]:
        """Pop up to ``n`` messages and describe them as a JSON-safe *claim* for XCom.

        A claim is ``{"queue_name", "semantics", "count", "receipts", "messages"}``, and ``"group"``
        when popped for a consumer group of a ring (whose receipts are that group's). ``receipts`` are
        ``[id, delivery]`` pairs of leased messages (at-least-once; empty for at-most-once).
        ``messages`` holds the messages with their payloads when there are at most
        ``xcom_max_messages`` of them; a larger leased batch stays claimed in the database and
        ``messages`` is ``None``: the next task reads it with :meth:`claimed_messages`. At-most-once
        pops finish the messages, so their payloads must fit in XCom: more than ``xcom_max_messages``
        is refused before anything is popped.
        """
        sem = Semantics.parse(semantics)
        check_claimable(sem, n, xcom_max_messages)
        queue = self.get_queue(queue_name, group)
        msgs = queue.pop(
            n, semantics=sem, visibility_timeout=visibility_timeout, wait=wait, consumer=consumer
        )
        return make_claim(
            queue_name,
            sem,
            msgs,
            queue.settings.payload_type,
            xcom_max_messages=xcom_max_messages,
            group=group,
        )

    def claimed_messages(self, claim: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Return the messages of a claim as JSON-safe dicts, reading them from the database if needed.

        Messages whose lease was lost since the claim are left out (they will be delivered again).
        """
        if claim.get("messages") is not None:
            return list(claim["messages"])
        queue = self.get_queue(claim["queue_name"], claim.get("group"))
        msgs = queue.leased([receipt(r) for r in claim.get("receipts") or []])
        return [message_to_xcom(m, queue.settings.payload_type) for m in msgs]

    def ack_claim(self, claim: Mapping[str, Any]) -> int:
        """Finish every leased message of a claim; all or nothing. A no-op for at-most-once claims."""
        receipts = claim.get("receipts") or []
        return self.ack_receipts(claim["queue_name"], receipts, group=claim.get("group")) if receipts else 0

    def nack_claim(
        self, claim: Mapping[str, Any], *, delay: float | None = None, error: str | None = None
    ) -> int:
        """Release every leased message of a claim for another try."""
        receipts = claim.get("receipts") or []
        if not receipts:
            return 0
        return self.nack_receipts(
            claim["queue_name"], receipts, delay=delay, error=error, group=claim.get("group")
        )

    # -- inspection and failed-message admin -------------------------------------------------------

    def stats(self, queue_name: str, *, group: str | None = None) -> dict[str, Any]:
        """Return the queue's depth by state as a JSON-safe dict."""
        return self.get_queue(queue_name, group).stats().as_dict()

    def peek(self, queue_name: str, n: int = 10, *, group: str | None = None) -> list[Message]:
        """Return up to ``n`` ready messages without claiming them."""
        return self.get_queue(queue_name, group).peek(n)

    def count_ready(
        self,
        queue_name: str,
        min_priority: int | None = None,
        cap: int = COUNT_CAP,
        *,
        group: str | None = None,
    ) -> int:
        """Count ready messages of at least ``min_priority``, stopping at ``cap``."""
        return self.get_queue(queue_name, group).count_ready(min_priority, cap)

    def list_failed(
        self, queue_name: str, limit: int = 100, after_id: int = 0, *, group: str | None = None
    ) -> list[FailedMessage]:
        """List failed (dead-letter) messages by id."""
        return self.get_queue(queue_name, group).list_failed(limit, after_id)

    def requeue_failed(
        self, queue_name: str, ids: Sequence[int] | None = None, *, group: str | None = None
    ) -> int:
        """Make failed messages ready again (all when ``ids`` is None)."""
        return self.get_queue(queue_name, group).requeue_failed(ids)

    def delete_failed(
        self, queue_name: str, ids: Sequence[int] | None = None, *, group: str | None = None
    ) -> int:
        """Discard failed messages (all when ``ids`` is None)."""
        return self.get_queue(queue_name, group).delete_failed(ids)

    def reclaim_expired(self, queue_name: str, *, group: str | None = None) -> int:
        """Return expired leases to ready (or failed); return how many moved."""
        return self.get_queue(queue_name, group).reclaim_expired()

    def jdbc(self) -> tuple[str, str | None, str | None]:
        """Return ``(url, user, password)`` for a JDBC reader of the same database (a Spark job).

        The URL carries the host, port, database and ``sslmode``; credentials are returned apart so
        that they can travel in the environment, not on a command line.
        """
        from airflow_dbqueue.engine.dialects.postgres.conninfo import jdbc_options

        conn = self.get_connection(self.dbqueue_conn_id)
        if connection_dialect(conn) != "postgresql":
            raise ConfigurationError(
                f"connection {conn.conn_id!r} is a SQL Server connection; Spark jobs read batches over "
                "PostgreSQL's JDBC driver, from a PostgreSQL queue database"
            )
        options = jdbc_options(connection_dsn(conn)[0])  # the same login (or token) as the hook's
        return options["url"], options.get("user"), options.get("password")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[DbConnection]:
        """Yield a connection in a transaction for exactly-once work (pop and write with ``conn=``)."""
        with self.get_conn().transaction() as conn:
            yield conn
