"""Online index rebuilds: the dialect surveys the schema's indexes and plans the steps (which to
rebuild, which leftover of a failed rebuild to drop, which to leave alone, in which order); this
service runs them one at a time under the schema's lock, each within its timeout, and not while a long
transaction would hold it up, and reports what each did."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from airflow_dbqueue.engine.dialects.base import Database
from airflow_dbqueue.engine.dialects.indexes import IndexHealth, IndexStep
from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    DbQueueError,
    LockTimeoutError,
    StatementTimeoutError,
)
from airflow_dbqueue.engine.maintenance.horizon import held_back
from airflow_dbqueue.engine.maintenance.lock import SchemaLock
from airflow_dbqueue.engine.maintenance.results import IndexAction
from airflow_dbqueue.engine.queue import check_seconds

log = logging.getLogger(__name__)

ANALYZED_FIRST = ("meta", "data", "done", "archive")
"""The tables whose statistics are refreshed before a survey that counts entries from them."""


def describe_failure(db: Database, what: str, exc: DbQueueError, timeout_s: float) -> str:
    """One line saying why ``what`` failed: its timeout, a lock it did not get, or the error."""
    if isinstance(exc, StatementTimeoutError):
        return f"{what} was cancelled ({db.describe_statement_timeout(timeout_s)})"
    if isinstance(exc, LockTimeoutError):
        return f"{what} gave up waiting for a lock after {timeout_s:g}s"
    return f"{what} failed: {exc}"


class Reindexer:
    """Rebuilds the bloated indexes of one schema online (see :meth:`Maintenance.rebuild_indexes`)."""

    def __init__(self, db: Database, lock: SchemaLock, analyze: Callable[[Sequence[str]], Any]) -> None:
        self._db = db
        self._lock = lock
        self._analyze = analyze
        self.schema = db.schema
        self._horizon_age: float | None = None

    def index_health(self) -> list[IndexHealth]:
        return self._db.index_survey().indexes

    def rebuild(
        self,
        *,
        bloat_ratio: float,
        min_bloat_bytes: int,
        timeout_s: float,
        analyze: bool,
        only: Sequence[str] | None,
        lock_wait_s: float,
        fragmentation_pct: float,
        horizon_min_age_s: float | None,
    ) -> dict[str, Any]:
        if bloat_ratio < 1 or min_bloat_bytes < 0 or timeout_s <= 0:
            raise ConfigurationError(
                "need reindex_bloat_ratio >= 1, reindex_min_bytes >= 0 and reindex_timeout > 0"
            )
        if not 0 <= fragmentation_pct <= 100:
            raise ConfigurationError(f"reindex_fragmentation_pct must be in 0..100, got {fragmentation_pct}")
        if horizon_min_age_s is not None:
            horizon_min_age_s = check_seconds("horizon_min_age", horizon_min_age_s)
        with self._lock.hold(lock_wait_s) as got:
            if not got:
                return {"skipped": self._lock.skip_reason, "actions": []}
            if analyze and self._db.index_counts_need_analyze:
                self._analyze(ANALYZED_FIRST)
            survey = self._db.index_survey()
            known = {h.index for h in survey.indexes} | {h.part_of for h in survey.indexes if h.part_of}
            unknown = sorted(set(only or ()) - known)
            if unknown:
                raise ConfigurationError(f"no index {unknown} in schema {self.schema!r}")
            steps = self._db.index_plan(
                survey,
                only=only,
                bloat_ratio=bloat_ratio,
                min_bloat_bytes=min_bloat_bytes,
                fragmentation_pct=fragmentation_pct,
            )
            self._horizon_age = horizon_min_age_s
            try:
                actions = [self._take(step, timeout_s) for step in steps]
            finally:
                self._horizon_age = None
            actions = self._with_sizes_after(steps, actions)
        return {"actions": [a.as_dict() for a in actions], **survey.report}

    def _take(self, step: IndexStep, timeout_s: float) -> IndexAction:
        h = step.health
        if step.run == "skip":
            return IndexAction(h.index, "skip", True, 0.0, h.size_bytes, reason=step.reason)
        error = held_back(self._db, step.label or step.statement, self._horizon_age)
        if error is not None:
            return IndexAction(h.index, "skip", False, 0.0, h.size_bytes, reason=step.reason, error=error)
        if step.run == "drop":
            return self._drop(step, timeout_s)
        return self._rebuild(step, timeout_s)

    def _rebuild(self, step: IndexStep, timeout_s: float) -> IndexAction:
        h = step.health
        log.info("dbqueue: %s (%s)", step.statement, step.reason)
        t0 = time.monotonic()
        try:
            present = self._db.rebuild_index(self._lock.conn, step, timeout_s)
        except DbQueueError as exc:
            error = describe_failure(self._db, step.statement, exc, timeout_s)
            if self._db.leftovers_note is not None:
                log.warning("dbqueue: %s; %s", error, self._db.leftovers_note)
            else:
                log.warning("dbqueue: %s; dropping what it left", error)
                for left in self._db.leftovers_of(h.index):
                    self._take(left, timeout_s)
            seconds = round(time.monotonic() - t0, 3)
            return IndexAction(
                h.index, step.action, False, seconds, h.size_bytes, reason=step.reason, error=error
            )
        seconds = round(time.monotonic() - t0, 3)
        if not present:
            error = f"index {h.index} is no longer on {self.schema}.{h.table}; nothing was run"
            return IndexAction(
                h.index, step.action, False, seconds, h.size_bytes, reason=step.reason, error=error
            )
        return IndexAction(h.index, step.action, True, seconds, h.size_bytes, reason=step.reason)

    def _drop(self, step: IndexStep, timeout_s: float) -> IndexAction:
        h = step.health
        log.info("dbqueue: %s (%s)", step.statement, step.reason)
        t0 = time.monotonic()
        try:
            self._db.drop_index(self._lock.conn, step, timeout_s)
        except DbQueueError as exc:
            error = describe_failure(self._db, step.statement, exc, timeout_s)
            log.warning("dbqueue: %s; the next run tries again", error)
            seconds = round(time.monotonic() - t0, 3)
            return IndexAction(h.index, step.action, False, seconds, h.size_bytes, None, step.reason, error)
        seconds = round(time.monotonic() - t0, 3)
        return IndexAction(h.index, step.action, True, seconds, h.size_bytes, 0, step.reason)

    def _with_sizes_after(self, steps: list[IndexStep], actions: list[IndexAction]) -> list[IndexAction]:
        """``actions`` with the size of each index rebuilt, read once after all of them ran."""
        rebuilt = [a.ok and s.run == "rebuild" for s, a in zip(steps, actions, strict=True)]
        if not any(rebuilt):
            return actions
        after = {x.index: x.size_bytes for x in self.index_health()}
        out = []
        for done, action in zip(rebuilt, actions, strict=True):
            a = dataclasses.replace(action, size_after=after.get(action.index)) if done else action
            if done:
                log.info(
                    "dbqueue: rebuilt %s.%s: %s -> %s bytes",
                    self.schema,
                    a.index,
                    a.size_before,
                    a.size_after,
                )
            out.append(a)
        return out
