"""Maintenance on SQL Server without a SQL Server: the decisions that need no server, run on the real
code (engine edition to ONLINE rebuild or REORGANIZE, the lock and query timeouts and the text that
carries them, bloat from page density, when to rebuild), and the maintenance steps driven through a
fake pyodbc connection (tests/fake_mssql.py) that answers by what a statement contains. Tests that use
the fake say ``fake`` in their name: they check what the Python side sends and how it reads the
answers, never that the T-SQL does what it should on a server (tests/integration/test_maintenance.py
does, given $DBQUEUE_TEST_MSSQL_DSN). Only the deadlock test builds a pyodbc exception: the rest run
without the driver."""

from __future__ import annotations

import datetime as dt
import logging
import math
from typing import Any

import pytest
import sqlglot
from sqlglot import exp

from airflow_dbqueue.engine import ConfigurationError, DbQueue, DeadlockError
from airflow_dbqueue.engine.dialects.mssql import maintenance as ms_maintenance
from airflow_dbqueue.engine.dialects.mssql.dialect import MssqlDatabase
from airflow_dbqueue.engine.dialects.mssql.maintenance import (
    MSSQL_TABLES,
    edition_name,
    mssql_expected_bytes,
    mssql_rebuild_reason,
    rebuild_mode,
)
from airflow_dbqueue.engine.dialects.mssql.params import int_literal, lock_timeout_ms, query_timeout_s
from airflow_dbqueue.engine.maintenance import APPLICATION_NAME, IndexHealth
from tests.fake_mssql import FakeSqlServer, import_pyodbc

DSN = "mssql://u:p@sqlserver.invalid:1433/queues"
MiB = 1024 * 1024


# -- the edition decides: ONLINE rebuild or REORGANIZE ---------------------------------------------


@pytest.mark.parametrize(
    ("edition", "mode"),
    [
        (3, "online rebuild"),  # Enterprise, Developer, Evaluation
        (5, "online rebuild"),  # Azure SQL Database
        (8, "online rebuild"),  # Azure SQL Managed Instance
        (2, "reorganize"),  # Standard, Web
        (4, "reorganize"),  # Express
        (9, "reorganize"),  # Azure SQL Edge
        (12, "reorganize"),  # an edition this code does not know: never an offline rebuild
        (None, "reorganize"),  # no answer
    ],
)
def test_the_engine_edition_chooses_online_rebuild_or_reorganize(edition: int | None, mode: str) -> None:
    assert rebuild_mode(edition) == mode


def test_editions_have_readable_names() -> None:
    assert edition_name(2) == "Standard (or Web, Business Intelligence) (2)"
    assert edition_name(3) == "Enterprise, Developer or Evaluation (3)"
    assert edition_name(12) == "EngineEdition (12)" and edition_name(None) == "an unknown edition"


# -- timeouts --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "ms"),
    [(None, -1), (0, 0), (0.0004, 1), (1, 1000), (1.0, 1000), (2.5, 2500), (1e9, 2**31 - 1)],
)
def test_lock_timeouts_are_whole_milliseconds_rounded_up(seconds: float | None, ms: int) -> None:
    assert lock_timeout_ms(seconds) == ms


@pytest.mark.parametrize(("seconds", "whole"), [(None, 0), (0, 0), (0.2, 1), (1.0, 1), (1.2, 2), (600, 600)])
def test_query_timeouts_are_whole_seconds_rounded_up(seconds: float | None, whole: int) -> None:
    assert query_timeout_s(seconds) == whole


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf, True, "5"])
def test_bad_timeouts_are_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="timeout"):
        lock_timeout_ms(bad)
    with pytest.raises(ConfigurationError, match="timeout"):
        query_timeout_s(bad)


@pytest.mark.parametrize(
    ("value", "text"), [(0, "0"), (-1, "-1"), (1500, "1500"), ("1500", "1500"), (" 7 ", "7")]
)
def test_an_integer_literal_is_written_as_the_integer(value: Any, text: str) -> None:
    assert int_literal(value, name="lock_ms", low=-1, high=2**31 - 1) == text


@pytest.mark.parametrize(
    "bad", [True, 1.5, "1e3", "", "1; DROP TABLE dbq.meta", "0x10", -2, 2**31, None, [1]]
)
def test_anything_but_an_integer_in_range_is_refused_by_name(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="lock_ms"):
        int_literal(bad, name="lock_ms", low=-1, high=2**31 - 1)


def test_set_timeouts_goes_as_a_plain_batch_with_the_integer_written_in() -> None:
    """SET LOCK_TIMEOUT takes no parameter, and a SET in a parameterized batch ends with that batch: the
    text carries the checked integer and no value is bound, so the setting holds for the session."""
    db = MssqlDatabase(DSN, schema="dbq")
    text, values = db.statement("set_timeouts", {"lock_ms": 1500})
    assert text.splitlines()[-1] == "SET LOCK_TIMEOUT 1500" and values == []
    [stmt] = sqlglot.parse(text, read="tsql", error_level=sqlglot.ErrorLevel.RAISE)
    assert isinstance(stmt, exp.Set)
    with pytest.raises(ConfigurationError, match="lock_ms"):
        db.statement("set_timeouts", {"lock_ms": "0; SHUTDOWN"})
    with pytest.raises(ConfigurationError, match="lock_ms"):
        db.statement("set_timeouts", {})
    assert db.statement("reset_timeouts")[0].splitlines()[-1] == "SET LOCK_TIMEOUT -1"


# -- bloat and the decision to rebuild -------------------------------------------------------------


def health(
    name: str = "meta_ready_idx",
    *,
    pages: int,
    leaf_pages: int | None,
    density: float | None,
    fill_factor: int = 100,
    fragmentation: float | None = 0.0,
    valid: bool = True,
    running: bool = False,
) -> IndexHealth:
    size = pages * 8192
    return IndexHealth(
        name,
        "meta",
        "nonclustered",
        valid,
        size,
        1000,
        mssql_expected_bytes(size, leaf_pages, density, fill_factor),
        running,
        fragmentation,
        density,
        fill_factor,
    )


def test_a_freshly_built_index_measures_about_one() -> None:
    fresh = health(pages=1003, leaf_pages=1000, density=89.7, fill_factor=90)
    assert fresh.bloat_ratio is not None and 0.99 < fresh.bloat_ratio < 1.01


def test_half_empty_leaf_pages_measure_about_two() -> None:
    half = health(pages=1010, leaf_pages=1000, density=45.0, fill_factor=90)
    assert half.bloat_ratio is not None and 1.95 < half.bloat_ratio < 2.05
    assert half.expected_bytes == (10 + 500) * 8192


def test_an_unmeasured_index_has_no_estimate() -> None:
    disabled = health(pages=0, leaf_pages=None, density=None, valid=False)
    assert disabled.expected_bytes is None and disabled.bloat_ratio is None


def test_the_sql_server_measures_are_reported_on_sql_server_only() -> None:
    ms_dict = health(pages=1010, leaf_pages=1000, density=45.0, fill_factor=90).as_dict()
    assert (ms_dict["page_density_pct"], ms_dict["fill_factor"], ms_dict["bloat_ratio"]) == (45.0, 90, 1.98)
    pg_dict = IndexHealth("meta_pkey", "meta", "btree", True, 16384, 0, 16384, False).as_dict()
    assert not {"fragmentation_pct", "page_density_pct", "fill_factor"} & set(pg_dict)


def test_a_bloated_index_is_rebuilt_when_big_enough() -> None:
    opts = {"bloat_ratio": 2.0, "min_bloat_bytes": MiB, "fragmentation_pct": 30.0}
    big = health(pages=1024, leaf_pages=1000, density=20.0)  # needs 200 leaf pages of 1000
    reason = mssql_rebuild_reason(big, **opts)
    assert reason is not None and "x4.6" in reason and "20% full" in reason
    small = health(pages=64, leaf_pages=60, density=20.0)  # as bloated, but 0.4 MiB in all
    assert mssql_rebuild_reason(small, **opts) is None


def test_a_fragmented_index_is_rebuilt_when_big_enough() -> None:
    opts = {"bloat_ratio": 2.0, "min_bloat_bytes": MiB, "fragmentation_pct": 30.0}
    big = health(pages=512, leaf_pages=500, density=95.0, fragmentation=45.0)
    reason = mssql_rebuild_reason(big, **opts)
    assert reason is not None and reason.startswith("45% fragmented")
    assert (
        mssql_rebuild_reason(health(pages=64, leaf_pages=60, density=95.0, fragmentation=80.0), **opts)
        is None
    )
    assert (
        mssql_rebuild_reason(health(pages=512, leaf_pages=500, density=95.0, fragmentation=29.0), **opts)
        is None
    )


# -- the steps through a fake pyodbc connection ----------------------------------------------------


class MaintenanceServer(FakeSqlServer):
    """Answers the maintenance's statements by what they contain (tests/fake_mssql.py records them)."""

    def __init__(self, *, edition: int = 2, lock_free: bool = True) -> None:
        super().__init__()
        self.edition = edition
        self.lock_free = lock_free
        self.index_rows: list[list[tuple[Any, ...]]] = []
        self.archive_counts: list[Any] = []
        self.holders: list[tuple[Any, ...]] = []
        self.queues: list[tuple[Any, ...]] = []
        """Rows of list_queues and get_queue (the queues table with a ring's capacity and lanes)."""
        self.clock = dt.datetime(2026, 1, 1, 12, 5)
        """What sample_clock answers (SYSUTCDATETIME())."""
        self.last_samples: list[tuple[Any, ...]] = []
        """Rows of samples_last: each queue's newest sample."""
        self.ring: dict[str, list[tuple[Any, ...]]] = {}
        """Answers of the ring's statements, by procedure (ring_reclaim_expired, ...), each used once."""

    def answer(self, text: str) -> list[tuple[Any, ...]] | None:  # noqa: PLR0911, PLR0912
        """Long on purpose: one branch per kind of statement or node, read as a table."""
        if "sp_getapplock" in text:
            return [(1 if self.lock_free else 0,)]
        if "sp_releaseapplock" in text:
            return [(1,)]
        if "FROM sys.dm_tran_locks" in text:
            return [(57, APPLICATION_NAME, "10.0.0.5", 12.0, "sleeping")]
        if "dm_db_index_physical_stats" in text:
            return self.index_rows.pop(0)
        if text.splitlines()[-1].startswith("SET LOCK_TIMEOUT"):
            return None
        if "DECLARE @online bit" in text:  # reindex_concurrently
            return [("ALTER INDEX ...",)]
        if text.startswith("-- SQL Server has no VACUUM") or "UPDATE STATISTICS" in text.splitlines()[-1]:
            return None
        if "FROM sys.dm_tran_session_transactions" in text:  # xmin_holders
            return self.holders
        if "JOIN sys.dm_db_partition_stats p ON p.object_id = t.object_id" in text:  # table_health
            return [(t, 8192, 0, 8192, 3, None, None, None, None, None) for t in MSSQL_TABLES]
        if "FROM [dbq].queues q ORDER BY name" in text:  # list_queues
            return self.queues
        if "FROM [dbq].queues q WHERE name = ?" in text:  # get_queue
            return self.queues[:1]
        if "SELECT x.gid FROM [dbq].ring_groups x" in text:  # ring_groups
            return self.ring.pop("ring_groups")
        for procedure in (
            "ring_reclaim_expired",
            "ring_floor",
            "ring_push_lanes_held",
            "ring_skip_abandoned",
            "ring_pass",
        ):
            if f"EXEC [dbq].{procedure} " in text:
                return self.ring.pop(procedure)
        if "DELETE FROM old OUTPUT deleted.batch_id INTO @gone" in text:  # purge_batches
            return self.ring.pop("purge_batches", [])
        if text == "SELECT SYSUTCDATETIME()":  # sample_clock
            return [(self.clock,)]
        if "s.taken_at = (SELECT max(x.taken_at)" in text:  # samples_last
            return self.last_samples
        if "INSERT INTO [dbq].samples" in text:  # sample_insert
            return None
        if "DELETE TOP" in text and "[dbq].samples" in text:  # samples_purge_batch
            return [(0,)]
        if "DELETE FROM old;" in text:  # purge_archive_batch
            return [(0,)]
        if "INTO @batch" in text:
            step = self.archive_counts.pop(0)
            if isinstance(step, Exception):
                raise step
            return [(step, step)]
        raise AssertionError(f"the fake has no answer for: {text[:120]}")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> MaintenanceServer:
    server = MaintenanceServer()
    server.attach(monkeypatch)
    return server


def index_row(
    name: str,
    table: str,
    *,
    pages: int,
    leaf: int | None,
    density: float | None,
    frag: float | None,
    fill_factor: int = 100,
    edition: int = 2,
    valid: int = 1,
    kind: str = "nonclustered",
) -> tuple[Any, ...]:
    """One row of index_health as the T-SQL returns it."""
    return (name, table, kind, valid, pages * 8192, 1000, leaf, frag, density, fill_factor, edition, 0)


def schema_indexes(edition: int, *, rebuilt: bool = False) -> list[tuple[Any, ...]]:
    return [
        index_row(
            "archive_pkey",
            "archive",
            pages=512,
            leaf=500,
            density=95.0,
            frag=10.0 if rebuilt else 45.0,
            edition=edition,
        ),
        index_row(
            "data_pkey", "data", pages=8, leaf=8, density=50.0, frag=60.0, kind="clustered", edition=edition
        ),
        index_row("done_pkey", "done", pages=0, leaf=None, density=None, frag=None, valid=0, edition=edition),
        index_row(
            "meta_pkey",
            "meta",
            pages=256,
            leaf=250,
            density=88.0,
            frag=1.0,
            fill_factor=90,
            kind="clustered",
            edition=edition,
        ),
        index_row(
            "meta_ready_idx",
            "meta",
            pages=224 if rebuilt else 1024,
            leaf=200 if rebuilt else 1000,
            density=99.0 if rebuilt else 20.0,
            frag=0.5,
            edition=edition,
        ),
    ]


def test_maintenance_takes_a_sql_server_without_io() -> None:
    m = DbQueue(DSN, schema="dbq").maintenance()  # no connection is opened: the host does not exist
    assert (m.dialect, m.tables) == ("mssql", MSSQL_TABLES)
    with pytest.raises(ConfigurationError, match="schema_version"):
        m.vacuum(["schema_version"])
    with pytest.raises(ConfigurationError, match="fragmentation_pct"):
        m.rebuild_indexes(reindex_fragmentation_pct=101)
    # A held transaction does not grow SQL Server's tables: the ring compaction is skipped, saying why.
    assert "version store" in m.compact_rings()["skipped"]


@pytest.mark.parametrize(
    ("edition", "online", "action"), [(2, False, "reorganize"), (3, True, "online rebuild")]
)
def test_rebuild_indexes_on_a_fake_sql_server(
    fake: MaintenanceServer, edition: int, online: bool, action: str
) -> None:
    fake.index_rows = [schema_indexes(edition), schema_indexes(edition, rebuilt=True)]
    report = DbQueue(DSN, schema="dbq").maintenance().rebuild_indexes(reindex_timeout=600)

    assert report["mode"] == action and report["engine_edition"] == edition
    assert "nothing to clean up" in report["leftovers"]
    got = [(a["index"], a["action"], a["ok"]) for a in report["actions"]]
    assert got == [
        ("archive_pkey", action, True),  # 45% fragmented, 4 MiB
        ("done_pkey", "skip", True),  # disabled: left to its owner
        ("meta_ready_idx", action, True),  # leaf pages 20% full: x4.6
    ]  # data_pkey (fragmented but 64 KiB) and meta_pkey (healthy) are left alone
    ready = next(a for a in report["actions"] if a["index"] == "meta_ready_idx")
    assert (ready["size_before"], ready["size_after"]) == (1024 * 8192, 224 * 8192)

    rebuilds = fake.statements("DECLARE @online bit")
    assert [r.values for r in rebuilds] == [[online, 10], [online, 10]]  # 600 s: at most 10 minutes' wait
    assert (
        "PARSENAME(N'[meta_ready_idx]', 1)" in rebuilds[1].text
        and "PARSENAME(N'[meta]', 1)" in rebuilds[1].text
    )
    for r in rebuilds:  # on the run's own connection, outside a transaction, with the query timeout set
        assert (r.app, r.autocommit, r.timeout) == (APPLICATION_NAME, True, 600)
    sets = [(e.text.splitlines()[-1], e.values) for e in fake.statements("SET LOCK_TIMEOUT")]
    assert sets == [("SET LOCK_TIMEOUT 600000", None), ("SET LOCK_TIMEOUT -1", None)] * 2
    [own] = [c for c in fake.connections if c.application_name == APPLICATION_NAME]
    assert own.closed and own.timeout == 0 and fake.statements("sp_releaseapplock")


def test_archive_on_a_fake_sql_server_runs_one_transaction_a_batch(fake: MaintenanceServer) -> None:
    fake.archive_counts = [3, 3, 1]
    result = DbQueue(DSN, schema="dbq").maintenance().archive(archive_after=0, batch_size=3, pause=0)
    assert (result.rows, result.batches, result.stopped) == (7, 3, "drained")
    batches = fake.statements("INTO @batch")
    assert [b.values for b in batches] == [[0.0, 0.0, True, "[]", 3]] * 3
    assert all((b.autocommit, b.timeout) == (False, 30) for b in batches)  # in a transaction
    [own] = [c for c in fake.connections if c.application_name == APPLICATION_NAME]
    assert (own.commits, own.rollbacks, own.autocommit, own.closed) == (3, 0, True, True)
    sets = [e.text.splitlines()[-1] for e in fake.statements("SET LOCK_TIMEOUT")]
    assert sets == ["SET LOCK_TIMEOUT 1000", "SET LOCK_TIMEOUT -1"]  # the archiver waits 1 s for a lock


def test_a_failed_archive_batch_rolls_back_alone_on_a_fake_sql_server(fake: MaintenanceServer) -> None:
    deadlock = import_pyodbc().Error(
        "40001", "[40001] chosen as the deadlock victim. (1205) (SQLExecDirectW)"
    )
    fake.archive_counts = [3, deadlock]
    with pytest.raises(DeadlockError):
        DbQueue(DSN, schema="dbq").maintenance().archive(archive_after=0, batch_size=3, pause=0)
    [own] = [c for c in fake.connections if c.application_name == APPLICATION_NAME]
    assert (own.commits, own.rollbacks, own.autocommit, own.closed) == (1, 1, True, True)
    assert fake.statements("SET LOCK_TIMEOUT -1") and fake.statements("sp_releaseapplock")


def test_a_second_run_skips_naming_the_holder_on_a_fake_sql_server(fake: MaintenanceServer) -> None:
    fake.lock_free = False
    result = DbQueue(DSN, schema="dbq").maintenance().archive(archive_after=0)
    assert result.stopped == "skipped" and result.rows == 0
    assert result.skipped is not None and "pid 57" in result.skipped and APPLICATION_NAME in result.skipped
    assert not fake.statements("INTO @batch") and not fake.statements("sp_releaseapplock")


def test_ms_module_exports_the_online_editions() -> None:
    assert set(ms_maintenance.ONLINE_REBUILD_EDITIONS) == {3, 5, 8}


def test_a_batch_above_the_lock_escalation_threshold_is_warned_about_on_a_fake_sql_server(
    fake: MaintenanceServer, caplog: pytest.LogCaptureFixture
) -> None:
    fake.archive_counts = [0, 0]
    m = DbQueue(DSN, schema="dbq").maintenance()
    with caplog.at_level(logging.WARNING, logger="airflow_dbqueue.engine.maintenance"):
        m.archive(archive_after=0, batch_size=5000)
        assert not [r for r in caplog.records if "escalate" in r.getMessage()]
        m.archive(archive_after=0, batch_size=6000)
    [warned] = [r.getMessage() for r in caplog.records if "escalate" in r.getMessage()]
    assert "batch_size 6000" in warned


def test_a_full_run_on_a_fake_sql_server(fake: MaintenanceServer) -> None:
    """Every step of Maintenance.run reads the rows of its SQL Server queries into the same report."""
    import datetime as dt
    import json

    started = dt.datetime(2026, 1, 1, 12, 0)
    fake.holders = [
        (
            "transaction",
            61,
            "long-report",
            "app",
            "sleeping",
            420.5,
            None,
            started,
            started,
            "UPDATE x",
            600.0,
        )
    ]
    fake.archive_counts = [2]
    fake.index_rows = [schema_indexes(2), schema_indexes(2, rebuilt=True), schema_indexes(2, rebuilt=True)]
    report = DbQueue(DSN, schema="dbq").maintain()
    assert json.loads(json.dumps(report)) == report and report["skipped"] is None
    [holder] = report["xmin_holders"]
    assert (holder["kind"], holder["pid"], holder["xid_age"]) == ("transaction", 61, None)
    assert holder["xact_start"] == "2026-01-01T12:00:00+00:00"  # UTC, as the query converts it
    assert report["upkeep"] == {} and report["archive"]["rows"] == 2 and report["purge_archive"]["rows"] == 0
    assert report["vacuum"]["statement"] == "UPDATE STATISTICS"
    assert set(report["vacuum"]["tables"]) == set(MSSQL_TABLES)
    assert report["indexes"]["mode"] == "reorganize"
    assert report["metrics"]["tables"]["meta"] == {
        "table_bytes": 8192,
        "index_bytes": 0,
        "total_bytes": 8192,
        "live_tuples": 3,
        "dead_tuples": None,
        "dead_ratio": None,
        "last_vacuum": None,
        "last_analyze": None,
        "autovacuum_count": None,
        "vacuum_count": None,
    }
    ready = report["metrics"]["indexes"]["meta_ready_idx"]
    assert (ready["page_density_pct"], ready["fill_factor"], ready["bloat_ratio"]) == (
        99.0,
        100,
        1.009,
    )  # 224 pages where 222 would do
    assert len(fake.statements("UPDATE STATISTICS")) == len(MSSQL_TABLES)
    # No queue to sample; the horizon section names the holder, and no dead rows (SQL Server counts none).
    assert report["samples"]["recorded"] == 0 and report["samples"]["taken_at"] == "2026-01-01T12:05:00+00:00"
    assert report["horizon"]["held"] is True and report["horizon"]["holders"] == report["xmin_holders"]
    assert report["horizon"]["oldest"]["backend_age_s"] == 600.0
    assert report["horizon"]["dead_rows"] is None and report["horizon"]["not_removable"] == []
    # the two rebuilds the transaction held up (an online rebuild would wait for it)
    assert [d["object"] for d in report["horizon"]["deferred"]] == ["archive_pkey", "meta_ready_idx"]


def test_no_rebuild_runs_while_a_long_transaction_is_open_on_a_fake_sql_server(
    fake: MaintenanceServer,
) -> None:
    """A transaction open longer than horizon_min_age_s: each rebuild is not run (an online rebuild
    would wait for it), reported as a skip that did not complete, naming the session."""
    fake.index_rows = [schema_indexes(3)]
    fake.holders = [
        ("transaction", 61, "report-job", "sa", "sleeping", 900.0, None, None, None, "SELECT 1", None)
    ]
    report = DbQueue(DSN, schema="dbq").maintenance().rebuild_indexes(reindex_timeout=600, horizon_min_age=60)
    got = [(a["index"], a["action"], a["ok"]) for a in report["actions"]]
    assert got == [
        ("archive_pkey", "skip", False),
        ("done_pkey", "skip", True),
        ("meta_ready_idx", "skip", False),
    ]
    skipped = next(a for a in report["actions"] if a["index"] == "meta_ready_idx")
    assert "open longer than 60s" in skipped["error"] and "pid 61" in skipped["error"]
    assert not fake.statements("DECLARE @online bit")  # no rebuild was sent
    [values] = [e.values for e in fake.statements("FROM sys.dm_tran_session_transactions")][:1]
    assert values is not None and values[0] == 60


def test_a_rings_upkeep_on_a_fake_sql_server(fake: MaintenanceServer) -> None:
    """recover(): a ring queue's upkeep (lease reclaim, then gap recovery), with the ring's capacity and
    lanes from its row, on the pooled connections (consumers run alongside; no maintenance lock)."""
    fake.queues = [
        (
            4,
            "events",
            "ring",
            "json",
            512,
            3,
            30.0,
            1.0,
            60.0,
            "auto",
            False,
            1024,
            8,
            300.0,
            None,
            "fail",
            "none",
            "slots",  # layout
        )
    ]
    fake.ring = {
        "ring_reclaim_expired": [(11, 1), (12, 1), (13, 2)],
        "ring_floor": [(40, 1)],  # ring_unwritten: position 40, a number up to it unwritten
        "ring_push_lanes_held": [("[5]",)],  # ring_snapshot: push lane 5 was held
        "ring_skip_abandoned": [(4, None)],
        "ring_pass": [(2,)],  # two lanes moved over given-up numbers
        "ring_groups": [(4, None, None, None, None, None, None, 33, 300, 40)],  # the default group alone
    }
    report = DbQueue(DSN, schema="dbq").maintenance().recover()
    assert report == {"events": {"reclaimed": 3, "gaps_skipped": 4, "batches_purged": 0}}
    [reclaim] = fake.statements("EXEC [dbq].ring_reclaim_expired ")
    # queue_id, capacity, lanes, max_attempts, limit, the group's key (the default group's: the queue id)
    assert reclaim.values == [4, 1024, 8, 3, 10_000, 4]
    [skip] = fake.statements("EXEC [dbq].ring_skip_abandoned ")
    assert skip.values == [4, 40, "[5]"]
    [passing] = fake.statements("EXEC [dbq].ring_pass ")
    assert passing.values == [4, 1024, 8]  # queue_id, capacity, lanes
    assert fake.ring == {}  # every answer was asked for
    assert not fake.statements("sp_getapplock")


def test_a_sample_of_a_table_queue_on_a_fake_sql_server(fake: MaintenanceServer) -> None:
    """sample(): the queue's stats, its pushes and pops since its last sample (table_flow, from that
    sample's time to this one's), the horizon figures, inserted under the maintenance lock; then the
    retention's batch."""

    class Sampling(MaintenanceServer):
        def answer(self, text: str) -> list[tuple[Any, ...]] | None:
            if "AS ready," in text or "AS oldest_ready_age_s" in text:  # stats
                return [(5, 1, 2, 0, 0, 12.5)]
            if "AS popped" in text:  # table_flow
                return [(9, 4)]
            return super().answer(text)

    server = Sampling()
    server.queues = [
        (
            4,
            "orders",
            "table",
            "json",
            512,
            3,
            30.0,
            1.0,
            60.0,
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
    ]
    before = dt.datetime(2026, 1, 1, 12, 0)
    server.last_samples = [(4, before, None, None)]
    server.clock = dt.datetime(2026, 1, 1, 12, 5)
    fake.answer = server.answer  # type: ignore[method-assign]
    fake.queues, fake.last_samples, fake.clock = server.queues, server.last_samples, server.clock
    out = DbQueue(DSN, schema="dbq").maintenance().sample()
    assert out["recorded"] == 1 and out["deleted"] == 0
    assert out["queues"]["orders"] == {"pushed": 9, "popped": 4, "push_total": None, "pop_total": None}
    [flow] = fake.statements("AS popped")
    assert flow.values is not None and before in flow.values and server.clock in flow.values
    [insert] = fake.statements("INSERT INTO [dbq].samples")
    assert insert.values is not None and insert.values[:7] == [4, server.clock, 5, 1, 2, 0, 12.5]
    assert fake.statements("sp_getapplock")
