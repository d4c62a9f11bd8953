"""One run of one design at one point: workers started, a timed window, a drain, and the checks."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import multiprocessing as mp
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from airflow_dbqueue.engine import DbQueue, MaintenanceConfig
from bench.backends import REFERENCES, Target, left_in_queue, setup_target, teardown_target
from bench.forkserver import forkserver_context
from bench.workers import RUN, STOP, STOP_PRODUCERS, WAIT, RunConfig, Shared, count_deliveries, worker_main


class BenchError(Exception):
    """The benchmark could not measure a point (a worker failed, a timeout, a bad argument)."""


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
    hold: dict[str, Any] | None = None
    """What a run with a held xmin horizon measured (``--hold-horizon``; :data:`HOLD_KEYS`)."""

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
    hold: bool = False,
    rate: float | None = None,
    recycle_only: bool = False,
) -> RunResult:
    """Measure one design at one point on a fresh schema (created here and dropped afterwards).

    With ``rate``, the producers together push at most that many messages a second.

    With ``maintenance``, a maintenance process runs ``DbQueue.maintain`` in a loop (every
    ``maintenance_interval`` seconds) from the start of the window until the producers stop; with
    ``recycle_only`` too, it runs only the table design's partition recycling
    (``Maintenance.recycle``) instead.

    With ``hold``, a session of its own holds the xmin horizon for the whole window (a REPEATABLE
    READ transaction with a snapshot and a transaction id, opened just before the window and rolled
    back at its end), the counters are sampled every second, and every call's latency is recorded;
    after the drain, one VACUUM of each table (a reference) or one ``maintain()`` (an engine design)
    runs, and :attr:`RunResult.hold` holds the figures of :data:`HOLD_KEYS`.
    """
    setup_target(target)
    try:
        with target.direct() as conn:
            start_bytes = table_stats(conn, target.schema)[0]
            with contextlib.suppress(psycopg.Error):
                conn.execute("CHECKPOINT")
            # consumers per consumer group
            cfg = RunConfig(
                target,
                producers,
                consumers * target.groups,
                batch,
                payload_bytes,
                backlog_cap,
                latencies or hold,
                rate=rate,
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
                hold=hold,
                recycle_only=recycle_only,
            )
            if result.hold is not None:
                result.hold.update(_after_release(target, conn))
            return dataclasses.replace(result, table_bytes_start=start_bytes)
    finally:
        teardown_target(target)


def _maintainer(
    target: Target,
    config: MaintenanceConfig,
    interval: float,
    stop: Any,
    out: Any,
    *,
    ready: Any,
    recycle_only: bool,
) -> None:
    """Entry point of the maintenance process: ``maintain()`` every ``interval`` seconds until ``stop``,
    ``ready`` set once it is connected (the measured window starts after it).
    A reference queue has no maintenance of its own: for one, the process runs VACUUM (ANALYZE) of each
    of its tables instead, the step of ``maintain()`` that keeps a queue's table and indexes small."""
    report: dict[str, Any] = {"runs": 0, "archived": 0, "reindexed": 0, "failed_reindexes": 0, "busy_s": 0.0}
    if recycle_only:
        report.update(
            {
                "emptied": 0,
                "moved": 0,
                "lock_not_granted": 0,
                "longest_emptying_s": 0.0,
                "longest_lock_s": 0.0,
            }
        )

    def recycle(dbq: DbQueue) -> None:
        r = dbq.maintenance().recycle(
            recycle_move_limit=config.recycle_move_limit,
            recycle_min_bytes=config.recycle_min_bytes,
            recycle_lock_timeout=config.recycle_lock_timeout_s,
        )
        report["emptied"] += len(r.get("emptied", []))
        report["moved"] += r.get("moved", 0)
        report["lock_not_granted"] += len(r.get("lock_not_granted", []))
        report["longest_emptying_s"] = max(report["longest_emptying_s"], r.get("longest_s", 0.0))
        report["longest_lock_s"] = max(report["longest_lock_s"], r.get("longest_lock_s", 0.0))

    def maintain(dbq: DbQueue) -> None:
        r = dbq.maintain(config)
        report["archived"] += r.get("archive", {}).get("rows", 0)
        actions = r.get("indexes", {}).get("actions", [])
        report["reindexed"] += sum(1 for a in actions if a["ok"])
        report["failed_reindexes"] += sum(1 for a in actions if not a["ok"])

    def vacuum(conn: psycopg.Connection[Any], tables: list[str]) -> None:
        for table in tables:
            conn.execute(f"VACUUM (ANALYZE) {table}")

    try:
        if target.design in REFERENCES:
            with target.connect(autocommit=True) as conn:
                listed = conn.execute(
                    "SELECT format('%%I.%%I', schemaname, tablename) FROM pg_tables WHERE schemaname = %s",
                    (target.schema,),
                )
                tables = [r[0] for r in listed]
                ready.value = 1
                _every(interval, stop, report, lambda: vacuum(conn, tables))
        else:
            with target.engine(2) as dbq:
                dbq.list_queues()  # connected before it says it is ready
                ready.value = 1
                _every(interval, stop, report, lambda: recycle(dbq) if recycle_only else maintain(dbq))
        out.put(report)
    except BaseException:
        out.put({"error": traceback.format_exc()})


def _every(interval: float, stop: Any, report: dict[str, Any], run: Callable[[], None]) -> None:
    """``run()`` every ``interval`` seconds until ``stop``, counting the runs and the seconds they took."""
    while not stop.value:
        t = time.monotonic()
        run()
        report["busy_s"] += time.monotonic() - t
        report["runs"] += 1
        end = time.monotonic() + interval
        while not stop.value and time.monotonic() < end:
            time.sleep(0.02)


def _context() -> mp.context.ForkServerContext:
    """The context the run's processes start in: the fork server's, which imported this module (and with
    it the engine and psycopg) once, so that a worker starts in a fork of it (about 0.7 s of CPU a worker
    less, before the window: the window starts once every worker is connected). This folder
    (``benchmarks/``, where ``bench`` is) is on its ``$PYTHONPATH``."""
    return forkserver_context([__name__], Path(__file__).resolve().parents[1])


class _Processes:
    """The processes of one run: P producers and C consumers (and a maintenance process, with
    ``maintenance``), the state they share, and the reports they hand back."""

    def __init__(
        self,
        cfg: RunConfig,
        maintenance: MaintenanceConfig | None,
        maintenance_interval: float,
        recycle_only: bool = False,
    ) -> None:
        ctx = _context()
        self.cfg = cfg
        self.m_stop, self.m_ready, self.m_out = ctx.RawValue("i", 0), ctx.RawValue("i", 0), ctx.Queue()
        self.m_proc = (
            ctx.Process(
                target=_maintainer,
                args=(cfg.target, maintenance, maintenance_interval, self.m_stop, self.m_out),
                kwargs={"ready": self.m_ready, "recycle_only": recycle_only},
                name="bench-maintenance",
                daemon=True,
            )
            if maintenance is not None
            else None
        )
        self.m_report: dict[str, Any] | None = None
        self.shm = Shared(
            phase=ctx.RawValue("i", WAIT),
            ready=ctx.Value("i", 0),
            failed=ctx.RawValue("i", 0),
            pushed=ctx.RawArray("q", cfg.producers),
            popped=ctx.RawArray("q", cfg.consumers),
            results=ctx.Queue(),
        )
        self.procs = [
            ctx.Process(
                target=worker_main, args=(role, i, cfg, self.shm), name=f"bench-{role}-{i}", daemon=True
            )
            for role, count in (("producer", cfg.producers), ("consumer", cfg.consumers))
            for i in range(count)
        ]
        self.results: dict[tuple[str, int], dict[str, Any]] = {}

    def collect(self, timeout: float) -> None:
        """Take the workers' reports that arrive within ``timeout``; raise if a worker failed."""
        try:
            while True:
                r = self.shm.results.get(timeout=timeout)
                if "error" in r:
                    raise BenchError(f"{self.cfg.target.design} {r['role']} {r['idx']} failed:\n{r['error']}")
                self.results[(r["role"], r["idx"])] = r
                timeout = 0
        except queue_mod.Empty:
            pass
        for p in self.procs:
            role, _, i = p.name.removeprefix("bench-").partition("-")
            if p.exitcode not in (None, 0) and (role, int(i)) not in self.results:
                raise BenchError(
                    f"{p.name} of the {self.cfg.target.design} run died with exit code {p.exitcode}"
                )

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise BenchError(f"{self.cfg.target.design}: timed out after {timeout:g}s waiting for {what}")
            self.collect(0.01)

    def sleep_watching(self, duration: float) -> None:
        end = time.monotonic() + duration
        while (left := end - time.monotonic()) > 0:
            if self.shm.failed.value:
                self.collect(1.0)
            time.sleep(min(0.05, left))

    def have(self, role: str, count: int) -> Callable[[], bool]:
        return lambda: all((role, i) in self.results for i in range(count))

    def start(self) -> None:
        """Start the workers and let them run once every one has connected."""
        for p in self.procs:
            p.start()
        self.wait_for(lambda: self.shm.ready.value == len(self.procs), 120, "the workers to connect")
        self.shm.phase.value = RUN

    def wait_for_maintenance(self, timeout: float) -> None:
        """Wait until the maintenance process is connected; raise with its error if it failed first."""
        assert self.m_proc is not None
        proc = self.m_proc
        connected = lambda: self.m_ready.value == 1 or not proc.is_alive()  # noqa: E731
        self.wait_for(connected, timeout, "the maintenance process to connect")
        if self.m_ready.value != 1:
            self.stop_maintenance(5.0)  # raises with the process's error
            raise BenchError(f"the maintenance process exited with code {proc.exitcode} before connecting")

    def stop_maintenance(self, drain_timeout: float) -> None:
        """Stop the maintenance process (if any) and take its report."""
        if self.m_proc is None:
            return
        self.m_stop.value = 1
        try:
            self.m_report = self.m_out.get(timeout=drain_timeout)
        except queue_mod.Empty:
            raise BenchError("the maintenance process did not report") from None
        if "error" in self.m_report:
            raise BenchError(f"the maintenance process failed:\n{self.m_report['error']}")
        self.m_proc.join(30)

    def drain(self, drain_timeout: float, log: Callable[[str], None]) -> int:
        """Once the producers stopped, let the consumers go on until everything pushed is popped, or
        nothing moves for a while; then stop them. Return how many messages were pushed."""
        cfg, shm = self.cfg, self.shm
        self.wait_for(self.have("producer", cfg.producers), 120, "the producers to stop")
        pushed_total = sum(self.results[("producer", i)]["pushed"] for i in range(cfg.producers))
        deadline = time.monotonic() + drain_timeout
        last, last_change = -1, time.monotonic()
        wanted = pushed_total * cfg.target.groups  # every group pops every message
        while (now_popped := sum(shm.popped)) < wanted and time.monotonic() < deadline:
            if now_popped != last:
                last, last_change = now_popped, time.monotonic()
            elif time.monotonic() - last_change > 5.0:
                log(f"  {cfg.target.design}: drain stalled at {now_popped} of {wanted} pops")
                break
            self.collect(0.01)
        shm.phase.value = STOP
        self.wait_for(self.have("consumer", cfg.consumers), 120, "the consumers to stop")
        for p in self.procs:
            p.join(30)
        return pushed_total

    def shut_down(self) -> None:
        """Stop every process that is still there, whatever happened."""
        self.shm.phase.value = STOP
        self.m_stop.value = 1
        if self.m_proc is not None and self.m_proc.is_alive():
            self.m_proc.join(10)
            if self.m_proc.is_alive():
                self.m_proc.terminate()
        for p in self.procs:
            if p.is_alive():
                p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)


@dataclasses.dataclass(frozen=True)
class _Window:
    """What the measured window saw: its times, WAL positions and counters at both ends."""

    t0: float
    t1: float
    lsn0: int
    lsn1: int
    popped0: int
    popped1: int
    pushed0: int
    pushed1: int


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
    hold: bool = False,
    recycle_only: bool = False,
) -> RunResult:
    """Run the workers (and maintenance) through warm-up, the measured window and the drain; return
    what the run measured and checked."""
    run = _Processes(cfg, maintenance, maintenance_interval, recycle_only)
    shm = run.shm
    held: _Hold | None = None
    try:
        run.start()
        run.sleep_watching(warmup)
        if run.m_proc is not None:
            # The loop runs beside the whole window: a spawned process takes a second or more to import
            # and connect on a loaded machine, longer than a short window, so the window waits for it.
            run.m_proc.start()
            run.wait_for_maintenance(120)
        if hold:
            held = _Hold(cfg.target, conn)
        lsn0, t0 = wal_lsn(conn), time.monotonic()
        popped0, pushed0 = sum(shm.popped), sum(shm.pushed)
        if held is not None:
            held.sample_window(run, t0, seconds, popped0)
        else:
            run.sleep_watching(seconds)
        popped1, pushed1 = sum(shm.popped), sum(shm.pushed)
        t1, lsn1 = time.monotonic(), wal_lsn(conn)
        window = _Window(t0, t1, lsn0, lsn1, popped0, popped1, pushed0, pushed1)
        if held is not None:
            held.end_of_window(conn)
        shm.phase.value = STOP_PRODUCERS
        run.stop_maintenance(drain_timeout)
        pushed_total = run.drain(drain_timeout, log)
    finally:
        if held is not None:
            held.release()
        run.shut_down()
    time.sleep(0.5)  # let the workers' backends flush their table statistics on exit
    result = _run_result(cfg, conn, run, window, pushed_total)
    if held is not None:
        result.hold = held.figures(result)
    return result


def _run_result(
    cfg: RunConfig, conn: psycopg.Connection[Any], run: _Processes, w: _Window, pushed_total: int
) -> RunResult:
    """What a finished run measured (the window) and checked (every worker's report)."""
    cons = [run.results[("consumer", i)] for i in range(cfg.consumers)]
    prods = [run.results[("producer", i)] for i in range(cfg.producers)]
    groups = cfg.target.groups  # each group must get every message once
    counts = [count_deliveries([p["pushed"] for p in prods], cons[k::groups]) for k in range(groups)]
    lost, dups, corrupt = (sum(c[i] for c in counts) for i in range(3))
    window = w.t1 - w.t0
    msgs = (w.popped1 - w.popped0) / groups  # a cycle: a message pushed and popped in every group
    size, dead, hot = table_stats(conn, cfg.target.schema)
    lat: dict[str, list[float]] = {}
    if cfg.latencies:
        for op, reports in (("push", prods), ("pop", cons), ("empty_pop", cons), ("ack", cons)):
            lat[op] = [d for r in reports for start, d in (r[f"{op}_lat"] or []) if w.t0 <= start <= w.t1]
    return RunResult(
        design=cfg.target.design,
        seconds=round(window, 3),
        cycles_per_s=msgs / window,
        pushed_per_s=(w.pushed1 - w.pushed0) / window,
        pushed=pushed_total,
        popped=sum(c["popped"] for c in cons),
        lost=lost,
        duplicated=dups,
        corrupt=corrupt,
        ack_failures=sum(c["ack_failures"] for c in cons),
        left_in_queue=left_in_queue(cfg.target, conn),
        backlog_at_end=w.pushed1 - w.popped1,
        table_bytes=size,
        dead_tuples=dead,
        hot_update_ratio=hot,
        wal_bytes_per_msg=(w.lsn1 - w.lsn0) / msgs if msgs else None,
        push_ms=_mean_ms(prods, "push"),
        pop_ms=_mean_ms(cons, "pop"),
        ack_ms=_mean_ms(cons, "ack") if cfg.target.lease else None,
        empty_pops=sum(c["empty_pops"] for c in cons),
        latencies=lat,
        maintenance=run.m_report,
        hot_bytes=hot_table_bytes(conn, cfg.target) if cfg.target.design not in REFERENCES else None,
    )


class _Hold:
    """A held xmin horizon over one run's measured window, and what the window saw meanwhile.

    Opened on a session of its own to the server: ``BEGIN ISOLATION LEVEL REPEATABLE READ``, then
    ``txid_current()`` (the transaction takes an id) and a read of a catalog (the snapshot is taken and
    kept until the transaction ends). From then on no VACUUM, autovacuum or page pruning anywhere in
    the database can remove a row version that died after that snapshot. The read is of ``pg_class``
    so that the hold takes no lock on the queue's tables: it holds the horizon and nothing else.
    """

    def __init__(self, target: Target, conn: psycopg.Connection[Any]) -> None:
        self.schema = target.schema
        self.groups = target.groups
        self.bytes_before, self.dead_before, _ = table_stats(conn, self.schema)
        self.archive_before = archive_bytes(conn, self.schema)
        self.archive_in_hold = 0
        self.conn: psycopg.Connection[Any] | None = psycopg.connect(
            target.server_dsn or target.dsn, application_name="dbqueue-bench-hold"
        )
        self.conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        row = self.conn.execute("SELECT txid_current(), pg_backend_pid()").fetchone()
        assert row is not None
        self.xid, self.pid = int(row[0]), int(row[1])
        self.conn.execute("SELECT count(*) FROM pg_catalog.pg_class").fetchone()
        self.samples: list[tuple[float, float, int]] = []
        """(planned offset into the window, time.monotonic(), messages popped) at each sample."""
        self.bytes_in_hold = self.dead_in_hold = 0
        self.xmin_age: int | None = None
        self.still_open = False

    def sample_window(self, run: _Processes, t0: float, seconds: float, popped0: int) -> None:
        """Sleep through the window, sampling the consumers' counters every second and at the edges
        of its first and last :func:`edge_seconds`."""
        edge = edge_seconds(seconds)
        offsets = sorted({float(k) for k in range(1, int(seconds) + 1)} | {edge, seconds - edge, seconds})
        self.samples = [(0.0, t0, popped0)]
        for offset in offsets:
            if offset <= 0 or offset > seconds:
                continue
            run.sleep_watching(t0 + offset - time.monotonic())
            self.samples.append((offset, time.monotonic(), sum(run.shm.popped)))

    def end_of_window(self, conn: psycopg.Connection[Any]) -> None:
        """Read the tables' size and dead tuples, and that the hold still held, as the window ends."""
        self.bytes_in_hold, self.dead_in_hold, _ = table_stats(conn, self.schema)
        self.archive_in_hold = archive_bytes(conn, self.schema)
        row = conn.execute(
            "SELECT age(backend_xmin), state FROM pg_stat_activity WHERE pid = %s", (self.pid,)
        ).fetchone()
        if row is not None:
            self.xmin_age = None if row[0] is None else int(row[0])
            self.still_open = row[1] == "idle in transaction"
        self.release()

    def release(self) -> None:
        """End the held transaction (idempotent)."""
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.rollback()
            self.conn.close()
            self.conn = None

    def rate(self, start: float, end: float) -> float | None:
        """Cycles per second between the samples planned at offsets ``start`` and ``end``."""
        at = {offset: (t, popped) for offset, t, popped in self.samples}
        if start not in at or end not in at or at[end][0] <= at[start][0]:
            return None
        (ta, pa), (tb, pb) = at[start], at[end]
        return (pb - pa) / self.groups / (tb - ta)

    def figures(self, result: RunResult) -> dict[str, Any]:
        """The hold's figures of one finished run (JSON-safe); see :data:`HOLD_KEYS`."""
        seconds = self.samples[-1][0] if self.samples else 0.0
        edge = edge_seconds(seconds)
        whole = [o for o, _, _ in self.samples if o == int(o)]
        each = [self.rate(a, b) for a, b in itertools.pairwise(whole)]
        return {
            "edge_s": edge,
            "cycles_per_s_first": _round(self.rate(0.0, edge)),
            "cycles_per_s_last": _round(self.rate(seconds - edge, seconds)),
            "cycles_per_s_each_s": [_round(r) for r in each],
            "bytes_before_hold": self.bytes_before,
            "bytes_in_hold": self.bytes_in_hold,
            "archive_bytes_before_hold": self.archive_before,
            "archive_bytes_in_hold": self.archive_in_hold,
            "dead_tuples_before_hold": self.dead_before,
            "dead_tuples_in_hold": self.dead_in_hold,
            "hold_xid": self.xid,
            "hold_xmin_age": self.xmin_age,
            "hold_held": self.still_open,
            "pop_max_ms": _max_ms(result.latencies.get("pop", []) + result.latencies.get("empty_pop", [])),
            "push_max_ms": _max_ms(result.latencies.get("push", [])),
        }


def edge_seconds(seconds: float) -> float:
    """The length of the first and of the last stretch of a held window whose cycles/s are reported:
    10 s, or half the window when it is shorter than 20 s (the two stretches do not overlap)."""
    return min(10.0, seconds / 2)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _max_ms(values: list[float]) -> float | None:
    return round(1000 * max(values), 3) if values else None


def _after_release(target: Target, conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """After the hold and the drain: one VACUUM (ANALYZE) of each of a reference's tables, or one run
    of an engine design's own maintenance (every finished message archivable, VACUUM, online rebuilds
    of bloated indexes, compaction of an outgrown ring); then the tables' size and dead tuples."""
    t = time.monotonic()
    if target.design in REFERENCES:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT format('%%I.%%I', schemaname, tablename) FROM pg_tables WHERE schemaname = %s",
                (target.schema,),
            )
        ]
        for table in tables:
            conn.execute(f"VACUUM (ANALYZE) {table}")
    else:
        with target.engine(1) as dbq:
            dbq.maintain(MaintenanceConfig(archive_after_s=0.0))
    took = time.monotonic() - t
    size, dead, _ = table_stats(conn, target.schema)
    return {
        "bytes_after_release": size,
        "archive_bytes_after_release": archive_bytes(conn, target.schema),
        "dead_tuples_after_release": dead,
        "after_release_s": round(took, 3),
    }


HOLD_KEYS = (
    "cycles_per_s_first",
    "cycles_per_s_last",
    "cycles_per_s_each_s",
    "bytes_before_hold",
    "bytes_in_hold",
    "bytes_after_release",
    "archive_bytes_before_hold",
    "archive_bytes_in_hold",
    "archive_bytes_after_release",
    "dead_tuples_before_hold",
    "dead_tuples_in_hold",
    "dead_tuples_after_release",
    "pop_max_ms",
    "push_max_ms",
    "hold_xid",
    "hold_xmin_age",
    "hold_held",
    "after_release_s",
)
"""The figures of :attr:`RunResult.hold` that run.py reports for each design, in this order:
cycles/s in the window's first and last ``edge_s`` seconds and in each of its seconds; the size of the
schema's tables with indexes and their dead tuples just before the hold, at the end of the window
(while it held) and after its release, the drain and one VACUUM or ``maintain()``, and of those sizes
the engine's ``archive`` table's (what archiving keeps by design); the longest pop and
push call that started in the window; the hold's transaction id, how many transaction ids were
assigned after its snapshot (``age(backend_xmin)`` at the end of the window), whether it was still
open then, and the seconds the VACUUM or ``maintain()`` after the release took."""


def archive_bytes(conn: psycopg.Connection[Any], schema: str) -> int:
    """Size of the engine's ``archive`` table in ``schema`` with its indexes (0 where there is none):
    what archiving keeps by design, apart from the queue's own tables in the hold's figures."""
    row = conn.execute(
        "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind = 'r' AND c.relname = 'archive'",
        (schema,),
    ).fetchone()
    return int(row[0]) if row else 0


def hot_table_bytes(conn: psycopg.Connection[Any], target: Target) -> int:
    """Size of the tables on the push/pop path (meta, data, done, or their partitions) with their
    indexes and TOAST."""
    row = conn.execute(
        "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind = 'r' "
        "AND (c.relname IN ('meta', 'data', 'done') OR c.relname ~ '^(meta|data|done)_[0-7]$')",
        (target.schema,),
    ).fetchone()
    return int(row[0]) if row else 0


def _mean_ms(reports: list[dict[str, Any]], op: str) -> float | None:
    """Mean milliseconds of one call of ``op`` over the workers' reports."""
    calls = sum(r[f"{op}_calls"] for r in reports)
    return 1000 * sum(r[f"{op}_s"] for r in reports) / calls if calls else None


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


def percentile(values: list[float], p: float) -> float | None:
    """The ``p``-th percentile (nearest rank) of ``values``; ``None`` when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]
