"""What maintenance asks of SQL Server, with its own meaning where PostgreSQL's has none.

There is no VACUUM (ghost records are the server's cleanup task's), so that step runs ``UPDATE
STATISTICS``; bloat is read from ``sys.dm_db_index_physical_stats`` (page density against the fill
factor, and fragmentation), and a bloated index is rebuilt with ``ALTER INDEX ... REBUILD WITH (ONLINE =
ON)`` where the engine edition has online index operations, ``REORGANIZE`` where it does not, decided
when the step runs and reported; a failed rebuild rolls back and leaves nothing to clean up. Timeouts
are the session's ``SET LOCK_TIMEOUT`` and the driver's query timeout.

:class:`MssqlMaintenance` is a part of :class:`MssqlDatabase`; the engine's maintenance calls it through
the :class:`~airflow_dbqueue.engine.dialects.base.Database` protocol only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from airflow_dbqueue.engine.dialects.indexes import IndexHealth, IndexStep, IndexSurvey
from airflow_dbqueue.engine.dialects.mssql.params import query_timeout_s
from airflow_dbqueue.engine.errors import DbQueueError, NotSupportedError

MSSQL_TABLES = (
    "meta",
    "meta_opt",
    "data",
    "done",
    "archive",
    "queues",
    "batches",
    "batch_items",
    "dedup",
    "ring_lanes",
    "ring_leases",
    "ring_retry",
    "ring_push_lanes",
    "ring_slots",
    "ring_failed",
    "ring_groups",
    "samples",
)
"""The tables of a schema on SQL Server (the batch ledger's items have a table of their own)."""
MSSQL_ESCALATION_ROWS = 5000
"""Rows one statement may lock on SQL Server before lock escalation may turn them into a table lock."""
MSSQL_NO_VACUUM = (
    "SQL Server has no VACUUM: the rows a DELETE leaves (ghost records) are removed by the server's ghost "
    "cleanup task; this step ran UPDATE STATISTICS"
)
MSSQL_NO_LEFTOVERS = (
    "nothing to clean up on SQL Server: a failed ALTER INDEX ... REBUILD rolls back and leaves no "
    "half-built index (PostgreSQL's REINDEX CONCURRENTLY can leave an INVALID one)"
)
MSSQL_NO_RECYCLING = (
    "SQL Server keeps old row versions in tempdb's version store, not in the table design's tables, "
    "which are not partitioned there: nothing to recycle"
)
MSSQL_NO_COMPACTION = (
    "SQL Server keeps no old row versions in a table (they go to tempdb's version store), so a held "
    "transaction does not grow the ring's tables; rebuild_indexes rebuilds their clustered indexes when "
    "they are fragmented"
)


ONLINE_REBUILD_EDITIONS: dict[int, str] = {
    3: "Enterprise, Developer or Evaluation",
    5: "Azure SQL Database",
    8: "Azure SQL Managed Instance",
}
"""``SERVERPROPERTY('EngineEdition')`` values whose engine rebuilds indexes with ``ONLINE = ON``."""

ENGINE_EDITIONS: dict[int, str] = {
    1: "Personal or Desktop Engine",
    2: "Standard (or Web, Business Intelligence)",
    4: "Express",
    6: "Azure Synapse dedicated SQL pool",
    9: "Azure SQL Edge",
    11: "Azure Synapse serverless SQL pool",
    **ONLINE_REBUILD_EDITIONS,
}
"""Names of the ``SERVERPROPERTY('EngineEdition')`` values, for reports."""


def edition_name(edition: int | None) -> str:
    """Return a readable name of an engine edition number (``"EngineEdition 12"`` when unknown)."""
    if edition is None:
        return "an unknown edition"
    return f"{ENGINE_EDITIONS.get(edition, 'EngineEdition')} ({edition})"


def rebuild_mode(edition: int | None) -> str:
    """Return how an index of a server of this engine edition is rebuilt without blocking the queue.

    ``"online rebuild"`` (``ALTER INDEX ... REBUILD WITH (ONLINE = ON)``) where the edition has online
    index operations (:data:`ONLINE_REBUILD_EDITIONS`), ``"reorganize"`` (``ALTER INDEX ... REORGANIZE``,
    online in every edition) otherwise, and for an edition this code does not know: an offline rebuild
    would lock the table for its whole duration, so it is never chosen.
    """
    return "online rebuild" if edition in ONLINE_REBUILD_EDITIONS else "reorganize"


def mssql_expected_bytes(
    size_bytes: int, leaf_pages: int | None, page_density_pct: float | None, fill_factor: int
) -> int | None:
    """Estimate the size a SQL Server index would have with its leaf pages filled to its fill factor.

    The leaf level holds ``leaf_pages`` pages, ``page_density_pct`` percent full on average; rebuilt,
    it would need ``leaf_pages * density / fill_factor`` pages. The rest of ``size_bytes`` (upper
    levels, LOB pages) is taken as it is. ``None`` when the leaf level was not measured (a disabled
    index, or no ``VIEW DATABASE STATE``).
    """
    if leaf_pages is None or page_density_pct is None:
        return None
    leaf_bytes = leaf_pages * 8192
    needed = math.ceil(leaf_pages * page_density_pct / max(1, min(100, fill_factor))) if leaf_pages else 0
    return max(8192, size_bytes - leaf_bytes + needed * 8192)


def mssql_rebuild_reason(
    h: IndexHealth, *, bloat_ratio: float, min_bloat_bytes: int, fragmentation_pct: float
) -> str | None:
    """Return why a SQL Server index should be rebuilt (or reorganized), or ``None`` to leave it.

    Bloated: at least ``bloat_ratio`` times the size its leaf pages would have at the fill factor, and
    ``min_bloat_bytes`` above it. Fragmented: at least ``fragmentation_pct`` percent logical
    fragmentation, in an index of at least ``min_bloat_bytes`` (small indexes gain nothing from order).
    """
    ratio, extra = h.bloat_ratio, h.bloat_bytes
    density = f"{h.page_density_pct:.0f}%" if h.page_density_pct is not None else "?"
    if ratio is not None and extra is not None and ratio >= bloat_ratio and extra >= min_bloat_bytes:
        return (
            f"{h.size_bytes} bytes for about {h.expected_bytes} needed (x{ratio:.1f}): leaf pages "
            f"{density} full, fill factor {h.fill_factor}"
        )
    frag = h.fragmentation_pct
    if frag is not None and frag >= fragmentation_pct and h.size_bytes >= min_bloat_bytes:
        return f"{frag:.0f}% fragmented ({h.size_bytes} bytes, leaf pages {density} full)"
    return None


class _IndexRow(NamedTuple):
    """A row of the ``index_health`` query."""

    name: str
    table: str
    method: str
    valid: int
    size_bytes: int
    entries: int | None
    leaf_pages: int | None
    fragmentation_pct: float | None
    page_density_pct: float | None
    fill_factor: int
    engine_edition: int | None
    running: int


def _index(row: _IndexRow) -> IndexHealth:
    """One row of ``index_health`` as an :class:`IndexHealth`."""
    size_bytes = int(row.size_bytes)
    density = row.page_density_pct
    expected = mssql_expected_bytes(
        size_bytes,
        None if row.leaf_pages is None else int(row.leaf_pages),
        None if density is None else float(density),
        int(row.fill_factor),
    )
    return IndexHealth(
        row.name,
        row.table,
        row.method,
        bool(row.valid),
        size_bytes,
        None if row.entries is None else int(row.entries),
        expected,
        bool(row.running),
        None if row.fragmentation_pct is None else round(float(row.fragmentation_pct), 2),
        None if density is None else round(float(density), 2),
        int(row.fill_factor),
    )


if TYPE_CHECKING:  # the dialect's class supplies them
    from airflow_dbqueue.engine.dialects.base import NamedStatements as _Statements
else:
    _Statements = object


class MssqlMaintenance(_Statements):
    """The maintenance part of :class:`MssqlDatabase` (see the module's docstring)."""

    if TYPE_CHECKING:  # what the dialect's class supplies besides its named statements

        def set_timeouts(self, conn: Any, *, statement_s: float | None, lock_s: float | None) -> None: ...

        def reset_timeouts(self, conn: Any) -> None: ...

    tables: tuple[str, ...] = MSSQL_TABLES
    escalation_rows: int | None = MSSQL_ESCALATION_ROWS
    no_vacuum: tuple[str, str] | None = ("UPDATE STATISTICS", MSSQL_NO_VACUUM)
    horizon_warning = (
        "cleanup is held back (the log cannot be truncated past it; under snapshot isolation row "
        "versions and ghost records stay)"
    )
    ring_compaction_skipped: str | None = MSSQL_NO_COMPACTION
    table_recycling_skipped: str | None = MSSQL_NO_RECYCLING
    leftovers_note: str | None = MSSQL_NO_LEFTOVERS
    index_counts_need_analyze = False  # the survey reads the indexes themselves

    @contextlib.contextmanager
    def session_timeouts(self, conn: Any, *, statement_s: float, lock_s: float) -> Iterator[None]:
        """The lock and query timeouts of ``conn``'s session for the block (a T-SQL ``SET`` lasts for
        the session, not a transaction), then no limits again."""
        self.set_timeouts(conn, statement_s=statement_s, lock_s=lock_s)
        try:
            yield
        finally:
            with contextlib.suppress(DbQueueError):
                self.reset_timeouts(conn)

    @staticmethod
    def describe_statement_timeout(timeout_s: float) -> str:
        return f"query timeout of {query_timeout_s(timeout_s)}s"

    @staticmethod
    def ring_laid_out_bytes(capacity: int, slot_bytes: int) -> int:
        raise NotSupportedError(MSSQL_NO_COMPACTION)

    def index_survey(self) -> IndexSurvey:
        """Every index of the schema as ``sys.dm_db_index_physical_stats`` measures it (SAMPLED), and
        the rebuild mode the server's engine edition allows (:func:`rebuild_mode`)."""
        out, edition = [], None
        for row in map(_IndexRow._make, self.fetchall("index_health", {"schema": self.schema})):
            edition = None if row.engine_edition is None else int(row.engine_edition)
            out.append(_index(row))
        mode = rebuild_mode(edition)
        why = f"{edition_name(edition)} " + (
            "rebuilds indexes online"
            if mode == "online rebuild"
            else "has no online index rebuild, so REORGANIZE (online in every edition)"
        )
        report = {
            "mode": mode,
            "engine_edition": edition,
            "edition": edition_name(edition),
            "why": why,
            "leftovers": MSSQL_NO_LEFTOVERS,
        }
        return IndexSurvey(out, report)

    def index_plan(
        self,
        survey: IndexSurvey,
        *,
        only: Sequence[str] | None,
        bloat_ratio: float,
        min_bloat_bytes: int,
        fragmentation_pct: float,
    ) -> list[IndexStep]:
        """Each index in turn: a disabled one, or one of a table an index operation runs on, is left
        alone; one bloated or fragmented (:func:`mssql_rebuild_reason`), or named in ``only``, is
        rebuilt in the survey's mode."""
        mode = survey.report["mode"]
        wanted = set(only) if only is not None else None
        steps: list[IndexStep] = []
        for h in survey.indexes:
            if wanted is not None and h.index not in wanted:
                continue
            if not h.valid:
                steps.append(
                    IndexStep(h, "skip", "skip", "disabled (ALTER INDEX ... DISABLE): left to its owner")
                )
                continue
            if h.build_running:
                reason = "an index operation runs in this database, or a resumable one is paused on its table"
                steps.append(IndexStep(h, "skip", "skip", reason))
                continue
            if wanted is not None:
                density = f"{h.page_density_pct:.0f}%" if h.page_density_pct is not None else "?"
                found: str | None = f"asked for ({h.size_bytes} bytes, leaf pages {density} full)"
            else:
                found = mssql_rebuild_reason(
                    h,
                    bloat_ratio=bloat_ratio,
                    min_bloat_bytes=min_bloat_bytes,
                    fragmentation_pct=fragmentation_pct,
                )
            if found is not None:
                on = f"ALTER INDEX {h.index} ON {self.schema}.{h.table}"
                how = "REBUILD WITH (ONLINE = ON)" if mode == "online rebuild" else "REORGANIZE"
                steps.append(IndexStep(h, mode, "rebuild", found, f"{on} {how}", f"{on} ({mode})"))
        return steps

    def rebuild_index(self, conn: Any, step: IndexStep, timeout_s: float) -> bool:
        """``ALTER INDEX ... REBUILD WITH (ONLINE = ON)`` or ``REORGANIZE`` (``step.action``) on ``conn``,
        within ``timeout_s``; False when the index is no longer there (nothing was run)."""
        h = step.health
        params = {
            "online": step.action == "online rebuild",
            "max_duration_min": max(1, math.ceil(timeout_s / 60)),
        }
        with self.session_timeouts(conn, statement_s=timeout_s, lock_s=timeout_s):
            row = self.fetchone(
                "reindex_concurrently", params, conn, identifiers={"index": h.index, "table": h.table}
            )
        return row is not None and row[0] is not None

    def drop_index(self, conn: Any, step: IndexStep, timeout_s: float) -> None:
        raise NotImplementedError(MSSQL_NO_LEFTOVERS)  # index_plan plans no drop

    def leftovers_of(self, index: str) -> list[IndexStep]:
        """None: a failed rebuild rolls back whole."""
        return []
