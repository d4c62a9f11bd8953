"""``DbQueueHook``: the queue engine behind an Airflow connection of an existing database type."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

from airflow_dbqueue.engine import (
    ConfigurationError,
    DbQueue,
    FailedMessage,
    GroupInfo,
    MaintenanceConfig,
    Message,
    PayloadType,
    QueueSettings,
    Semantics,
)
from airflow_dbqueue.engine.ring import RingQueue

if TYPE_CHECKING:
    from types import TracebackType

    import psycopg
    from airflow.sdk import Connection

    from airflow_dbqueue.engine import Maintenance, Queue

DEFAULT_SCHEMA = "dbqueue"
SCHEMA_EXTRA = "dbqueue_schema"
"""Connection extra naming the schema that holds the queue tables (default ``dbqueue``)."""

CONN_TYPE = "dbqueue"
"""The provider's own connection type: its form picks the dialect (extra ``dialect``) and the schema."""
DIALECT_EXTRA = "dialect"
DIALECTS = ("postgresql", "mssql")

# Connection types that select a dialect (a dbqueue connection names its dialect in its extra).
_DIALECTS = {"postgres": "postgresql", "postgresql": "postgresql", "mssql": "mssql", "odbc": "mssql"}
# Extras of SQL Server connections that are not ODBC attributes (Airflow's own, and ours).
_NOT_ODBC_EXTRAS = frozenset(
    {
        SCHEMA_EXTRA,
        DIALECT_EXTRA,
        f"extra__{CONN_TYPE}__{SCHEMA_EXTRA}",
        f"extra__{CONN_TYPE}__{DIALECT_EXTRA}",
        "connect_kwargs",
        "sqlalchemy_scheme",
        "sqlalchemy_query",
        "allow_driver_in_extra",
    }
)
# Token authentication the postgres provider builds (extra -> PostgresHook's method).
_TOKEN_EXTRAS = {"iam": "get_iam_token", "azure": "get_azure_iam_token"}
# libpq parameters a connection's extras may carry through to the driver.
_LIBPQ_EXTRAS = frozenset(
    {
        "sslmode",
        "sslcert",
        "sslkey",
        "sslrootcert",
        "sslcrl",
        "sslpassword",
        "application_name",
        "connect_timeout",
        "options",
        "target_session_attrs",
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "gssencmode",
        "channel_binding",
    }
)


def _extra(extra: Mapping[str, Any], name: str) -> Any:
    """An extra of a dbqueue connection, written plain or with the ``extra__dbqueue__`` prefix."""
    value = extra.get(name)
    return value if value not in (None, "") else extra.get(f"extra__{CONN_TYPE}__{name}")


def connection_dialect(conn: Connection) -> str:
    """Return the dialect a connection selects (``postgresql`` or ``mssql``), checking its type."""
    conn_type = (conn.conn_type or "").lower()
    if conn_type == CONN_TYPE:
        dialect = str(_extra(conn.extra_dejson or {}, DIALECT_EXTRA) or "postgresql").lower()
        if dialect not in DIALECTS:
            raise ConfigurationError(
                f"connection {conn.conn_id!r} names the dialect {dialect!r}; a dbqueue connection's "
                f"dialect is one of {', '.join(DIALECTS)}"
            )
        return dialect
    if conn_type not in _DIALECTS:
        raise ConfigurationError(
            f"connection {conn.conn_id!r} is of type {conn_type or '<none>'!r}; DbQueueHook needs a "
            f"connection of type {CONN_TYPE!r}, or a database connection of type 'postgres', 'mssql' or "
            "'odbc' (SQL Server)"
        )
    return _DIALECTS[conn_type]


def connection_dsn(conn: Connection) -> tuple[str, str]:
    """Return ``(dsn, queue_schema)`` for an Airflow connection, checking that its type has a dialect.

    Shared by the hook (sync) and the trigger (which looks the connection up asynchronously).
    """
    from airflow_dbqueue.engine.dialects.postgres.conninfo import make_dsn

    dialect = connection_dialect(conn)
    extra = conn.extra_dejson or {}
    schema = _extra(extra, SCHEMA_EXTRA) or DEFAULT_SCHEMA
    if dialect == "mssql":
        return mssql_url(conn, extra), str(schema)
    login, password, port = conn.login, conn.password, conn.port
    tokens = [key for key in _TOKEN_EXTRAS if str(extra.get(key, "")).lower() in ("true", "1", "yes")]
    if tokens:
        login, password, port = _token_login(conn, tokens[0])
    params: dict[str, Any] = {
        "host": conn.host or None,
        "port": port or None,
        "user": login or None,
        "password": password or None,
        "dbname": conn.schema or None,
    }
    params.update({k: v for k, v in extra.items() if k in _LIBPQ_EXTRAS})
    return make_dsn(params), str(schema)


def _token_login(conn: Connection, key: str) -> tuple[str, str, int]:
    """Login, token and port for a connection whose extra asks for token authentication (``iam`` for
    AWS, ``azure`` for Azure), built by the postgres provider's PostgresHook as it does for itself."""
    try:
        from airflow.providers.postgres.hooks.postgres import PostgresHook
    except ImportError:
        raise ConfigurationError(
            f"connection {conn.conn_id!r} asks for {key!r} token authentication, which the postgres "
            "provider builds: pip install 'apache-airflow-providers-postgres[amazon]' (or [azure])"
        ) from None
    hook = PostgresHook(postgres_conn_id=conn.conn_id)
    login, token, port = getattr(hook, _TOKEN_EXTRAS[key])(conn)
    return str(login), str(token), int(port or 5432)


def mssql_url(conn: Connection, extra: Mapping[str, Any]) -> str:
    """Return the ``mssql://`` URL of an Airflow ``mssql`` or ``odbc`` connection.

    Host, port, login, password and schema (the database) make the URL; the extras that are ODBC
    attributes (``Driver``, ``Encrypt``, ``TrustServerCertificate`` ...) go as its query.
    """
    from urllib.parse import quote, urlencode

    cred = ""
    if conn.login:
        cred = (
            quote(conn.login, safe="") + (f":{quote(conn.password, safe='')}" if conn.password else "") + "@"
        )
    host = conn.host or "localhost"
    port = f":{int(conn.port)}" if conn.port else ""
    attrs = {k: str(v) for k, v in extra.items() if k not in _NOT_ODBC_EXTRAS and not isinstance(v, dict)}
    named = [k for k in attrs if k.lower() == "driver"]
    if named and not _driver_in_extra_allowed():
        # OdbcHook's guard: a driver named in a connection's extra loads that library into the
        # worker, so an extra may name one only where the deployment allows it.
        raise ConfigurationError(
            f"connection {conn.conn_id!r} names an ODBC driver in its extra ({named[0]}), which "
            "[providers.odbc] allow_driver_in_extra does not allow (as for OdbcHook); set it to True in "
            "Airflow's configuration, or leave Driver out to use ODBC Driver 18 for SQL Server"
        )
    query = f"?{urlencode(attrs)}" if attrs else ""
    return f"mssql://{cred}{host}{port}/{quote(conn.schema or '', safe='')}{query}"


def _driver_in_extra_allowed() -> bool:
    from airflow.configuration import conf

    return bool(conf.getboolean("providers.odbc", "allow_driver_in_extra", fallback=False))


_GROUP_GAUGES = ("lag_messages", "lag_seconds", "idle_s")
_QUEUE_GAUGES = (
    "ready",
    "delayed",
    "in_flight",
    "failed",
    "finished",
    "oldest_ready_age_s",
    "pushed_per_s",
    "finished_per_s",
)
_TABLE_GAUGES = ("total_bytes", "table_bytes", "index_bytes", "live_tuples", "dead_tuples", "dead_ratio")
_INDEX_GAUGES = ("size_bytes", "bloat_ratio", "bloat_bytes", "fragmentation_pct", "page_density_pct")


def emit_metrics(metrics: Mapping[str, Any], *, prefix: str = "dbqueue") -> int:
    """Send the gauges of a metrics dict (:meth:`DbQueueHook.queue_metrics`) through Airflow's metrics.

    Names are stable and carry no schema, queue, table or index name; those travel as tags, as
    Airflow's own metrics do since 3.2: ``<prefix>.queue.<gauge>`` tagged ``schema`` and ``queue``
    (``ready``, ``delayed``, ``in_flight``, ``failed``, ``finished``, ``oldest_ready_age_s``,
    ``pushed_per_s``, ``finished_per_s``), ``<prefix>.group.<gauge>`` tagged ``schema``, ``queue`` and
    ``group`` (a ring's consumer groups besides its default one: ``lag_messages``, ``lag_seconds``,
    ``idle_s``), ``<prefix>.table.<gauge>`` tagged ``schema`` and ``table``
    (sizes, live and dead rows), ``<prefix>.index.<gauge>`` tagged ``schema`` and ``index`` (size and
    bloat; on SQL Server also fragmentation and page density) and ``<prefix>.xmin_holders`` tagged
    ``schema``.

    :return: how many gauges were sent (values that are ``None`` are left out).
    """
    from airflow.sdk.observability.stats import Stats

    schema = metrics["schema"]
    sent = 0

    def gauge(name: str, value: Any, tags: dict[str, str]) -> None:
        nonlocal sent
        if value is None:
            return
        Stats.gauge(f"{prefix}.{name}", float(value), tags={"schema": schema, **tags})
        sent += 1

    for queue, values in metrics.get("queues", {}).items():
        for key in _QUEUE_GAUGES:
            gauge(f"queue.{key}", values.get(key), {"queue": queue})
        for group, figures in (values.get("groups") or {}).items():
            for key in _GROUP_GAUGES:
                gauge(f"group.{key}", figures.get(key), {"queue": queue, "group": group})
    for table, values in metrics.get("tables", {}).items():
        for key in _TABLE_GAUGES:
            gauge(f"table.{key}", values.get(key), {"table": table})
    for index, values in metrics.get("indexes", {}).items():
        for key in _INDEX_GAUGES:
            gauge(f"index.{key}", values.get(key), {"index": index})
    gauge("xmin_holders", len(metrics.get("xmin_holders", [])), {})
    return sent


def message_to_xcom(msg: Message, payload_type: PayloadType) -> dict[str, Any]:
    """Return a JSON-safe dict of a message (bytes payloads as base64, flagged by ``payload_encoding``)."""
    out: dict[str, Any] = {
        "id": msg.id,
        "attempts": msg.attempts,
        "delivery": msg.delivery,
        "priority": msg.priority,
        "enqueued_at": msg.enqueued_at.isoformat(),
        "payload": msg.payload,
    }
    if payload_type is PayloadType.BYTES:
        out["payload"] = base64.b64encode(msg.payload).decode("ascii")
        out["payload_encoding"] = "base64"
    return out


class DbQueueHook(BaseHook):  # type: ignore[misc]
    """Interact with airflow-dbqueue queues through an Airflow database connection.

    The connection is of the provider's own type ``dbqueue``, whose form names the dialect
    (``postgresql`` or ``mssql``) and the queue schema, or of an existing database type: ``postgres``;
    ``mssql`` and ``odbc`` for SQL Server, through pyodbc (``pip install 'airflow-dbqueue[mssql]'``).
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
        connect_timeout: float = 10.0,
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
        conn: psycopg.Connection[Any] | None = None,
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
        conn: psycopg.Connection[Any] | None = None,
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
        conn: psycopg.Connection[Any] | None = None,
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
        return self.get_queue(queue_name, group).ack_receipts([_receipt(r) for r in receipts])

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
            [_receipt(r) for r in receipts], delay=delay, error=error
        )

    def leased(
        self, queue_name: str, receipts: Sequence[Sequence[int]], *, group: str | None = None
    ) -> list[Message]:
        """Return the still-leased messages of ``receipts``, with payloads."""
        return self.get_queue(queue_name, group).leased([_receipt(r) for r in receipts])

    # -- claims: what the pop operator and the claiming sensor hand to the next task ---------------

    def claim(
        self,
        queue_name: str,
        n: int,
        *,
        semantics: Semantics | str = Semantics.AT_LEAST_ONCE,
        visibility_timeout: float | None = None,
        wait: float = 0.0,
        xcom_max_messages: int = 100,
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
        if sem is Semantics.EXACTLY_ONCE:
            raise ConfigurationError(
                "exactly-once needs the processing to run in the pop's transaction, which XCom cannot "
                "carry: pop with DbQueueHook.transaction() inside the task that writes the results"
            )
        if sem is Semantics.AT_MOST_ONCE and n > xcom_max_messages:
            raise ConfigurationError(
                f"an at-most-once pop of up to {n} messages cannot hand them on: popped messages are "
                f"finished, and more than xcom_max_messages={xcom_max_messages} payloads would flood XCom; "
                "use at-least-once (the batch stays claimed) or a smaller batch"
            )
        queue = self.get_queue(queue_name, group)
        msgs = queue.pop(
            n, semantics=sem, visibility_timeout=visibility_timeout, wait=wait, consumer=consumer
        )
        leased = sem is Semantics.AT_LEAST_ONCE
        inline = len(msgs) <= xcom_max_messages
        claim = {
            "queue_name": queue_name,
            "semantics": sem.value,
            "count": len(msgs),
            "receipts": [list(m.receipt) for m in msgs] if leased else [],
            "messages": [message_to_xcom(m, queue.settings.payload_type) for m in msgs] if inline else None,
        }
        if group is not None:
            claim["group"] = group
        return claim

    def claimed_messages(self, claim: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Return the messages of a claim as JSON-safe dicts, reading them from the database if needed.

        Messages whose lease was lost since the claim are left out (they will be delivered again).
        """
        if claim.get("messages") is not None:
            return list(claim["messages"])
        queue = self.get_queue(claim["queue_name"], claim.get("group"))
        msgs = queue.leased([_receipt(r) for r in claim.get("receipts") or []])
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
        cap: int = 1_000_000,
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

    # -- maintenance (the maintenance DAG's steps; see airflow_dbqueue.engine.maintenance) ---------------

    def maintenance(self) -> Maintenance:
        """Return the engine's maintenance steps for this schema."""
        return self.get_conn().maintenance()

    def archive(
        self,
        *,
        older_than_s: float = 300.0,
        batch_size: int = 1000,
        pause_s: float = 0.05,
        time_budget_s: float = 60.0,
        queues: Sequence[str] | None = None,
        lock_wait_s: float = 0.0,
    ) -> dict[str, Any]:
        """Move finished messages older than ``older_than_s`` into the archive in bounded batches.

        See :meth:`Maintenance.archive`. Returns a JSON-safe dict; ``skipped`` says why when another
        maintenance run held the schema's lock for longer than ``lock_wait_s``.
        """
        return (
            self.maintenance()
            .archive(
                older_than_s=older_than_s,
                batch_size=batch_size,
                pause_s=pause_s,
                time_budget_s=time_budget_s,
                queues=queues,
                lock_wait_s=lock_wait_s,
            )
            .as_dict()
        )

    def purge_archive(
        self,
        *,
        older_than_s: float,
        batch_size: int = 1000,
        pause_s: float = 0.05,
        time_budget_s: float = 60.0,
        queues: Sequence[str] | None = None,
        lock_wait_s: float = 0.0,
    ) -> dict[str, Any]:
        """Delete archived messages older than ``older_than_s`` in bounded batches (the archive retention)."""
        return (
            self.maintenance()
            .purge_archive(
                older_than_s=older_than_s,
                batch_size=batch_size,
                pause_s=pause_s,
                time_budget_s=time_budget_s,
                queues=queues,
                lock_wait_s=lock_wait_s,
            )
            .as_dict()
        )

    def recover(
        self, queues: Sequence[str] | None = None, *, limit: int = 10_000
    ) -> dict[str, dict[str, int]]:
        """Run each queue's design upkeep: reclaim expired leases (and, for ring queues, recover gaps)."""
        return self.maintenance().recover(queues, limit=limit)

    def vacuum(self, *, lock_wait_s: float = 0.0) -> dict[str, Any]:
        """VACUUM (ANALYZE) the schema's tables, skipping any that another session has locked.

        SQL Server has no VACUUM (its ghost cleanup task removes deleted rows): there the step runs
        UPDATE STATISTICS, and the result says so.
        """
        return self.maintenance().vacuum(lock_wait_s=lock_wait_s)

    def compact_rings(
        self,
        *,
        bloat_ratio: float = 1.5,
        min_bloat_bytes: int = 8 * 1024 * 1024,
        lock_timeout_s: float = 2.0,
        lock_wait_s: float = 0.0,
        horizon_min_age_s: float = 10.0,
    ) -> dict[str, Any]:
        """Rewrite ring tables that outgrew their laid-out size; see :meth:`Maintenance.compact_rings`
        (PostgreSQL; skipped on SQL Server, whose tables keep no old row versions)."""
        return self.maintenance().compact_rings(
            bloat_ratio=bloat_ratio,
            min_bloat_bytes=min_bloat_bytes,
            lock_timeout_s=lock_timeout_s,
            lock_wait_s=lock_wait_s,
            horizon_min_age_s=horizon_min_age_s,
        )

    def rebuild_indexes(
        self,
        *,
        bloat_ratio: float = 2.0,
        min_bloat_bytes: int = 1024 * 1024,
        timeout_s: float = 600.0,
        lock_wait_s: float = 0.0,
        fragmentation_pct: float = 30.0,
        horizon_min_age_s: float | None = None,
    ) -> dict[str, Any]:
        """Rebuild bloated indexes online; see :meth:`Maintenance.rebuild_indexes`.

        PostgreSQL: REINDEX INDEX CONCURRENTLY, and INVALID leftovers of failed rebuilds are dropped.
        SQL Server: ALTER INDEX ... REBUILD WITH (ONLINE = ON) where the engine edition allows it,
        REORGANIZE otherwise (the result's ``mode`` and ``edition`` say which); ``fragmentation_pct``
        applies there only. With ``horizon_min_age_s``, a rebuild is not run while a transaction open
        longer than that would hold it up (its action is ``skip`` with ``ok`` false).
        """
        return self.maintenance().rebuild_indexes(
            bloat_ratio=bloat_ratio,
            min_bloat_bytes=min_bloat_bytes,
            timeout_s=timeout_s,
            lock_wait_s=lock_wait_s,
            fragmentation_pct=fragmentation_pct,
            horizon_min_age_s=horizon_min_age_s,
        )

    def check_horizon(
        self, *, min_age_s: float = 300.0, min_xid_age: int = 1_000_000
    ) -> list[dict[str, Any]]:
        """Return (and log a warning for) whatever holds back cleanup, as JSON-safe dicts.

        PostgreSQL: the xmin horizon (VACUUM cannot remove dead rows). SQL Server: long transactions of
        the database and snapshot transactions (log truncation, row-version and ghost cleanup).
        """
        m = self.maintenance()
        holders = m.xmin_holders(min_age_s=min_age_s, min_xid_age=min_xid_age)
        what = (
            "Cleanup is held back (log truncation, row versions and ghost records)"
            if m.dialect == "mssql"
            else "The xmin horizon is held back (VACUUM cannot remove dead rows)"
        )
        for h in holders:
            self.log.warning("%s: %s", what, h.describe())
        return [h.as_dict() for h in holders]

    def queue_metrics(
        self, queues: Sequence[str] | None = None, *, rate_window_s: float = 300.0, emit: bool = True
    ) -> dict[str, Any]:
        """Return the schema's queue metrics as a JSON-safe dict, and send them through Airflow's metrics.

        See :meth:`Maintenance.metrics` for the dict and :func:`emit_metrics` for the metric names.
        """
        metrics = self.maintenance().metrics(queues, rate_window_s=rate_window_s)
        if emit:
            sent = emit_metrics(metrics)
            self.log.info("Sent %d dbqueue gauges for schema %s", sent, metrics["schema"])
        return metrics

    def maintenance_step(
        self, name: str, config: MaintenanceConfig | Mapping[str, Any] | None = None, *, emit: bool = True
    ) -> dict[str, Any]:
        """Run one step of :meth:`maintain` (a name of ``STEPS``) as ``maintain`` runs it; return its
        JSON-safe result (see :meth:`Maintenance.step`). The maintenance DAG runs each step as a task
        of its own through this. The ``metrics`` step's result is also sent through Airflow's metrics
        unless ``emit`` is false.
        """
        if config is None or isinstance(config, Mapping):
            config = MaintenanceConfig.from_mapping(config or {})
        out = self.maintenance().step(name, config)
        if name == "metrics" and emit:
            sent = emit_metrics(out)
            self.log.info("Sent %d dbqueue gauges for schema %s", sent, out["schema"])
        return out

    def maintain(
        self, config: MaintenanceConfig | Mapping[str, Any] | None = None, *, emit: bool = True
    ) -> dict[str, Any]:
        """Run every maintenance step once under the schema's lock; return the JSON-safe report.

        ``config`` is a :class:`MaintenanceConfig` or a mapping of its fields (``None`` values keep
        the defaults). The report's ``metrics`` are also sent through Airflow's metrics unless ``emit``
        is false.
        """
        if config is None or isinstance(config, Mapping):
            config = MaintenanceConfig.from_mapping(config or {})
        report = self.maintenance().run(config)
        if report["skipped"]:
            self.log.warning("dbqueue maintenance skipped: %s", report["skipped"])
        if emit:
            emit_metrics(report["metrics"])
        return report

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """Yield a connection in a transaction for exactly-once work (pop and write with ``conn=``)."""
        with self.get_conn().transaction() as conn:
            yield conn


def _receipt(r: Sequence[int]) -> tuple[int, int]:
    try:
        mid, delivery = r
    except (TypeError, ValueError):
        raise ConfigurationError(f"a receipt is a pair [id, delivery], got {r!r}") from None
    return mid, delivery
