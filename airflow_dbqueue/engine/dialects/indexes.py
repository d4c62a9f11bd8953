"""What a dialect reports of the schema's indexes, and the steps it plans to keep them small.

Maintenance's reindexer (``engine/maintenance/reindexer.py``) asks the dialect for a survey of the
indexes (:class:`IndexSurvey`), for the steps to take (:class:`IndexStep`, in the order to take them),
and runs each step through the dialect; it never knows which database decides or runs them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

_LEFTOVER = re.compile(r"_cc(new|old)\d*$")
"""Suffixes PostgreSQL gives the indexes of a REINDEX CONCURRENTLY in progress (or one that failed)."""


@dataclasses.dataclass(frozen=True, slots=True)
class IndexHealth:
    """One index of the schema, with an estimate of the size its entries need."""

    index: str
    table: str
    method: str
    valid: bool
    size_bytes: int
    entries: int | None
    """Entries counted by the last VACUUM or ANALYZE (``None`` when never counted)."""
    expected_bytes: int | None
    """Size a freshly built B-tree of ``entries`` entries would have (``None`` for other methods, or
    when ``entries`` is unknown). SQL Server: the size with the leaf pages filled to the fill factor
    (``mssql_expected_bytes``)."""
    build_running: bool
    """An index build (CREATE INDEX or REINDEX CONCURRENTLY) is running on the table right now (on SQL
    Server: an index operation runs in the database, or a resumable one is paused on the table)."""
    fragmentation_pct: float | None = None
    """SQL Server: logical fragmentation of the leaf level, in percent (``None`` on PostgreSQL)."""
    page_density_pct: float | None = None
    """SQL Server: how full the leaf pages are on average, in percent (``None`` on PostgreSQL)."""
    fill_factor: int | None = None
    """SQL Server: the index's fill factor (100 for the default 0; ``None`` on PostgreSQL)."""
    part_of: str | None = None
    """PostgreSQL: the partitioned index this index is the part of one partition of (the table
    design's ``meta_ready_idx_3`` of ``meta_ready_idx``); ``None`` for any other index. Naming the
    partitioned index in a rebuild's ``only`` names each of its parts."""

    @property
    def bloat_ratio(self) -> float | None:
        """``size_bytes / expected_bytes``: about 1 for a fresh index, more as it bloats."""
        if not self.expected_bytes:
            return None
        return self.size_bytes / self.expected_bytes

    @property
    def bloat_bytes(self) -> int | None:
        """Bytes beyond the expected size (0 when there are none)."""
        if self.expected_bytes is None:
            return None
        return max(0, self.size_bytes - self.expected_bytes)

    @property
    def leftover(self) -> bool:
        """An INVALID index left by a failed concurrent rebuild (``<name>_ccnew``, ``<name>_ccold``)."""
        return not self.valid and _LEFTOVER.search(self.index) is not None

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict (without the SQL Server measures on PostgreSQL)."""
        out = dataclasses.asdict(self)
        if self.fill_factor is None:
            for key in ("fragmentation_pct", "page_density_pct", "fill_factor"):
                del out[key]
        if self.part_of is None:
            del out["part_of"]
        ratio = self.bloat_ratio
        out["bloat_ratio"] = None if ratio is None else round(ratio, 3)
        out["bloat_bytes"] = self.bloat_bytes
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class IndexSurvey:
    """Every index of the schema, and what the dialect adds to a rebuild's report."""

    indexes: list[IndexHealth]
    report: dict[str, Any] = dataclasses.field(default_factory=dict)
    """JSON-safe entries of the rebuild report (SQL Server: the rebuild mode and the engine edition)."""


@dataclasses.dataclass(frozen=True, slots=True)
class IndexStep:
    """One step the dialect plans for an index: leave it (``skip``), rebuild it, or drop it."""

    health: IndexHealth
    action: str
    """What the report calls the step (``reindex``, ``online rebuild``, ``drop leftover``, ``skip``...)."""
    run: Literal["skip", "rebuild", "drop"]
    reason: str
    statement: str = ""
    """The statement the step runs, for the log and for messages (empty for ``skip``)."""
    label: str = ""
    """How a message that the step was not run names it (the statement when empty)."""
