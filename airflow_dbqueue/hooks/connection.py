"""The Airflow connections a :class:`~airflow_dbqueue.hooks.dbqueue.DbQueueHook` takes: which dialect a
connection selects, and the engine's DSN and queue schema built from it (shared by the hook, the
trigger, which looks its connection up asynchronously, and the Queues page)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from airflow_dbqueue.engine import ConfigurationError
from airflow_dbqueue.engine.dialects.base import (
    DEFAULT_SCHEMA,
    DIALECTS,
    MSSQL,
    POOLER_NONE,
    POSTGRESQL,
    check_pooler,
)

if TYPE_CHECKING:
    from airflow.sdk import Connection

SCHEMA_EXTRA = "dbqueue_schema"
"""Connection extra naming the schema that holds the queue tables (default ``dbqueue``)."""
POOLER_EXTRA = "dbqueue_pooler"
"""Connection extra: ``transaction`` when the host is a pooler in transaction mode (``none`` or
``session`` otherwise; the engine's ``pooler``)."""
LISTEN_HOST_EXTRA = "dbqueue_listen_host"
LISTEN_PORT_EXTRA = "dbqueue_listen_port"
"""Connection extras: the host and port that reach the same database with a session of its own (the
server, or a pooler in session mode), with the connection's login and database: the engine's
``listen_dsn``, where waiting pops, sensors and triggers LISTEN and maintenance holds its lock."""

CONN_TYPE = "dbqueue"
"""The provider's own connection type: its form picks the dialect (extra ``dialect``) and the schema."""
DIALECT_EXTRA = "dialect"

# Connection types that select a dialect (a dbqueue connection names its dialect in its extra).
_DIALECTS = {"postgres": POSTGRESQL, "postgresql": POSTGRESQL, "mssql": MSSQL, "odbc": MSSQL}
_OUR_EXTRAS = (SCHEMA_EXTRA, DIALECT_EXTRA, POOLER_EXTRA, LISTEN_HOST_EXTRA, LISTEN_PORT_EXTRA)
# Extras of SQL Server connections that are not ODBC attributes (Airflow's own, and ours).
_NOT_ODBC_EXTRAS = frozenset(
    {
        *_OUR_EXTRAS,
        *(f"extra__{CONN_TYPE}__{name}" for name in _OUR_EXTRAS),
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
        dialect = str(_extra(conn.extra_dejson or {}, DIALECT_EXTRA) or POSTGRESQL).lower()
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


class Target(NamedTuple):
    """What the engine needs of an Airflow connection: :class:`~airflow_dbqueue.engine.DbQueue`'s
    ``dsn``, ``schema``, ``pooler`` and ``listen_dsn``."""

    dsn: str
    schema: str
    pooler: str
    listen_dsn: str | None

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``DbQueue`` (and ``make_database``) besides the DSN."""
        return {"schema": self.schema, "pooler": self.pooler, "listen_dsn": self.listen_dsn}


def connection_dsn(conn: Connection) -> tuple[str, str]:
    """Return ``(dsn, queue_schema)`` for an Airflow connection, checking that its type has a dialect."""
    target = connection_target(conn)
    return target.dsn, target.schema


def connection_target(conn: Connection) -> Target:
    """Return the engine's :class:`Target` for an Airflow connection, checking that its type has a
    dialect and that its pooler extras make sense."""
    from airflow_dbqueue.engine.dialects.factory import postgres_dsn as make_dsn

    dialect = connection_dialect(conn)
    extra = conn.extra_dejson or {}
    schema = str(_extra(extra, SCHEMA_EXTRA) or DEFAULT_SCHEMA)
    try:
        pooler = check_pooler(_extra(extra, POOLER_EXTRA) or None)
    except ConfigurationError as exc:
        raise ConfigurationError(f"connection {conn.conn_id!r}: {exc}") from None
    listen_host = _extra(extra, LISTEN_HOST_EXTRA)
    listen_port = _extra(extra, LISTEN_PORT_EXTRA)
    if dialect == MSSQL:
        if pooler != POOLER_NONE or listen_host or listen_port:
            raise ConfigurationError(
                f"connection {conn.conn_id!r}: {POOLER_EXTRA}, {LISTEN_HOST_EXTRA} and "
                f"{LISTEN_PORT_EXTRA} are PostgreSQL's (SQL Server has no transaction pooler or LISTEN)"
            )
        return Target(mssql_url(conn, extra), schema, pooler, None)
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
    listen_dsn = None
    if listen_host or listen_port:
        if listen_port not in (None, "") and not str(listen_port).strip().isdigit():
            raise ConfigurationError(
                f"connection {conn.conn_id!r}: {LISTEN_PORT_EXTRA} must be a port number, got {listen_port!r}"
            )
        listen_dsn = make_dsn(
            {**params, "host": listen_host or params["host"], "port": listen_port or params["port"]}
        )
    return Target(make_dsn(params), schema, pooler, listen_dsn)


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
