"""A small interpreter of the T-SQL that the ring's stored procedures are written in, for offline tests.

No SQL Server can run on the build machines. This runs the procedures and inline functions of the SQL
Server ``functions.sql`` as written, statement by statement (sqlglot's parse of each, and the block layout
that ``tests/unit/test_mssql_dialect.py`` checks), on the tables of its ``schema.sql`` held in memory, so
that a test can check what a procedure does to a ring, not only that its text parses. It covers the part
of T-SQL those procedures use, with T-SQL's rules where they differ from Python's: NULL propagates and a
comparison with NULL is unknown, ``/`` and ``%`` truncate toward zero, NULL sorts lowest, ``SELECT @x =
...`` over no row leaves ``@x`` as it was, an aggregate over no row gives one row, ``UPDATE`` evaluates
every ``SET`` on the row as it was, ``OUTPUT`` sees ``deleted`` and ``inserted``, ``@@ROWCOUNT`` is the
last statement's count, and a scalar subquery of more than one row is an error. Anything outside that
subset raises :class:`NotImplementedError` rather than being guessed at.

Locks: a test says which rows *other* transactions hold (:attr:`Server.others`: ``S``, ``U`` or ``X``).
A statement that reads a row with an incompatible lock request (a plain or ``READCOMMITTEDLOCK`` read asks
for ``S``, ``UPDLOCK`` and the rows an ``UPDATE`` or ``DELETE`` writes for ``U`` then ``X``) passes over
it with ``READPAST``; without, it waits. A row counts only if it qualifies for the statement (its joins
and ``WHERE``), and a ``TOP`` read stops at its limit (in the order of its ``ORDER BY``), as with the
index seeks the procedures are written for: a ``TOP (1)`` read waits only for the first row it reaches.
A wait is where the interpreter stops being a server, since nothing else runs: a test may say what the
holders do then (:attr:`Server.on_wait`: they finish, perhaps after writing, and let go), and the
statement runs again; otherwise the holder never lets go, and under ``SET LOCK_TIMEOUT`` that is error
1222 (which ``TRY ... CATCH`` can catch), or else :class:`Blocked`. Every wait is recorded
(:attr:`Server.lock_waits`). ``NOLOCK`` reads anything. The locks this session takes (``U`` and ``X``) are
kept in :attr:`Server.mine`. Transactions are not modelled: what a statement did stays done.

Left out on purpose: ``ring_series`` (the numbers 0 .. n - 1 from a cross join of 16^6 rows) is computed
directly; ``WAITFOR DELAY`` only counts (:attr:`Server.waits`); the clock (:attr:`Server.now`) moves only
when a test moves it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import itertools
import json
import math
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sqlglot
from sqlglot import exp

from tests.fake_mssql import FakeConnection, FakeCursor, FakeSqlServer

Row = dict[str, Any]
Ctx = dict[str, Row | None]

_DAY_ZERO = dt.datetime(1900, 1, 1)  # CAST(0 AS datetime)
_CONFLICTS = {"S": {"X"}, "U": {"U", "X"}, "X": {"S", "U", "X"}}
_AGGREGATES = (exp.Min, exp.Max, exp.Sum, exp.Count, exp.GroupConcat, exp.Avg)


class TsqlError(Exception):
    """An error a statement raised: ``number`` is SQL Server's native error number (50000: RAISERROR)."""

    def __init__(self, number: int, message: str) -> None:
        super().__init__(f"({number}) {message}")
        self.number = number
        self.message = message


class Blocked(Exception):
    """A statement would wait for a lock another transaction holds, without a lock timeout."""


class _Break(Exception):
    pass


class _Return(Exception):
    pass


class _Again(Exception):
    """The holders of the locks a statement waited for let go: the statement runs again."""


# -- tables ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Table:
    """Rows of a table or a table variable, in the order of its primary key (its clustered index)."""

    name: str
    columns: list[str]
    key: tuple[str, ...] = ()
    defaults: dict[str, Callable[[], Any]] = dataclasses.field(default_factory=dict)
    not_null: set[str] = dataclasses.field(default_factory=set)
    rows: list[Row] = dataclasses.field(default_factory=list)
    checks: dict[str, exp.Expression] = dataclasses.field(default_factory=dict)

    def key_of(self, row: Row) -> tuple[Any, ...]:
        return tuple(row[c] for c in self.key)

    def scan(self) -> list[Row]:
        if not self.key:
            return list(self.rows)
        return sorted(self.rows, key=lambda r: [_sort_key(v) for v in self.key_of(r)])

    def insert(self, values: Mapping[str, Any]) -> Row:
        unknown = set(values) - set(self.columns)
        if unknown:
            raise TsqlError(207, f"invalid column name(s) {sorted(unknown)} in {self.name}")
        row = {
            c: values[c] if c in values else self.defaults[c]() if c in self.defaults else None
            for c in self.columns
        }
        for c in self.not_null:
            if row[c] is None:
                raise TsqlError(515, f"cannot insert NULL into column {c!r} of {self.name}")
        if self.key and any(self.key_of(r) == self.key_of(row) for r in self.rows):
            raise TsqlError(2627, f"violation of the primary key of {self.name}: {self.key_of(row)}")
        self.rows.append(row)
        return row

    def find(self, **key: Any) -> Row | None:
        """The row whose columns have the values given (for tests)."""
        got = [r for r in self.rows if all(r[k] == v for k, v in key.items())]
        assert len(got) <= 1, got
        return got[0] if got else None


def _sort_key(v: Any) -> tuple[int, Any]:
    """T-SQL's order: NULL lowest."""
    return (0, 0) if v is None else (1, v)


def _table_from_schema(server: Server, name: str, schema: exp.Schema) -> Table:
    """A table of a CREATE TABLE or a DECLARE ... TABLE."""
    table = Table(name, [])
    for item in schema.expressions:
        if isinstance(item, exp.ColumnDef):
            _add_column(server, table, item)
        elif isinstance(item, exp.Constraint):
            _add_constraint(table, item)
        elif isinstance(item, exp.PrimaryKey):  # DECLARE @t TABLE (..., PRIMARY KEY (a, b))
            table.key = tuple(e.name.lower() for e in item.expressions)
            table.not_null |= set(table.key)
        else:
            raise NotImplementedError(item.sql(dialect="tsql"))
    return table


def schema_tables(server: Server, statements: Iterable[exp.Expression]) -> dict[str, Table]:
    """The tables that CREATE TABLE statements make (with their columns, NOT NULL, DEFAULT, PRIMARY KEY
    and CHECK constraints), empty. Other statements (indexes, sequences, a table's options) are passed
    over."""
    tables: dict[str, Table] = {}
    for stmt in statements:
        if isinstance(stmt, exp.Create) and stmt.args.get("kind") == "TABLE":
            table = _table_from_schema(server, stmt.this.this.name.lower(), stmt.this)
            tables[table.name] = table
    return tables


def _add_column(server: Server, table: Table, col: exp.ColumnDef) -> None:
    name = col.name.lower()
    table.columns.append(name)
    for c in col.args.get("constraints") or []:
        kind = c.kind
        if isinstance(kind, exp.NotNullColumnConstraint) and not kind.args.get("allow_null"):
            table.not_null.add(name)
        elif isinstance(kind, exp.DefaultColumnConstraint):
            table.defaults[name] = lambda value=kind.this: _constant(server, value)
        elif isinstance(kind, exp.PrimaryKeyColumnConstraint):
            table.key = (name,)
            table.not_null.add(name)
        elif isinstance(kind, exp.GeneratedAsIdentityColumnConstraint):
            counter = itertools.count(int(kind.args["start"].this), int(kind.args["increment"].this))
            table.defaults[name] = lambda counter=counter: next(counter)


def _sequence(stmt: exp.Create) -> tuple[str, int]:
    """The name (as QUOTENAME writes it, ``[schema].[name]``) and first number of a CREATE SEQUENCE."""
    props = stmt.args["properties"].expressions
    [start] = [p.args["start"] for p in props if isinstance(p, exp.SequenceProperties)]
    return f"[{stmt.this.db}].[{stmt.this.name}]", int(start.this)


def _constant(server: Server, value: exp.Expression) -> Any:
    frame = Frame(server, lock_timeout=-1)
    return frame.eval(value, Env(frame))


def _add_constraint(table: Table, constraint: exp.Constraint) -> None:
    parts = constraint.expressions
    if isinstance(parts[0], exp.PrimaryKey):
        table.key = tuple(o.this.name.lower() for o in parts[0].expressions)
    elif isinstance(
        parts[0], exp.PrimaryKeyColumnConstraint
    ):  # PRIMARY KEY [NON]CLUSTERED (...) [WITH (...)]
        [columns] = [
            p
            for p in parts[1:]
            if isinstance(p, exp.ClusteredColumnConstraint | exp.NonClusteredColumnConstraint)
        ]
        table.key = tuple(o.this.name.lower() for o in columns.this)
    elif isinstance(parts[0], exp.CheckColumnConstraint):
        table.checks[constraint.name.lower()] = parts[0].this
        return
    elif isinstance(parts[0], exp.UniqueColumnConstraint):
        return  # not enforced (queue and group names): the engine looks a name up before it adds it
    else:
        raise NotImplementedError(constraint.sql(dialect="tsql"))
    table.not_null |= set(table.key)


# -- procedures --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Param:
    name: str
    type: str
    default: exp.Expression | None
    has_default: bool
    output: bool


@dataclasses.dataclass
class Procedure:
    name: str
    params: list[Param]
    body: list[Any]


@dataclasses.dataclass
class Function:
    name: str
    params: list[Param]
    query: exp.Expression


_CONTROL = re.compile(r"^(IF|WHILE) (.*)$", re.DOTALL)
_HEADER = re.compile(
    r"CREATE OR ALTER (PROCEDURE|FUNCTION) \[?[a-z_]+\]?\.([a-z_]+)(.*?)\n(?:RETURNS TABLE\n)?AS\n", re.DOTALL
)
_INSERT_EXEC = re.compile(r"^(INSERT INTO @[a-z_]+ \([a-z_, ]+\)) (EXEC .*;)$", re.DOTALL)


def _parse_one(text: str) -> exp.Expression:
    text = re.sub(r"%\([a-z_]+\)s", "?", text)
    parsed = [
        s for s in sqlglot.parse(text, read="tsql", error_level=sqlglot.ErrorLevel.RAISE) if s is not None
    ]
    if len(parsed) != 1 or isinstance(parsed[0], exp.Command):
        raise NotImplementedError(f"not one statement: {text[:100]}")
    return parsed[0]


def _params(text: str) -> list[Param]:
    text = " ".join(text.split()).strip()
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    out = []
    for part in filter(None, (p.strip() for p in re.split(r",\s*(?=@)", text))):
        m = re.fullmatch(r"@([a-z_0-9]+) ([a-z0-9]+(?:\([a-z0-9, ]+\))?)(?: = ([^ ]+))?( OUTPUT)?", part)
        if not m:
            raise NotImplementedError(f"parameter {part!r}")
        default = m.group(3)
        out.append(
            Param(
                m.group(1),
                m.group(2),
                None if default is None else _parse_one(f"SELECT {default}").expressions[0],
                default is not None,
                bool(m.group(4)),
            )
        )
    return out


def parse_body(lines: Sequence[str]) -> list[Any]:
    """The statements and control flow of a procedure body (its lines between BEGIN and END), in the
    layout test_mssql_dialect's procedure check enforces."""
    root: list[Any] = []
    stack: list[tuple[str, list[Any]]] = [("root", root)]
    buf = ""
    for line in lines:
        body = stack[-1][1]
        if not buf and line in ("BEGIN TRY", "BEGIN CATCH"):
            node: list[Any] = ["try", [], []] if line == "BEGIN TRY" else body[-1]
            if line == "BEGIN TRY":
                body.append(node)
            stack.append(
                ("TRY" if line == "BEGIN TRY" else "CATCH", node[1] if line == "BEGIN TRY" else node[2])
            )
            continue
        if not buf and line in ("END;", "END TRY", "END CATCH;"):
            stack.pop()
            continue
        if not buf and line in ("BREAK;", "RETURN;", "THROW;"):
            body.append([line[:-1].lower()])
            continue
        if line == "BEGIN":
            control = _CONTROL.match(buf)
            assert control, buf
            cond = _parse_one(f"SELECT 1 WHERE {control.group(2)}").args["where"].this
            node = [control.group(1).lower(), cond, []]
            body.append(node)
            stack.append(("BEGIN", node[2]))
            buf = ""
            continue
        buf = f"{buf} {line}".strip()
        if buf.endswith(";") and not _CONTROL.match(buf):
            if m := re.fullmatch(r"WAITFOR DELAY @([a-z_]+);", buf):
                body.append(["wait", m.group(1)])
            elif m := _INSERT_EXEC.match(buf):
                target = _parse_one(m.group(1) + " VALUES (1)")
                body.append(["insert_exec", target, _parse_one(m.group(2))])
            else:
                body.append(["stmt", _parse_one(buf)])
            buf = ""
    assert len(stack) == 1 and not buf, (stack, buf)
    return root


def load_routines(text: str) -> tuple[dict[str, Procedure], dict[str, Function]]:
    """The procedures and functions of functions.sql blocks (``{schema}`` composed), by name."""
    procs: dict[str, Procedure] = {}
    funcs: dict[str, Function] = {}
    for m in _HEADER.finditer(text):
        kind, name, head = m.group(1), m.group(2), m.group(3)
        rest = text[m.end() :]
        end = re.search(r"\n(?:-- name: |\Z)", rest)
        block = rest[: end.start() if end else len(rest)]
        code = [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("--")]
        if kind == "PROCEDURE":
            assert code[0] == "BEGIN" and code[-1] == "END", (name, code[0], code[-1])
            procs[name] = Procedure(name, _params(head), parse_body(code[1:-1]))
        else:
            create = _parse_one(m.group(0) + "\n".join(code))
            assert isinstance(create, exp.Create) and isinstance(create.expression, exp.Return), name
            funcs[name] = Function(name, _params(head), create.expression.this)
    return procs, funcs


# -- the server --------------------------------------------------------------------------------------


class Server:
    """Tables, sequences and routines in memory; :meth:`call` runs a procedure, :meth:`query` a statement."""

    def __init__(self, procedures: Mapping[str, Procedure], functions: Mapping[str, Function]) -> None:
        self.procedures = dict(procedures)
        self.functions = dict(functions)
        self.tables: dict[str, Table] = {}
        self.sequences: dict[str, dict[str, int]] = {}  # name -> {object_id, current_value}
        self.others: dict[tuple[str, tuple[Any, ...]], str] = {}
        self.mine: dict[tuple[str, tuple[Any, ...]], str] = {}
        self.on_wait: Callable[[Server, list[tuple[str, tuple[Any, ...]]]], bool] | None = None
        """What the other transactions do when a statement waits for rows they hold (``(table, key)`` of
        each): return True once they let go (the statement then runs again), False to keep holding."""
        self.lock_waits: list[list[tuple[str, tuple[Any, ...]]]] = []
        self.now = dt.datetime(2026, 1, 1, 12, 0, 0)
        self.waits = 0
        self.calls: list[str] = []
        self.rng = random.Random(0)

    # setup

    def create_sequence(self, name: str, start: int) -> int:
        """A sequence (``name`` as T-SQL writes it, ``[schema].[name]``); its current_value is ``start``
        until a number is handed out, and then the last number handed out."""
        object_id = 1000 + len(self.sequences)
        self.sequences[name] = {"object_id": object_id, "current_value": start, "next": start}
        return object_id

    def sequence(self, name: str) -> dict[str, int]:
        if name not in self.sequences:
            raise TsqlError(2812, f"sequence {name!r} does not exist")
        return self.sequences[name]

    def lock(self, table: str, key: tuple[Any, ...], mode: str) -> None:
        """Another transaction holds ``mode`` (``S``, ``U`` or ``X``) on a row."""
        self.others[(table, key)] = mode

    # running

    def call(self, name: str, /, **args: Any) -> tuple[list[list[tuple[Any, ...]]], dict[str, Any]]:
        """Run procedure ``name``: ``(result sets, output parameters)`` (positional only: a procedure may
        have a parameter @name)."""
        frame = Frame(self, lock_timeout=-1)
        outputs = frame.call(name, {k: (v, False) for k, v in args.items()})
        return frame.results, outputs

    def batch(self, text: str, values: Sequence[Any] = ()) -> list[list[tuple[Any, ...]]]:
        """Run a batch as a client sends it (``?`` placeholders bound to ``values`` in order): the rows of
        each result set it returned."""
        frame = Frame(self, lock_timeout=-1)
        bound = iter(values)
        # ? outside quoted strings and identifiers is a placeholder.
        text = re.sub(
            r"N?'(?:[^']|'')*'|\[[^\]]*\]|--[^\n]*|\?",
            lambda m: _literal(next(bound)) if m.group(0) == "?" else m.group(0),
            text,
        )
        assert next(bound, None) is None, "more values than placeholders"
        for stmt in sqlglot.parse(text, read="tsql", error_level=sqlglot.ErrorLevel.RAISE):
            if stmt is not None:
                if isinstance(stmt, exp.Command):
                    raise NotImplementedError(stmt.sql(dialect="tsql")[:100])
                frame.execute(stmt)
        return frame.results

    def query(self, text: str, **params: Any) -> list[tuple[Any, ...]]:
        """Run one statement with ``%(name)s`` parameters and return the rows of its result sets."""
        frame = Frame(self, lock_timeout=-1)
        frame.execute(_parse_one(re.sub(r"%\(([a-z_]+)\)s", lambda m: _literal(params[m.group(1)]), text)))
        return [r for rs in frame.results for r in rs]


def _literal(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return "N'" + value.replace("'", "''") + "'"
    if isinstance(value, bytes | bytearray | memoryview):
        return "0x" + bytes(value).hex()
    if isinstance(value, dt.datetime):
        return f"CAST('{value.isoformat(sep=' ')}' AS datetime2(6))"
    raise NotImplementedError(type(value))


# -- evaluation --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Env:
    """Where an expression is evaluated: the row of each source in scope, the enclosing query's, and for
    aggregates the rows of the group."""

    frame: Frame
    ctx: Ctx = dataclasses.field(default_factory=dict)
    columns: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    outer: Env | None = None
    group: list[Ctx] | None = None
    projected: dict[str, Any] | None = None
    windows: dict[int, Any] | None = None

    def child(self, ctx: Ctx, columns: dict[str, list[str]], **kw: Any) -> Env:
        return Env(self.frame, ctx, columns, self, **kw)

    def column(self, table: str, name: str) -> Any:
        env: Env | None = self
        while env is not None:
            if table:
                if table in env.columns:
                    if name not in env.columns[table]:
                        raise TsqlError(207, f"invalid column name {table}.{name}")
                    row = env.ctx.get(table)
                    return None if row is None else row[name]
            else:
                if env.projected is not None and name in env.projected:
                    return env.projected[name]
                hits = [a for a, cols in env.columns.items() if name in cols]
                if len(hits) > 1:
                    raise TsqlError(209, f"ambiguous column name {name}")
                if hits:
                    row = env.ctx.get(hits[0])
                    return None if row is None else row[name]
            env = env.outer
        raise TsqlError(207, f"invalid column name {table + '.' if table else ''}{name}")


def _num(v: str) -> int | float:
    return int(v) if re.fullmatch(r"-?\d+", v) else float(v)


def _div(a: Any, b: Any) -> Any:
    if b == 0:
        raise TsqlError(8134, "divide by zero error encountered")
    if isinstance(a, int) and isinstance(b, int):
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q
    return a / b


def _mod(a: Any, b: Any) -> Any:
    if b == 0:
        raise TsqlError(8134, "divide by zero error encountered")
    r = abs(a) % abs(b)
    return -r if a < 0 else r


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    exp.Sub: lambda a, b: a - b,
    exp.Mul: lambda a, b: a * b,
    exp.Div: _div,
    exp.Mod: _mod,
    exp.EQ: lambda a, b: a == b,
    exp.NEQ: lambda a, b: a != b,
    exp.LT: lambda a, b: a < b,
    exp.LTE: lambda a, b: a <= b,
    exp.GT: lambda a, b: a > b,
    exp.GTE: lambda a, b: a >= b,
}


def _cast(value: Any, to: exp.DataType, style: int | None = None) -> Any:  # noqa: PLR0911
    if value is None:
        return None
    kind = to.this
    T = exp.DataType.Type
    if kind in (T.INT, T.BIGINT, T.SMALLINT, T.TINYINT, T.BIT):
        if isinstance(value, str):
            return int(value.strip())
        if kind == T.BIT:
            return 1 if value else 0
        return int(value)  # a float truncates toward zero
    if kind in (T.FLOAT, T.DOUBLE, T.DECIMAL):
        return float(value)
    if kind in (T.NVARCHAR, T.VARCHAR, T.NCHAR, T.CHAR, T.TEXT):
        if isinstance(value, bytes):
            return value.decode()
        return str(value)
    if kind == T.VARBINARY:
        if isinstance(value, bytes):
            return value
        if isinstance(value, str):
            return bytes.fromhex(value) if style == 2 else value.encode()
        raise NotImplementedError(f"CAST({value!r} AS varbinary)")
    if kind in (T.DATETIME2, T.DATETIME):
        if isinstance(value, str):
            return dt.datetime.fromisoformat(value)
        return _DAY_ZERO + dt.timedelta(days=value) if isinstance(value, int) else value
    raise NotImplementedError(f"CAST AS {to.sql(dialect='tsql')}")


def _date_add(unit: str, amount: Any, when: Any) -> Any:
    if amount is None or when is None:
        return None
    step = {
        "MICROSECOND": dt.timedelta(microseconds=1),
        "MILLISECOND": dt.timedelta(milliseconds=1),
        "SECOND": dt.timedelta(seconds=1),
        "MINUTE": dt.timedelta(minutes=1),
        "DAY": dt.timedelta(days=1),
    }[unit.upper()]
    return when + step * int(amount)


class Frame:
    """One procedure call: its variables, its result sets, the error a CATCH block handles."""

    def __init__(self, server: Server, *, lock_timeout: int) -> None:
        self.server = server
        self.vars: dict[str, Any] = {}
        self.types: dict[str, str] = {}
        self.tables: dict[str, Table] = {}
        self.results: list[list[tuple[Any, ...]]] = []
        self.rowcount = 0
        self.lock_timeout = lock_timeout
        self.error: TsqlError | None = None

    # -- calls

    def call(self, name: str, args: Mapping[str, tuple[Any, bool]]) -> dict[str, Any]:
        proc = self.server.procedures.get(name)
        if proc is None:
            raise NotImplementedError(f"procedure {name}")
        self.server.calls.append(name)
        inner = Frame(self.server, lock_timeout=self.lock_timeout)
        known = {p.name for p in proc.params}
        unknown = set(args) - known
        if unknown:
            raise TsqlError(8145, f"{sorted(unknown)} is not a parameter of {name}")
        for p in proc.params:
            inner.types[p.name] = p.type
            if p.name in args:
                inner.vars[p.name] = inner.assign(p.name, args[p.name][0])
            elif p.has_default:
                assert p.default is not None
                inner.vars[p.name] = inner.eval(p.default, Env(inner))
            else:
                raise TsqlError(201, f"{name} expects parameter @{p.name}, which was not supplied")
        with contextlib.suppress(_Return):
            inner.run(proc.body)
        self.results.extend(inner.results)
        return {p.name: inner.vars[p.name] for p in proc.params if p.output}

    def run(self, body: Sequence[Any]) -> None:  # noqa: PLR0912
        """Long on purpose: one branch per kind of statement or node, read as a table."""
        for node in body:
            kind = node[0]
            if kind == "stmt":
                self.execute(node[1])
            elif kind == "if":
                if self.truth(node[1]):
                    self.run(node[2])
            elif kind == "while":
                while self.truth(node[1]):
                    try:
                        self.run(node[2])
                    except _Break:
                        break
            elif kind == "break":
                raise _Break
            elif kind == "return":
                raise _Return
            elif kind == "try":
                try:
                    self.run(node[1])
                except TsqlError as exc:
                    self.error = exc
                    self.run(node[2])
            elif kind == "throw":
                assert self.error is not None
                raise self.error
            elif kind == "wait":  # the time passes on the server's clock
                self.server.waits += 1
                self.server.now += self.vars[node[1]] - _DAY_ZERO
            elif kind == "insert_exec":
                self.insert_exec(node[1], node[2])
            else:
                raise NotImplementedError(kind)

    def truth(self, cond: exp.Expression) -> bool:
        while True:
            try:
                return self.eval(cond, Env(self)) is True
            except _Again:
                continue

    # -- statements

    def execute(self, stmt: exp.Expression) -> None:
        """Run one statement; again from its start when the locks it waited for were let go (it has
        changed nothing before a wait: every statement reads what it changes first)."""
        while True:
            try:
                self._execute(stmt)
                return
            except _Again:
                continue

    def _execute(self, stmt: exp.Expression) -> None:  # noqa: PLR0911, PLR0912
        """Long on purpose: one branch per kind of statement or node, read as a table."""
        if isinstance(stmt, exp.Set):
            for item in stmt.expressions:
                self.set_item(item.this)
            return
        if isinstance(stmt, exp.Declare):
            for item in stmt.expressions:
                [var] = item.this
                name = var.name.lower()
                kind = item.args.get("kind")
                if isinstance(kind, exp.Schema):
                    self.tables[name] = _table_from_schema(self.server, f"@{name}", kind)
                else:
                    self.types[name] = kind.sql(dialect="tsql").lower() if kind is not None else ""
                    default = item.args.get("default")  # False when there is none
                    has = isinstance(default, exp.Expression)
                    self.vars[name] = self.assign(name, self.eval(default, Env(self))) if has else None
            return
        if isinstance(stmt, exp.Select | exp.Union):
            if (
                isinstance(stmt, exp.Select)
                and stmt.expressions
                and all(isinstance(e, exp.EQ) and isinstance(e.this, exp.Parameter) for e in stmt.expressions)
            ):
                self.select_assign(stmt)
                return
            rows = self.query(stmt, Env(self)).rows
            self.results.append(rows)
            self.rowcount = len(rows)
            return
        if isinstance(stmt, exp.Insert):
            self.rowcount = self.insert(stmt)
            return
        if isinstance(stmt, exp.Update):
            self.rowcount = self.update(stmt)
            return
        if isinstance(stmt, exp.Delete):
            self.rowcount = self.delete(stmt)
            return
        if isinstance(stmt, exp.Execute):
            self.execute_call(stmt)
            return
        if isinstance(stmt, exp.Anonymous) and stmt.name.upper() == "RAISERROR":
            self.raiserror(stmt)
            return
        raise NotImplementedError(stmt.sql(dialect="tsql")[:100])

    def assign(self, name: str, value: Any) -> Any:
        kind = self.types.get(name, "")
        base = kind.split("(")[0]
        if value is not None and base == "bit":
            return 1 if value else 0
        if value is not None and base in ("int", "bigint", "smallint", "tinyint"):
            return int(value)  # a float truncates toward zero
        return value

    def set_item(self, eq: exp.Expression) -> None:
        assert isinstance(eq, exp.EQ), eq
        target = eq.this
        if isinstance(target, exp.Column):  # SET NOCOUNT ON, SET LOCK_TIMEOUT 100, ...
            option = target.name.upper()
            if option == "LOCK_TIMEOUT":
                self.lock_timeout = int(self.eval(eq.expression, Env(self)))
            elif option not in ("NOCOUNT", "XACT_ABORT"):
                raise NotImplementedError(f"SET {option}")
            self.rowcount = 0
            return
        name = target.name.lower()
        if name not in self.vars and name not in self.types:
            raise TsqlError(137, f"must declare the scalar variable @{name}")
        self.vars[name] = self.assign(name, self.eval(eq.expression, Env(self)))
        self.rowcount = 1

    def select_assign(self, stmt: exp.Select) -> None:
        targets = [e.this.name.lower() for e in stmt.expressions]
        query = stmt.copy()
        query.set("expressions", [e.expression for e in stmt.expressions])
        rows = self.query(query, Env(self)).rows
        for row in rows:  # each row assigns in turn: the last one's values stay
            for name, value in zip(targets, row, strict=True):
                self.vars[name] = self.assign(name, value)
        self.rowcount = len(rows)

    def raiserror(self, call: exp.Anonymous) -> None:
        args = [self.eval(a, Env(self)) for a in call.expressions]
        text, values = str(args[0]), iter(args[3:])
        message = re.sub(r"%(?:I64)?[ds]", lambda m: str(next(values)), text)
        raise TsqlError(50000, message)

    def execute_call(self, stmt: exp.Execute) -> None:
        target = stmt.this
        name = target.name
        args: dict[str, tuple[Any, bool]] = {}
        outputs: dict[str, str] = {}
        for i, arg in enumerate(stmt.expressions):
            if not isinstance(arg, exp.Alias | exp.EQ):  # positional: EXEC sys.sp_executesql @sql
                args[f"#{i}"] = (self.eval(arg, Env(self)), False)
                continue
            output = isinstance(arg, exp.Alias) and arg.alias.upper() == "OUTPUT"
            eq = arg.this if isinstance(arg, exp.Alias) else arg
            assert isinstance(eq, exp.EQ) and isinstance(eq.this, exp.Parameter), arg
            param = eq.this.name.lower()
            args[param] = (self.eval(eq.expression, Env(self)), output)
            if output:
                assert isinstance(eq.expression, exp.Parameter), arg
                outputs[param] = eq.expression.name.lower()
        if target.args.get("db") is not None and target.db.lower() == "sys":
            got = self.system_call(name, {k: v for k, (v, _) in args.items()})
        else:
            got = self.call(name, args)
        for param, var in outputs.items():
            self.vars[var] = self.assign(var, got[param])

    def system_call(self, name: str, args: Mapping[str, Any]) -> dict[str, Any]:
        if name == "sp_sequence_get_range":
            seq = self.server.sequence(str(args["sequence_name"]))
            first, size = seq["next"], int(args["range_size"])
            seq["next"] += size
            seq["current_value"] = first + size - 1
            return {"range_first_value": first}
        if name == "sp_executesql":
            for statement in filter(None, (t.strip() for t in str(args["#0"]).split(";"))):
                if m := re.fullmatch(
                    r"CREATE SEQUENCE (\S+) AS bigint START WITH (\d+) MINVALUE \d+ CACHE \d+", statement
                ):
                    self.server.create_sequence(m.group(1), int(m.group(2)))
                elif m := re.fullmatch(r"DROP SEQUENCE IF EXISTS (\S+)", statement):
                    self.server.sequences.pop(m.group(1), None)
                else:
                    raise NotImplementedError(f"sp_executesql {statement!r}")
            return {}
        raise NotImplementedError(f"sys.{name}")

    def insert_exec(self, insert: exp.Insert, call: exp.Execute) -> None:
        before = len(self.results)
        self.execute_call(call)
        rows = [r for rs in self.results[before:] for r in rs]
        del self.results[before:]
        table, columns = self.insert_target(insert)
        for row in rows:
            table.insert(dict(zip(columns, row, strict=True)))
        self.rowcount = len(rows)

    # -- DML

    def table(self, node: exp.Table) -> Table:
        if isinstance(node.this, exp.Parameter):
            name = node.this.name.lower()
            if name not in self.tables:
                raise TsqlError(1087, f"must declare the table variable @{name}")
            return self.tables[name]
        name = node.name.lower()
        if name not in self.server.tables:
            raise TsqlError(208, f"invalid object name {name}")
        return self.server.tables[name]

    def insert_target(self, insert: exp.Insert) -> tuple[Table, list[str]]:
        target = insert.this
        if isinstance(target, exp.Schema):
            table = self.table(target.this)
            return table, [c.name.lower() for c in target.expressions]
        table = self.table(target)
        return table, list(table.columns)

    def insert(self, insert: exp.Insert) -> int:
        table, columns = self.insert_target(insert)
        source = insert.expression
        env = Env(self)
        if isinstance(source, exp.Values):
            rows = [tuple(self.eval(v, env) for v in t.expressions) for t in source.expressions]
        else:
            rows = self.query(source, env).rows
        made = []
        for row in rows:
            if len(row) != len(columns):
                raise TsqlError(
                    121, f"{len(columns)} columns and {len(row)} values in an INSERT into {table.name}"
                )
            made.append(table.insert(dict(zip(columns, row, strict=True))))
            self.check(table, made[-1])
            if table.name in self.server.tables:
                self.server.mine[(table.name, table.key_of(made[-1]))] = "X"
        self.output(insert, [(None, r, Env(self)) for r in made])
        return len(made)

    def check(self, table: Table, row: Row) -> None:
        for name, cond in table.checks.items():
            if self.eval(cond, Env(self, {table.name: row}, {table.name: table.columns})) is False:
                raise TsqlError(547, f"the row {row} of {table.name} breaks its CHECK constraint {name}")

    def output(self, stmt: exp.Expression, changes: Sequence[tuple[Row | None, Row | None, Env]]) -> None:
        """OUTPUT: each change's deleted and inserted rows, and the rows of the statement's FROM it was found
        with (``env``)."""
        returning = stmt.args.get("returning")
        if returning is None:
            return
        into = returning.args.get("into")
        rows = []
        for old, new, found in changes:
            ctx: Ctx = {"deleted": old, "inserted": new}
            cols = {"deleted": list((old or new or {}).keys()), "inserted": list((new or old or {}).keys())}
            env = found.child(ctx, cols)
            rows.append(tuple(self.eval(_unalias(e), env) for e in returning.expressions))
        if not isinstance(into, exp.Expression):  # OUTPUT without INTO: a result set
            self.results.append(rows)
            return
        table = self.tables[into.name.lower()]
        for row in rows:
            table.insert(dict(zip(table.columns, row, strict=True)))

    def target_rows(self, stmt: exp.Update | exp.Delete, alias: str) -> tuple[Table, list[tuple[Row, Env]]]:
        """The rows an UPDATE or DELETE changes (each once, with the sources' row it was found with)."""
        ctes = {c.alias.lower(): c.this for c in (stmt.args.get("with_") or exp.With()).expressions}
        env = Env(self)
        if alias in ctes:  # an updatable CTE: one source, its columns those of the base table
            cte = ctes[alias]
            assert isinstance(cte, exp.Select) and not cte.args.get("joins"), cte.sql(dialect="tsql")
            source = cte.args["from_"].this
            base_alias = source.alias_or_name.lower()
            table = self.table(source)
            found = self.query(cte, env, keep=True)
            assert all(isinstance(e, exp.Column) for e in cte.expressions)
            rows = [
                (ctx[base_alias], env.child({alias: ctx[base_alias]}, {alias: table.columns}))
                for ctx in found.ctxs
            ]
            return table, [(r, e) for r, e in rows if r is not None]
        from_ = stmt.args.get("from_")
        if from_ is None and isinstance(stmt, exp.Delete):
            from_ = exp.From(this=stmt.this)
        if from_ is None:
            from_ = exp.From(this=stmt.this)
        select = exp.Select(expressions=[exp.Literal.number(1)]).from_(from_.this.copy(), copy=False)
        where = stmt.args.get("where")
        if where is not None:
            select.set("where", where.copy())
        found = self.query(select, env, keep=True, target=alias)
        table = self.table(next(s for s in _sources(select) if s.alias_or_name.lower() == alias))
        seen: set[int] = set()
        out = []
        for ctx in found.ctxs:
            row = ctx[alias]
            if row is None or id(row) in seen:
                continue
            seen.add(id(row))
            out.append((row, env.child(ctx, found.columns)))
        return table, out

    def update(self, stmt: exp.Update) -> int:
        target = stmt.this
        alias = target.alias_or_name.lower()
        table, rows = self.target_rows(stmt, alias)
        changes: list[tuple[Row | None, Row | None, Env]] = []
        planned = []
        for row, env in rows:
            new: dict[str, Any] = {}
            for eq in stmt.expressions:
                assert isinstance(eq, exp.EQ), eq
                value = self.eval(eq.expression, env)
                if isinstance(eq.this, exp.Parameter):
                    name = eq.this.name.lower()
                    self.vars[name] = self.assign(name, value)
                else:
                    column = eq.this.name.lower()
                    if column not in table.columns:
                        raise TsqlError(207, f"invalid column name {column}")
                    new[column] = value
            planned.append((row, new, env))
        for row, new, env in planned:
            old = dict(row)
            row.update(new)
            for c in table.not_null:
                if row[c] is None:
                    raise TsqlError(515, f"cannot update column {c!r} of {table.name} to NULL")
            if table.key and any(r is not row and table.key_of(r) == table.key_of(row) for r in table.rows):
                raise TsqlError(2627, f"violation of the primary key of {table.name}")
            self.check(table, row)
            if table.name in self.server.tables:
                self.server.mine[(table.name, table.key_of(row))] = "X"
            changes.append((old, dict(row), env))
        self.output(stmt, changes)
        return len(planned)

    def delete(self, stmt: exp.Delete) -> int:
        tables = stmt.args.get("tables") or []
        alias = (tables[0] if tables else stmt.this).alias_or_name.lower()
        table, rows = self.target_rows(stmt, alias)
        changes: list[tuple[Row | None, Row | None, Env]] = []
        for row, env in rows:
            table.rows.remove(row)
            if table.name in self.server.tables:
                self.server.mine[(table.name, table.key_of(row))] = "X"
            changes.append((dict(row), None, env))
        self.output(stmt, changes)
        return len(rows)

    # -- queries

    def query(self, node: exp.Expression, env: Env, *, keep: bool = False, target: str | None = None) -> Rel:
        if isinstance(node, exp.Subquery):
            return self.query(node.this, env, keep=keep, target=target)
        if isinstance(node, exp.Union):
            if node.args.get("distinct"):
                raise NotImplementedError("UNION without ALL")
            left, right = self.query(node.left, env), self.query(node.right, env)
            return Rel(left.names, left.rows + right.rows)
        if not isinstance(node, exp.Select):
            raise NotImplementedError(node.sql(dialect="tsql")[:100])
        return self.select(node, env, keep=keep, target=target)

    def select(self, sel: exp.Select, env: Env, *, keep: bool, target: str | None) -> Rel:  # noqa: PLR0912, PLR0915
        """Long on purpose: one branch per kind of statement or node, read as a table."""
        for cte in (sel.args.get("with_") or exp.With()).expressions:
            raise NotImplementedError(f"a CTE in a SELECT: {cte.alias}")
        from_ = sel.args.get("from_")
        columns: dict[str, list[str]] = {}
        ctxs: list[Ctx] = [{}]
        blocked: dict[int, tuple[str, tuple[Any, ...]]] = {}  # rows another transaction holds: (table, key)
        updating: dict[str, Table] = {}  # the sources read with update locks, by alias
        if from_ is not None:
            joins = list(from_.this.args.get("joins") or []) + list(sel.args.get("joins") or [])
            ctxs, columns = self.source(from_.this, env, target, blocked, updating)
            for join in joins:
                ctxs, columns = self.join(ctxs, columns, join, env, target, blocked, updating)
        where = sel.args.get("where")
        if where is not None:
            ctxs = [c for c in ctxs if self.eval(where.this, env.child(c, columns)) is True]
        group = sel.args.get("group")
        aggregated = group is not None or any(_has_aggregate(e) for e in sel.expressions)
        # A TOP read stops at its limit: it waits only for the rows up to it, in its order (below).
        stops = sel.args.get("limit") is not None and not aggregated
        if not stops:
            self.wait_for_locks(ctxs, blocked)
        if aggregated:
            self.take_update_locks(ctxs, updating)
        windows = self.windows(sel, ctxs, env, columns)
        names = [_name(e) for e in sel.expressions]
        out: list[tuple[tuple[Any, ...], Ctx, dict[str, Any]]] = []
        if aggregated:
            groups: dict[tuple[Any, ...], list[Ctx]] = {}
            if group is None:
                groups[()] = ctxs
            else:
                for c in ctxs:
                    key = tuple(self.eval(g, env.child(c, columns)) for g in group.expressions)
                    groups.setdefault(key, []).append(c)
            for members in groups.values():
                first = members[0] if members else dict.fromkeys(columns)
                genv = env.child(first, columns, group=members)
                values = tuple(self.eval(_unalias(e), genv) for e in sel.expressions)
                out.append((values, first, dict(zip([n or "" for n in names], values, strict=True))))
        else:
            for i, c in enumerate(ctxs):
                cenv = env.child(c, columns, windows=windows[i] if windows else None)
                values = tuple(self.eval(_unalias(e), cenv) for e in sel.expressions)
                out.append((values, c, dict(zip([n or "" for n in names], values, strict=True))))
        if sel.args.get("distinct"):
            seen, unique = set(), []
            for item in out:
                if item[0] not in seen:
                    seen.add(item[0])
                    unique.append(item)
            out = unique
        order = sel.args.get("order")
        if order is not None:
            for ordered in reversed(order.expressions):

                def key(item: tuple[Any, ...], o: exp.Ordered = ordered) -> tuple[int, Any]:
                    oenv = env.child(item[1], columns, projected=item[2])
                    return _sort_key(self.eval(o.this, oenv))

                out.sort(key=key, reverse=bool(ordered.args.get("desc")))
        limit = sel.args.get("limit")
        if limit is not None:
            n = self.eval(limit.expression, env)
            out = out[: max(0, int(n))]
        if stops:
            self.wait_for_locks([c for _, c, _ in out], blocked)
        if not aggregated:
            self.take_update_locks([c for _, c, _ in out], updating)
        return Rel(names, [v for v, _, _ in out], [c for _, c, _ in out] if keep else [], columns)

    def take_update_locks(self, ctxs: Iterable[Ctx], updating: Mapping[str, Table]) -> None:
        """The rows a statement found with update locks keep them (the others it passed are let go)."""
        for c in ctxs:
            for alias, table in updating.items():
                row = c.get(alias)
                if row is not None:
                    self.server.mine.setdefault((table.name, table.key_of(row)), "U")

    def wait_for_locks(self, ctxs: Iterable[Ctx], blocked: Mapping[int, tuple[str, tuple[Any, ...]]]) -> None:
        """Wait for the rows of ``ctxs`` that other transactions hold, if any: the statement runs again
        when :attr:`Server.on_wait` says they let go; otherwise error 1222 under a lock timeout, or
        :class:`Blocked`."""
        held = list(
            dict.fromkeys(
                blocked[id(r)] for c in ctxs for r in c.values() if r is not None and id(r) in blocked
            )
        )
        if not held:
            return
        self.server.lock_waits.append(held)
        on_wait = self.server.on_wait
        if on_wait is not None and on_wait(self.server, held):
            raise _Again
        if self.lock_timeout >= 0:
            raise TsqlError(1222, "Lock request time out period exceeded.")
        raise Blocked(f"a statement would wait for ever for rows another transaction holds: {held}")

    def source(
        self,
        node: exp.Expression,
        env: Env,
        target: str | None,
        blocked: dict[int, tuple[str, tuple[Any, ...]]],
        updating: dict[str, Table],
    ) -> tuple[list[Ctx], dict[str, list[str]]]:
        alias = node.alias_or_name.lower() if not isinstance(node, exp.Subquery) else node.alias.lower()
        if isinstance(node, exp.Subquery):
            rel = self.query(node.this, env)
            return self.derived(alias, rel)
        assert isinstance(node, exp.Table), node
        inner = node.this
        if isinstance(inner, exp.Anonymous):  # a table-valued function
            return self.derived(
                alias, self.function(inner.name, [self.eval(a, env) for a in inner.expressions])
            )
        if isinstance(inner, exp.OpenJSON):
            return self.derived(alias, _openjson(self.eval(inner.this, env)))
        if node.db.lower() == "sys" and node.name.lower() == "sequences":
            rows = [(s["object_id"], s["current_value"], n) for n, s in self.server.sequences.items()]
            return self.derived(alias, Rel(["object_id", "current_value", "name"], rows))
        table = self.table(node)
        hints = {h.name.upper() for hint in node.args.get("hints") or [] for h in hint.expressions}
        mode = None if "NOLOCK" in hints else "U" if "UPDLOCK" in hints or alias == target else "S"
        rows = []
        for row in table.scan():
            held = self.server.others.get((table.name, table.key_of(row))) if table.key else None
            if mode is not None and held in _CONFLICTS[mode]:
                if "READPAST" in hints:
                    continue
                blocked[id(row)] = (table.name, table.key_of(row))
            rows.append(row)
        if mode == "U" and table.name in self.server.tables:
            updating[alias] = table
        return [{alias: r} for r in rows], {alias: list(table.columns)}

    @staticmethod
    def derived(alias: str, rel: Rel) -> tuple[list[Ctx], dict[str, list[str]]]:
        names = [n for n in rel.names if n]
        rows = [{n: v for n, v in zip(rel.names, r, strict=True) if n} for r in rel.rows]
        return [{alias: r} for r in rows], {alias: names}

    def function(self, name: str, args: Sequence[Any]) -> Rel:
        if name == "ring_series":
            [n] = args
            return Rel(["k"], [(k,) for k in range(max(0, int(n or 0)))])
        func = self.server.functions.get(name)
        if func is None:
            raise NotImplementedError(f"function {name}")
        inner = Frame(self.server, lock_timeout=self.lock_timeout)
        for p, v in zip(func.params, args, strict=True):
            inner.vars[p.name] = v
        return inner.query(func.query, Env(inner))

    def join(  # noqa: PLR0917, PLR0912
        self,
        ctxs: list[Ctx],
        columns: dict[str, list[str]],
        join: exp.Join,
        env: Env,
        target: str | None,
        blocked: dict[int, tuple[str, tuple[Any, ...]]],
        updating: dict[str, Table],
    ) -> tuple[list[Ctx], dict[str, list[str]]]:
        """Long on purpose: one branch per kind of statement or node, read as a table."""
        node = join.this
        out: list[Ctx] = []
        if isinstance(node, exp.Lateral):  # CROSS APPLY, OUTER APPLY: the right side per left row
            alias = node.alias.lower()
            cross = bool(node.args.get("cross_apply"))
            right_cols: list[str] | None = None
            for c in ctxs:
                lenv = env.child(c, columns)
                inner = node.this
                if isinstance(inner, exp.Subquery):
                    rel = self.query(inner.this, lenv)
                elif isinstance(inner, exp.OpenJSON):
                    rel = _openjson(self.eval(inner.this, lenv))
                elif isinstance(
                    call := inner.expression if isinstance(inner, exp.Dot) else inner, exp.Anonymous
                ):
                    rel = self.function(call.name, [self.eval(a, lenv) for a in call.expressions])
                else:
                    raise NotImplementedError(inner.sql(dialect="tsql"))
                rights, cols = self.derived(alias, rel)
                right_cols = cols[alias]
                out.extend({**c, **r} for r in rights)
                if not rights and not cross:
                    out.append({**c, alias: None})
            if right_cols is None:
                inner = node.this
                names = [_name(e) for e in inner.this.expressions] if isinstance(inner, exp.Subquery) else []
                right_cols = [n for n in names if n] or (
                    ["key", "value", "type"] if isinstance(inner, exp.OpenJSON) else ["k"]
                )
            return out, {**columns, alias: right_cols}
        rights, rcols = self.source(node, env, target, blocked, updating)
        merged = {**columns, **rcols}
        side = (join.args.get("side") or "").upper()
        kind = (join.args.get("kind") or "").upper()
        on = join.args.get("on")
        if side not in ("", "LEFT") or kind not in ("", "INNER", "CROSS"):
            raise NotImplementedError(join.sql(dialect="tsql"))
        for c in ctxs:
            matched = False
            for r in rights:
                both = {**c, **r}
                if on is None or self.eval(on, env.child(both, merged)) is True:
                    out.append(both)
                    matched = True
            if not matched and side == "LEFT":
                out.append({**c, **dict.fromkeys(rcols)})
        return out, merged

    def windows(  # noqa: PLR0912
        self, sel: exp.Select, ctxs: list[Ctx], env: Env, columns: dict[str, list[str]]
    ) -> list[dict[int, Any]] | None:
        """Long on purpose: one branch per kind of statement or node, read as a table."""
        found = [w for e in sel.expressions for w in e.find_all(exp.Window)]
        if not found:
            return None
        values: list[dict[int, Any]] = [{} for _ in ctxs]
        for w in found:
            if w.args.get("partition_by"):
                raise NotImplementedError("PARTITION BY")
            order = w.args.get("order")
            spec = w.args.get("spec")
            idx = list(range(len(ctxs)))
            keys = []
            if order is not None:
                for i in idx:
                    keys.append(
                        [_sort_key(self.eval(o.this, env.child(ctxs[i], columns))) for o in order.expressions]
                    )
                if any(o.args.get("desc") for o in order.expressions):
                    raise NotImplementedError("a window ordered DESC")
                idx.sort(key=lambda i: keys[i])
            rows_frame = spec is not None and (spec.args.get("kind") or "").upper() == "ROWS"
            if spec is not None and not (
                spec.args.get("start") == "UNBOUNDED"
                and spec.args.get("start_side") == "PRECEDING"
                and spec.args.get("end") in (None, "CURRENT ROW")
            ):
                raise NotImplementedError(spec.sql(dialect="tsql"))
            func = w.this
            for pos, i in enumerate(idx):
                if order is None:
                    upto = idx
                elif rows_frame:
                    upto = idx[: pos + 1]
                else:  # RANGE: the row's peers too
                    upto = [j for j in idx if keys[j] <= keys[i]]
                if isinstance(func, exp.RowNumber):
                    values[i][id(w)] = pos + 1
                elif isinstance(func, exp.Sum | exp.Count):
                    args = [
                        self.eval(func.this, env.child(ctxs[j], columns))
                        if not isinstance(func.this, exp.Star)
                        else 1
                        for j in upto
                    ]
                    present = [a for a in args if a is not None]
                    if isinstance(func, exp.Count):
                        values[i][id(w)] = len(present)
                    else:
                        values[i][id(w)] = sum(present) if present else None
                else:
                    raise NotImplementedError(func.sql(dialect="tsql"))
        return values

    # -- expressions

    def eval(self, node: exp.Expression, env: Env) -> Any:  # noqa: PLR0911, PLR0912, PLR0915
        """Long on purpose: one branch per kind of statement or node, read as a table."""
        if isinstance(node, exp.Paren):
            return self.eval(node.this, env)
        if isinstance(node, exp.Column):
            return env.column(node.table.lower(), node.name.lower())
        if isinstance(node, exp.Parameter):
            if isinstance(node.this, exp.Parameter):  # @@ROWCOUNT, @@PROCID
                special = node.this.name.upper()
                if special == "ROWCOUNT":
                    return self.rowcount
                if special == "PROCID":
                    return 0
                raise NotImplementedError(f"@@{special}")
            name = node.name.lower()
            if name not in self.vars and name not in self.types:
                raise TsqlError(137, f"must declare the scalar variable @{name}")
            return self.vars.get(name)
        if isinstance(node, exp.Null):
            return None
        if isinstance(node, exp.Literal):
            return str(node.this) if node.is_string else _num(str(node.this))
        if isinstance(node, exp.National):
            return str(node.this)
        if isinstance(node, exp.Neg):
            v = self.eval(node.this, env)
            return None if v is None else -v
        if isinstance(node, exp.Add):
            a, b = self.eval(node.this, env), self.eval(node.expression, env)
            if a is None or b is None:
                return None
            if isinstance(a, str) != isinstance(b, str):
                raise NotImplementedError(f"{a!r} + {b!r}")
            return a + b
        for kind, op in _BINARY.items():
            if isinstance(node, kind):
                a, b = self.eval(node.this, env), self.eval(node.expression, env)
                return None if a is None or b is None else op(a, b)
        if isinstance(node, exp.And | exp.Or):
            a = self.eval(node.this, env)
            b = self.eval(node.expression, env)
            if isinstance(node, exp.And):
                return False if False in (a, b) else (None if None in (a, b) else True)
            return True if True in (a, b) else (None if None in (a, b) else False)
        if isinstance(node, exp.Not):
            v = self.eval(node.this, env)
            return None if v is None else not v
        if isinstance(node, exp.Is):
            assert isinstance(node.expression, exp.Null), node
            return self.eval(node.this, env) is None
        if isinstance(node, exp.Between):
            v, lo, hi = (self.eval(x, env) for x in (node.this, node.args["low"], node.args["high"]))
            return None if None in (v, lo, hi) else lo <= v <= hi
        if isinstance(node, exp.In):
            v = self.eval(node.this, env)
            query = node.args.get("query")
            if query is not None:
                items = [r[0] for r in self.query(query, env).rows]
            else:
                items = [self.eval(e, env) for e in node.expressions]
            if v is None:
                return None
            if v in [i for i in items if i is not None]:
                return True
            return None if None in items else False
        if isinstance(node, exp.Exists):
            return bool(self.query(node.this, env).rows)
        if isinstance(node, exp.Subquery):
            rows = self.query(node.this, env).rows
            if len(rows) > 1:
                raise TsqlError(512, "subquery returned more than 1 value")
            return rows[0][0] if rows else None
        if isinstance(node, exp.Case):
            for branch in node.args["ifs"]:
                if self.eval(branch.this, env) is True:
                    return self.eval(branch.args["true"], env)
            default = node.args.get("default")
            return None if default is None else self.eval(default, env)
        if isinstance(node, exp.Coalesce):
            for arg in [node.this, *node.expressions]:
                v = self.eval(arg, env)
                if v is not None:
                    return v
            return None
        if isinstance(node, exp.Cast):
            return _cast(self.eval(node.this, env), node.args["to"])
        if isinstance(node, exp.Convert):
            style = node.args.get("style")
            return _cast(
                self.eval(node.expression, env), node.this, None if style is None else self.eval(style, env)
            )
        if isinstance(node, exp.Window):
            assert env.windows is not None, node
            return env.windows[id(node)]
        if isinstance(node, _AGGREGATES):
            return self.aggregate(node, env)
        return self.function_call(node, env)

    def function_call(self, node: exp.Expression, env: Env) -> Any:  # noqa: PLR0911, PLR0912
        """Long on purpose: one branch per kind of statement or node, read as a table."""
        if isinstance(node, exp.Abs):
            v = self.eval(node.this, env)
            return None if v is None else abs(v)
        if isinstance(node, exp.Floor):
            v = self.eval(node.this, env)
            return None if v is None else (math.floor(v) if isinstance(v, float) else v)
        if isinstance(node, exp.Pow):
            a, b = self.eval(node.this, env), self.eval(node.expression, env)
            return None if a is None or b is None else float(a) ** b
        if isinstance(node, exp.DateAdd):
            unit = node.args["unit"].name
            return _date_add(unit, self.eval(node.expression, env), self.eval(node.this, env))
        if isinstance(node, exp.HexString):
            return bytes.fromhex(str(node.this))
        if isinstance(node, exp.TimeStrToTime):
            v = self.eval(node.this, env)
            return dt.datetime.fromisoformat(v) if isinstance(v, str) else v
        if isinstance(node, exp.DateDiff):
            end, start = self.eval(node.this, env), self.eval(node.expression, env)
            if end is None or start is None:
                return None
            unit = node.args["unit"].name.upper()
            step = {"MICROSECOND": dt.timedelta(microseconds=1), "MILLISECOND": dt.timedelta(milliseconds=1)}[
                unit
            ]
            return (end - start) // step
        if isinstance(node, exp.Uuid):
            return self.server.rng.getrandbits(64)
        if isinstance(node, exp.Repeat):
            text, times = self.eval(node.this, env), self.eval(node.args["times"], env)
            return None if text is None or times is None else str(text) * int(times)
        if isinstance(node, exp.Left):
            text, length = self.eval(node.this, env), self.eval(node.expression, env)
            return None if text is None or length is None else str(text)[: int(length)]
        if isinstance(node, exp.ObjectId):
            seq = self.server.sequences.get(str(self.eval(node.this, env)))
            return None if seq is None else seq["object_id"]
        if isinstance(node, exp.Anonymous):
            name = node.name.upper()
            args = [self.eval(a, env) for a in node.expressions]
            if name == "SYSUTCDATETIME":
                return self.server.now
            if name == "ERROR_NUMBER":
                return None if self.error is None else self.error.number
            if name == "CHECKSUM":
                return (hash(tuple(args)) % (2**32)) - 2**31
            if name == "OBJECT_SCHEMA_NAME":
                return "dbq"
            if name == "OBJECT_ID":
                seq = self.server.sequences.get(str(args[0]))
                return None if seq is None else seq["object_id"]
            if name == "QUOTENAME":
                return None if args[0] is None else "[" + str(args[0]).replace("]", "]]") + "]"
            if name == "REPLICATE":
                return None if None in args else str(args[0]) * int(args[1])
            raise NotImplementedError(f"function {name}")
        raise NotImplementedError(f"{type(node).__name__}: {node.sql(dialect='tsql')[:100]}")

    def aggregate(self, node: exp.Expression, env: Env) -> Any:
        if env.group is None:
            raise NotImplementedError(f"an aggregate outside a grouped query: {node.sql(dialect='tsql')}")
        arg = node.this
        order = None
        if isinstance(node, exp.GroupConcat) and isinstance(arg, exp.Order):
            order, arg = arg.expressions, arg.this
        members = env.group
        if order is not None:
            for ordered in reversed(order):
                members = sorted(
                    members,
                    key=lambda c, o=ordered: _sort_key(
                        self.eval(o.this, Env(self, c, env.columns, env.outer))
                    ),
                    reverse=bool(ordered.args.get("desc")),
                )
        if isinstance(arg, exp.Star):
            values = [1] * len(members)
        else:
            values = [self.eval(arg, Env(self, c, env.columns, env.outer)) for c in members]
        present = [v for v in values if v is not None]
        if isinstance(node, exp.Count):
            return len(present)
        if not present:
            return None
        if isinstance(node, exp.Min):
            return min(present)
        if isinstance(node, exp.Max):
            return max(present)
        if isinstance(node, exp.Sum):
            return sum(present)
        if isinstance(node, exp.GroupConcat):
            separator = self.eval(node.args["separator"], env)
            return str(separator).join(str(v) for v in present)
        raise NotImplementedError(node.sql(dialect="tsql"))


@dataclasses.dataclass
class Rel:
    names: list[str | None]
    rows: list[tuple[Any, ...]]
    ctxs: list[Ctx] = dataclasses.field(default_factory=list)
    columns: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def _name(e: exp.Expression) -> str | None:
    if isinstance(e, exp.Alias):
        return e.alias.lower()
    if isinstance(e, exp.Column):
        return e.name.lower()
    return None


def _unalias(e: exp.Expression) -> exp.Expression:
    return e.this if isinstance(e, exp.Alias) else e


def _has_aggregate(e: exp.Expression) -> bool:
    def walk(node: exp.Expression) -> bool:
        if isinstance(node, exp.Window | exp.Subquery | exp.Select):
            return False
        if isinstance(node, _AGGREGATES):
            return True
        return any(walk(c) for c in node.iter_expressions())

    return walk(e)


def _sources(select: exp.Select) -> Iterable[exp.Table]:
    from_ = select.args["from_"]
    yield from_.this
    for join in list(from_.this.args.get("joins") or []) + list(select.args.get("joins") or []):
        if isinstance(join.this, exp.Table):
            yield join.this


def _openjson(text: Any) -> Rel:
    """OPENJSON(x) without a schema: key, value (as text, NULL for null) and type of each element."""
    if text is None:
        return Rel(["key", "value", "type"], [])
    items = json.loads(text)
    if not isinstance(items, list):
        raise NotImplementedError("OPENJSON of an object")
    rows = []
    for i, v in enumerate(items):
        kind = 0 if v is None else 1 if isinstance(v, str) else 3 if isinstance(v, bool) else 2
        value = None if v is None else v if isinstance(v, str) else json.dumps(v)
        rows.append((str(i), value, kind))
    return Rel(["key", "value", "type"], rows)


# -- a ring on the interpreter -----------------------------------------------------------------------


@functools.cache
def schema_blocks() -> dict[str, str]:
    """The blocks of the SQL Server ``schema.sql`` (``schema``) and ``functions.sql`` (one a routine,
    named for it), composed for schema ``dbq``, in install order."""
    from airflow_dbqueue.engine.dialects.mssql import MssqlDatabase
    from airflow_dbqueue.engine.sqlfile import parse_named_queries, read_text

    db = MssqlDatabase("mssql://h/db", schema="dbq")
    blocks = {}
    for filename in ("schema.sql", "functions.sql"):
        text = read_text("airflow_dbqueue.engine.dialects.mssql", filename)
        blocks.update({name: db.compose(body) for name, body in parse_named_queries(text).items()})
    return blocks


def ring_server(blocks: Mapping[str, str]) -> Server:
    """A server holding the tables, the schema's own sequences (the groups' gids) and the ring's routines
    as the blocks of :func:`schema_blocks` (or ``blocks``, composed alike) make them."""
    procedures, functions, ddl = _parsed_schema(tuple(blocks.items()))
    server = Server(procedures, functions)
    server.tables = schema_tables(server, ddl)
    for stmt in ddl:
        if isinstance(stmt, exp.Create) and stmt.args.get("kind") == "SEQUENCE":
            server.create_sequence(*_sequence(stmt))
    # The queues' CHECK constraints test names with LIKE and COLLATE, which the interpreter does not
    # evaluate; the rows tests write there are the engine's, whose names it validated.
    server.tables["queues"].checks.clear()
    return server


def _parsed_schema(
    blocks: tuple[tuple[str, str], ...],
) -> tuple[dict[str, Procedure], dict[str, Function], list[exp.Expression]]:
    procedures: dict[str, Procedure] = {}
    functions: dict[str, Function] = {}
    ddl: list[exp.Expression] = []
    for name, body in blocks:
        block_procedures, block_functions, block_ddl = _parsed_block(name, body)
        procedures.update(block_procedures)
        functions.update(block_functions)
        ddl.extend(block_ddl)
    return procedures, functions, ddl


@functools.lru_cache(maxsize=256)
def _parsed_block(
    name: str, body: str
) -> tuple[dict[str, Procedure], dict[str, Function], list[exp.Expression]]:
    if "\nCREATE OR ALTER " in f"\n{body}":
        procedures, functions = load_routines(f"-- name: {name}\n{body}")
        return procedures, functions, []
    return {}, {}, [stmt for stmt in sqlglot.parse(body, read="tsql") if stmt is not None]


class Ring:
    """A ring made by ``ring_create`` on a :class:`Server`, and the calls of the engine's named queries on
    it (each procedure called with the arguments the SQL Server dialect's named query of its name passes,
    as tests/unit/test_mssql_ring_procedures.py checks), returning what the tests look at."""

    def __init__(self, server: Server, *, queue_id: int = 1, capacity: int = 16, lanes: int = 4) -> None:
        self.server, self.queue_id, self.capacity, self.lanes = server, queue_id, capacity, lanes
        server.call("ring_create", queue_id=queue_id, capacity=capacity, slot_bytes=8, lanes=lanes)
        self.seq = f"[dbq].[ring_{queue_id}_seq]"

    def push(self, *payloads: bytes, timeout_s: float = 0.0) -> list[int]:
        """ring_push of a batch (a JSON array of hex strings): the numbers written."""
        _, out = self.server.call(
            "ring_push",
            queue_id=self.queue_id,
            cap=self.capacity,
            payloads=json.dumps([p.hex() for p in payloads]),
            payload=None,
            timeout_s=timeout_s,
            first=None,
            once=0,
            num=None,
            written=None,
        )
        if out["num"] is None:
            return []
        assert out["written"] == 1, out
        return list(range(out["num"], out["num"] + len(payloads)))

    def abandon(self, n: int) -> list[int]:
        """Numbers a push took and never wrote (it rolled back, or its process died, after taking them):
        ring_push of ``n`` messages, stopped after it took its numbers. Another transaction holds every
        slot not held already while it runs, so its writes read past them until its timeout (none) and it
        fails with DQ001, having written nothing; its numbers stay issued. None are taken when the ring
        has no room for ``n`` (ring_push then returns before taking any)."""
        before = self.issued
        slots = [("ring_slots", (self.queue_id, slot)) for slot in range(self.capacity)]
        added = [key for key in slots if key not in self.server.others]
        for table, key in added:
            self.server.lock(table, key, "U")
        try:
            self.push(*[b"lost"] * n)
        except TsqlError as exc:
            assert "[DQ001]" in exc.message, exc
        finally:
            for key in added:
                del self.server.others[key]
        return list(range(before + 1, self.issued + 1))

    @property
    def issued(self) -> int:
        return self.server.sequence(self.seq)["current_value"]

    def take(
        self, n: int, *, lease: bool = False, wait: bool = False, consumer: str = "c"
    ) -> list[tuple[Any, ...]]:
        """ring_take (the fast path: retries checked first): its rows."""
        results, _ = self.server.call(
            "ring_take",
            queue_id=self.queue_id,
            cap=self.capacity,
            lanes=self.lanes,
            n=n,
            lease=lease,
            vt=30.0,
            consumer=consumer,
            retries=1,
            wait=wait,
        )
        assert len(results) <= 1, results  # one result set at most
        return results[0] if results else []

    def pop(
        self,
        n: int,
        *,
        gap: int | None = None,
        issued: int | None = None,
        snap: str | None = None,
        force: bool = False,
        lease: bool = False,
        own: bool = False,
        consumer: str = "c",
    ) -> tuple[list[tuple[Any, ...]], tuple[Any, ...]]:
        """ring_pop: (its message rows, its last row: gap, issued position, push lanes)."""
        results, _ = self.server.call(
            "ring_pop",
            queue_id=self.queue_id,
            cap=self.capacity,
            lanes=self.lanes,
            n=n,
            lease=lease,
            vt=30.0,
            consumer=consumer,
            own=own,
            gap=gap,
            gap_issued=issued,
            gap_snap=snap,
            force=force,
        )
        [rows] = results  # one result set
        assert rows and rows[-1][0] is None, rows
        return rows[:-1], rows[-1][6:]

    def pass_lanes(self) -> int:
        """ring_pass: how many lanes moved."""
        _, out = self.server.call(
            "ring_pass", queue_id=self.queue_id, cap=self.capacity, lanes=self.lanes, moved=None
        )
        return int(out["moved"])

    def skip_abandoned(self, snap: str = "[]") -> int:
        [[(skipped, _)]], _ = self.server.call(
            "ring_skip_abandoned", queue_id=self.queue_id, issued=self.issued, snap=snap
        )
        return int(skipped)

    def nack(
        self, ids: Sequence[int], deliveries: Sequence[int], *, max_attempts: int = 5
    ) -> list[tuple[Any, ...]]:
        [rows], _ = self.server.call(
            "ring_settle",
            queue_id=self.queue_id,
            cap=self.capacity,
            lanes=self.lanes,
            ids=json.dumps(list(ids)),
            deliveries=json.dumps(list(deliveries)),
            nack=1,
            delay_s=0.0,
            backoff_s=0.0,
            backoff_max_s=0.0,
            max_attempts=max_attempts,
            error="nacked",
            gid=self.queue_id,
        )
        return rows

    def positions(self) -> list[int]:
        """Each lane's position, by lane."""
        lanes = [r for r in self.server.tables["ring_lanes"].scan() if r["queue_id"] == self.queue_id]
        return [r["pos"] for r in lanes]

    def leases(self) -> list[tuple[int, int, list[int | None], int]]:
        """(lo, hi, starts, n) of each open lease, by lo."""
        rows = [r for r in self.server.tables["ring_leases"].scan() if r["queue_id"] == self.queue_id]
        return [(r["lo"], r["hi"], json.loads(r["starts"]), r["n"]) for r in rows]

    def slot_of(self, number: int) -> tuple[int, bytes | None]:
        """(seq, payload) of the slot of ``number``."""
        row = self.server.tables["ring_slots"].find(queue_id=self.queue_id, slot=number % self.capacity)
        assert row is not None
        return row["seq"], row["payload"]

    def retry(self) -> list[tuple[int, int, int]]:
        """(id, state, attempts) of each retry row, by id."""
        rows = [r for r in self.server.tables["ring_retry"].scan() if r["queue_id"] == self.queue_id]
        return [(r["id"], r["state"], r["attempts"]) for r in rows]

    def gaps_skipped(self) -> int:
        return self.server.sequence(f"[dbq].[ring_{self.queue_id}_gaps]")["current_value"]


# -- the engine on the interpreter -------------------------------------------------------------------


def drop_queue(db: Any, queue_id: int) -> None:
    """Drop a ring queue as ``DbQueue.drop_queue`` does on SQL Server, in one transaction, but for its
    first statement: the queue's push lock (``sp_getapplock`` in a batch with ``IF``) is outside the
    interpreter's subset, and nothing else runs here to wait for."""
    params = {"queue_id": queue_id}
    with db.transaction() as conn:
        db.execute("ring_drop", params, conn)
        db.execute("drop_queue_messages", params, conn)
        db.execute("drop_queue_finished", params, conn)
        assert db.fetchone("drop_queue", params, conn) is not None


class InterpretedSqlServer(FakeSqlServer):
    """The fake pyodbc server of tests/fake_mssql.py, answering every batch the dialect sends by running it
    on a :class:`Server`: the engine's named queries, as the SQL Server dialect binds them, run on the
    interpreted procedures. A batch may return one result set at most (the dialect reads one). A T-SQL
    error is raised as pyodbc raises SQL Server's (so the dialect translates it); a rollback puts the
    tables back as the connection's transaction found them (sequences stay where they are, as on SQL
    Server). Transactions are not isolated from each other: use one at a time."""

    def __init__(self, server: Server) -> None:
        super().__init__()
        self.tsql = server

    def connect(self, *, application_name: str | None = None, autocommit: bool = False) -> FakeConnection:
        conn = _Connection(self, application_name, autocommit)
        self.connections.append(conn)
        return conn

    def answer(self, text: str) -> list[tuple[Any, ...]] | None:
        values = self.log[-1].values or []
        try:
            results = self.tsql.batch(text, values)
        except TsqlError as exc:
            raise _pyodbc_error(exc) from None
        assert len(results) <= 1, f"{len(results)} result sets from: {text[:200]}"
        return results[0] if results else None


def _pyodbc_error(exc: TsqlError) -> Exception:
    """What pyodbc raises for SQL Server's error ``exc`` (SQLSTATE, then the driver's message)."""
    from tests.fake_mssql import import_pyodbc

    pyodbc = import_pyodbc()
    driver = "[Microsoft][ODBC Driver 18 for SQL Server][SQL Server]"
    text = f"{driver}{exc.message} ({exc.number}) (SQLExecDirectW)"
    if exc.number == 1205:
        return pyodbc.Error("40001", f"[40001] {text}")
    if exc.number == 1222:
        return pyodbc.Error("HY000", f"[HY000] {text}")
    return pyodbc.ProgrammingError("42000", f"[42000] {text}")


class _Cursor(FakeCursor):
    def execute(self, text: str, *params: Any) -> FakeCursor:
        conn = self.conn
        assert isinstance(conn, _Connection)
        conn.begin()
        try:
            return super().execute(text, *params)
        except Exception:
            if conn.autocommit:
                conn.restore()
            raise
        finally:
            if conn.autocommit:
                conn.saved = None


class _Connection(FakeConnection):
    saved: dict[str, list[Row]] | None = None

    def cursor(self) -> FakeCursor:
        return _Cursor(self)

    @property
    def tsql(self) -> Server:
        assert isinstance(self.server, InterpretedSqlServer)
        return self.server.tsql

    def begin(self) -> None:
        if self.saved is None:
            self.saved = {name: [dict(r) for r in t.rows] for name, t in self.tsql.tables.items()}

    def restore(self) -> None:
        if self.saved is not None:
            for name, rows in self.saved.items():
                self.tsql.tables[name].rows = rows
        self.saved = None

    def commit(self) -> None:
        super().commit()
        self.saved = None

    def rollback(self) -> None:
        super().rollback()
        self.restore()
