"""PostgreSQL connection strings: checked without I/O, described without credentials, built from an
Airflow connection's fields, read back as a JDBC reader's options (a Spark job), and probed for a
server that accepts connections (the embedded server's start)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
import psycopg.conninfo

from airflow_dbqueue.engine.errors import ConfigurationError

_INTEGER_OPTIONS = (
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)
_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def check_dsn(dsn: str) -> None:
    """Raise :class:`ConfigurationError` for a connection string that libpq cannot use, without any I/O.

    libpq checks a string's syntax and option names when it parses it, but a port or a timeout that is
    not a number only when it connects: the pool then retried it until its timeout and reported the
    database as unreachable. Values are never echoed (a password may be among them).
    """
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigurationError(f"the PostgreSQL connection string is not valid: {first}") from None
    for port in str(info.get("port") or "").split(","):
        if port.strip() and not (port.strip().isdigit() and 1 <= int(port) <= 65535):
            raise ConfigurationError(
                f"the PostgreSQL connection string is not valid: port {port.strip()!r} is not a port "
                "number (1..65535)"
            )
    for name in _INTEGER_OPTIONS:
        value = str(info.get(name) or "").strip()
        if value and not value.lstrip("-").isdigit():
            raise ConfigurationError(
                f"the PostgreSQL connection string is not valid: {name} {value!r} is not an integer"
            )
    sslmode = info.get("sslmode")
    if sslmode and sslmode not in _SSLMODES:
        raise ConfigurationError(
            f"the PostgreSQL connection string is not valid: sslmode {sslmode!r} is not one of "
            f"{', '.join(_SSLMODES)}"
        )


def describe_dsn(dsn: str) -> str:
    """Return ``host:port/dbname`` of a DSN or URI, without credentials, for error messages."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:
        return "<unparsable connection string>"
    host = info.get("host") or info.get("hostaddr") or "localhost"
    return f"{host}:{info.get('port') or 5432}/{info.get('dbname') or info.get('user') or ''}"


def connect_error(dsn: str, *, connect_timeout: int) -> Exception | None:
    """Open one connection to ``dsn`` and close it again: None when the server accepted it, else why
    not (the driver's error of an unreachable or starting server; any other error is raised)."""
    try:
        with psycopg.connect(dsn, connect_timeout=connect_timeout):
            return None
    except psycopg.OperationalError as exc:
        return exc


def make_dsn(params: Mapping[str, Any]) -> str:
    """A libpq connection string of ``params`` (``host``, ``port``, ``user``, ``password``, ``dbname``
    and libpq's options); those that are None are left out."""
    return psycopg.conninfo.make_conninfo("", **{k: v for k, v in params.items() if v is not None})


def jdbc_options(dsn: str, *, transaction_pooler: bool = False) -> dict[str, str]:
    """Spark JDBC options (url, user, password) for the PostgreSQL database of a libpq ``dsn``.

    The URL carries the host, port, database and ``sslmode``; ``user`` and ``password`` are there only
    when the DSN has them. Behind a transaction pooler the URL sets ``prepareThreshold=0``: the JDBC
    driver then never names a server-side prepared statement, which would live on one server connection
    while the pooler sends the next transaction to another.
    """
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    url = f"jdbc:postgresql://{info.get('host') or 'localhost'}:{info.get('port') or 5432}/"
    out = {"url": url + str(info.get("dbname") or "postgres")}
    query = []
    if info.get("sslmode"):
        query.append(f"sslmode={info['sslmode']}")
    if transaction_pooler:
        query.append("prepareThreshold=0")
    if query:
        out["url"] += "?" + "&".join(query)
    if info.get("user"):
        out["user"] = str(info["user"])
    if info.get("password"):
        out["password"] = str(info["password"])
    return out
