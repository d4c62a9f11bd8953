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


def validate_schema_name(name: object) -> str:
    """Return ``name`` if it is a valid schema name, else raise :class:`InvalidNameError`."""
    return _check("schema", name, SCHEMA_NAME_MAX)


def validate_identifier(name: object) -> str:
    """Return ``name`` if it is a valid name of a table or index the engine made, else raise.

    Such names (``meta``, ``meta_ready_idx``, ``meta_ready_idx_ccnew``) come from the schema or the
    catalog and are quoted by the driver; this check keeps anything else out of utility statements.
    """
    return _check("identifier", name, 63)
