"""How values, names and rows cross between the engine and T-SQL: ``%(name)s`` placeholders as pyodbc's
``?`` with adapted values (lists as JSON arrays, aware times as naive UTC), T-SQL literals for
:meth:`MssqlDatabase.render`, checked integer constants where T-SQL takes no parameter, the session's
timeouts, and pyodbc's rows as the engine expects them."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from airflow_dbqueue.engine.errors import ConfigurationError

INLINE_INT_PARAMS: dict[str, dict[str, tuple[int, int]]] = {"set_timeouts": {"lock_ms": (-1, 2**31 - 1)}}
"""Parameters that T-SQL does not accept as parameters (``SET LOCK_TIMEOUT`` takes a constant), by query:
written into the text as integers after :func:`int_literal` checked them against the range given."""


def int_literal(value: Any, *, name: str, low: int, high: int) -> str:
    """Return ``value`` as the text of an integer in ``low..high`` for a T-SQL statement that takes a
    constant; raise :class:`ConfigurationError` for anything else (booleans, fractions, other text)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigurationError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    text = value.strip() if isinstance(value, str) else str(value)
    if not re.fullmatch(r"-?[0-9]{1,10}", text) or not low <= int(text) <= high:
        raise ConfigurationError(f"{name} must be an integer in {low}..{high}, got {value!r}")
    return str(int(text))


def lock_timeout_ms(seconds: float | None) -> int:
    """Return the ``SET LOCK_TIMEOUT`` value for ``seconds`` (``None``: wait without limit, -1).

    Rounded up to whole milliseconds and capped at 2**31 - 1; negative, NaN or infinite seconds raise
    :class:`ConfigurationError`.
    """
    if seconds is None:
        return -1
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
        raise ConfigurationError(f"a lock timeout must be a finite number of seconds, got {seconds!r}")
    if seconds < 0:
        raise ConfigurationError(f"a lock timeout must be >= 0 seconds, got {seconds!r}")
    return min(2**31 - 1, math.ceil(seconds * 1000))


def query_timeout_s(seconds: float | None) -> int:
    """Return the driver's query timeout for ``seconds``: whole seconds, rounded up (0.2 s waits 1 s),
    at least 1 for any positive value; 0 (no timeout) for ``None`` or 0."""
    if seconds is None:
        return 0
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
        raise ConfigurationError(f"a statement timeout must be a finite number of seconds, got {seconds!r}")
    if seconds < 0:
        raise ConfigurationError(f"a statement timeout must be >= 0 seconds, got {seconds!r}")
    return min(2**31 - 1, math.ceil(seconds))


def inline_int_params(name: str, sql: str, params: Mapping[str, Any] | None) -> str:
    """Write the :data:`INLINE_INT_PARAMS` of query ``name`` into ``sql`` as checked integer literals."""
    ranges = INLINE_INT_PARAMS.get(name)
    if not ranges:
        return sql
    given = params or {}

    def repl(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in ranges:
            return m.group(0)
        if key not in given:
            raise ConfigurationError(f"no value for the query parameter {key!r}")
        low, high = ranges[key]
        return int_literal(given[key], name=key, low=low, high=high)

    return _NAMED.sub(repl, sql)


_NAMED = re.compile(r"%\(([a-z_][a-z0-9_]*)\)s")


def adapt_value(value: Any) -> Any:
    """Return ``value`` as pyodbc should bind it.

    Lists and tuples become one JSON array (bytes items as hex strings, for ``CONVERT(..., 2)``); UUIDs
    become text; aware datetimes become naive UTC (every time column is UTC ``datetime2``).
    """
    if isinstance(value, list | tuple):
        return json.dumps([v.hex() if isinstance(v, bytes | bytearray | memoryview) else v for v in value])
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.UTC).replace(tzinfo=None)
    return value


def to_positional(sql: str, params: Mapping[str, Any] | None) -> tuple[str, list[Any]]:
    """Turn ``%(name)s`` placeholders into ``?`` and return the values in placeholder order.

    A name used twice is bound twice. A placeholder without a value raises :class:`ConfigurationError`;
    values that no placeholder names are ignored (a query may not need every value the design passes).
    """
    values: list[Any] = []
    given = params or {}

    def repl(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in given:
            raise ConfigurationError(f"no value for the query parameter {name!r}")
        values.append(adapt_value(given[name]))
        return "?"

    return _NAMED.sub(repl, sql), values


def sql_literal(value: Any) -> str:  # noqa: PLR0911
    """Return ``value`` as a T-SQL literal (for :meth:`MssqlDatabase.render`; never for user input)."""
    value = adapt_value(value)
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bytes | bytearray):
        return "0x" + bytes(value).hex()
    if isinstance(value, dt.datetime):
        return f"CAST('{value.isoformat(sep=' ')}' AS datetime2(6))"
    if isinstance(value, str):
        return "N'" + value.replace("'", "''") + "'"
    raise ConfigurationError(f"cannot render a {type(value).__name__} as a T-SQL literal")


def render_named(sql: str, params: Mapping[str, Any]) -> str:
    """Replace ``%(name)s`` placeholders by T-SQL literals of ``params``."""

    def repl(m: re.Match[str]) -> str:
        if m.group(1) not in params:
            raise ConfigurationError(f"no value for the query parameter {m.group(1)!r}")
        return sql_literal(params[m.group(1)])

    return _NAMED.sub(repl, sql)


def quote_identifier(name: str) -> str:
    """Return ``name`` bracket-quoted (``]`` doubled), as T-SQL's QUOTENAME does."""
    return "[" + name.replace("]", "]]") + "]"


# Queries whose rows carry receipt lists as JSON text (columns 2 and 3: ids, deliveries).
_JSON_LIST_COLUMNS: dict[str, tuple[int, ...]] = {
    "claim_batch": (2, 3),
    "claim_batch_with": (2, 3),
    "get_batch": (2, 3),
    "lock_batch": (2, 3),
    "open_batches": (2, 3),
    "ring_record_batch": (2, 3),
}


def adapt_row(name: str, row: Sequence[Any]) -> tuple[Any, ...]:
    """Return a pyodbc row as the engine expects it: naive datetimes as aware UTC (every time column
    is UTC), and the JSON lists of :data:`_JSON_LIST_COLUMNS` as lists."""
    out: list[Any] = [
        v.replace(tzinfo=dt.UTC) if isinstance(v, dt.datetime) and v.tzinfo is None else v for v in row
    ]
    for i in _JSON_LIST_COLUMNS.get(name, ()):
        out[i] = json.loads(out[i]) if out[i] is not None else []
    return tuple(out)
