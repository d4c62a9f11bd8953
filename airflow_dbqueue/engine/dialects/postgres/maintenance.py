"""What maintenance asks of PostgreSQL: the tables VACUUM visits, statement and lock timeouts of a
session, B-tree bloat estimates, and online index rebuilds (``REINDEX INDEX CONCURRENTLY``) with the
clean-up of the INVALID index a failed one leaves (``DROP INDEX CONCURRENTLY``).

:class:`PostgresMaintenance` is a part of :class:`PostgresDatabase`; the engine's maintenance calls it
through the :class:`~airflow_dbqueue.engine.dialects.base.Database` protocol only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine.dialects.indexes import IndexHealth, IndexStep, IndexSurvey

TABLES = (
    "meta",
    "meta_opt",
    "data",
    "done",
    "archive",
    "queues",
    "batches",
    "dedup",
    "ring_lanes",
    "ring_leases",
    "ring_retry",
    "ring_slots",
    "ring_failed",
    "ring_groups",
    "samples",
)
"""The schema's tables, in the order VACUUM visits them (the dequeue paths first: a ring's pops update
``ring_lanes`` and write ``ring_leases``; its slots are overwritten in place by pushes)."""


def _ms(seconds: float) -> str:
    return str(max(0, int(seconds * 1000)))


def expected_btree_bytes(entries: float, key_width: int, fillfactor: int, block_size: int) -> int:
    """Estimate the size of a freshly built B-tree index of ``entries`` entries.

    Each leaf entry is an 8-byte index tuple header plus the key columns, MAXALIGNed, plus a 4-byte
    line pointer; leaf pages are filled to ``fillfactor`` percent of what the page header (24 bytes) and
    the B-tree special space (16 bytes) leave. Inner pages hold one downlink a leaf page (none when a
    single leaf is the root), and the metapage is one more. Deduplication makes some indexes smaller
    than this: the estimate errs towards "not bloated".
    """
    tuple_bytes = 4 + 8 * math.ceil((8 + max(0, key_width)) / 8)
    usable = (block_size - 24 - 16) * max(10, min(100, fillfactor)) / 100
    leaf = max(1, math.ceil(max(0.0, entries) * tuple_bytes / usable))
    inner = math.ceil(leaf * tuple_bytes / usable) if leaf > 1 else 0
    return (1 + leaf + inner) * block_size


def ring_slots_laid_out_bytes(capacity: int, slot_bytes: int, block_size: int = 8192) -> int:
    """The heap size ``ring_create`` lays a PostgreSQL ring's slots out in.

    It writes every slot with a filler of ``5/4 slot_bytes`` at fillfactor 50 and then empties it, so
    a page holds as many slots as fit that filler row (24 bytes of tuple header, 20 of columns, the
    filler; 8-byte aligned; a 4-byte line pointer each) in the half page the fillfactor leaves, plus
    the one placed when the page crosses it. Checked against the size of rings made by create_queue.
    """
    row = -(-(24 + 20 + slot_bytes * 5 // 4) // 8) * 8
    per_page = max(1, (block_size - 24 - 4 - block_size // 2 - row) // (row + 4) + 1)
    return -(-capacity // per_page) * block_size


if TYPE_CHECKING:  # the dialect's class supplies them
    from airflow_dbqueue.engine.dialects.base import NamedStatements as _Statements
else:
    _Statements = object


class PostgresMaintenance(_Statements):
    """The maintenance part of :class:`PostgresDatabase` (see the module's docstring)."""

    tables: tuple[str, ...] = TABLES
    escalation_rows: int | None = None  # PostgreSQL never escalates row locks
    no_vacuum: tuple[str, str] | None = None
    horizon_warning = "the xmin horizon is held back (VACUUM cannot remove dead rows)"
    ring_compaction_skipped: str | None = None
    table_recycling_skipped: str | None = None
    leftovers_note: str | None = None  # a failed REINDEX CONCURRENTLY can leave an INVALID index
    index_counts_need_analyze = True  # reltuples comes from the last VACUUM or ANALYZE

    @contextlib.contextmanager
    def session_timeouts(self, conn: Any, *, statement_s: float, lock_s: float) -> Iterator[None]:
        """``statement_timeout`` and ``lock_timeout`` of ``conn``'s session for the block, then the
        session's defaults again."""
        params = {"statement_ms": _ms(statement_s), "lock_ms": _ms(lock_s), "local": False}
        self.fetchone("set_timeouts", params, conn)
        try:
            yield
        finally:
            self.fetchall("reset_timeouts", None, conn)

    @staticmethod
    def describe_statement_timeout(timeout_s: float) -> str:
        return f"statement timeout of {timeout_s:g}s, or pg_cancel_backend"

    @staticmethod
    def ring_laid_out_bytes(capacity: int, slot_bytes: int) -> int:
        return ring_slots_laid_out_bytes(capacity, slot_bytes)

    def index_survey(self) -> IndexSurvey:
        """Every index of the schema, with a B-tree's expected size from its entries and key width.

        The table design's partitions have an index each for each of their table's (meta_ready_idx_3
        is meta_3's part of meta_ready_idx, :attr:`IndexHealth.part_of`): those are listed, each with
        its own size and entries, and rebuilt one at a time. The partitioned index holds nothing and
        is not listed (``REINDEX INDEX CONCURRENTLY`` of it waits behind every writer of its table)."""
        out = []
        for (
            name,
            table,
            method,
            valid,
            size,
            reltuples,
            key_width,
            fillfactor,
            block_size,
            running,
            part_of,
        ) in self.fetchall("index_health", {"schema": self.schema}):
            if size is None:  # dropped while read (a ring of the rows layout has indexes of its own)
                continue
            entries = None if reltuples is None or reltuples < 0 else int(reltuples)
            expected = (
                expected_btree_bytes(entries, key_width, fillfactor, block_size)
                if method == "btree" and entries is not None
                else None
            )
            out.append(
                IndexHealth(
                    name, table, method, valid, int(size), entries, expected, running, part_of=part_of
                )
            )
        return IndexSurvey(out)

    def index_plan(
        self,
        survey: IndexSurvey,
        *,
        only: Sequence[str] | None,
        bloat_ratio: float,
        min_bloat_bytes: int,
        fragmentation_pct: float,
    ) -> list[IndexStep]:
        """INVALID indexes first (a leftover of a failed rebuild is dropped, one of the schema's own
        rebuilt), then every valid B-tree past ``bloat_ratio`` and ``min_bloat_bytes`` (or named in
        ``only``). Indexes of a table an index build runs on are left alone. ``fragmentation_pct`` is
        SQL Server's measure and not used here."""
        wanted = set(only) if only is not None else None

        def named(h: IndexHealth) -> bool:
            return wanted is None or h.index in wanted or (h.part_of is not None and h.part_of in wanted)

        steps: list[IndexStep] = []
        for h in survey.indexes:
            if h.valid or (not named(h) and not h.leftover):
                continue
            if h.build_running:
                steps.append(IndexStep(h, "skip", "skip", "an index build runs"))
            elif h.leftover:
                reason = "INVALID index left by a failed concurrent rebuild"
                steps.append(IndexStep(h, "drop leftover", "drop", reason, self._drop_statement(h)))
            else:
                steps.append(
                    IndexStep(h, "rebuild invalid", "rebuild", "INVALID", self._reindex_statement(h))
                )
        for h in survey.indexes:
            if not h.valid or h.method != "btree" or h.build_running:
                continue
            if not named(h):
                continue
            ratio, extra = h.bloat_ratio, h.bloat_bytes
            estimate = f"{h.size_bytes} bytes for about {h.expected_bytes} needed"
            if wanted is not None:
                reason = f"asked for ({estimate})"
            elif ratio is None or extra is None or ratio < bloat_ratio or extra < min_bloat_bytes:
                continue
            else:
                reason = f"{estimate} (x{ratio:.1f})"
            steps.append(IndexStep(h, "reindex", "rebuild", reason, self._reindex_statement(h)))
        return steps

    def _reindex_statement(self, h: IndexHealth) -> str:
        return f"REINDEX INDEX CONCURRENTLY {self.schema}.{h.index}"

    def _drop_statement(self, h: IndexHealth) -> str:
        return f"DROP INDEX CONCURRENTLY {self.schema}.{h.index}"

    def rebuild_index(self, conn: Any, step: IndexStep, timeout_s: float) -> bool:
        """``REINDEX INDEX CONCURRENTLY`` on ``conn`` (autocommit), within ``timeout_s`` for its locks
        and its run."""
        with self.session_timeouts(conn, statement_s=timeout_s, lock_s=timeout_s):
            self.execute("reindex_concurrently", None, conn, identifiers={"index": step.health.index})
        return True

    def drop_index(self, conn: Any, step: IndexStep, timeout_s: float) -> None:
        """``DROP INDEX CONCURRENTLY`` on ``conn`` (autocommit), within ``timeout_s``."""
        with self.session_timeouts(conn, statement_s=timeout_s, lock_s=timeout_s):
            self.execute("drop_index_concurrently", None, conn, identifiers={"index": step.health.index})

    def leftovers_of(self, index: str) -> list[IndexStep]:
        """The drops of the INVALID indexes a failed rebuild of ``index`` left (none while a build
        runs on their table)."""
        reason = "INVALID index left by a failed concurrent rebuild"
        return [
            IndexStep(h, "drop leftover", "drop", reason, self._drop_statement(h))
            for h in self.index_survey().indexes
            if h.leftover and h.index.startswith(f"{index}_cc") and not h.build_running
        ]
