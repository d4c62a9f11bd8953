"""A stand-in for a SQL Server behind pyodbc, for the offline tests of the SQL Server dialect: no SQL Server
can run on the build machines.

:class:`FakeSqlServer` hands out :class:`FakeConnection` objects shaped like pyodbc's (cursor, commit,
rollback, close, ``autocommit``, ``timeout``). Every statement sent through them is recorded in
``server.log`` with the values bound and the connection's state at the time, and answered by
:meth:`FakeSqlServer.answer`: by default the next step of the server's script (the rows to return, or an
exception to raise); a subclass may answer by what a statement contains instead. Tests that use it say
``fake`` in their name: they check what the Python side sends and how it reads the answers, never that
the T-SQL does what it should on a server.

:func:`import_pyodbc` is for the few tests that need the driver itself (its exception classes, a real
connect): everything else here, and the dialect until it connects, is pure Python.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import pytest

from airflow_dbqueue.engine.dialects.mssql import MssqlDatabase
from tests.helpers import require

Rows = list[tuple[Any, ...]]


def import_pyodbc() -> ModuleType:
    """Return pyodbc for a test that needs the driver; without it the test is skipped, or fails under
    ``scripts/test``, which installs it (see :func:`tests.helpers.require`)."""
    try:
        import pyodbc
    except ImportError as exc:
        require(
            f"pyodbc cannot be imported ({exc})",
            "the mssql extra and Debian's unixodbc; scripts/test installs both",
        )
        raise
    return pyodbc


@dataclasses.dataclass(frozen=True)
class Sent:
    """One statement as the fake received it."""

    text: str
    values: list[Any] | None
    """The values bound to its ``?`` in order; None when it was sent without parameters."""
    app: str | None
    """The sending connection's application name."""
    autocommit: bool
    timeout: int
    """The sending connection's query timeout (seconds; 0 is none)."""


class FakeSqlServer:
    """Hands out connections, records what they send (:attr:`log`), answers from :attr:`script`.

    :param script: one step per statement, in order: the rows it returns (``[]`` for none), None for a
        statement without a result set, or an exception, raised as pyodbc would.
    """

    def __init__(self, script: Iterable[Any] = ()) -> None:
        self.script: list[Any] = list(script)
        self.log: list[Sent] = []
        self.connections: list[FakeConnection] = []

    def connect(self, *, application_name: str | None = None, autocommit: bool = False) -> FakeConnection:
        """What :meth:`MssqlDatabase.connect` returns, in its signature."""
        conn = FakeConnection(self, application_name, autocommit)
        self.connections.append(conn)
        return conn

    def attach(self, monkeypatch: pytest.MonkeyPatch, db: MssqlDatabase | None = None) -> FakeSqlServer:
        """Make ``db`` (without it, every :class:`MssqlDatabase`) connect to this fake; return the fake."""
        if db is None:
            monkeypatch.setattr(MssqlDatabase, "connect", lambda _db, **kw: self.connect(**kw))
        else:
            monkeypatch.setattr(db, "connect", self.connect)
        return self

    def answer(self, text: str) -> Rows | None:
        """The answer to one statement: the next step of the script."""
        if not self.script:
            raise AssertionError(f"the fake's script has no step left for: {text[:120]}")
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return None if step is None else list(step)

    def statements(self, needle: str) -> list[Sent]:
        """What was sent whose text contains ``needle``, in order."""
        return [e for e in self.log if needle in e.text]

    @property
    def executed(self) -> list[tuple[str, list[Any]]]:
        """``(text, values)`` of every statement sent, in order (``[]`` for no values)."""
        return [(e.text, e.values or []) for e in self.log]

    @property
    def commits(self) -> int:
        return sum(c.commits for c in self.connections)

    @property
    def rollbacks(self) -> int:
        return sum(c.rollbacks for c in self.connections)


class FakeCursor:
    def __init__(self, conn: FakeConnection) -> None:
        self.conn = conn
        self.description: Any = None
        self.rowcount = -1  # unknown, as pyodbc reports it for a SELECT
        self._rows: Rows = []

    def execute(self, text: str, *params: Any) -> FakeCursor:
        """Record and answer ``text``; values come as pyodbc takes them (one sequence, or one by one)."""
        c = self.conn
        if not params:
            values = None
        elif len(params) == 1 and isinstance(params[0], Sequence) and not isinstance(params[0], str | bytes):
            values = list(params[0])
        else:
            values = list(params)
        c.server.log.append(Sent(text, values, c.application_name, c.autocommit, c.timeout))
        rows = c.server.answer(text)
        self.description = None if rows is None else [("c",)]
        self._rows = rows or []
        return self

    def nextset(self) -> bool:
        return False

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> Rows:
        return list(self._rows)

    def close(self) -> None:
        pass


class FakeConnection:
    def __init__(self, server: FakeSqlServer, application_name: str | None, autocommit: bool) -> None:
        self.server = server
        self.application_name = application_name
        self.autocommit = autocommit
        self.timeout = 0
        self.commits = self.rollbacks = 0
        self.closed = False

    def cursor(self) -> FakeCursor:
        return FakeCursor(self)

    def commit(self) -> None:
        self.commits += 1

    def rollback(self) -> None:
        self.rollbacks += 1

    def close(self) -> None:
        self.closed = True
