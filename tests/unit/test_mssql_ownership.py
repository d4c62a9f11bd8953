"""What the engine may create and drop on SQL Server, without a SQL Server: reserved schemas refused at
construction, and install and uninstall driven through the fake SQL Server of tests/fake_mssql.py, here
keeping a model of one database's catalog (schemas and the objects in them) and answering the dialect's
statements by what they contain. Tests that use the fake say ``fake`` in their name: they check the
Python side's decisions (what it creates, records, drops and refuses), and that every statement it
sends parses as T-SQL; that the T-SQL does the same on a server is
tests/integration/test_ownership_mssql.py's, given $DBQUEUE_TEST_MSSQL_DSN. Only the tests that build
pyodbc's exceptions import pyodbc (:func:`tests.fake_mssql.import_pyodbc`): the rest run without it."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from airflow_dbqueue.engine import DbQueue, ForeignObjectsError, InvalidNameError, SchemaError
from airflow_dbqueue.engine.dialects.mssql import schema as ms_schema
from airflow_dbqueue.engine.dialects.mssql.dialect import MssqlDatabase
from airflow_dbqueue.engine.dialects.mssql.errors import translate
from airflow_dbqueue.engine.dialects.mssql.schema import functions_sql, schema_sql
from airflow_dbqueue.engine.dialects.ownership import FUNCTIONS_KIND, engine_objects
from airflow_dbqueue.engine.sqlfile import read_text
from tests.fake_mssql import FakeConnection, FakeCursor, FakeSqlServer, Rows, import_pyodbc
from tests.unit.test_mssql_dialect import DRIVER, tsql_statements

DSN = "mssql://u:p@sqlserver.invalid:1433/queues"
LATEST = schema_sql()[0]
SHA = functions_sql()[1]


@pytest.mark.parametrize(
    "schema", ["dbo", "sys", "information_schema", "guest", "db_owner", "db_datareader", "db_ddladmin"]
)
def test_reserved_schemas_are_refused_at_construction(schema: str) -> None:
    """No I/O: the host does not even resolve."""
    with pytest.raises(InvalidNameError, match=rf"schema name '{schema}' is not valid: it is a reserved"):
        DbQueue(DSN, schema=schema)


BLOCKS = frozenset(
    MssqlDatabase(DSN, schema="dbq").compose(batch) for batch in [schema_sql()[1], *functions_sql()[0]]
)
"""The batches of schema.sql and functions.sql as an install sends them to schema dbq."""


class FakeCatalog(FakeSqlServer):
    """One database's schemas and their objects, as the dialect's statements see and change them; a
    change is kept only when its transaction commits (:class:`TransactionalConnection`)."""

    def __init__(self) -> None:
        super().__init__()
        self.schemas: dict[str, dict[tuple[str, str], str]] = {}
        """schema -> {(kind, name): identity}"""
        self.versions: dict[str, list[int]] = {}
        self.owned: dict[str, set[tuple[str, str]]] = {}
        self.rings: dict[str, list[str]] = {}
        self.referrers: dict[tuple[str, str], str] = {}
        """(schema, table) -> what refers to it from outside the engine"""

    def connect(self, *, application_name: str | None = None, autocommit: bool = False) -> FakeConnection:
        conn = TransactionalConnection(self, application_name, autocommit)
        self.connections.append(conn)
        return conn

    @property
    def sent(self) -> list[str]:
        """The text of every statement sent, in order."""
        return [e.text for e in self.log]

    def add(self, schema: str, kind: str, name: str) -> None:
        self.schemas.setdefault(schema, {})[(kind, name)] = f"[{schema}].[{name}]"

    def answer(self, text: str) -> Rows | None:  # noqa: PLR0911, PLR0912
        """Long on purpose: one branch per kind of statement or node, read as a table."""
        values = self.log[-1].values or []  # those bound to this statement (FakeCursor logs it first)
        m = re.search(r"\[(\w+)\]\.", text)
        schema = m.group(1) if m else (values[0] if values else "")
        objects = self.schemas.get(schema, {})
        if "sp_getapplock" in text:
            return None
        if text.startswith("SELECT CASE WHEN OBJECT_ID(QUOTENAME"):  # schema_installed
            return [(int(("table", "schema_version") in self.schemas.get(values[0], {})),)]
        if text.startswith("SELECT coalesce(max(version)"):
            return [(max(self.versions.get(schema, [0])),)]
        if text.startswith("SELECT CASE WHEN SCHEMA_ID"):  # schema_exists
            return [(int(values[0] in self.schemas),)]
        if "CREATE SCHEMA" in text:
            self.schemas[schema] = {}
            return None
        if "FROM sys.objects o JOIN sys.schemas s" in text:  # schema_objects
            return sorted((k, n, ident) for (k, n), ident in self.schemas.get(values[0], {}).items())
        if "INSERT INTO" in text and ".schema_version" in text:
            self.versions.setdefault(schema, []).append(values[0])
            return None
        if "JOIN sys.objects o ON o.object_id IN (r.push_seq_id" in text:  # owned_ring_sequences
            return [(n,) for n in self.rings.get(schema, [])]
        if text.startswith("INSERT INTO") and ".owned_objects" in text:
            pairs = zip(json.loads(values[0]), json.loads(values[1]), strict=True)
            self.owned.setdefault(schema, set()).update(pairs)
            return None
        if text.startswith("SELECT kind, name FROM"):
            return sorted(self.owned.get(schema, set()))
        if "SELECT name FROM" in text and "WHERE kind = 'functions'" in text:  # functions_applied
            return [(n,) for k, n in self.owned.get(schema, set()) if k == "functions"]
        if text.startswith("DELETE FROM") and ".owned_objects" in text:  # forget_owned
            self.owned.get(schema, set()).discard((values[0], values[1]))
            return None
        if text in BLOCKS:  # a batch of schema.sql or functions.sql: what it creates
            for kind, name in engine_objects(text.replace(f"[{schema}].", "{schema}.")):
                self.add(schema, kind, name)
            return None
        if m := re.search(
            r"^IF OBJECT_ID\(N'\[(\w+)\]\.\[(\w+)\]', N'P'\) IS NOT NULL\n", text, re.MULTILINE
        ):
            # drop_owned_routine: the procedure of that name, else the function
            objects = self.schemas[m.group(1)]
            kind = "procedure" if ("procedure", m.group(2)) in objects else "function"
            del objects[(kind, m.group(2))]
            return None
        if m := re.search(
            r"DROP (TABLE|SEQUENCE IF EXISTS|PROCEDURE|SCHEMA) \[(\w+)\](?:\.\[(\w+)\])?", text
        ):
            what, schema, name = m.group(1), m.group(2), m.group(3)
            objects = self.schemas.get(schema, {})
            if what == "SCHEMA":
                assert not objects, f"DROP SCHEMA of a schema that holds {objects}"
                del self.schemas[schema]
                return None
            if what == "TABLE" and (schema, name) in self.referrers:
                raise import_pyodbc().ProgrammingError(
                    "42000",
                    f"[42000] {DRIVER}[SQL Server][DQ006] objects that are not the engine's refer to "
                    f"[{schema}].[{name}]: {self.referrers[(schema, name)]}; nothing was dropped (50000) "
                    "(SQLExecDirectW)",
                )
            kind = {"TABLE": "table", "SEQUENCE IF EXISTS": "sequence", "PROCEDURE": "procedure"}[what]
            objects.pop((kind, name), None)
            if name in self.rings.get(schema, []):
                self.rings[schema].remove(name)
            return None
        raise AssertionError(f"the fake has no answer for: {text[:160]}")


class TransactionalConnection(FakeConnection):
    """Every change is kept only on commit: the catalog is copied at the first statement and put back
    on rollback, as a transaction of a real server would."""

    server: FakeCatalog

    def __init__(self, server: FakeCatalog, application_name: str | None, autocommit: bool) -> None:
        super().__init__(server, application_name, autocommit)
        self._saved: Any = None

    def cursor(self) -> FakeCursor:
        if self._saved is None:
            c = self.server
            self._saved = (
                {s: dict(o) for s, o in c.schemas.items()},
                {s: list(v) for s, v in c.versions.items()},
                {s: set(o) for s, o in c.owned.items()},
                {s: list(r) for s, r in c.rings.items()},
            )
        return super().cursor()

    def commit(self) -> None:
        super().commit()
        self._saved = None

    def rollback(self) -> None:
        super().rollback()
        if self._saved is not None:
            c = self.server
            c.schemas, c.versions, c.owned, c.rings = self._saved
            self._saved = None


@pytest.fixture
def catalog(monkeypatch: pytest.MonkeyPatch) -> FakeCatalog:
    cat = FakeCatalog()
    cat.attach(monkeypatch)
    return cat


ENGINE = engine_objects(read_text(ms_schema.__name__.rpartition(".")[0], "schema.sql")) | engine_objects(
    read_text(ms_schema.__name__.rpartition(".")[0], "functions.sql")
)
"""What a fresh install holds (with the catalogue, owned_objects)."""
OWNED = ENGINE | {("schema", "dbq"), (FUNCTIONS_KIND, SHA)}
"""What a fresh install's catalogue lists: its objects, the schema it created, the routines file applied."""


def test_a_fresh_install_creates_its_schema_and_records_all_it_made_on_a_fake_sql_server(
    catalog: FakeCatalog,
) -> None:
    db = MssqlDatabase(DSN, schema="dbq")
    assert db.install() == LATEST
    assert set(catalog.schemas["dbq"]) == ENGINE
    assert catalog.owned["dbq"] == OWNED
    assert catalog.versions["dbq"] == [LATEST] == [100]
    sent = len(catalog.sent)
    assert db.install() == LATEST  # idempotent: nothing is created or recorded again
    assert not any("CREATE" in t or "INSERT" in t for t in catalog.sent[sent:])
    catalog.rings["dbq"] = ["ring_1_seq", "ring_1_gaps"]
    for name in catalog.rings["dbq"]:
        catalog.add("dbq", "sequence", name)
    db.drop_schema()
    assert "dbq" not in catalog.schemas
    for text in catalog.sent:  # the queries (the schema's batches are parsed by test_mssql_dialect)
        if not engine_objects(text.replace("[dbq].", "{schema}.")):
            tsql_statements(text)


def test_install_refuses_a_schema_holding_other_objects_on_a_fake_sql_server(catalog: FakeCatalog) -> None:
    catalog.add("dbq", "table", "customers")
    catalog.add("dbq", "view", "report")
    with pytest.raises(ForeignObjectsError) as info:
        MssqlDatabase(DSN, schema="dbq").install()
    assert sorted(info.value.objects) == ["table [dbq].[customers]", "view [dbq].[report]"]
    assert "Nothing was installed" in str(info.value)
    assert set(catalog.schemas["dbq"]) == {("table", "customers"), ("view", "report")}
    assert catalog.rollbacks == 1 and "dbq" not in catalog.versions


def test_an_empty_schema_is_used_and_kept_on_a_fake_sql_server(catalog: FakeCatalog) -> None:
    catalog.schemas["dbq"] = {}
    db = MssqlDatabase(DSN, schema="dbq")
    db.install()
    assert not any("CREATE SCHEMA" in t for t in catalog.sent)
    assert ("schema", "dbq") not in catalog.owned["dbq"]
    db.drop_schema()
    assert catalog.schemas["dbq"] == {}  # the engine's objects are gone; the schema was not its own


def test_uninstall_drops_only_what_the_catalogue_lists_on_a_fake_sql_server(catalog: FakeCatalog) -> None:
    db = MssqlDatabase(DSN, schema="dbq")
    db.install()
    catalog.add("dbq", "table", "customers")  # someone else's, put there after the install
    catalog.add("dbq", "procedure", "helper")
    db.drop_schema()
    assert set(catalog.schemas["dbq"]) == {("table", "customers"), ("procedure", "helper")}
    assert not any("[customers]" in t or "[helper]" in t for t in catalog.sent)


def test_uninstall_refused_by_a_referrer_drops_nothing_on_a_fake_sql_server(catalog: FakeCatalog) -> None:
    import_pyodbc()  # the fake refuses the drop as pyodbc reports the procedure's error
    db = MssqlDatabase(DSN, schema="dbq")
    db.install()
    before = dict(catalog.schemas["dbq"])
    catalog.referrers[("dbq", "meta")] = "[reports].[depth]"
    with pytest.raises(ForeignObjectsError, match=r"\[reports\]\.\[depth\]"):
        db.drop_schema()
    assert catalog.schemas["dbq"] == before  # rolled back whole


@pytest.mark.parametrize("versions", [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4, 5, 6]])
def test_an_install_of_a_development_version_is_refused_on_a_fake_sql_server(
    catalog: FakeCatalog, versions: list[int]
) -> None:
    """An install made before release 1.0 (schema versions 1 to 6, with the engine's catalogue from
    version 3 on or without it) is neither upgraded nor uninstalled: install and uninstall raise
    SchemaError, as on PostgreSQL, and the schema is left as it was."""
    for kind, name in ENGINE:
        catalog.add("dbq", kind, name)
    catalog.versions["dbq"] = list(versions)
    if versions[-1] >= 3:
        catalog.owned["dbq"] = set(ENGINE)
    before = (dict(catalog.schemas["dbq"]), set(catalog.owned.get("dbq", set())))
    db = MssqlDatabase(DSN, schema="dbq")
    for call in (db.install, db.drop_schema):
        with pytest.raises(SchemaError, match=rf"development version .* \(schema version {versions[-1]}\)"):
            call()
    assert (catalog.schemas["dbq"], catalog.owned.get("dbq", set())) == before
    assert catalog.versions["dbq"] == versions
    assert not any(t.startswith(("CREATE", "DROP", "INSERT")) or t in BLOCKS for t in catalog.sent)


def test_a_newer_install_is_refused_on_a_fake_sql_server(catalog: FakeCatalog) -> None:
    MssqlDatabase(DSN, schema="dbq").install()
    catalog.versions["dbq"].append(LATEST + 1)
    with pytest.raises(SchemaError, match=rf"version {LATEST + 1}, newer than this code's {LATEST}"):
        MssqlDatabase(DSN, schema="dbq").install()


def test_an_install_lacking_a_table_of_its_version_is_refused_on_a_fake_sql_server(
    catalog: FakeCatalog,
) -> None:
    """An install recorded at this code's version without a table this code creates (made by another
    build of that version) is refused with a SchemaError naming the table, and nothing is sent that
    creates, drops or records anything, whether its routines file is the one applied or not."""
    MssqlDatabase(DSN, schema="dbq").install()
    del catalog.schemas["dbq"][("table", "samples")]
    before = (dict(catalog.schemas["dbq"]), set(catalog.owned["dbq"]))
    for applied in (SHA, "f" * 64):
        catalog.owned["dbq"] = (before[1] - {(FUNCTIONS_KIND, SHA)}) | {(FUNCTIONS_KIND, applied)}
        sent = len(catalog.sent)
        with pytest.raises(SchemaError, match=r"at schema version \d+ without the table\(s\) samples that"):
            MssqlDatabase(DSN, schema="dbq").install()
        assert not any(t.startswith(("CREATE", "DROP", "INSERT")) or t in BLOCKS for t in catalog.sent[sent:])
        assert catalog.schemas["dbq"] == before[0] and catalog.versions["dbq"] == [LATEST]


def test_a_changed_routines_file_is_applied_in_one_transaction_on_a_fake_sql_server(
    catalog: FakeCatalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every routine of a functions.sql whose SHA-256 is not the one recorded is altered, in one
    transaction; a routine of the engine's that the file no longer defines is dropped and forgotten; the
    catalogue then names the new file's SHA-256 only. The tables are left alone."""
    db = MssqlDatabase(DSN, schema="dbq")
    db.install()
    batches, _, names = functions_sql()
    kept = [b for b in batches if "{schema}.ring_drop_group\n" not in b]
    assert len(kept) == len(batches) - 1
    monkeypatch.setattr(ms_schema, "functions_sql", lambda: (kept, "f" * 64, names - {"ring_drop_group"}))
    commits, sent = catalog.commits, len(catalog.sent)
    assert db.install() == LATEST
    assert catalog.commits == commits + 1
    applied = catalog.sent[sent:]
    composed = {MssqlDatabase(DSN, schema="dbq").compose(b) for b in kept}
    assert composed <= set(applied) and catalog.versions["dbq"] == [LATEST]
    assert not any(t.startswith("CREATE TABLE") for t in applied)
    assert ("procedure", "ring_drop_group") not in catalog.schemas["dbq"]
    assert catalog.owned["dbq"] == (OWNED - {(FUNCTIONS_KIND, SHA), ("procedure", "ring_drop_group")}) | {
        (FUNCTIONS_KIND, "f" * 64)
    }
    sent = len(catalog.sent)
    assert db.install() == LATEST  # applied: nothing to do
    assert not any(t in BLOCKS or t.startswith(("CREATE", "DROP", "INSERT")) for t in catalog.sent[sent:])


def test_uninstall_drops_routines_then_tables_then_sequences_and_the_schema_on_a_fake_sql_server(
    catalog: FakeCatalog,
) -> None:
    """Uninstall drops what the catalogue lists: the procedures, then the inline functions (after the
    procedures that call them, before the tables they read), the tables, the sequences, the catalogue's
    own table last of the tables (uninstall reads it until then), and the schema the engine created."""
    db = MssqlDatabase(DSN, schema="dbq")
    db.install()
    assert {("table", "ring_leases"), ("table", "ring_retry"), ("table", "ring_push_lanes")} <= ENGINE
    assert {("function", "ring_held"), ("function", "ring_ready"), ("function", "ring_series")} <= ENGINE
    assert {
        ("procedure", "ring_take"),
        ("procedure", "ring_settle"),
        ("procedure", "ring_floor_try"),
    } <= ENGINE
    sent = len(catalog.sent)
    db.drop_schema()
    assert "dbq" not in catalog.schemas
    code = ["\n".join(ln for ln in t.splitlines() if not ln.startswith("--")) for t in catalog.sent[sent:]]
    drops = [t for t in code if t.startswith(("DROP ", "IF OBJECT_ID(", "SET NOCOUNT ON;\nDECLARE @found"))]
    kinds: list[str] = []  # the kinds dropped, in order, each run of one kind once
    for text in drops:
        names = re.findall(r"\[dbq\]\.\[(\w+)\]", text)
        kind = next(k for k, n in ENGINE if n == names[0]) if names else "schema"
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    assert kinds == ["procedure", "function", "table", "sequence", "table", "schema"]
    routines = [t for t in drops if t.startswith("IF OBJECT_ID(")]
    assert len(routines) == len([k for k, _ in ENGINE if k in ("procedure", "function")])
    for text in drops:
        tsql_statements(text)


def test_a_refused_queue_lock_is_a_deadlock_retried_by_the_dialect() -> None:
    from airflow_dbqueue.engine import DeadlockError

    exc = import_pyodbc().ProgrammingError(
        "42000",
        f"[42000] {DRIVER}[SQL Server][DQ007] the push lock of queue dbqueue.queue.[dbq].7 was not "
        "granted (sp_getapplock returned -3: a deadlock victim) (50000) (SQLExecDirectW)",
    )
    assert isinstance(translate(exc, where="h:1433/db", schema="dbq"), DeadlockError)


def test_the_refusal_code_is_translated_to_foreign_objects() -> None:
    exc = import_pyodbc().ProgrammingError(
        "42000",
        f"[42000] {DRIVER}[SQL Server][DQ006] objects that are not the engine's refer to [dbq].[meta]: "
        "[r].[v]; nothing was dropped (50000) (SQLExecDirectW)",
    )
    got = translate(exc, where="h:1433/db", schema="dbq")
    assert isinstance(got, ForeignObjectsError) and "[r].[v]" in str(got)


# -- queue handles on SQL Server: settings, and a push or drop as the dialect sends it ---------------


@pytest.mark.parametrize("name", ["get_queue", "list_queues"])
@pytest.mark.parametrize("pkg", ["postgres", "mssql"])
def test_the_settings_queries_select_every_settings_column(name: str, pkg: str) -> None:
    """DbQueue reads a queue's settings by position (client._SETTINGS_COLUMNS); on SQL Server the
    queries once lacked the ring's capacity, so no queue could be opened there."""
    import sqlglot

    from airflow_dbqueue.engine.client import _SETTINGS_COLUMNS
    from airflow_dbqueue.engine.sqlfile import load_queries

    body = load_queries(f"airflow_dbqueue.engine.dialects.{pkg}", "queries")[name]
    text = re.sub(r"%\(\w+\)s", "1", body.replace("{schema}", "dbq"))
    select = sqlglot.parse_one(text, read="tsql" if pkg == "mssql" else "postgres")
    # PostgreSQL's get_queue adds what the session's role may do to the queue (its grants), which the
    # client reads when it is there
    extra = ["actions"] if (pkg, name) == ("postgres", "get_queue") else []
    assert [e.alias_or_name for e in select.expressions] == [*_SETTINGS_COLUMNS, *extra]


def _fake_dbq(monkeypatch: pytest.MonkeyPatch, script: list[Any]) -> tuple[DbQueue, FakeSqlServer]:
    dbq = DbQueue(DSN, schema="dbq")
    assert isinstance(dbq.db, MssqlDatabase)
    return dbq, FakeSqlServer(script).attach(monkeypatch, dbq.db)


ORDERS = (
    7,
    "orders",
    "table",
    "json",
    1024,
    5,
    30.0,
    1.0,
    300.0,
    "auto",
    True,
    None,
    None,
    300.0,
    None,
    "fail",
    "none",
    None,  # layout
)


def test_a_push_to_a_dropped_queue_raises_on_a_fake_sql_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """The push's batch takes the queue's push lock shared and inserts only while the queue exists; a
    batch that returns no id means the queue is gone, and nothing was written."""
    from airflow_dbqueue.engine import QueueNotFoundError

    dbq, fake = _fake_dbq(monkeypatch, [[ORDERS], [(101,), (102,)], []])
    q = dbq.queue("orders")
    assert q.push_batch([{"n": 1}, {"n": 2}]) == [101, 102]
    with pytest.raises(QueueNotFoundError, match="queue 'orders' does not exist in schema 'dbq'"):
        q.push({"n": 3})
    (_, _), (push, values), _ = fake.executed
    assert "EXEC @locked = sys.sp_getapplock @Resource = @resource, @LockMode = 'Shared'" in push
    assert "IF @locked < 0\n    RAISERROR (N'[DQ007]" in push  # a refused lock fails the batch
    assert "WHERE @locked >= 0 AND EXISTS (SELECT 1 FROM [dbq].queues WHERE queue_id = ?)" in push
    assert values[:2] == [0.0, 7]  # the delay, then the queue id of the lock's resource
    tsql_statements(push)


def test_a_drop_locks_the_queue_then_deletes_in_order_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dbq, fake = _fake_dbq(monkeypatch, [[ORDERS], [], [], [], [(7,)]])
    assert dbq.drop_queue("orders")
    sent = [text for text, _ in fake.executed[1:]]
    assert "@LockMode = 'Exclusive'" in sent[0] and "RAISERROR (N'[DQ007]" in sent[0]
    assert "DELETE FROM [dbq].meta WHERE queue_id = @queue_id" in sent[1]
    assert "DELETE FROM [dbq].done WHERE queue_id = @queue_id" in sent[2]
    assert "DELETE FROM [dbq].archive" in sent[3] and "OUTPUT deleted.queue_id" in sent[3]
    assert [values for _, values in fake.executed[1:]] == [[7]] * 4
    assert (fake.commits, fake.rollbacks) == (2, 0)  # the lookup, then the drop: one transaction
    for text in sent:
        tsql_statements(text)


def link_failure(call: str = "SQLExecDirectW") -> Exception:
    """What pyodbc raises on a connection whose server went away (SQLSTATE 08S01)."""
    return import_pyodbc().OperationalError(
        "08S01", f"[08S01] {DRIVER}Communication link failure (10054) ({call})"
    )


class RestartedServer(FakeSqlServer):
    """Answers every statement with the row ``(1,)``, but on the connections named ``old...``: those
    idled across a restart, so every statement on them fails as a closed link does."""

    def answer(self, text: str) -> Rows | None:
        if (self.log[-1].app or "").startswith("old"):
            raise link_failure()
        return [(1,)]


class StaleConnection(FakeConnection):
    """A pooled connection of :class:`RestartedServer` from before its restart: its rollback fails too."""

    def rollback(self) -> None:
        super().rollback()
        raise link_failure("SQLEndTran")


COUNT_READY = {"queue_id": 1, "min_priority": 0, "cap": 10, "max_attempts": 5, "opts": False}


def test_connections_dead_after_an_idle_spell_are_replaced_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three pooled connections whose server went away while they idled: the first call checks the one
    it takes (SELECT 1), finds it dead, closes every idle one and runs on a new connection; nothing
    fails. Connections in steady use are not checked."""
    db = MssqlDatabase(DSN, schema="dbq")
    fake = RestartedServer().attach(monkeypatch, db)
    stale = [StaleConnection(fake, f"old{i}", autocommit=False) for i in range(3)]
    db._idle = [(c, 0.0) for c in stale]  # idle since long ago
    assert db.fetchone("count_ready", COUNT_READY) == (1,)
    assert all(c.closed for c in stale) and len(fake.connections) == 1  # one new connection opened
    [new] = fake.connections
    assert (fake.log[0].app, fake.log[0].text) == ("old2", "SELECT 1")  # the one taken was checked
    assert [e.app for e in fake.log[1:]] == [None] and not new.closed  # the call ran on the new one
    assert db.fetchone("count_ready", COUNT_READY) == (1,)
    assert len(fake.log) == 3 and fake.log[2].app is None and len(fake.connections) == 1
    assert fake.log[2].text == fake.log[1].text  # just used: taken without a check
