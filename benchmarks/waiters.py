#!/usr/bin/env python
"""Waiters: many consumers blocked in ``pop(1, wait=30)`` on one queue, one push every 20 ms.

    python benchmarks/waiters.py                       # 1, 50 and 500 waiters, threads and processes
    python benchmarks/waiters.py --waiters 50 --mode threads --seconds 20 --repeat 3 --json

Each point runs W waiters for ``--seconds`` while the main process pushes one message every
``--interval`` seconds (on a schedule, 300-byte payloads that vary per message, ``payloads.py``), all
on the engine's defaults (``DbQueue`` with its pool of 10, ``notify="auto"``, the pop's poll of 1 s).
``--mode threads`` runs the W waiters as threads of one process (one ``DbQueue``); ``--mode
processes`` spreads them over ``min(W, --max-processes)`` processes of their own (one ``DbQueue``
each, W / processes threads each). ``--design`` names the queue: ``table`` (the default), ``ring`` (a ring
of the slots layout) or ``ring-rows`` (a ring of the rows layout, PostgreSQL's default ring), each
with its defaults otherwise (a ring's capacity of 16,384).

What a point reports:

- ``errors``: exceptions the waiters' pops raised, by type (a pop that raises is counted and called
  again);
- latency from a push's return (its commit) to the return of the pop that took the message: p50, p99,
  max, and ``late``, how many took longer than half the poll interval (a message found only by a
  waiter's poll);
- CPU per delivered message, in ms: the waiter processes' (their user and system time over the
  window) and the server's (every process of the server, which the benchmark started; absent with
  ``--dsn``), and ``cpu_vs_one``: the total against the run of one waiter in the same mode and run;
- ``wakes_per_msg``: how often a waiter was woken by a notification, per message delivered.

Nothing is lost: every message is counted and checksummed (blake2b of each payload, added up), and at
the end one stop message per waiter ends the waiters (which also checks that a push of W messages,
one NOTIFY, reaches every waiter). A run is invalid (exit 1) when a message is lost or duplicated, or
a checksum differs. The reference is the run of one waiter, which is the least a delivery costs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from payloads import fillers, make  # benchmarks/ is a folder of scripts

from airflow_dbqueue.engine import DbQueue

QUEUE = "waiters_q"
HEADER = struct.Struct(">qQ")  # (number, 0), then a random filler; number -1 is a stop message
STOP = -1
PAYLOAD_BYTES = 300
DESIGNS: dict[str, dict[str, str]] = {
    "table": {"design": "table"},
    "ring": {"design": "ring", "layout": "slots"},
    "ring-rows": {"design": "ring", "layout": "rows"},
}
"""The queue each ``--design`` creates (run.py's names: ``ring`` is the slots layout)."""


def digest(payload: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "big")


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclasses.dataclass(frozen=True)
class Job:
    """What a waiter process needs: where its queue is, how many threads wait, and each pop's wait."""

    dsn: str
    schema: str
    threads: int
    wait: float
    naive: bool = False


NAIVE_POP = (
    "DELETE FROM {t} WHERE id = (SELECT id FROM {t} ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) "
    "RETURNING payload"
)
NAIVE_PUSH = (
    "WITH i AS (INSERT INTO {t} (payload) SELECT unnest(%s::bytea[]) RETURNING 1) "
    "SELECT pg_notify('{ch}', '') FROM (SELECT count(*) FROM i) c"
)


def naive_waiter(
    job: Job, ready: Any, taken: list[tuple[int, float, int]], tally: Counter[str], lock: threading.Lock
) -> None:
    """The naive reference's waiter: a connection of its own that LISTENs, pops with SKIP LOCKED, and
    waits for a notification (any: every push notifies every listener) or its poll of 1 s."""
    table = f"{job.schema}.naive"
    with psycopg.connect(job.dsn, autocommit=True) as conn:
        conn.execute(f"LISTEN naive_{job.schema}")
        with ready.get_lock():
            ready.value += 1
        while True:
            try:
                row = conn.execute(NAIVE_POP.format(t=table)).fetchone()
            except psycopg.Error as exc:
                with lock:
                    tally["error:" + type(exc).__name__] += 1
                time.sleep(0.01)
                continue
            if row is None:
                for _ in conn.notifies(timeout=1.0, stop_after=1):
                    with lock:
                        tally["wakes"] += 1
                continue
            p = bytes(row[0])
            number = HEADER.unpack_from(p)[0]
            with lock:
                taken.append((number, time.time(), digest(p)))
            if number == STOP:
                return


def waiter_process(job: Job, ready: Any, window: Any, out: Any) -> None:
    """Threads popping one message at a time until each takes a stop message; reports what they took."""
    if job.naive:
        naive_process(job, ready, window, out)
        return
    from airflow_dbqueue.engine.dialects.postgres import hub

    wakes = 0
    lock = threading.Lock()
    real_wait = hub.Waiter.wait

    def counting_wait(self: hub.Waiter, timeout: float) -> bool:
        nonlocal wakes
        got = real_wait(self, timeout)
        if got:
            with lock:
                wakes += 1
        return got

    hub.Waiter.wait = counting_wait  # type: ignore[method-assign]
    taken: list[tuple[int, float, int]] = []
    errors: Counter[str] = Counter()
    with DbQueue(job.dsn, schema=job.schema) as dbq:
        q = dbq.queue(QUEUE)

        def run() -> None:
            with ready.get_lock():
                ready.value += 1
            while True:
                try:
                    msgs = q.pop_payloads(1, wait=job.wait)
                except Exception as exc:  # counted and reported; the waiter goes on
                    with lock:
                        errors[type(exc).__name__] += 1
                    time.sleep(0.01)
                    continue
                now = time.time()
                for p in msgs:
                    number = HEADER.unpack_from(p)[0]
                    with lock:
                        taken.append((number, now, digest(p)))
                    if number == STOP:
                        return

        workers = [threading.Thread(target=run) for _ in range(job.threads)]
        for t in workers:
            t.start()
        window[0].wait()
        cpu0, wakes0 = cpu_self(), wakes
        window[1].wait()
        cpu1, wakes1 = cpu_self(), wakes
        for t in workers:
            t.join()
    out.put({"taken": taken, "errors": dict(errors), "cpu_s": cpu1 - cpu0, "wakes": wakes1 - wakes0})


def naive_process(job: Job, ready: Any, window: Any, out: Any) -> None:
    taken: list[tuple[int, float, int]] = []
    tally: Counter[str] = Counter()
    lock = threading.Lock()
    workers = [
        threading.Thread(target=naive_waiter, args=(job, ready, taken, tally, lock))
        for _ in range(job.threads)
    ]
    for t in workers:
        t.start()
    window[0].wait()
    cpu0, wakes0 = cpu_self(), tally["wakes"]
    window[1].wait()
    cpu1, wakes1 = cpu_self(), tally["wakes"]
    for t in workers:
        t.join()
    errors = {k.split(":", 1)[1]: v for k, v in tally.items() if k.startswith("error:")}
    out.put({"taken": taken, "errors": errors, "cpu_s": cpu1 - cpu0, "wakes": wakes1 - wakes0})


def server_cpu(pid: int | None) -> float | None:
    """User and system seconds of the server's processes (the postmaster and its children)."""
    if pid is None:
        return None
    total = 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        main = psutil.Process(pid)
        for p in [main, *main.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
    return total


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


@contextlib.contextmanager
def naive_table(dsn: str, schema: str) -> Iterator[Callable[[list[bytes]], Any]]:
    """The naive reference's table in ``schema``; yields its push (one INSERT that notifies)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {schema}.naive (id bigserial PRIMARY KEY, payload bytea NOT NULL)")
        text = NAIVE_PUSH.format(t=f"{schema}.naive", ch=f"naive_{schema}")
        try:
            yield lambda payloads: conn.execute(text, (payloads,))
        finally:
            conn.execute(f"DROP TABLE {schema}.naive")


def push_paced(
    args: argparse.Namespace, push: Callable[[list[bytes]], Any], pushed: dict[int, tuple[float, int]]
) -> Counter[str]:
    """Push one message every ``--interval`` for ``--seconds`` (on a schedule), noting each in
    ``pushed``; return the errors of pushes that failed (their messages are not expected)."""
    fill = fillers(PAYLOAD_BYTES, HEADER.size)
    errors: Counter[str] = Counter()
    t0 = time.monotonic()
    for i in range(int(args.seconds / args.interval)):
        pause = t0 + i * args.interval - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        p = make(HEADER, fill, i, 0)
        try:
            push([p])
        except Exception as exc:  # counted; the message is not expected
            errors[type(exc).__name__] += 1
            continue
        pushed[i] = (time.time(), digest(p))
    return errors


def run_point(
    args: argparse.Namespace, dsn: str, server_pid: int | None, mode: str, waiters: int, *, naive: bool
) -> dict[str, Any]:
    procs = 1 if mode == "threads" else min(waiters, args.max_processes)
    per = [waiters // procs + (1 if i < waiters % procs else 0) for i in range(procs)]
    schema = f"bench_w_{uuid.uuid4().hex[:8]}"
    fill = fillers(PAYLOAD_BYTES, HEADER.size)
    ctx = mp.get_context("spawn")
    ready = ctx.Value("i", 0)
    window = (ctx.Event(), ctx.Event())
    out: Any = ctx.Queue()
    with DbQueue(dsn, schema=schema) as dbq:
        dbq.install()
        q = dbq.create_queue(QUEUE, payload_type="bytes", notify=args.notify, **DESIGNS[args.design])
        layout = None if q.settings.layout is None else q.settings.layout.value
        push: Callable[[list[bytes]], Any] = q.push_batch
        stack = contextlib.ExitStack()
        if naive:
            push = stack.enter_context(naive_table(dsn, schema))
        workers = [
            ctx.Process(
                target=waiter_process, args=(Job(dsn, schema, n, args.wait, naive), ready, window, out)
            )
            for n in per
        ]
        try:
            for w in workers:
                w.start()
            deadline = time.monotonic() + 120
            while ready.value < waiters and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(args.settle)  # every waiter is in its wait
            pushed: dict[int, tuple[float, int]] = {}  # number: (when its push returned, digest)
            srv0 = server_cpu(server_pid)
            window[0].set()
            t0 = time.monotonic()
            push_errors = push_paced(args, push, pushed)
            # the window ends when the last message was taken (or 2 poll intervals later)
            time.sleep(min(2.0, 2 * 1.0))
            srv1 = server_cpu(server_pid)
            window[1].set()
            elapsed = time.monotonic() - t0
            stops = [make(HEADER, fill, STOP, k) for k in range(waiters)]
            push(stops)
            results = [out.get(timeout=args.wait + 120) for _ in workers]
            for w in workers:
                w.join(30)
        finally:
            for w in workers:
                if w.is_alive():
                    w.kill()
            stack.close()
            dbq.uninstall()
    r = summary(
        args,
        mode,
        waiters,
        procs,
        results,
        pushed,
        push_errors,
        elapsed,
        None if srv0 is None or srv1 is None else srv1 - srv0,
    )
    r["layout"] = layout
    if naive:
        r["design"], r["notify"], r["layout"] = "naive", "always", None
    return r


def summary(  # noqa: PLR0917 - one point's parts, each named at its one call
    args: argparse.Namespace,
    mode: str,
    waiters: int,
    procs: int,
    results: list[dict[str, Any]],
    pushed: dict[int, tuple[float, int]],
    push_errors: Counter[str],
    elapsed: float,
    server: float | None,
) -> dict[str, Any]:
    """One point's figures from what the waiters took and what was pushed."""
    taken = [t for r in results for t in r["taken"]]
    got = [t for t in taken if t[0] != STOP]
    stopped = [t for t in taken if t[0] == STOP]
    numbers = Counter(t[0] for t in got)
    latencies = [t[1] - pushed[t[0]][0] for t in got if t[0] in pushed]
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r["errors"])
    client_cpu = sum(r["cpu_s"] for r in results)
    delivered = len(got)
    return {
        "benchmark": "waiters",
        "mode": mode,
        "waiters": waiters,
        "processes": procs,
        "design": args.design,
        "notify": args.notify,
        "interval_s": args.interval,
        "seconds": round(elapsed, 2),
        "pushed": len(pushed),
        "delivered": delivered,
        "lost": len(set(pushed) - set(numbers)),
        "duplicated": sum(c - 1 for c in numbers.values() if c > 1),
        "checksum_ok": sum(d for _, d in pushed.values()) == sum(t[2] for t in got)
        and len(stopped) == waiters,
        "stops_taken": len(stopped),
        "errors": dict(errors),
        "push_errors": dict(push_errors),
        "p50_ms": None if not latencies else round(1000 * statistics.median(latencies), 2),
        "p99_ms": None if not latencies else round(1000 * percentile(latencies, 0.99), 2),  # type: ignore[operator]
        "max_ms": None if not latencies else round(1000 * max(latencies), 2),
        "late": sum(1 for x in latencies if x > 0.5),
        "client_cpu_s": round(client_cpu, 3),
        "server_cpu_s": None if server is None else round(server, 3),
        "cpu_ms_per_msg": round(1000 * (client_cpu + (server or 0.0)) / max(1, delivered), 3),
        "client_cpu_ms_per_msg": round(1000 * client_cpu / max(1, delivered), 3),
        "wakes_per_msg": round(sum(r["wakes"] for r in results) / max(1, delivered), 2),
        "load_1m": round(os.getloadavg()[0], 2),
    }


def valid(r: dict[str, Any]) -> bool:
    return bool(
        r["lost"] == 0 and r["duplicated"] == 0 and r["checksum_ok"] and r["delivered"] == r["pushed"]
    )


@contextlib.contextmanager
def database(dsn: str | None) -> Iterator[tuple[str, int | None]]:
    """Yield ``(dsn, server pid)``: the given server (pid unknown), or a throwaway embedded one that
    accepts enough connections for 500 waiters in 50 processes."""
    dsn = dsn or os.environ.get("DBQUEUE_TEST_DSN")
    if dsn:
        yield dsn, None
        return
    from airflow_dbqueue.engine.embedded import EmbeddedPostgres

    tmp = Path(tempfile.mkdtemp(prefix="dbqueue-bench-pg-"))
    server = EmbeddedPostgres(tmp / "data", settings={"max_connections": "800"})
    try:
        server.start()
        yield server.dsn, server.postmaster_pid()
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waiters", type=int, nargs="+", default=[1, 50, 500])
    ap.add_argument("--mode", nargs="+", choices=("threads", "processes"), default=["threads", "processes"])
    ap.add_argument("--max-processes", type=int, default=50, help="processes at most in --mode processes")
    ap.add_argument("--design", choices=tuple(DESIGNS), default="table")
    ap.add_argument("--notify", choices=("auto", "always", "never"), default="auto")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of pushes a point")
    ap.add_argument("--interval", type=float, default=0.02, help="seconds between two pushes")
    ap.add_argument("--wait", type=float, default=30.0, help="each pop's wait")
    ap.add_argument(
        "--settle", type=float, default=2.0, help="seconds between the waiters' start and the first push"
    )
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--naive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the naive reference at each point (a connection a waiter, LISTEN, NOTIFY on every "
        "push)",
    )
    ap.add_argument("--dsn")
    ap.add_argument("--json", action="store_true", help="one JSON object a point on stdout")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok = True
    sides = [False, True] if args.naive else [False]
    with database(args.dsn) as (dsn, pid):
        for rep in range(args.repeat):
            for mode in args.mode:
                one: dict[bool, float] = {}
                for w, naive in [(w, n) for w in sorted(args.waiters) for n in sides]:
                    r = run_point(args, dsn, pid, mode, w, naive=naive)
                    r["repeat"] = rep
                    if w == 1:
                        one[naive] = r["cpu_ms_per_msg"]
                    r["cpu_vs_one"] = round(r["cpu_ms_per_msg"] / one[naive], 2) if one.get(naive) else None
                    ok = ok and valid(r)
                    if args.json:
                        print(json.dumps(r), flush=True)
                    else:
                        print(
                            f"{r['design']:9} {mode:9} {w:4} waiters ({r['processes']} proc): delivered "
                            f"{r['delivered']}/"
                            f"{r['pushed']} lost {r['lost']} dup {r['duplicated']} checksum "
                            f"{'ok' if r['checksum_ok'] else 'BAD'} errors {r['errors'] or 0} | p50 "
                            f"{r['p50_ms']} ms p99 {r['p99_ms']} ms max {r['max_ms']} ms late {r['late']} | "
                            f"cpu {r['cpu_ms_per_msg']} ms/msg (client {r['client_cpu_ms_per_msg']}, "
                            f"x{r['cpu_vs_one']} of one) wakes/msg {r['wakes_per_msg']} | "
                            f"load {r['load_1m']}",
                            flush=True,
                        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
