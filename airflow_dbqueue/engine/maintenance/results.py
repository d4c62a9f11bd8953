"""What maintenance steps report: JSON-safe results shared by the services of this package."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence
from typing import Any

APPLICATION_NAME = "airflow-dbqueue-maintenance"
"""``application_name`` of the connection a maintenance step runs on (and holds its lock with)."""
MiB = 1024 * 1024


def iso(value: Any) -> Any:
    """``value`` as ISO 8601 text when it is a datetime, else as it is."""
    return value.isoformat() if isinstance(value, dt.datetime) else value


@dataclasses.dataclass(frozen=True, slots=True)
class BatchResult:
    """What a batched step (archiving, archive retention) did in one run."""

    schema: str
    step: str
    """``archive`` or ``purge_archive``."""
    rows: int
    """Messages moved to the archive (``archive``) or deleted from it (``purge_archive``)."""
    batches: int
    seconds: float
    stopped: str
    """Why the run ended: ``drained`` (a short batch: nothing old enough is left), ``time budget`` or
    ``skipped`` (another run holds the lock; see ``skipped``)."""
    skipped: str | None = None
    discarded: int = 0
    """``archive``: finished messages of queues dropped meanwhile, deleted with their payloads instead
    of archived (nothing is archived for a queue that no longer exists)."""
    notes: tuple[str, ...] = ()
    """Queues named for the step that no longer exist, skipped."""

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict (for logs, XCom and the CLI)."""
        return {**dataclasses.asdict(self), "notes": list(self.notes)}


@dataclasses.dataclass(frozen=True, slots=True)
class IndexAction:
    """One thing :meth:`Maintenance.rebuild_indexes` did (or tried) to an index."""

    index: str
    action: str
    """``reindex`` (bloated), ``rebuild invalid`` (an INVALID index of the schema), ``drop leftover``
    (the INVALID index of a failed concurrent rebuild), or ``skip`` (a build runs on its table). On
    SQL Server: ``online rebuild`` or ``reorganize`` (see ``rebuild_mode``), or ``skip`` (an index
    operation runs, or the index is disabled)."""
    ok: bool
    seconds: float
    size_before: int | None = None
    size_after: int | None = None
    reason: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class XminHolder:
    """Something that holds back the xmin horizon, so VACUUM cannot remove dead rows."""

    kind: str
    """``transaction``, ``replication slot`` or ``prepared transaction``."""
    pid: int | None
    name: str
    """The application name (transactions), slot name or prepared transaction's gid."""
    user: str | None
    state: str | None
    age_s: float | None
    xid_age: int | None
    xact_start: str | None
    query_start: str | None
    query: str | None
    """The session's current or last statement (transactions), or the slot type."""
    backend_age_s: float | None = None
    """How long the session of a transaction has been connected (``None`` for slots and prepared
    transactions)."""

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> XminHolder:
        """Build one from a row of the dialect's ``xmin_holders`` query."""
        kind, pid, name, user, state, age_s, xid_age, xact_start, query_start, query, backend_age_s = row
        return cls(
            kind=kind,
            pid=pid,
            name=name,
            user=user,
            state=state,
            age_s=None if age_s is None else round(float(age_s), 1),
            xid_age=xid_age,
            xact_start=iso(xact_start),
            query_start=iso(query_start),
            query=query,
            backend_age_s=None if backend_age_s is None else round(float(backend_age_s), 1),
        )

    def describe(self) -> str:
        """One line for a log."""
        age = f"{self.age_s:.0f}s" if self.age_s is not None else "?"
        bits = [f"{self.kind} {self.name!r}"]
        if self.pid is not None:
            bits.append(f"pid {self.pid}")
        if self.user:
            bits.append(f"user {self.user}")
        if self.state:
            bits.append(f"state {self.state}")
        bits.append(f"age {age}, {self.xid_age} transactions" if self.xid_age is not None else f"age {age}")
        if self.query_start:
            bits.append(f"query started {self.query_start}")
        if self.query:
            bits.append(f"query {self.query[:120]!r}")
        return ", ".join(bits)

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict."""
        return dataclasses.asdict(self)
