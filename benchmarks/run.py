#!/usr/bin/env python
"""Benchmark: full push-then-pop cycles per second of a queue design, against the naive baseline.

    python benchmarks/run.py --design {table,ring,naive} --producers P --consumers C --batch N \
        --seconds S [--json] [--semantics {at-most-once,at-least-once}] [--payload-bytes 300]

    python benchmarks/run.py --maintenance [--producers P --consumers C --batch N --seconds S]

With none of --producers/--consumers/--batch it sweeps P x C in 1x1, 2x2, 4x4, 8x8 and batch in
1, 100, 1000. Every point measures the chosen design and, in the same run, the naive baseline (one
table, INSERT to push, DELETE ... FOR UPDATE SKIP LOCKED ... RETURNING to pop) at the same P x C x
batch, each on a fresh schema that is dropped afterwards. Producers and consumers are separate
processes with a connection each. Every run checks that no message was lost or delivered twice.
With ``--maintenance`` it measures the engine design at one point twice in the same run, without and with
a maintenance process looping (archiving, VACUUM, online index rebuilds), and prints push/pop/ack latency
percentiles (p50/p95/p99) of both with their ratios. See benchmarks/README.md for what the columns mean.

The database is ``--dsn``, else ``$DBQUEUE_TEST_DSN``, else a throwaway embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import statistics
import struct
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import psycopg
from payloads import Fillers  # benchmarks/ is a folder of scripts
from psycopg import sql

from airflow_dbqueue.engine import DbQueue, DbQueueError, LeaseExpiredError, MaintenanceConfig

TEST_DSN_ENV = "DBQUEUE_TEST_DSN"
BASELINE = "naive"
# A second reference: PGMQ's SQL (read = a visibility-time UPDATE, then delete or archive), measured
# like the baseline with plain psycopg, for the at-least-once comparison (--pgmq).
PGMQ = "pgmq"
REFERENCES = (BASELINE, PGMQ)
# Designs the engine implements, measured through DbQueue.
ENGINE_DESIGNS: tuple[str, ...] = ("table", "ring")
ALL_DESIGNS = ("table", "ring", BASELINE, PGMQ)
SEMANTICS = ("at-most-once", "at-least-once")
QUEUE_NAME = "bench_q"

SWEEP_PAIRS = ((1, 1), (2, 2), (4, 4), (8, 8))
SWEEP_BATCHES = (1, 100, 1000)

# A payload starts with (producer index, sequence number); the rest is a filler from a pool of random
# ones (payloads.py): payloads differ in every byte position, as real ones do.
HEADER = struct.Struct(">IQ")

# Run phases, in a shared integer that the parent advances.
WAIT, RUN, STOP_PRODUCERS, STOP = 0, 1, 2, 3


class BenchError(Exception):
    """The benchmark could not measure a point (a worker failed, a timeout, a bad argument)."""


class DesignNotAvailable(BenchError):
    """The requested design is not implemented yet."""


def check_design(design: str) -> None:
    """Raise :class:`DesignNotAvailable` unless ``design`` can be measured."""
    if design in REFERENCES or design in ENGINE_DESIGNS:
        return
    raise DesignNotAvailable(
        f"the {design} design is not available yet: the engine implements only the "
        f"{' and '.join(ENGINE_DESIGNS)} design so far; run with --design table (or --design naive)"
    )


# -- what the workers connect to ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """One design's queue on one fresh schema; picklable, handed to every worker."""

    design: str
    dsn: str
    schema: str
    semantics: str
    archive: bool
    notify: str
    capacity: int | None = None
    """Slots of a ring (ring design only)."""
    payload_bytes: int = 300
    groups: int = 1
    """Consumer groups of a ring (``--groups``): each message is popped once in each, and consumer
    ``i`` pops for group ``i % groups`` (group 0 the ring's default one)."""

    def group_of(self, consumer: int) -> str | None:
        """The consumer group consumer ``consumer`` pops for (None: the default group)."""
        k = consumer % self.groups
        return f"g{k}" if k else None

    @property
    def lease(self) -> bool:
        return self.semantics == "at-least-once"


def setup_target(target: Target) -> None:
    """Create the target's schema and queue."""
    if target.design == BASELINE:
        with psycopg.connect(target.dsn, autocommit=True) as conn:
            s = sql.Identifier(target.schema)
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
            conn.execute(
                sql.SQL("CREATE TABLE {}.t (id bigserial PRIMARY KEY, payload bytea NOT NULL)").format(s)
            )
        return
    if target.design == PGMQ:
        with psycopg.connect(target.dsn, autocommit=True) as conn:
            for stmt in PGMQ_SCHEMA:
                conn.execute(sql.SQL(stmt).format(s=sql.Identifier(target.schema)))
        return
    with DbQueue(target.dsn, schema=target.schema, pool_size=1) as dbq:
        dbq.install()
        if target.design == "ring":  # pages laid out for the payload size; a ring does not archive
            dbq.create_queue(
                QUEUE_NAME,
                design="ring",
                payload_type="bytes",
                notify=target.notify,
                capacity=target.capacity,
                max_payload_bytes=target.payload_bytes,
            )
            for k in range(1, target.groups):
                dbq.queue(QUEUE_NAME).add_group(f"g{k}")  # type: ignore[attr-defined]
            return
        dbq.create_queue(
            QUEUE_NAME,
            design=target.design,
            payload_type="bytes",
            notify=target.notify,
            archive=target.archive,
        )


def left_in_queue(target: Target, conn: psycopg.Connection[Any]) -> int:
    """Messages still in the queue (ready, delayed, leased or failed)."""
    if target.design in REFERENCES:
        table = "t" if target.design == BASELINE else "q"
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(target.schema, table))
        ).fetchone()
        return int(row[0]) if row else 0
    with DbQueue(target.dsn, schema=target.schema, pool_size=1) as dbq:
        left = 0
        for k in range(target.groups):
            st = dbq.queue(QUEUE_NAME).group(target.group_of(k)).stats()
            left += st.ready + st.delayed + st.in_flight + st.failed
        return left


def teardown_target(target: Target) -> None:
    """Drop the target's schema with everything in it."""
    if target.design in REFERENCES:
        with psycopg.connect(target.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(target.schema)))
        return
    with DbQueue(target.dsn, schema=target.schema, pool_size=1) as dbq:
        dbq.uninstall()


class Backend(Protocol):
    """What a worker does to one design's queue."""

    def push(self, payloads: list[bytes]) -> None: ...

    def pop(self, n: int) -> tuple[list[bytes], Any]:
        """Pop up to n messages; return their payloads and a token for :meth:`ack`."""
        ...

    def ack(self, token: Any) -> None:
        """Finish what pop returned (a no-op for at-most-once)."""
        ...

    def close(self) -> None: ...


class EngineBackend:
    """A queue of an engine design, through the public API."""

    def __init__(self, target: Target, consumer: int = 0) -> None:
        self.dbq = DbQueue(target.dsn, schema=target.schema, pool_size=1)
        self.queue = self.dbq.queue(QUEUE_NAME).group(target.group_of(consumer))
        self.semantics = target.semantics
        self.lease = target.lease

    def push(self, payloads: list[bytes]) -> None:
        self.queue.push_batch(payloads)

    def pop(self, n: int) -> tuple[list[bytes], Any]:
        msgs = self.queue.pop(n, semantics=self.semantics)
        return [m.payload for m in msgs], msgs

    def ack(self, token: Any) -> None:
        if self.lease and token:
            self.queue.ack(token)

    def close(self) -> None:
        self.dbq.close()


def naive_statements(schema: str) -> tuple[sql.Composed, sql.Composed]:
    """The naive baseline's push (payloads as a binary ``bytea[]``, ``%b``) and pop (a batch size), on
    the table ``schema.t (id bigserial primary key, payload bytea)``. Used by cost.py too."""
    t = sql.Identifier(schema, "t")
    push = sql.SQL("INSERT INTO {t} (payload) SELECT unnest(%b::bytea[])").format(t=t)
    pop = sql.SQL(
        "DELETE FROM {t} WHERE id = ANY (ARRAY("
        "SELECT id FROM {t} ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)) RETURNING id, payload"
    ).format(t=t)
    return push, pop


class NaiveBackend:
    """The naive baseline (as in hasql-queue): one table, INSERT to push, DELETE to pop.

    At-most-once pops are autocommit DELETE ... RETURNING. At-least-once pops run the same DELETE in
    a transaction that commits after the consumer has recorded the messages: the commit is the ack,
    the row locks are the lease, and a consumer dying before commit gives the messages back.
    """

    def __init__(self, target: Target, role: str) -> None:
        self.lease = target.lease and role == "consumer"
        # The claim is an array of locked ids taken once (an InitPlan), then index probes. The former
        # DELETE ... WHERE id IN (SELECT ... LIMIT %s FOR UPDATE SKIP LOCKED) was planned as a hash semi
        # join over a sequential scan of the whole table on every pop (EXPLAIN of its prepared, generic
        # plan at 80,000 rows), and once ran one DELETE for over 9 minutes at batch 1000 (a backlog of
        # 81,000 rows and 20,000 dead; why that long was not found).
        # Payload arrays go in binary (%b) and rows come back in binary, as the engine's hot queries do:
        # with a text array (%s) a naive producer spent 7.8 us of client CPU a message hex-quoting
        # payloads (split measurement at batch 1000), and the baseline made 85,624 cycles/s at 2x2
        # batch 1000 against 156,622 in binary, in runs minutes apart. The comparison is of queue designs,
        # not of wire formats.
        self.conn = psycopg.connect(target.dsn, autocommit=not self.lease, application_name="dbqueue-bench")
        self.push_sql, self.pop_sql = naive_statements(target.schema)

    def push(self, payloads: list[bytes]) -> None:
        self.conn.execute(self.push_sql, (payloads,))

    def pop(self, n: int) -> tuple[list[bytes], Any]:
        rows = self.conn.execute(self.pop_sql, (n,), binary=True).fetchall()
        if not rows and self.lease:
            self.conn.rollback()
        return [r[1] for r in rows], None

    def ack(self, token: Any) -> None:
        if self.lease:
            self.conn.commit()

    def close(self) -> None:
        self.conn.close()


PGMQ_SCHEMA = (
    # As pgmq.create() lays out a queue (pgmq 1.x): q_<name> and a_<name>, msg_id from an identity,
    # an index on vt. The message column is bytea here (pgmq's is jsonb), the same bytes as the others.
    "CREATE SCHEMA {s}",
    "CREATE TABLE {s}.q (msg_id bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY, "
    "read_ct integer NOT NULL DEFAULT 0, enqueued_at timestamptz NOT NULL DEFAULT now(), "
    "vt timestamptz NOT NULL, message bytea)",
    "CREATE INDEX q_vt_idx ON {s}.q (vt ASC)",
    "CREATE TABLE {s}.a (msg_id bigint PRIMARY KEY, read_ct integer NOT NULL DEFAULT 0, "
    "enqueued_at timestamptz NOT NULL DEFAULT now(), archived_at timestamptz NOT NULL DEFAULT now(), "
    "vt timestamptz NOT NULL, message bytea)",
    "CREATE INDEX a_archived_at_idx ON {s}.a (archived_at)",
)


class PgmqBackend:
    """PGMQ's statements (pgmq 1.x ``send_batch``, ``read``, ``delete``/``archive``, ``pop``).

    At-least-once: ``read`` sets the visibility time of up to n visible messages (SKIP LOCKED), then the
    consumer deletes them by id, or archives them (one DELETE ... RETURNING feeding an INSERT) when the
    run archives. At-most-once: ``pop``, a DELETE ... RETURNING of visible messages. Every statement is
    autocommit, as pgmq's client runs them.
    """

    VT_S = 30

    def __init__(self, target: Target) -> None:
        self.lease = target.lease
        self.conn = psycopg.connect(target.dsn, autocommit=True, application_name="dbqueue-bench")
        q, a = sql.Identifier(target.schema, "q"), sql.Identifier(target.schema, "a")
        self.push_sql = sql.SQL(
            "INSERT INTO {q} (vt, message) SELECT clock_timestamp(), unnest(%b::bytea[]) RETURNING msg_id"
        ).format(q=q)
        self.read_sql = sql.SQL(
            "WITH cte AS (SELECT msg_id FROM {q} WHERE vt <= clock_timestamp() ORDER BY msg_id ASC "
            "LIMIT %s FOR UPDATE SKIP LOCKED) "
            "UPDATE {q} m SET vt = clock_timestamp() + make_interval(secs => %s), read_ct = read_ct + 1 "
            "FROM cte WHERE m.msg_id = cte.msg_id "
            "RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.vt, m.message"
        ).format(q=q)
        self.pop_sql = sql.SQL(
            "WITH cte AS (SELECT msg_id FROM {q} WHERE vt <= clock_timestamp() ORDER BY msg_id ASC "
            "LIMIT %s FOR UPDATE SKIP LOCKED) "
            "DELETE FROM {q} WHERE msg_id = ANY (SELECT msg_id FROM cte) "
            "RETURNING msg_id, read_ct, enqueued_at, vt, message"
        ).format(q=q)
        if target.archive:
            self.ack_sql = sql.SQL(
                "WITH archived AS (DELETE FROM {q} WHERE msg_id = ANY (%b) "
                "RETURNING msg_id, vt, read_ct, enqueued_at, message) "
                "INSERT INTO {a} (msg_id, vt, read_ct, enqueued_at, message) "
                "SELECT msg_id, vt, read_ct, enqueued_at, message FROM archived RETURNING msg_id"
            ).format(q=q, a=a)
        else:
            self.ack_sql = sql.SQL("DELETE FROM {q} WHERE msg_id = ANY (%b) RETURNING msg_id").format(q=q)

    def push(self, payloads: list[bytes]) -> None:
        self.conn.execute(self.push_sql, (payloads,), binary=True).fetchall()

    def pop(self, n: int) -> tuple[list[bytes], Any]:
        if not self.lease:
            rows = self.conn.execute(self.pop_sql, (n,), binary=True).fetchall()
            return [r[4] for r in rows], None
        rows = self.conn.execute(self.read_sql, (n, self.VT_S), binary=True).fetchall()
        return [r[4] for r in rows], [r[0] for r in rows]

    def ack(self, token: Any) -> None:
        if self.lease and token:
            done = self.conn.execute(self.ack_sql, (token,), binary=True).fetchall()
            if len(done) != len(token):
                raise LeaseExpiredError(f"pgmq: {len(token) - len(done)} of {len(token)} messages were gone")

    def close(self) -> None:
        self.conn.close()


def open_backend(target: Target, role: str, idx: int = 0) -> Backend:
    if target.design == BASELINE:
        return NaiveBackend(target, role)
    if target.design == PGMQ:
        return PgmqBackend(target)
    return EngineBackend(target, idx if role == "consumer" else 0)


# -- workers ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunConfig:
    target: Target
    producers: int
    consumers: int
    batch: int
    payload_bytes: int
    backlog_cap: int
    latencies: bool = False
    """Record (start, seconds) of every call, for latency percentiles."""


@dataclasses.dataclass
class Shared:
    """State shared by the parent and the workers (each counter slot has one writer)."""

    phase: Any  # RawValue('i')
    ready: Any  # Value('i'), with its lock
    failed: Any  # RawValue('i')
    pushed: Any  # RawArray('q', producers): messages each producer has pushed
    popped: Any  # RawArray('q', consumers): messages each consumer has popped (and acked)
    results: Any  # Queue of the workers' final reports


def _produce(backend: Backend, idx: int, cfg: RunConfig, shm: Shared) -> dict[str, Any]:
    pick = Fillers(cfg.payload_bytes, HEADER.size).pick
    pack = HEADER.pack
    n, cap, groups = cfg.batch, cfg.backlog_cap, cfg.target.groups
    pushed, popped, phase = shm.pushed, shm.popped, shm.phase
    seq = 0
    throttled = calls = 0
    busy = 0.0
    clock = time.perf_counter
    lat: list[tuple[float, float]] | None = [] if cfg.latencies else None
    while phase.value == RUN:
        if sum(pushed) * groups - sum(popped) > cap * groups:  # the groups' mean backlog
            throttled += 1
            time.sleep(0.0005)
            continue
        payloads = [pack(idx, s) + pick(idx, s) for s in range(seq, seq + n)]
        t = clock()
        backend.push(payloads)
        took = clock() - t
        busy += took
        if lat is not None:
            lat.append((time.monotonic() - took, took))
        calls += 1
        seq += n
        pushed[idx] = seq
    return {
        "role": "producer",
        "idx": idx,
        "pushed": seq,
        "throttled": throttled,
        "push_calls": calls,
        "push_s": busy,
        "push_lat": lat,
    }


class Received:
    """What one consumer received: per producer, a bitmap of the sequence numbers seen; and how many
    payloads came again to this consumer, or were no producer's (wrong size, producer or filler)."""

    def __init__(self, producers: int, payload_bytes: int) -> None:
        self.pick = Fillers(payload_bytes, HEADER.size).pick
        self.bitmaps = [bytearray(1024) for _ in range(producers)]
        self.size = payload_bytes
        self.dups = self.corrupt = 0

    def add(self, payloads: list[bytes]) -> None:
        size, hs, unpack = self.size, HEADER.size, HEADER.unpack_from
        pick, bitmaps, n_producers = self.pick, self.bitmaps, len(self.bitmaps)
        for data in payloads:
            if len(data) != size:
                self.corrupt += 1
                continue
            p, s = unpack(data)
            if p >= n_producers or data[hs:] != pick(p, s):
                self.corrupt += 1
                continue
            bm = bitmaps[p]
            byte, bit = s >> 3, 1 << (s & 7)
            if byte >= len(bm):
                bm.extend(bytes(max(byte + 1, 2 * len(bm)) - len(bm)))
            if bm[byte] & bit:
                self.dups += 1
            else:
                bm[byte] |= bit


def count_deliveries(pushed: list[int], consumers: list[dict[str, Any]]) -> tuple[int, int, int]:
    """Return ``(lost, duplicated, corrupt)`` of a run: ``pushed[p]`` messages of each producer ``p``
    (sequence numbers 0 .. pushed[p]-1) against the consumers' reports (:class:`Received`'s bitmaps,
    ``local_dups`` and ``corrupt``). A number nobody received is lost; one received by several
    consumers, or twice by one, is duplicated; a number past what its producer pushed is corrupt."""
    lost = dups = corrupt = 0
    for pi, n in enumerate(pushed):
        union, delivered = 0, 0
        for c in consumers:
            bm = int.from_bytes(c["bitmaps"][pi], "little")
            delivered += bm.bit_count()
            union |= bm
        dups += delivered - union.bit_count()
        lost += n - (union & ((1 << n) - 1)).bit_count()
        corrupt += (union >> n).bit_count()
    dups += sum(c["local_dups"] for c in consumers)
    corrupt += sum(c["corrupt"] for c in consumers)
    return lost, dups, corrupt


def _consume(backend: Backend, idx: int, cfg: RunConfig, shm: Shared) -> dict[str, Any]:
    got = Received(cfg.producers, cfg.payload_bytes)
    ack_failures = empty = 0
    count = pop_calls = ack_calls = 0
    pop_s = ack_s = 0.0
    clock = time.perf_counter
    popped, phase = shm.popped, shm.phase
    pop_lat: list[tuple[float, float]] | None = [] if cfg.latencies else None
    ack_lat: list[tuple[float, float]] | None = [] if cfg.latencies else None
    while phase.value != STOP:
        t = clock()
        payloads, token = backend.pop(cfg.batch)
        took = clock() - t
        pop_s += took
        pop_calls += 1
        if pop_lat is not None and payloads:  # an empty pop measures nothing
            pop_lat.append((time.monotonic() - took, took))
        if not payloads:
            empty += 1
            time.sleep(0.001)
            continue
        got.add(payloads)
        t = clock()
        try:
            backend.ack(token)
        except LeaseExpiredError:
            ack_failures += 1
            continue
        finally:
            took = clock() - t
            ack_s += took
            ack_calls += 1
            if ack_lat is not None and cfg.target.lease:
                ack_lat.append((time.monotonic() - took, took))
        count += len(payloads)
        popped[idx] = count
    return {
        "role": "consumer",
        "idx": idx,
        "popped": count,
        "bitmaps": [bytes(b) for b in got.bitmaps],
        "local_dups": got.dups,
        "corrupt": got.corrupt,
        "ack_failures": ack_failures,
        "empty_pops": empty,
        "pop_calls": pop_calls,
        "pop_s": pop_s,
        "ack_calls": ack_calls,
        "ack_s": ack_s,
        "pop_lat": pop_lat,
        "ack_lat": ack_lat,
    }


def _worker(role: str, idx: int, cfg: RunConfig, shm: Shared) -> None:
    """Entry point of a producer or consumer process."""
    try:
        backend = open_backend(cfg.target, role, idx)
        try:
            with shm.ready.get_lock():
                shm.ready.value += 1
            while shm.phase.value == WAIT:
                time.sleep(0.002)
            if role == "producer":
                result = _produce(backend, idx, cfg, shm)
            else:
                result = _consume(backend, idx, cfg, shm)
        finally:
            backend.close()
        shm.results.put(result)
    except BaseException:
        shm.failed.value = 1
        shm.results.put({"role": role, "idx": idx, "error": traceback.format_exc()})


# -- one run of one design -------------------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    design: str
    seconds: float
    cycles_per_s: float
    pushed_per_s: float
    pushed: int
    popped: int
    lost: int
    duplicated: int
    corrupt: int
    ack_failures: int
    left_in_queue: int
    backlog_at_end: int
    table_bytes: int
    dead_tuples: int
    hot_update_ratio: float | None
    wal_bytes_per_msg: float | None
    push_ms: float | None
    pop_ms: float | None
    ack_ms: float | None
    empty_pops: int
    latencies: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Seconds of each push, pop (that returned messages) and ack in the window (``--maintenance``)."""
    maintenance: dict[str, Any] | None = None
    """What the maintenance process did during the run (``--maintenance``)."""
    hot_bytes: int | None = None
    """Size of meta, data and done with indexes after the drain (engine designs)."""
    table_bytes_start: int = 0
    """Size of the schema's tables with indexes when the run started (a ring's slots are preallocated)."""

    @property
    def valid(self) -> bool:
        """Nothing lost, duplicated or corrupted, every ack accepted and the queue drained."""
        return (self.lost, self.duplicated, self.corrupt, self.ack_failures, self.left_in_queue) == (0,) * 5


def parse_lsn(lsn: str) -> int:
    hi, lo = lsn.split("/")
    return (int(hi, 16) << 32) + int(lo, 16)


def wal_lsn(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return parse_lsn(row[0])


def table_stats(conn: psycopg.Connection[Any], schema: str) -> tuple[int, int, float | None]:
    """(total bytes of the schema's tables with indexes and TOAST, dead tuples, HOT update ratio)."""
    row = conn.execute(
        "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'r'",
        (schema,),
    ).fetchone()
    size = int(row[0]) if row else 0
    row = conn.execute(
        "SELECT coalesce(sum(n_dead_tup), 0), coalesce(sum(n_tup_upd), 0), coalesce(sum(n_tup_hot_upd), 0) "
        "FROM pg_stat_user_tables WHERE schemaname = %s",
        (schema,),
    ).fetchone()
    dead, upd, hot = (int(x) for x in row) if row else (0, 0, 0)
    return size, dead, (hot / upd if upd else None)


def run_design(
    target: Target,
    *,
    producers: int,
    consumers: int,
    batch: int,
    payload_bytes: int,
    seconds: float,
    warmup: float,
    backlog_cap: int,
    drain_timeout: float,
    log: Callable[[str], None],
    latencies: bool = False,
    maintenance: MaintenanceConfig | None = None,
    maintenance_interval: float = 1.0,
) -> RunResult:
    """Measure one design at one point on a fresh schema (created here and dropped afterwards).

    With ``maintenance``, a maintenance process runs ``DbQueue.maintain`` in a loop (every
    ``maintenance_interval`` seconds) from the start of the window until the producers stop.
    """
    setup_target(target)
    try:
        with psycopg.connect(target.dsn, autocommit=True) as conn:
            start_bytes = table_stats(conn, target.schema)[0]
            with contextlib.suppress(psycopg.Error):
                conn.execute("CHECKPOINT")
            # consumers per consumer group
            cfg = RunConfig(
                target, producers, consumers * target.groups, batch, payload_bytes, backlog_cap, latencies
            )
            result = _measure(
                cfg,
                conn,
                seconds=seconds,
                warmup=warmup,
                drain_timeout=drain_timeout,
                log=log,
                maintenance=maintenance,
                maintenance_interval=maintenance_interval,
            )
            return dataclasses.replace(result, table_bytes_start=start_bytes)
    finally:
        teardown_target(target)


def _maintainer(target: Target, config: MaintenanceConfig, interval: float, stop: Any, out: Any) -> None:
    """Entry point of the maintenance process: ``maintain()`` every ``interval`` seconds until ``stop``."""
    report: dict[str, Any] = {"runs": 0, "archived": 0, "reindexed": 0, "failed_reindexes": 0, "busy_s": 0.0}
    try:
        with DbQueue(target.dsn, schema=target.schema, pool_size=2) as dbq:
            while not stop.value:
                t = time.monotonic()
                r = dbq.maintain(config)
                report["busy_s"] += time.monotonic() - t
                report["runs"] += 1
                report["archived"] += r.get("archive", {}).get("rows", 0)
                actions = r.get("indexes", {}).get("actions", [])
                report["reindexed"] += sum(1 for a in actions if a["ok"])
                report["failed_reindexes"] += sum(1 for a in actions if not a["ok"])
                end = time.monotonic() + interval
                while not stop.value and time.monotonic() < end:
                    time.sleep(0.02)
        out.put(report)
    except BaseException:
        out.put({"error": traceback.format_exc()})


def _measure(
    cfg: RunConfig,
    conn: psycopg.Connection[Any],
    *,
    seconds: float,
    warmup: float,
    drain_timeout: float,
    log: Callable[[str], None],
    maintenance: MaintenanceConfig | None = None,
    maintenance_interval: float = 1.0,
) -> RunResult:
    ctx = mp.get_context("spawn")
    m_stop, m_out = ctx.RawValue("i", 0), ctx.Queue()
    m_proc = (
        ctx.Process(
            target=_maintainer,
            args=(cfg.target, maintenance, maintenance_interval, m_stop, m_out),
            name="bench-maintenance",
            daemon=True,
        )
        if maintenance is not None
        else None
    )
    m_report: dict[str, Any] | None = None
    shm = Shared(
        phase=ctx.RawValue("i", WAIT),
        ready=ctx.Value("i", 0),
        failed=ctx.RawValue("i", 0),
        pushed=ctx.RawArray("q", cfg.producers),
        popped=ctx.RawArray("q", cfg.consumers),
        results=ctx.Queue(),
    )
    procs = [
        ctx.Process(target=_worker, args=(role, i, cfg, shm), name=f"bench-{role}-{i}", daemon=True)
        for role, count in (("producer", cfg.producers), ("consumer", cfg.consumers))
        for i in range(count)
    ]
    results: dict[tuple[str, int], dict[str, Any]] = {}

    def collect(timeout: float) -> None:
        """Take the workers' reports that arrive within ``timeout``; raise if a worker failed."""
        try:
            while True:
                r = shm.results.get(timeout=timeout)
                if "error" in r:
                    raise BenchError(f"{cfg.target.design} {r['role']} {r['idx']} failed:\n{r['error']}")
                results[(r["role"], r["idx"])] = r
                timeout = 0
        except queue_mod.Empty:
            pass
        for p in procs:
            role, _, i = p.name.removeprefix("bench-").partition("-")
            if p.exitcode not in (None, 0) and (role, int(i)) not in results:
                raise BenchError(f"{p.name} of the {cfg.target.design} run died with exit code {p.exitcode}")

    def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise BenchError(f"{cfg.target.design}: timed out after {timeout:g}s waiting for {what}")
            collect(0.01)

    def sleep_watching(duration: float) -> None:
        end = time.monotonic() + duration
        while (left := end - time.monotonic()) > 0:
            if shm.failed.value:
                collect(1.0)
            time.sleep(min(0.05, left))

    def have(role: str, count: int) -> Callable[[], bool]:
        return lambda: all((role, i) in results for i in range(count))

    try:
        for p in procs:
            p.start()
        wait_for(lambda: shm.ready.value == len(procs), 120, "the workers to connect")
        shm.phase.value = RUN
        sleep_watching(warmup)
        if m_proc is not None:
            m_proc.start()
        lsn0, t0 = wal_lsn(conn), time.monotonic()
        popped0, pushed0 = sum(shm.popped), sum(shm.pushed)
        sleep_watching(seconds)
        popped1, pushed1 = sum(shm.popped), sum(shm.pushed)
        t1, lsn1 = time.monotonic(), wal_lsn(conn)
        backlog = pushed1 - popped1
        shm.phase.value = STOP_PRODUCERS
        if m_proc is not None:
            m_stop.value = 1
            try:
                m_report = m_out.get(timeout=drain_timeout)
            except queue_mod.Empty:
                raise BenchError("the maintenance process did not report") from None
            if "error" in m_report:
                raise BenchError(f"the maintenance process failed:\n{m_report['error']}")
            m_proc.join(30)
        wait_for(have("producer", cfg.producers), 120, "the producers to stop")
        pushed_total = sum(results[("producer", i)]["pushed"] for i in range(cfg.producers))
        # Drain: consumers go on until everything pushed is popped, or nothing moves for a while.
        deadline = time.monotonic() + drain_timeout
        last, last_change = -1, time.monotonic()
        while (
            now_popped := sum(shm.popped)
        ) < pushed_total * cfg.target.groups and time.monotonic() < deadline:
            if now_popped != last:
                last, last_change = now_popped, time.monotonic()
            elif time.monotonic() - last_change > 5.0:
                log(f"  {cfg.target.design}: drain stalled at {now_popped} of {pushed_total} messages")
                break
            collect(0.01)
        shm.phase.value = STOP
        wait_for(have("consumer", cfg.consumers), 120, "the consumers to stop")
        for p in procs:
            p.join(30)
    finally:
        shm.phase.value = STOP
        m_stop.value = 1
        if m_proc is not None and m_proc.is_alive():
            m_proc.join(10)
            if m_proc.is_alive():
                m_proc.terminate()
        for p in procs:
            if p.is_alive():
                p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
    time.sleep(0.5)  # let the workers' backends flush their table statistics on exit

    cons = [results[("consumer", i)] for i in range(cfg.consumers)]
    prods = [results[("producer", i)] for i in range(cfg.producers)]
    groups = cfg.target.groups  # each group must get every message once
    counts = [count_deliveries([p["pushed"] for p in prods], cons[k::groups]) for k in range(groups)]
    lost, dups, corrupt = (sum(c[i] for c in counts) for i in range(3))
    window = t1 - t0
    msgs = (popped1 - popped0) / groups  # a cycle: a message pushed and popped in every group
    size, dead, hot = table_stats(conn, cfg.target.schema)
    lat: dict[str, list[float]] = {}
    if cfg.latencies:
        for op, reports in (("push", prods), ("pop", cons), ("ack", cons)):
            lat[op] = [d for r in reports for start, d in (r[f"{op}_lat"] or []) if t0 <= start <= t1]
    return RunResult(
        design=cfg.target.design,
        seconds=round(window, 3),
        cycles_per_s=msgs / window,
        pushed_per_s=(pushed1 - pushed0) / window,
        pushed=pushed_total,
        popped=sum(c["popped"] for c in cons),
        lost=lost,
        duplicated=dups,
        corrupt=corrupt,
        ack_failures=sum(c["ack_failures"] for c in cons),
        left_in_queue=left_in_queue(cfg.target, conn),
        backlog_at_end=backlog,
        table_bytes=size,
        dead_tuples=dead,
        hot_update_ratio=hot,
        wal_bytes_per_msg=(lsn1 - lsn0) / msgs if msgs else None,
        push_ms=_mean_ms(prods, "push"),
        pop_ms=_mean_ms(cons, "pop"),
        ack_ms=_mean_ms(cons, "ack") if cfg.target.lease else None,
        empty_pops=sum(c["empty_pops"] for c in cons),
        latencies=lat,
        maintenance=m_report,
        hot_bytes=hot_table_bytes(conn, cfg.target) if cfg.target.design not in REFERENCES else None,
    )


def hot_table_bytes(conn: psycopg.Connection[Any], target: Target) -> int:
    """Size of the tables on the push/pop path (meta, data, done) with their indexes and TOAST."""
    row = conn.execute(
        "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind = 'r' AND c.relname IN ('meta', 'data', 'done')",
        (target.schema,),
    ).fetchone()
    return int(row[0]) if row else 0


def _mean_ms(reports: list[dict[str, Any]], op: str) -> float | None:
    """Mean milliseconds of one call of ``op`` over the workers' reports."""
    calls = sum(r[f"{op}_calls"] for r in reports)
    return 1000 * sum(r[f"{op}_s"] for r in reports) / calls if calls else None


# -- points, output, main --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    producers: int
    consumers: int
    batch: int


def plan(producers: int | None, consumers: int | None, batch: int | None) -> list[Point]:
    """The points to measure: every dimension not given on the command line is swept."""
    if producers is None and consumers is None:
        pairs: list[tuple[int, int]] = list(SWEEP_PAIRS)
    else:
        p = producers or consumers
        c = consumers or producers
        assert p is not None and c is not None
        pairs = [(p, c)]
    batches = list(SWEEP_BATCHES) if batch is None else [batch]
    return [Point(p, c, b) for p, c in pairs for b in batches]


def _logger(args: argparse.Namespace) -> Callable[[str], None]:
    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    return log


def backlog_cap(args: argparse.Namespace, point: Point) -> int:
    """Messages queued at most before producers pause (``--backlog-cap``, else from the point)."""
    return int(args.backlog_cap or max(1000, 50 * point.batch * point.consumers))


def ring_capacity(args: argparse.Namespace, point: Point, cap: int) -> int:
    """``--capacity``, else a ring big enough for the backlog and every batch in flight: the bench
    measures flow, not a full ring pushing back (--capacity makes it smaller to measure that)."""
    return int(args.capacity or cap + (point.producers + point.consumers * args.groups + 2) * point.batch)


def make_target(args: argparse.Namespace, dsn: str, design: str, point: Point, cap: int) -> Target:
    """A fresh schema's queue of ``design`` for one run at ``point``."""
    capacity = ring_capacity(args, point, cap)
    return Target(
        design=design,
        dsn=dsn,
        schema=f"bench_{design}_{uuid.uuid4().hex[:10]}",
        semantics=args.semantics,
        archive=args.archive,
        notify=args.notify,
        capacity=capacity if design == "ring" else None,
        payload_bytes=args.payload_bytes,
        groups=args.groups if design == "ring" else 1,
    )


def measure_point(args: argparse.Namespace, dsn: str, point: Point, seconds: float) -> dict[str, Any]:
    """Measure the design and the naive baseline at one point; return the point's report."""

    log = _logger(args)
    cap = backlog_cap(args, point)
    designs = [args.design] if args.design == BASELINE else [args.design, BASELINE]
    if args.pgmq and args.design not in REFERENCES:
        designs.append(PGMQ)
    runs: dict[str, list[RunResult]] = {d: [] for d in designs}
    for attempt in range(args.repeat):
        for design in designs:
            target = make_target(args, dsn, design, point, cap)
            which = f" (run {attempt + 1} of {args.repeat})" if args.repeat > 1 else ""
            log(
                f"measuring {design} {args.semantics} {point.producers}x{point.consumers} "
                f"batch {point.batch} for {seconds:g}s{which}"
            )
            run = run_design(
                target,
                producers=point.producers,
                consumers=point.consumers,
                batch=point.batch,
                payload_bytes=args.payload_bytes,
                seconds=seconds,
                warmup=args.warmup,
                backlog_cap=cap,
                drain_timeout=args.drain_timeout,
                log=log,
            )
            runs[design].append(run)
            log(
                f"  {design}: {run.cycles_per_s:,.0f} cycles/s, lost {run.lost}, "
                f"duplicated {run.duplicated}, corrupt {run.corrupt}"
            )
    main_run, base = combine(runs[args.design]), combine(runs[BASELINE])
    out: dict[str, Any] = {
        "design": args.design,
        "semantics": args.semantics,
        "producers": point.producers,
        "consumers": point.consumers,
        "batch": point.batch,
        "payload_bytes": args.payload_bytes,
        "seconds": main_run.seconds,
        "cycles_per_s": round(main_run.cycles_per_s, 1),
        "baseline_cycles_per_s": round(base.cycles_per_s, 1),
        "ratio": round(main_run.cycles_per_s / base.cycles_per_s, 3) if base.cycles_per_s else None,
        "lost": main_run.lost,
        "duplicated": main_run.duplicated,
        "table_bytes": main_run.table_bytes,
        "table_bytes_start": main_run.table_bytes_start,
        "dead_tuples": main_run.dead_tuples,
        "hot_update_ratio": _round(main_run.hot_update_ratio, 3),
        "wal_bytes_per_msg": _round(main_run.wal_bytes_per_msg, 1),
        "pushed_per_s": round(main_run.pushed_per_s, 1),
        "pushed": main_run.pushed,
        "popped": main_run.popped,
        "corrupt": main_run.corrupt,
        "ack_failures": main_run.ack_failures,
        "left_in_queue": main_run.left_in_queue,
        "backlog_at_end": main_run.backlog_at_end,
        "push_ms": _round(main_run.push_ms, 3),
        "pop_ms": _round(main_run.pop_ms, 3),
        "ack_ms": _round(main_run.ack_ms, 3),
        "empty_pops": main_run.empty_pops,
        "backlog_cap": cap,
        "warmup_s": args.warmup,
        "archive": args.archive if args.design == "table" else None,
        "capacity": ring_capacity(args, point, cap) if args.design == "ring" else None,
        "groups": args.groups if args.design == "ring" else None,
        "notify": args.notify if args.design not in REFERENCES else None,
    }
    if PGMQ in designs and args.design != PGMQ:
        pgmq = combine(runs[PGMQ])
        out["pgmq_cycles_per_s"] = round(pgmq.cycles_per_s, 1)
        out["pgmq_ratio"] = round(main_run.cycles_per_s / pgmq.cycles_per_s, 3) if pgmq.cycles_per_s else None
        out["pgmq_lost"], out["pgmq_duplicated"] = pgmq.lost, pgmq.duplicated
        out["pgmq_wal_bytes_per_msg"] = _round(pgmq.wal_bytes_per_msg, 1)
        if args.repeat > 1:
            out["pgmq_cycles_per_s_runs"] = [round(r.cycles_per_s, 1) for r in runs[PGMQ]]
    for key in (
        "lost",
        "duplicated",
        "corrupt",
        "table_bytes",
        "dead_tuples",
        "wal_bytes_per_msg",
        "left_in_queue",
        "push_ms",
        "pop_ms",
        "ack_ms",
    ):
        out[f"baseline_{key}"] = _round(getattr(base, key), 3)
    if args.repeat > 1:
        out["cycles_per_s_runs"] = [round(r.cycles_per_s, 1) for r in runs[args.design]]
        out["baseline_cycles_per_s_runs"] = [round(r.cycles_per_s, 1) for r in runs[BASELINE]]
    out["valid"] = all(combine(rs).valid for rs in runs.values())
    return out


def percentile(values: list[float], p: float) -> float | None:
    """The ``p``-th percentile (nearest rank) of ``values``; ``None`` when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


PERCENTILES = (50, 95, 99)
LATENCY_OPS = ("push", "pop", "ack")


def maintenance_config(args: argparse.Namespace) -> MaintenanceConfig:
    """What the maintenance process runs in a loop: archive everything finished, VACUUM, rebuild bloated
    indexes (from 256 KiB of bloat, so rebuilds happen within a short window)."""
    return MaintenanceConfig(
        archive_after_s=args.archive_after,
        archive_retention_s=None,
        batch_size=1000,
        pause_s=0.05,
        time_budget_s=max(1.0, args.maintenance_interval),
        vacuum=True,
        reindex=True,
        reindex_bloat_ratio=2.0,
        reindex_min_bytes=256 * 1024,
        reindex_timeout_s=60.0,
    )


def measure_maintenance_point(
    args: argparse.Namespace, dsn: str, point: Point, seconds: float
) -> dict[str, Any]:
    """Measure the engine design at one point without and with maintenance running, in turn."""

    log = _logger(args)
    cap = backlog_cap(args, point)
    config = maintenance_config(args)
    runs: dict[str, list[RunResult]] = {"off": [], "on": []}
    for attempt in range(args.repeat):
        for mode in ("off", "on"):
            target = make_target(args, dsn, args.design, point, cap)
            which = f" (run {attempt + 1} of {args.repeat})" if args.repeat > 1 else ""
            log(
                f"measuring {args.design} {args.semantics} {point.producers}x{point.consumers} "
                f"batch {point.batch} for {seconds:g}s, maintenance {mode}{which}"
            )
            run = run_design(
                target,
                producers=point.producers,
                consumers=point.consumers,
                batch=point.batch,
                payload_bytes=args.payload_bytes,
                seconds=seconds,
                warmup=args.warmup,
                backlog_cap=cap,
                drain_timeout=args.drain_timeout,
                log=log,
                latencies=True,
                maintenance=config if mode == "on" else None,
                maintenance_interval=args.maintenance_interval,
            )
            runs[mode].append(run)
            log(f"  {mode}: {run.cycles_per_s:,.0f} cycles/s, lost {run.lost}, duplicated {run.duplicated}")
    out: dict[str, Any] = {
        "mode": "maintenance",
        "design": args.design,
        "semantics": args.semantics,
        "producers": point.producers,
        "consumers": point.consumers,
        "batch": point.batch,
        "payload_bytes": args.payload_bytes,
        "seconds": seconds,
        "runs_per_mode": args.repeat,
        "maintenance_interval_s": args.maintenance_interval,
        "maintenance_config": dataclasses.asdict(config),
    }
    for mode, rs in runs.items():
        out[f"cycles_per_s_{mode}"] = round(statistics.median(r.cycles_per_s for r in rs), 1)
        out[f"hot_bytes_{mode}"] = max(r.hot_bytes or 0 for r in rs)
        out[f"table_bytes_{mode}"] = max(r.table_bytes for r in rs)
        for op in LATENCY_OPS:
            values = [v for r in rs for v in r.latencies.get(op, [])]
            out[f"{op}_calls_{mode}"] = len(values)
            for pct in PERCENTILES:
                v = percentile(values, pct)
                out[f"{op}_p{pct}_ms_{mode}"] = None if v is None else round(1000 * v, 3)
    for op in LATENCY_OPS:
        for pct in PERCENTILES:
            off, on = out[f"{op}_p{pct}_ms_off"], out[f"{op}_p{pct}_ms_on"]
            out[f"{op}_p{pct}_ratio"] = round(on / off, 3) if off and on is not None else None
    off_cps = out["cycles_per_s_off"]
    out["cycles_ratio"] = round(out["cycles_per_s_on"] / off_cps, 3) if off_cps else None
    totals: dict[str, Any] = {}
    for r in runs["on"]:
        for k, v in (r.maintenance or {}).items():
            totals[k] = totals.get(k, 0) + v
    out["maintenance"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in totals.items()}
    all_runs = runs["off"] + runs["on"]
    out["lost"] = sum(r.lost for r in all_runs)
    out["duplicated"] = sum(r.duplicated for r in all_runs)
    out["valid"] = all(r.valid for r in all_runs)
    return out


def maintenance_table(r: dict[str, Any]) -> str:
    """The latency comparison of :func:`measure_maintenance_point` as a text table."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    head = ["op", "calls off/on"]
    for pct in PERCENTILES:
        head += [f"p{pct} off", f"p{pct} on", "ratio"]
    rows = [head]
    for op in LATENCY_OPS:
        if not r[f"{op}_calls_off"] and not r[f"{op}_calls_on"]:
            continue
        row = [f"{op} ms", f"{r[f'{op}_calls_off']}/{r[f'{op}_calls_on']}"]
        for pct in PERCENTILES:
            row += [ms(r[f"{op}_p{pct}_ms_off"]), ms(r[f"{op}_p{pct}_ms_on"]), ratio(r[f"{op}_p{pct}_ratio"])]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]
    m = r["maintenance"]
    lines.append(
        f"cycles/s: off {r['cycles_per_s_off']:,.0f}, on {r['cycles_per_s_on']:,.0f} "
        f"(ratio {ratio(r['cycles_ratio'])})"
    )
    lines.append(
        f"hot tables (meta, data, done) after the drain: off {r['hot_bytes_off'] / 1e6:.1f} MB, "
        f"on {r['hot_bytes_on'] / 1e6:.1f} MB; all tables: off {r['table_bytes_off'] / 1e6:.1f} MB, "
        f"on {r['table_bytes_on'] / 1e6:.1f} MB"
    )
    lines.append(
        f"maintenance: {m.get('runs', 0)} runs, {m.get('archived', 0):,} messages archived, "
        f"{m.get('reindexed', 0)} indexes rebuilt online ({m.get('failed_reindexes', 0)} failed), "
        f"busy {m.get('busy_s', 0):.1f}s | lost {r['lost']}, duplicated {r['duplicated']}, "
        f"{'ok' if r['valid'] else 'INVALID'}"
    )
    return "\n".join(lines)


def combine(runs: list[RunResult]) -> RunResult:
    """The run with the median cycles/s, with the correctness counts of all runs added up."""
    ordered = sorted(runs, key=lambda r: r.cycles_per_s)
    return dataclasses.replace(
        ordered[(len(ordered) - 1) // 2],
        lost=sum(r.lost for r in runs),
        duplicated=sum(r.duplicated for r in runs),
        corrupt=sum(r.corrupt for r in runs),
        ack_failures=sum(r.ack_failures for r in runs),
        left_in_queue=sum(r.left_in_queue for r in runs),
    )


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits) if isinstance(x, float) else x


COLUMNS: tuple[tuple[str, int, Callable[[dict[str, Any]], str]], ...] = (
    ("design", 6, lambda r: r["design"]),
    ("P", 2, lambda r: str(r["producers"])),
    ("C", 2, lambda r: str(r["consumers"])),
    ("batch", 5, lambda r: str(r["batch"])),
    ("cycles/s", 9, lambda r: f"{r['cycles_per_s']:,.0f}"),
    ("naive/s", 9, lambda r: f"{r['baseline_cycles_per_s']:,.0f}"),
    ("ratio", 6, lambda r: "-" if r["ratio"] is None else f"{r['ratio']:.2f}"),
    ("pgmq/s", 9, lambda r: _fmt_opt(r.get("pgmq_cycles_per_s"))),
    ("vs pgmq", 7, lambda r: "-" if r.get("pgmq_ratio") is None else f"{r['pgmq_ratio']:.2f}"),
    ("lost", 4, lambda r: str(r["lost"] + r["baseline_lost"] + r.get("pgmq_lost", 0))),
    ("dup", 4, lambda r: str(r["duplicated"] + r["baseline_duplicated"] + r.get("pgmq_duplicated", 0))),
    ("table MB", 11, lambda r: f"{r['table_bytes_start'] / 1e6:.0f}>{r['table_bytes'] / 1e6:.0f}"),
    ("naive MB", 8, lambda r: f"{(r['baseline_table_bytes'] or 0) / 1e6:.0f}"),
    ("dead tup", 8, lambda r: str(r["dead_tuples"])),
    ("HOT", 4, lambda r: "-" if r["hot_update_ratio"] is None else f"{r['hot_update_ratio']:.0%}"),
    ("WAL B/msg", 9, lambda r: _fmt_opt(r["wal_bytes_per_msg"])),
    ("naive WAL", 9, lambda r: _fmt_opt(r["baseline_wal_bytes_per_msg"])),
    ("ok", 7, lambda r: "ok" if r["valid"] else "INVALID"),
)


def _fmt_opt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def table_header() -> str:
    return "  ".join(name.rjust(w) if i else name.ljust(w) for i, (name, w, _) in enumerate(COLUMNS))


def table_row(r: dict[str, Any]) -> str:
    return "  ".join(f(r).rjust(w) if i else f(r).ljust(w) for i, (_, w, f) in enumerate(COLUMNS))


@contextlib.contextmanager
def database(dsn: str | None) -> Iterator[tuple[str, str]]:
    """Yield ``(dsn, where)``: the given server, or a throwaway embedded one stopped on exit."""
    dsn = dsn or os.environ.get(TEST_DSN_ENV)
    if dsn:
        yield dsn, "given"
        return
    from airflow_dbqueue.engine.embedded import EmbeddedPostgres

    tmp = Path(tempfile.mkdtemp(prefix="dbqueue-bench-pg-"))
    server = EmbeddedPostgres(tmp / "data")
    try:
        yield server.start(), "embedded, throwaway"
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def server_info(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        names = ("server_version", "shared_buffers", "synchronous_commit", "fsync", "max_wal_size")
        return {n: str(conn.execute(f"SHOW {n}").fetchone()[0]) for n in names}  # type: ignore[index]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Full push-then-pop cycles/s of a queue design against the naive baseline.",
        epilog="Without --producers/--consumers/--batch: sweeps P x C in 1x1..8x8, batch in 1, 100, 1000.",
    )
    ap.add_argument("--design", choices=ALL_DESIGNS, default="table")
    ap.add_argument("--producers", type=int, help="producer processes (default: swept)")
    ap.add_argument("--consumers", type=int, help="consumer processes (default: swept)")
    ap.add_argument("--batch", type=int, help="messages per push and per pop (default: swept)")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per run (default 10)")
    ap.add_argument("--sweep-seconds", type=float, help="window per run in a sweep (default: --seconds)")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up before the window")
    ap.add_argument("--semantics", choices=SEMANTICS, default="at-most-once")
    ap.add_argument("--payload-bytes", type=int, default=300)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per design and point, alternating with the baseline; reports the median (default 1)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object per point")
    ap.add_argument("--dsn", help=f"database (default ${TEST_DSN_ENV}, else a throwaway embedded server)")
    ap.add_argument(
        "--archive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="engine queue keeps finished messages for the archiver (engine default: on)",
    )
    ap.add_argument("--notify", choices=("never", "auto", "always"), default="never")
    ap.add_argument(
        "--pgmq",
        action="store_true",
        help="also measure PGMQ's statements (read with a visibility time, then delete; archive with "
        "--archive) in the same run, as a second reference",
    )
    ap.add_argument("--capacity", type=int, help="ring slots (default: backlog cap + batches in flight)")
    ap.add_argument(
        "--groups",
        type=int,
        default=1,
        help="consumer groups of the ring, each with --consumers consumers; a cycle is a message pushed "
        "and popped in every group (default 1)",
    )
    ap.add_argument("--backlog-cap", type=int, help="pause producers above this backlog (50 x batch x C)")
    ap.add_argument("--drain-timeout", type=float, default=120.0)
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument(
        "--maintenance",
        action="store_true",
        help="latency percentiles without and with maintenance running (one point; default 2x2, batch 100)",
    )
    ap.add_argument(
        "--maintenance-interval", type=float, default=1.0, help="seconds between maintenance runs"
    )
    ap.add_argument(
        "--archive-after",
        type=float,
        default=0.0,
        help="maintenance archives messages finished this long ago",
    )
    args = ap.parse_args(argv)
    for name in ("producers", "consumers"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name} must be >= 1")
    if args.batch is not None and not 1 <= args.batch <= 100_000:
        ap.error("--batch must be in 1..100000")
    if args.seconds <= 0 or (args.sweep_seconds is not None and args.sweep_seconds <= 0) or args.warmup < 0:
        ap.error("--seconds and --sweep-seconds must be > 0, --warmup >= 0")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.groups < 1 or (args.groups > 1 and args.design != "ring"):
        ap.error("--groups must be >= 1, and above 1 only with --design ring")
    if args.payload_bytes < HEADER.size:
        ap.error(f"--payload-bytes must be >= {HEADER.size} (the (producer, seq) header)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_design(args.design)
    except DesignNotAvailable as exc:
        print(f"run.py: {exc}", file=sys.stderr)
        return 2
    if args.maintenance:
        if args.design not in ENGINE_DESIGNS:
            print(
                f"run.py: --maintenance measures an engine design ({', '.join(ENGINE_DESIGNS)})",
                file=sys.stderr,
            )
            return 2
        return main_maintenance(args)
    points = plan(args.producers, args.consumers, args.batch)
    sweep = None in (args.producers, args.consumers, args.batch)
    seconds = args.sweep_seconds if sweep and args.sweep_seconds else args.seconds
    cores = os.cpu_count() or 0
    all_valid = True
    try:
        with database(args.dsn) as (dsn, where):
            info = server_info(dsn)
            if not args.json:
                print(
                    f"PostgreSQL {info['server_version']} ({where}; shared_buffers={info['shared_buffers']}, "
                    f"synchronous_commit={info['synchronous_commit']}, fsync={info['fsync']}) | "
                    f"machine: {cores} cores, load average {os.getloadavg()[0]:.1f}"
                )
                print(
                    f"design {args.design} vs naive | {args.semantics} | payload {args.payload_bytes} B | "
                    f"{seconds:g} s per run after {args.warmup:g} s warm-up"
                    + (f", median of {args.repeat}" if args.repeat > 1 else "")
                    + (
                        f" | archive={'on' if args.archive else 'off'} notify={args.notify}"
                        if args.design == "table"
                        else f" | notify={args.notify}"
                        if args.design == "ring"
                        else ""
                    )
                )
                print(table_header(), flush=True)
            for point in points:
                row = measure_point(args, dsn, point, seconds)
                row["pg_version"] = info["server_version"]
                row["cores"] = cores
                row["load_avg_1m"] = round(os.getloadavg()[0], 2)
                all_valid &= row["valid"]
                print(json.dumps(row) if args.json else table_row(row), flush=True)
    except (BenchError, DbQueueError, psycopg.Error) as exc:
        print(f"run.py: {exc}", file=sys.stderr)
        return 1
    if not all_valid:
        print("run.py: INVALID run: messages were lost, duplicated or corrupted", file=sys.stderr)
        return 1
    return 0


def main_maintenance(args: argparse.Namespace) -> int:
    """``--maintenance``: one point, without and with maintenance running, latency percentiles."""
    p = args.producers or args.consumers or 2
    point = Point(p, args.consumers or p, args.batch or 100)
    cores = os.cpu_count() or 0
    try:
        with database(args.dsn) as (dsn, where):
            info = server_info(dsn)
            row = measure_maintenance_point(args, dsn, point, args.seconds)
            row["pg_version"] = info["server_version"]
            row["cores"] = cores
            row["load_avg_1m"] = round(os.getloadavg()[0], 2)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"PostgreSQL {info['server_version']} ({where}; synchronous_commit="
                    f"{info['synchronous_commit']}, fsync={info['fsync']}) | machine: {cores} cores, "
                    f"load average {row['load_avg_1m']:.1f}"
                )
                print(
                    f"design {args.design} | {args.semantics} | {point.producers}x{point.consumers} batch "
                    f"{point.batch} | payload {args.payload_bytes} B | {args.seconds:g} s per run, "
                    f"maintenance off then on, {args.repeat} run(s) each | maintenance every "
                    f"{args.maintenance_interval:g}s: archive after {args.archive_after:g}s, VACUUM, reindex"
                )
                print(maintenance_table(row), flush=True)
    except (BenchError, DbQueueError, psycopg.Error) as exc:
        print(f"run.py: {exc}", file=sys.stderr)
        return 1
    if not row["valid"]:
        print("run.py: INVALID run: messages were lost, duplicated or corrupted", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
