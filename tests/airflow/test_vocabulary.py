"""One name and one default a concept, on every face: the engine, the hook, the operators, the sensor and
trigger, the maintenance DAG and the command line (see "Names and defaults" in docs/concepts.md).

The rules checked here:

- a call signature (and a command-line option) takes seconds under a plain name (``visibility_timeout``,
  ``lock_wait``); a data field (``QueueSettings``, ``MaintenanceConfig``, the DAG's params, reports)
  carries ``_s`` (``visibility_timeout_s``, ``lock_wait_s``);
- a name has one default wherever it is taken, and the default of the data field ``X_s`` is the default
  of the argument ``X``; but for the differences listed in :data:`DIFFERENCES`, each with its reason;
- no old name is taken any longer, except through its alias, and every alias warns naming the new name.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from airflow_dbqueue import cli
from airflow_dbqueue.engine import DbQueue, GroupInfo, MaintenanceConfig, QueueNotFoundError, QueueSettings
from airflow_dbqueue.engine.maintenance import Maintenance
from airflow_dbqueue.engine.queue import Queue
from airflow_dbqueue.engine.renames import RENAMED_ATTRIBUTE
from airflow_dbqueue.engine.ring import RingQueue
from airflow_dbqueue.engine.table import TableQueue
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.hooks.maintenance import MaintenanceSteps
from airflow_dbqueue.hooks.operations import QueueOperations
from airflow_dbqueue.operators.dbqueue import DbQueueAckOperator, DbQueuePopOperator, DbQueuePushOperator
from airflow_dbqueue.operators.spark import DbQueueSparkSubmitOperator
from airflow_dbqueue.sensors.dbqueue import DbQueueSensor
from airflow_dbqueue.triggers.dbqueue import DbQueueTrigger

REPO = Path(__file__).resolve().parents[2]

CLASSES = (DbQueue, Queue, TableQueue, RingQueue, Maintenance, QueueOperations, MaintenanceSteps)
"""The engine's and the hook's classes whose public methods are faces."""
CONSTRUCTORS = (
    DbQueuePushOperator,
    DbQueuePopOperator,
    DbQueueAckOperator,
    DbQueueSparkSubmitOperator,
    DbQueueSensor,
    DbQueueTrigger,
)
"""The Airflow classes whose constructor arguments are faces."""
DATA = (QueueSettings, MaintenanceConfig, GroupInfo)
"""The data objects: their fields in seconds end in ``_s``."""

DIFFERENCES: dict[tuple[str, str], str] = {
    # (argument, face): why its default differs from the argument's default elsewhere.
    ("semantics", "QueueOperations.pop"): "an Airflow task is retried: what it popped must come back",
    ("semantics", "QueueOperations.claim"): "an Airflow task is retried: what it claimed must come back",
    ("semantics", "DbQueuePopOperator"): "an Airflow task is retried: what it claimed must come back",
    ("visibility_timeout", "DbQueueSparkSubmitOperator"): "a Spark job holds its batch for minutes, "
    "its lease extended every third of it; a dead driver's batch comes back after that",
    ("poll_interval", "DbQueueSensor"): "the triggerer runs many triggers in one loop; NOTIFY wakes "
    "them, and the poll is a fallback",
    ("poll_interval", "DbQueueTrigger"): "the triggerer runs many triggers in one loop; NOTIFY wakes "
    "them, and the poll is a fallback",
    ("horizon_min_age", "Maintenance.rebuild_indexes"): "called alone it does not look (None); "
    "maintenance runs pass horizon_min_age_s",
    ("horizon_min_age", "MaintenanceSteps.rebuild_indexes"): "as Maintenance.rebuild_indexes",
    ("missing_ok", "QueueOperations.drop_queue"): "until the next release: not given (None), a missing "
    "queue still returns False, with a DeprecationWarning; then False, as the engine's",
    ("missing_ok", "QueueOperations.drop_group"): "as QueueOperations.drop_queue",
    ("archive_retention", "dbqueue archive"): "the command deletes archived messages only when told to",
    ("archive_retention", "dbqueue maintain"): "the command deletes archived messages only when told to",
}
"""Defaults that differ on purpose, each with its reason (also in docs/concepts.md)."""

INHERITED = {
    "visibility_timeout": "None: the queue's visibility_timeout_s",
    "delay": "None (nack, release): the queue's retry backoff",
    "max_messages": "None (DbQueueSensor): its min_messages",
    "batch_size": "None (DbQueueTrigger): its min_messages",
}
"""Arguments that may default to None meaning a setting of the queue's, or another argument's."""

HOMONYMS = {
    "n": "how many to pop (1) or to peek at (10)",
    "limit": "a page of a listing (100), or the most expired leases a reclaim moves (RECLAIM_LIMIT)",
    "max_messages": "a pop operator's batch for XCom (100), or a Spark job's batch (10,000)",
    "wait": "a pop's wait for a message (0), or RingQueue.recover_gaps' wait for a gap's holders (2 s)",
    "batch_size": "a maintenance batch's rows, or the ready messages that fire a trigger",
}
"""Names of different things, whose defaults are not compared (each its own thing, documented)."""

RENAMED: dict[str, str] = {
    "older_than_s": "archive_after",  # and purge_archive's: archive_retention
    "pause_s": "pause",
    "time_budget_s": "time_budget",
    "lock_wait_s": "lock_wait",
    "wait_s": "lock_wait",
    "statement_timeout_s": "statement_timeout",
    "min_age_s": "horizon_min_age",
    "min_xid_age": "horizon_min_xid_age",
    "horizon_min_age_s": "horizon_min_age",
    "bloat_ratio": "reindex_bloat_ratio",  # compact_rings: compact_bloat_ratio
    "min_bloat_bytes": "reindex_min_bytes",  # compact_rings: compact_min_bytes
    "fragmentation_pct": "reindex_fragmentation_pct",
    "timeout_s": "reindex_timeout",  # compact_rings: compact_timeout
    "lock_timeout_s": "compact_lock_timeout",
    "rate_window_s": "rate_window",
    "lease_timeout": "visibility_timeout",
}
"""Old argument names, which no signature takes any longer (only an alias does)."""


def _faces() -> Iterator[tuple[str, inspect.Signature]]:
    for cls in CLASSES:
        for name, fn in inspect.getmembers(cls, callable):
            if not name.startswith("_"):
                yield f"{cls.__name__}.{name}", inspect.signature(fn)
    for cls in CONSTRUCTORS:
        yield cls.__name__, inspect.signature(cls.__init__)


def _arguments() -> Iterator[tuple[str, str, Any]]:
    """Every (face, argument, default) of the Python faces; required arguments have no default."""
    for face, sig in _faces():
        for p in sig.parameters.values():
            if p.name in ("self", "args", "kwargs") or p.default is inspect.Parameter.empty:
                continue
            yield face, p.name, p.default


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _options() -> Iterator[tuple[str, str, str, Any]]:
    """Every (command, option, dest, default) of the command line's options, old names left out."""
    for command, parser in _subcommands().items():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            if action.help == argparse.SUPPRESS:
                continue  # an old name, kept as an alias: see test_cli_aliases_warn
            yield f"dbqueue {command}", action.option_strings[-1], action.dest, action.default


def _data_defaults() -> dict[str, Any]:
    """``{field: default}`` of the data objects' fields in seconds (``_s``)."""
    out: dict[str, Any] = {}
    for cls in DATA:
        for f in dataclasses.fields(cls):
            if f.name.endswith("_s") and f.default is not dataclasses.MISSING:
                out[f.name] = f.default
    return out


def _all_defaults() -> dict[str, list[tuple[str, Any]]]:
    """``{argument: [(face, default)]}`` over the Python faces and the command line."""
    by_name: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for face, name, default in _arguments():
        by_name[name].append((face, default))
    for command, _option, dest, default in _options():
        by_name[dest].append((command, default))
    return by_name


def test_seconds_are_plain_in_calls_and_carry_s_in_data() -> None:
    suffixed = [f"{face}: {name}" for face, name, _ in _arguments() if name.endswith("_s")]
    suffixed += [f"{cmd}: {opt}" for cmd, opt, _, _ in _options() if opt.endswith("-s")]
    assert suffixed == [], "call signatures and options take seconds under plain names"
    for name in _data_defaults():
        assert name.endswith("_s")


def test_one_default_a_name_on_every_face() -> None:
    clashes = []
    for name, uses in sorted(_all_defaults().items()):
        if name in HOMONYMS:
            continue
        kept = [(face, d) for face, d in uses if (name, face) not in DIFFERENCES]
        if name in INHERITED:
            kept = [(face, d) for face, d in kept if d is not None]
        values = {repr(str(d)) if isinstance(d, str) else repr(d) for _, d in kept}
        if len(values) > 1:
            clashes.append(f"{name}: {sorted(kept, key=lambda u: u[0])}")
    assert clashes == [], "one default a name, but for DIFFERENCES"


def test_a_data_field_and_its_argument_agree() -> None:
    data = _data_defaults()
    disagree = []
    for name, uses in _all_defaults().items():
        field = f"{name}_s"
        if field not in data:
            continue
        for face, default in uses:
            if (name, face) in DIFFERENCES or (default is None and name in INHERITED):
                continue
            if default != data[field]:
                disagree.append(f"{face}: {name}={default!r}, but {field}={data[field]!r}")
    assert disagree == []


def test_differences_are_real_and_documented() -> None:
    """Every listed difference exists (one that no longer does is struck off the list), and the docs
    name the argument of each."""
    defaults = _all_defaults()
    concepts = (REPO / "docs" / "concepts.md").read_text()
    section = concepts[concepts.index("## Names and defaults") :]
    for name, face in DIFFERENCES:
        assert face in {f for f, _ in defaults[name]}, (name, face)
        assert f"`{name}`" in section, name


def test_no_old_name_is_taken() -> None:
    old = [f"{face}: {name}" for face, name, _ in _arguments() if name in RENAMED]
    old += [f"{cmd}: {opt}" for cmd, opt, _, _ in _options() if opt in cli.RENAMED_OPTIONS]
    assert old == []


def _renamed_functions() -> Iterator[tuple[str, Callable[..., Any], dict[str, str]]]:
    for cls in CLASSES:
        for name, fn in inspect.getmembers(cls, callable):
            renames = getattr(fn, RENAMED_ATTRIBUTE, None)
            if renames:
                yield f"{cls.__name__}.{name}", fn, renames


def _stub() -> mock.MagicMock:
    """A stand-in for a Maintenance or a hook: every attribute a mock (a MagicMock's own ``_lock`` too)."""
    stub = mock.MagicMock()
    stub._lock = mock.MagicMock()
    return stub


def _call(fn: Callable[..., Any], **kwargs: Any) -> None:
    """Call ``fn`` on a stand-in: the arguments must bind (a ``TypeError`` is raised), but what the body
    then does with the stand-in's mocks is not this test's business."""
    try:
        fn(_stub(), **kwargs)
    except TypeError:
        raise
    except Exception:
        pass


def test_every_function_alias_warns() -> None:
    found = list(_renamed_functions())
    assert {face for face, _, _ in found} >= {
        "Maintenance.archive",
        "Maintenance.purge_archive",
        "Maintenance.compact_rings",
        "Maintenance.rebuild_indexes",
        "MaintenanceSteps.archive",
        "MaintenanceSteps.queue_metrics",
    }
    for face, fn, renames in found:
        params = inspect.signature(fn).parameters
        required = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        for old, new in renames.items():
            rest = {n: 1 for n in required if n != new}
            assert new in params and old not in params, (face, old, new)
            assert RENAMED.get(old) == new or old == "older_than_s" or new.startswith("compact_"), (old, new)
            with pytest.warns(DeprecationWarning, match=f"{old}=.*use {new}="):
                _call(fn, **rest, **{old: 1})
            with pytest.raises(TypeError, match=f"both {old}"):
                fn(_stub(), **rest, **{old: 1, new: 1})


def test_the_old_name_reaches_the_new_argument() -> None:
    m = mock.MagicMock()
    with pytest.warns(DeprecationWarning):
        Maintenance.archive(m, older_than_s=7, pause_s=0)
    assert m._archiver.run.call_args.kwargs["older_than_s"] == 7
    with pytest.warns(DeprecationWarning):
        Maintenance.purge_archive(m, older_than_s=9)
    assert m._archiver.run.call_args.kwargs["older_than_s"] == 9
    with pytest.warns(DeprecationWarning, match="use compact_lock_timeout="):
        Maintenance.compact_rings(m, lock_timeout_s=3)
    assert m._compactor.compact.call_args.kwargs["lock_timeout_s"] == 3


def test_cli_aliases_warn(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    values = {"--no-compact": None}
    for old, new in cli.RENAMED_OPTIONS.items():
        command = "metrics" if new == "--rate-window" else "maintain"
        value = values.get(old, "7")
        given = [old] if value is None else [old, value]
        wanted = [new] if value is None else [new, value]
        with pytest.warns(DeprecationWarning, match=f"{old} is deprecated.*use {new}"):
            by_old = parser.parse_args([command, *given])
        by_new = parser.parse_args([command, *wanted])
        assert vars(by_old) == vars(by_new), old
        assert f"{old} is deprecated" in capsys.readouterr().err
    assert parser.parse_args(["maintain"]).compact_rings is True


def test_spark_operator_alias_warns() -> None:
    with pytest.warns(DeprecationWarning, match="lease_timeout= is deprecated.*use visibility_timeout="):
        op = DbQueueSparkSubmitOperator(task_id="t", queue_name="q", application="a.py", lease_timeout=60)
    assert op.visibility_timeout == 60
    assert DbQueueSparkSubmitOperator.renamed_arguments == {"lease_timeout": "visibility_timeout"}


def _queue() -> TableQueue:
    return TableQueue(mock.MagicMock(), QueueSettings(name="q", queue_id=1))


def test_queue_attribute_alias_warns() -> None:
    q = _queue()
    with pytest.warns(DeprecationWarning, match="reclaim_every_s is deprecated.*use reclaim_every"):
        assert q.reclaim_every_s == q.reclaim_every
    with pytest.warns(DeprecationWarning):
        q.reclaim_every_s = 5.0
    assert q.reclaim_every == 5.0


def test_hook_create_queue_returns_the_queue_and_its_settings_warn() -> None:
    hook = DbQueueHook("unused")
    queue = _queue()
    with mock.patch.object(DbQueueHook, "get_conn") as get_conn:
        get_conn.return_value.create_queue.return_value = queue
        got = hook.create_queue("q", install=False)
    assert got is queue and isinstance(got, TableQueue) and isinstance(got, Queue)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert got.settings.max_attempts == 5 and got.name == "q"
    with pytest.warns(DeprecationWarning, match="its result's max_attempts is deprecated"):
        assert got.max_attempts == 5  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        got.no_such_setting  # type: ignore[attr-defined]  # noqa: B018


def test_hook_drop_queue_default_moves_to_the_engines() -> None:
    hook = DbQueueHook("unused")
    with mock.patch.object(DbQueueHook, "get_conn") as get_conn:
        get_conn.return_value.drop_queue.side_effect = QueueNotFoundError("q", "s")
        with pytest.warns(DeprecationWarning, match="missing_ok defaults to False in the next release"):
            assert hook.drop_queue("q") is False
        with pytest.raises(QueueNotFoundError):
            hook.drop_queue("q", missing_ok=False)


def _dag_params() -> set[str]:
    """The params of the maintenance DAG, as its file declares them."""
    tree = ast.parse((REPO / "dags" / "dbqueue_maintenance.py").read_text())
    [params] = [
        kw.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "DAG"
        for kw in node.keywords
        if kw.arg == "params"
    ]
    assert isinstance(params, ast.Dict)
    return {k.value for k in params.keys if isinstance(k, ast.Constant)}


def test_maintenance_dag_params_are_config_fields() -> None:
    """The DAG's params (and so its Variable's keys) are MaintenanceConfig's fields: data, in ``_s``."""
    fields = {f.name for f in dataclasses.fields(MaintenanceConfig)}
    params = _dag_params() - {"conn_id", "schema"}
    assert {"archive_after_s", "archive_retention_s", "lock_wait_s"} <= params <= fields, params - fields
