"""Validation of the identifiers (queue and schema names) that the engine puts into SQL.

Names are validated here and then quoted by the driver's identifier quoting; they are never pasted
raw into a statement.
"""

from __future__ import annotations

import re

from airflow_dbqueue.engine.errors import InvalidNameError

_NAME = re.compile(r"[a-z_][a-z0-9_]*")
QUEUE_NAME_MAX = 48
SCHEMA_NAME_MAX = 40

POSTGRESQL_RESERVED_SCHEMAS = frozenset({"public", "information_schema"})
"""Schemas of PostgreSQL that hold objects not the engine's (``public``) or the system's own; every
``pg_*`` schema is refused as well, by the reserved prefix."""
MSSQL_RESERVED_SCHEMAS = frozenset(
    {
        "dbo",
        "sys",
        "information_schema",
        "guest",
        "db_owner",
        "db_accessadmin",
        "db_securityadmin",
        "db_ddladmin",
        "db_backupoperator",
        "db_datareader",
        "db_datawriter",
        "db_denydatareader",
        "db_denydatawriter",
    }
)
"""Schemas of SQL Server that hold objects not the engine's (``dbo``), the system's own, or the fixed
database roles' (compared without regard to case, as SQL Server's default collations do)."""


def _check(kind: str, name: object, max_len: int) -> str:
    if not isinstance(name, str):
        raise InvalidNameError(f"{kind} name must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidNameError(f"{kind} name must not be empty")
    if len(name) > max_len:
        raise InvalidNameError(f"{kind} name {name!r} is {len(name)} characters long; the limit is {max_len}")
    if not _NAME.fullmatch(name):
        raise InvalidNameError(
            f"{kind} name {name!r} is not valid: use lower-case letters, digits and underscores, "
            "starting with a letter or underscore"
        )
    if name.startswith("pg_"):
        raise InvalidNameError(f"{kind} name {name!r} is not valid: the prefix 'pg_' is reserved")
    return name


def validate_queue_name(name: object) -> str:
    """Return ``name`` if it is a valid queue name, else raise :class:`InvalidNameError`."""
    return _check("queue", name, QUEUE_NAME_MAX)


def validate_schema_name(name: object, reserved: frozenset[str] = frozenset()) -> str:
    """Return ``name`` if it is a valid schema name, else raise :class:`InvalidNameError`.

    :param reserved: names of the database's own schemas (:data:`POSTGRESQL_RESERVED_SCHEMAS`,
        :data:`MSSQL_RESERVED_SCHEMAS`), refused because they hold objects the engine did not create:
        its tables there would live among them, and no uninstall could tell them apart by schema.
    """
    name = _check("schema", name, SCHEMA_NAME_MAX)
    if name.lower() in reserved:
        raise InvalidNameError(
            f"schema name {name!r} is not valid: it is a reserved schema of the database, which holds "
            "objects that are not the engine's; give the queues a schema of their own (the default is "
            "'dbqueue')"
        )
    return name


def validate_identifier(name: object) -> str:
    """Return ``name`` if it is a valid name of a table or index the engine made, else raise.

    Such names (``meta``, ``meta_ready_idx``, ``meta_ready_idx_ccnew``) come from the schema or the
    catalog and are quoted by the driver; this check keeps anything else out of utility statements.
    """
    return _check("identifier", name, 63)
