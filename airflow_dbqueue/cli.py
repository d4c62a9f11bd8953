"""``dbqueue``: the command line of the engine (no Airflow needed).

    dbqueue [--dsn DSN] [--schema S] init
    dbqueue create QUEUE [--payload-type json|text|bytes] [--max-attempts N] [--visibility-timeout S]
                   [--design table|ring] [--capacity N] [--lanes N] [--dedup-window S] [--ttl S]
                   [--on-expiry fail|drop] [--ordering none|per_key] [--layout slots|rows]
    dbqueue push QUEUE JSON [JSON ...] [--priority P] [--delay S] [--dedup-key K ...] [--ttl S]
                 [--key K ...]
    dbqueue pop QUEUE [-n N] [--semantics at-most-once|at-least-once] [--wait S] [--group G]
    dbqueue stats [QUEUE ...]
    dbqueue failed QUEUE [--requeue | --delete]
    dbqueue groups QUEUE
    dbqueue add-group QUEUE GROUP [--start now|earliest] [--on-lag block|drop_group] [--lag-timeout S]
    dbqueue drop-group QUEUE GROUP [--missing-ok]
    dbqueue archive [--archive-after S] [--archive-retention S] [--batch-size N] [--pause S]
                    [--time-budget S] [--queue Q ...] [--lock-wait S]
    dbqueue maintain [the archive options] [--no-vacuum] [--no-reindex] [--no-compact-rings]
                     [--reindex-bloat-ratio R] [--reindex-min-bytes B] [--reindex-fragmentation-pct P]
                     [--reindex-timeout S] [--compact-bloat-ratio R] [--compact-min-bytes B]
                     [--compact-lock-timeout S] [--horizon-min-age S] [--horizon-min-xid-age N]
                     [--horizon-min-dead-rows N] [--no-samples] [--samples-keep S]
                     [--every S [--runs N]]
    dbqueue metrics [QUEUE ...] [--rate-window S]
    dbqueue demo [--messages N]
    dbqueue pipeline [--messages N] [--batch N] [--airflow-home DIR] [--spark connect|submit]
                     [--design table|ring]

Without ``--dsn`` or ``$DBQUEUE_DSN`` the embedded PostgreSQL is started on demand. Options are named
as the engine's arguments and :class:`MaintenanceConfig`'s fields are (``--archive-after`` is
``archive_after_s``), in seconds; the old names in :data:`RENAMED_OPTIONS` still work, with a warning.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from airflow_dbqueue.cli_demo import cmd_demo, cmd_pipeline
from airflow_dbqueue.cli_demo import say as _say
from airflow_dbqueue.engine import (
    DSN_ENV,
    ConfigurationError,
    DbQueue,
    DbQueueError,
    GroupNotFoundError,
    MaintenanceConfig,
)
from airflow_dbqueue.engine.access import ACTIONS
from airflow_dbqueue.engine.dialects.base import DEFAULT_SCHEMA
from airflow_dbqueue.engine.maintenance import config as defaults
from airflow_dbqueue.engine.models import (
    DEFAULT_DEDUP_WINDOW_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_VISIBILITY_TIMEOUT_S,
    GroupInfo,
)
from airflow_dbqueue.engine.renames import warn_renamed
from airflow_dbqueue.engine.ring import (
    RING_DEFAULT_CAPACITY,
    RING_DEFAULT_LAG_TIMEOUT_S,
    RING_DEFAULT_LANES,
    RingQueue,
)
from airflow_dbqueue.engine.ring_rows import RowsRingQueue

RENAMED_OPTIONS = {
    "--older-than": "--archive-after",
    "--retention": "--archive-retention",
    "--bloat-ratio": "--reindex-bloat-ratio",
    "--min-bloat-bytes": "--reindex-min-bytes",
    "--fragmentation-pct": "--reindex-fragmentation-pct",
    "--compact-ratio": "--compact-bloat-ratio",
    "--no-compact": "--no-compact-rings",
    "--window": "--rate-window",
}
"""Options under their old names (``{old: new}``), kept for one release: each still works and warns."""


class _RenamedOption(argparse.Action):
    """An option under its old name: stores what the new one would, and warns (a
    :class:`DeprecationWarning`, and a line on stderr, where a command's user reads it)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        old = option_string or self.option_strings[0]
        new = RENAMED_OPTIONS[old]
        print(
            f"dbqueue: {old} is deprecated and will be removed in the next release; use {new}",
            file=sys.stderr,
        )
        warn_renamed("dbqueue", old, new, stacklevel=2)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def _renamed(c: argparse.ArgumentParser, old: str, dest: str, **kwargs: Any) -> None:
    """Add option ``old`` (a key of :data:`RENAMED_OPTIONS`), hidden from the help, setting ``dest``."""
    c.add_argument(old, dest=dest, action=_RenamedOption, help=argparse.SUPPRESS, **kwargs)


@contextlib.contextmanager
def _database(args: argparse.Namespace) -> Iterator[DbQueue]:
    dsn = args.dsn or os.environ.get(DSN_ENV)
    server = None
    if not dsn:
        from airflow_dbqueue.engine.embedded import EmbeddedPostgres

        server = EmbeddedPostgres()
        t0 = time.monotonic()
        dsn = server.start()
        _say(f"embedded PostgreSQL at {dsn} ({server.data_dir}), ready in {time.monotonic() - t0:.1f}s")
    dbq = DbQueue(dsn, schema=args.schema, pool_size=8)
    try:
        yield dbq
    finally:
        dbq.close()
        if server is not None and not args.keep_server:
            server.stop()


def _cmd_init(dbq: DbQueue, args: argparse.Namespace) -> int:
    _say(f"schema {dbq.schema!r} at version {dbq.install()}")
    return 0


def _cmd_create(dbq: DbQueue, args: argparse.Namespace) -> int:
    dbq.install()
    q = dbq.create_queue(
        args.queue,
        design=args.design,
        payload_type=args.payload_type,
        max_attempts=args.max_attempts,
        visibility_timeout=args.visibility_timeout,
        capacity=args.capacity,
        lanes=args.lanes,
        dedup_window=args.dedup_window,
        ttl=args.ttl,
        on_expiry=args.on_expiry,
        ordering=args.ordering,
        layout=args.layout,
    )
    _say(json.dumps({"queue": q.name, "settings": str(q.settings)}))
    return 0


def _cmd_push(dbq: DbQueue, args: argparse.Namespace) -> int:
    payloads = []
    for i, text in enumerate(args.payloads):
        try:
            payloads.append(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ConfigurationError(
                f"payload #{i} is not JSON ({exc}): {text[:80]!r}; nothing was pushed"
            ) from None
    q = dbq.queue(args.queue)
    ids = q.push_batch(
        payloads,
        priority=args.priority,
        delay=args.delay,
        dedup_keys=args.dedup_key,
        ttl=args.ttl,
        keys=args.key,
    )
    _say(json.dumps({"ids": ids}))
    return 0


def _cmd_pop(dbq: DbQueue, args: argparse.Namespace) -> int:
    q = dbq.queue(args.queue)
    for m in q.pop(args.n, semantics=args.semantics, wait=args.wait, group=args.group):
        _say(json.dumps({"id": m.id, "attempts": m.attempts, "priority": m.priority, "payload": m.payload}))
    return 0


def _cmd_stats(dbq: DbQueue, args: argparse.Namespace) -> int:
    names = args.queues or [s.name for s in dbq.list_queues()]
    for name in names:
        _say(json.dumps(dbq.queue(name).stats().as_dict()))
    return 0


def _cmd_failed(dbq: DbQueue, args: argparse.Namespace) -> int:
    q = dbq.queue(args.queue)
    if args.requeue:
        _say(json.dumps({"requeued": q.requeue_failed()}))
    elif args.delete:
        _say(json.dumps({"deleted": q.delete_failed()}))
    else:
        for f in q.list_failed(limit=1000):
            row = {"id": f.id, "attempts": f.attempts, "error": f.last_error, "payload": f.payload}
            _say(json.dumps(row))
    return 0


def _ring(dbq: DbQueue, name: str) -> RingQueue | RowsRingQueue:
    """The ring queue ``name``: :class:`QueueNotFoundError` when there is none, :class:`ConfigurationError`
    when it is of another design (consumer groups are the ring's)."""
    q = dbq.queue(name)
    if not isinstance(q, (RingQueue, RowsRingQueue)):
        raise ConfigurationError(
            f"queue {name!r} is a {q.settings.design} queue: consumer groups need the ring design "
            "(dbqueue create QUEUE --design ring)"
        )
    return q


def _group_row(q: RingQueue | RowsRingQueue, info: GroupInfo) -> dict[str, Any]:
    """One consumer group as ``dbqueue groups`` prints it: its position, what it has still to finish (in
    messages, and the age of its oldest ready one), what maintenance does when it lags, and how long
    maintenance has seen it not move."""
    extra = q.group(info.name).stats().extra
    return {
        "queue": q.name,
        "group": info.name,
        "pop_position": info.pop_position,
        "lag_messages": extra["lag_messages"],
        "lag_seconds": round(extra["lag_seconds"], 3),
        "on_lag": info.on_lag.value,
        "lag_timeout_s": info.lag_timeout_s,
        "idle_s": None if info.idle_s is None else round(info.idle_s, 3),
        "created_at": None if info.created_at is None else info.created_at.isoformat(),
    }


def _cmd_groups(dbq: DbQueue, args: argparse.Namespace) -> int:
    q = _ring(dbq, args.queue)
    for info in q.groups():
        try:
            row = _group_row(q, info)
        except GroupNotFoundError:
            continue  # dropped meanwhile
        _say(json.dumps(row))
    return 0


def _cmd_add_group(dbq: DbQueue, args: argparse.Namespace) -> int:
    q = _ring(dbq, args.queue)
    q.add_group(args.group, start=args.start, on_lag=args.on_lag, lag_timeout=args.lag_timeout)
    [info] = [g for g in q.groups() if g.name == args.group]
    _say(json.dumps(_group_row(q, info)))
    return 0


def _cmd_drop_group(dbq: DbQueue, args: argparse.Namespace) -> int:
    q = _ring(dbq, args.queue)
    dropped = q.drop_group(args.group, missing_ok=args.missing_ok)
    _say(json.dumps({"queue": q.name, "group": args.group, "dropped": dropped}))
    return 0


def _cmd_grant(dbq: DbQueue, args: argparse.Namespace) -> int:
    added = dbq.grant(args.role, args.queue, args.actions)
    _say(json.dumps({"role": args.role, "queue": args.queue, "granted": added}))
    return 0


def _cmd_revoke(dbq: DbQueue, args: argparse.Namespace) -> int:
    removed = dbq.revoke(args.role, args.queue, args.actions)
    _say(json.dumps({"role": args.role, "queue": args.queue, "revoked": removed}))
    return 0


def _cmd_grants(dbq: DbQueue, args: argparse.Namespace) -> int:
    for role, queue, action in dbq.grants():
        _say(json.dumps({"role": role, "queue": queue, "action": action}))
    return 0


def _cmd_archive(dbq: DbQueue, args: argparse.Namespace) -> int:
    m = dbq.maintenance()
    batch = {
        "batch_size": args.batch_size,
        "pause": args.pause,
        "time_budget": args.time_budget,
        "queues": args.queue or None,
        "lock_wait": args.lock_wait,
    }
    result = m.archive(archive_after=args.archive_after, **batch)
    _say(json.dumps(result.as_dict()))
    if args.archive_retention is not None and result.skipped is None:
        _say(json.dumps(m.purge_archive(archive_retention=args.archive_retention, **batch).as_dict()))
    return 0


def _cmd_maintain(dbq: DbQueue, args: argparse.Namespace) -> int:
    config = MaintenanceConfig(
        queues=tuple(args.queue) if args.queue else None,
        archive_after_s=args.archive_after,
        archive_retention_s=args.archive_retention,
        batch_size=args.batch_size,
        pause_s=args.pause,
        time_budget_s=args.time_budget,
        vacuum=args.vacuum,
        reindex=args.reindex,
        reindex_bloat_ratio=args.reindex_bloat_ratio,
        reindex_min_bytes=args.reindex_min_bytes,
        reindex_fragmentation_pct=args.reindex_fragmentation_pct,
        reindex_timeout_s=args.reindex_timeout,
        compact_rings=args.compact_rings,
        compact_bloat_ratio=args.compact_bloat_ratio,
        compact_min_bytes=args.compact_min_bytes,
        compact_lock_timeout_s=args.compact_lock_timeout,
        lock_wait_s=args.lock_wait,
        horizon_min_age_s=args.horizon_min_age,
        horizon_min_xid_age=args.horizon_min_xid_age,
        horizon_min_dead_rows=args.horizon_min_dead_rows,
        samples=args.samples,
        samples_keep_s=args.samples_keep,
    )
    if args.every is None:
        if args.runs is not None:
            raise ConfigurationError("--runs needs --every")
        return 1 if _maintain_once(dbq, config, indent=2) else 0
    if not 0 < args.every <= 86_400 or (args.runs is not None and args.runs < 1):
        raise ConfigurationError("--every must be in (0, 86400] seconds and --runs at least 1")
    # A loop for a process of its own beside busy queues: one JSON line a run; a run that did not
    # complete is reported and the next one comes as usual. SIGTERM or Ctrl-C ends it between runs, so
    # that no step (a REINDEX CONCURRENTLY) is cut off halfway; a second one ends it at once.
    stopping: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        if stopping:
            raise KeyboardInterrupt
        stopping.append(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    runs = 0
    try:
        while not stopping:
            started = time.monotonic()
            _maintain_once(dbq, config, indent=None)
            runs += 1
            if args.runs is not None and runs >= args.runs:
                break
            while not stopping and time.monotonic() < started + args.every:
                time.sleep(min(0.1, max(0.0, started + args.every - time.monotonic())))
    except KeyboardInterrupt:
        return 130  # stopped in the middle of a run
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _maintain_once(dbq: DbQueue, config: MaintenanceConfig, indent: int | None) -> bool:
    """Run every maintenance step once and print the report; True when a step did not complete."""
    report = dbq.maintain(config)
    if report["skipped"]:
        print(f"dbqueue: maintenance skipped: {report['skipped']}", file=sys.stderr)
    _say(json.dumps(report, indent=indent))
    for step in report["incomplete"]:
        print(
            f"dbqueue: maintenance did not complete: {step['action']} {step['object']}: {step['why']}",
            file=sys.stderr,
        )
    return bool(report["incomplete"])


def _cmd_metrics(dbq: DbQueue, args: argparse.Namespace) -> int:
    _say(json.dumps(dbq.maintenance().metrics(args.queues or None, rate_window=args.rate_window), indent=2))
    return 0


def _batch_options(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--archive-after",
        type=float,
        default=defaults.ARCHIVE_AFTER_S,
        help="archive finished messages older than S seconds",
    )
    _renamed(c, "--older-than", "archive_after", type=float)
    c.add_argument(
        "--archive-retention",
        type=float,
        help="delete archived messages archived more than S seconds ago (default: keep them)",
    )
    _renamed(c, "--retention", "archive_retention", type=float)
    c.add_argument("--batch-size", type=int, default=defaults.BATCH_SIZE, help="rows per batch statement")
    c.add_argument("--pause", type=float, default=defaults.PAUSE_S, help="seconds between batches")
    c.add_argument(
        "--time-budget", type=float, default=defaults.TIME_BUDGET_S, help="seconds a batched step may run"
    )
    c.add_argument("--queue", action="append", help="only this queue (repeatable; default: every queue)")
    c.add_argument("--lock-wait", type=float, default=0.0, help="seconds to wait for another maintenance run")


def _maintain_options(c: argparse.ArgumentParser) -> None:
    """The options of ``dbqueue maintain`` beyond the batch options: which steps run, and their limits."""
    c.add_argument(
        "--no-vacuum",
        dest="vacuum",
        action="store_false",
        help="skip VACUUM (UPDATE STATISTICS on SQL Server)",
    )
    c.add_argument("--no-reindex", dest="reindex", action="store_false", help="skip index rebuilds")
    _reindex_limits(c)
    c.add_argument(
        "--no-compact-rings",
        dest="compact_rings",
        action="store_false",
        help="skip rewriting ring tables that outgrew their size",
    )
    _renamed(c, "--no-compact", "compact_rings", nargs=0, const=False)
    c.add_argument(
        "--compact-bloat-ratio",
        type=float,
        default=defaults.COMPACT_BLOAT_RATIO,
        help="rewrite a ring table this many times its laid-out size",
    )
    _renamed(c, "--compact-ratio", "compact_bloat_ratio", type=float)
    c.add_argument(
        "--compact-min-bytes",
        type=int,
        default=defaults.COMPACT_MIN_BYTES,
        help="... and this many bytes above it",
    )
    c.add_argument(
        "--compact-lock-timeout",
        type=float,
        default=defaults.COMPACT_LOCK_TIMEOUT_S,
        help="seconds a rewrite waits for its exclusive lock (pushes and pops wait behind it)",
    )
    c.add_argument(
        "--horizon-min-age",
        type=float,
        default=defaults.HORIZON_MIN_AGE_S,
        help="warn of transactions open longer than S seconds, and skip online rebuilds while there are any",
    )
    c.add_argument(
        "--horizon-min-xid-age",
        type=int,
        default=defaults.HORIZON_MIN_XID_AGE,
        help="warn of replication slots holding an xmin older than N transactions",
    )
    c.add_argument(
        "--horizon-min-dead-rows",
        type=int,
        default=defaults.HORIZON_MIN_DEAD_ROWS,
        help="name a table whose VACUUM left at least N dead rows in the report's horizon section",
    )
    c.add_argument(
        "--no-samples",
        dest="samples",
        action="store_false",
        help="record no sample of each queue in the schema's samples table",
    )
    c.add_argument(
        "--samples-keep",
        type=float,
        default=defaults.SAMPLES_KEEP_S,
        help="delete samples older than S seconds (a day)",
    )


def _reindex_limits(c: argparse.ArgumentParser) -> None:
    """The options of ``dbqueue maintain`` that say which indexes are rebuilt, and how long one may take."""
    c.add_argument(
        "--reindex-bloat-ratio",
        type=float,
        default=defaults.REINDEX_BLOAT_RATIO,
        help="rebuild indexes this many times too big",
    )
    _renamed(c, "--bloat-ratio", "reindex_bloat_ratio", type=float)
    c.add_argument(
        "--reindex-min-bytes",
        type=int,
        default=defaults.REINDEX_MIN_BYTES,
        help="... and this many bytes too big",
    )
    _renamed(c, "--min-bloat-bytes", "reindex_min_bytes", type=int)
    c.add_argument(
        "--reindex-fragmentation-pct",
        type=float,
        default=defaults.REINDEX_FRAGMENTATION_PCT,
        help="SQL Server: also rebuild this fragmented (%%)",
    )
    _renamed(c, "--fragmentation-pct", "reindex_fragmentation_pct", type=float)
    c.add_argument(
        "--reindex-timeout",
        type=float,
        default=defaults.REINDEX_TIMEOUT_S,
        help="seconds one rebuild may take",
    )


def _queue_commands(sub: Any) -> None:
    """The commands of one queue's messages: ``create``, ``push``, ``pop``, ``stats`` and ``failed``."""
    c = sub.add_parser("create", help="create a queue")
    c.add_argument("queue")
    c.add_argument("--payload-type", default="json", choices=["json", "text", "bytes"])
    c.add_argument("--max-attempts", type=int, default=DEFAULT_MAX_ATTEMPTS)
    c.add_argument("--visibility-timeout", type=float, default=DEFAULT_VISIBILITY_TIMEOUT_S)
    c.add_argument("--design", default="table", choices=["table", "ring"])
    c.add_argument(
        "--capacity",
        type=int,
        help=f"a ring's slots, or pushes on the rows layout (default {RING_DEFAULT_CAPACITY})",
    )
    c.add_argument(
        "--lanes",
        type=int,
        help=f"a ring's lanes: consumers that take at once (default {RING_DEFAULT_LANES})",
    )
    c.add_argument(
        "--dedup-window",
        type=float,
        default=DEFAULT_DEDUP_WINDOW_S,
        help="seconds a push's deduplication key is remembered",
    )
    c.add_argument(
        "--ttl", type=float, help="seconds a message may wait to be popped (table design, rows layout)"
    )
    c.add_argument("--on-expiry", default="fail", choices=["fail", "drop"])
    c.add_argument("--ordering", default="none", choices=["none", "per_key"])
    c.add_argument(
        "--layout",
        choices=["slots", "rows"],
        help="a ring's storage layout (the dialect's default when left out; rows: PostgreSQL only)",
    )
    c = sub.add_parser("push", help="push JSON payloads")
    c.add_argument("queue")
    c.add_argument("payloads", nargs="+", metavar="JSON")
    c.add_argument("--priority", type=int, default=0)
    c.add_argument("--delay", type=float, default=0.0)
    c.add_argument(
        "--dedup-key",
        action="append",
        help="a deduplication key, one a payload, in order (repeat the option)",
    )
    c.add_argument("--ttl", type=float, help="the messages' time to live (a queue created with --ttl)")
    c.add_argument(
        "--key", action="append", help="an ordering key, one a payload, in order (repeat the option)"
    )
    c = sub.add_parser("pop", help="pop messages (printed as JSON lines)")
    c.add_argument("queue")
    c.add_argument("-n", type=int, default=1)
    c.add_argument("--semantics", default="at-most-once", choices=["at-most-once", "at-least-once"])
    c.add_argument("--wait", type=float, default=0.0)
    c.add_argument("--group", help="a ring's consumer group to pop for (default: its default group)")
    c = sub.add_parser("stats", help="queue depth by state")
    c.add_argument("queues", nargs="*")
    c = sub.add_parser("failed", help="list, requeue or delete failed messages")
    c.add_argument("queue")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--requeue", action="store_true")
    g.add_argument("--delete", action="store_true")


def _group_commands(sub: Any) -> None:
    """The commands of a ring's consumer groups: ``groups``, ``add-group`` and ``drop-group``."""
    c = sub.add_parser("groups", help="a ring's consumer groups: position, lag, on_lag (JSON lines)")
    c.add_argument("queue")
    c = sub.add_parser("add-group", help="add a consumer group to a ring")
    c.add_argument("queue")
    c.add_argument("group")
    c.add_argument(
        "--start",
        default="now",
        metavar="now|earliest",
        help="see what is pushed from now on (default), or also what some group has not taken yet",
    )
    c.add_argument(
        "--on-lag",
        default="block",
        metavar="block|drop_group",
        help="what maintenance does when nobody pops the group for its lag timeout "
        "(default: block, a warning)",
    )
    c.add_argument(
        "--lag-timeout",
        type=float,
        default=RING_DEFAULT_LAG_TIMEOUT_S,
        help=f"seconds (default {RING_DEFAULT_LAG_TIMEOUT_S:g})",
    )
    c = sub.add_parser("drop-group", help="drop a ring's consumer group")
    c.add_argument("queue")
    c.add_argument("group")
    c.add_argument("--missing-ok", action="store_true", help="no error when the group does not exist")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dbqueue", description="Message queues inside PostgreSQL.")
    p.add_argument("--dsn", help=f"database connection string (default: ${DSN_ENV}, else embedded)")
    p.add_argument("--schema", default=DEFAULT_SCHEMA, help="schema holding the queue tables")
    p.add_argument("--keep-server", action="store_true", help="leave the embedded server running")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("init", help="create or migrate the schema")
    _queue_commands(sub)
    _group_commands(sub)
    for name, verb in (("grant", "let a database role take actions"), ("revoke", "take actions back")):
        c = sub.add_parser(name, help=f"{verb} on a queue, or on every queue (PostgreSQL)")
        c.add_argument("role", help="a database role (CREATE ROLE first)")
        c.add_argument("--queue", help="one queue (default: every queue, present and future)")
        c.add_argument(
            "--actions",
            required=True,
            help=f"comma-separated, of {', '.join(ACTIONS)} (pop implies read; admin implies pop and read)",
        )
    sub.add_parser("grants", help="every grant (JSON lines: role, queue or null for every queue, action)")
    c = sub.add_parser("archive", help="archive finished messages in batches (and apply a retention)")
    _batch_options(c)
    c = sub.add_parser("maintain", help="run every maintenance step once (archive, VACUUM, reindex, ...)")
    _batch_options(c)
    _maintain_options(c)
    c.add_argument(
        "--every",
        type=float,
        help="run the steps again every S seconds until stopped (SIGTERM or Ctrl-C, between runs; a "
        "second one stops it at once), printing one JSON line a run",
    )
    c.add_argument("--runs", type=int, help="with --every: stop after N runs")
    c = sub.add_parser("metrics", help="queue depth, age, rates, table sizes and index bloat as JSON")
    c.add_argument("queues", nargs="*")
    c.add_argument(
        "--rate-window",
        type=float,
        default=defaults.RATE_WINDOW_S,
        help="seconds over which rates are counted",
    )
    _renamed(c, "--window", "rate_window", type=float)
    c = sub.add_parser("demo", help="an engine-only order pipeline (no Airflow, no Spark)")
    c.add_argument("--messages", type=int, default=20_000)
    c = sub.add_parser("pipeline", help="the Spark pipeline DAG end to end (the README's main job)")
    c.add_argument("--messages", type=int, default=20_000)
    c.add_argument("--batch", type=int, default=5_000, help="most messages per Spark batch")
    c.add_argument("--airflow-home", help="Airflow home to use (default: next to the embedded data)")
    c.add_argument(
        "--spark",
        default="connect",
        choices=["connect", "submit"],
        help="run the batches on a local Spark Connect server started once (default), or with one "
        "spark-submit each",
    )
    c.add_argument(
        "--design",
        default="table",
        choices=["table", "ring"],
        help="the orders queue's design: the table design (default), or a ring holding every order",
    )
    return p


COMMANDS = {
    "init": _cmd_init,
    "create": _cmd_create,
    "push": _cmd_push,
    "pop": _cmd_pop,
    "stats": _cmd_stats,
    "failed": _cmd_failed,
    "groups": _cmd_groups,
    "add-group": _cmd_add_group,
    "drop-group": _cmd_drop_group,
    "grant": _cmd_grant,
    "revoke": _cmd_revoke,
    "grants": _cmd_grants,
    "archive": _cmd_archive,
    "maintain": _cmd_maintain,
    "metrics": _cmd_metrics,
    "demo": cmd_demo,
    "pipeline": cmd_pipeline,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dbqueue`` command."""
    args = build_parser().parse_args(argv)
    try:
        with _database(args) as dbq:
            return COMMANDS[args.command](dbq, args)
    except DbQueueError as exc:
        print(f"dbqueue: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
