#!/usr/bin/env python
"""The asyncio face against the synchronous one and against a naive queue driven by asyncio psycopg.

    python benchmarks/asyncface.py                         # 2x2 batch 100 and 4x4 batch 1, then latency
    python benchmarks/asyncface.py --points 2x2x100 --seconds 10 --repeat 3 --json
    python benchmarks/asyncface.py --latency-only --waiters 200

**Throughput.** For each point ``PxCxB`` (producers x consumers x batch) and each side, P producer and
C consumer processes (spawned, one connection each, as ``run.py``'s) push and pop 300-byte payloads
that vary per message (``payloads.py``) at most once for ``--seconds`` after a second of warm-up;
producers pause while more than ``max(1000, 50 x B x C)`` messages are queued. The sides:

- ``sync``: ``DbQueue`` (``push_batch``, ``pop_payloads``), a table-design queue, ``notify="never"``;
- ``async``: the same calls of ``AsyncDbQueue``, awaited, one task a process on its event loop;
- ``naive-async``: ``run.py``'s naive queue (INSERT, ``DELETE ... SKIP LOCKED RETURNING``) on a psycopg
  ``AsyncConnection``, awaited.

Consumers pop without waiting (a pop of nothing sleeps 1 ms). Every payload popped is checked against
its header and added to a checksum; at the end the consumers drain the queue and the run is invalid
(exit 1) when a message was lost, duplicated or changed. ``cycles/s`` is what consumers popped in the
window over its length; sides alternate within a repeat, and ``--repeat`` reports medians.

**Wake-up latency.** ``--waiters`` asyncio consumers of one process wait in
``pop(1, wait=30)`` on one queue (``notify="auto"``, the defaults otherwise) while the main task pushes
one message every 20 ms for ``--seconds``; latency runs from a push's return (its commit) to the return
of the pop that took its message: p50, p99 and max. ``benchmarks/waiters.py --mode threads`` measures
the synchronous face's waiting threads the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import struct
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.backends import naive_statements
from payloads import fillers, make

HEADER = struct.Struct(">II")
PAYLOAD_BYTES = 300
SIDES = ("sync", "async", "naive-async")


def check(payload: bytes) -> int:
    """The payload's hash for the checksum, after checking its filler against its header."""
    a, b = HEADER.unpack_from(payload)
    if payload[HEADER.size :] != fillers(PAYLOAD_BYTES, HEADER.size).pick(a, b):
        raise AssertionError(f"payload {a}:{b} changed")
    return (a << 32 | b) * 0x9E3779B97F4A7C15 % (1 << 61)


class Shared:
    """Counters the processes of a run share."""

    def __init__(self, ctx: Any) -> None:
        self.pushed = ctx.Value("q", 0)
        self.popped = ctx.Value("q", 0)
        self.in_window = ctx.Value("q", 0)
        self.sum_pushed = ctx.Value("q", 0)
        self.sum_popped = ctx.Value("q", 0)
        self.producing = ctx.Value("b", 1)


def _add(value: Any, n: int) -> None:
    with value.get_lock():
        value.value += n


def _add_sum(value: Any, n: int) -> None:
    with value.get_lock():
        value.value = (value.value + n) % (1 << 61)


async def _aworker(side: str, role: str, idx: int, cfg: dict[str, Any], sh: Shared) -> None:
    from airflow_dbqueue.engine.aio import AsyncDbQueue

    batch, cap = cfg["batch"], cfg["cap"]
    start, end = cfg["window"]
    if side == "async":
        dbq = AsyncDbQueue(cfg["dsn"], schema=cfg["schema"], pool_size=1)
        q = await dbq.queue("bench")

        async def push(ps: list[bytes]) -> None:
            await q.push_batch(ps)

        async def pop() -> list[bytes]:
            return list(await q.pop_payloads(batch))

        async def close() -> None:
            await dbq.close()
    else:
        conn = await psycopg.AsyncConnection.connect(cfg["dsn"], autocommit=True)
        push_sql, pop_sql = naive_statements(cfg["schema"])

        async def push(ps: list[bytes]) -> None:
            await conn.execute(push_sql, (ps,))

        async def pop() -> list[bytes]:
            cur = await conn.execute(pop_sql, (batch,), binary=True)
            return [r[0] for r in await cur.fetchall()]

        async def close() -> None:
            await conn.close()

    try:
        if role == "producer":
            n = 0
            while time.time() < end:
                if sh.pushed.value - sh.popped.value > cap:
                    await asyncio.sleep(0.001)
                    continue
                ps = [make(HEADER, fillers(PAYLOAD_BYTES, HEADER.size), idx, n + i) for i in range(batch)]
                await push(ps)
                n += batch
                _add(sh.pushed, batch)
                _add_sum(sh.sum_pushed, sum(map(check, ps)))
        else:
            while True:
                got = await pop()
                if not got:
                    if not sh.producing.value and sh.pushed.value == sh.popped.value:
                        return
                    await asyncio.sleep(0.001)
                    continue
                now = time.time()
                _add(sh.popped, len(got))
                if start <= now < end:
                    _add(sh.in_window, len(got))
                _add_sum(sh.sum_popped, sum(map(check, got)))
    finally:
        await close()


def _sworker(role: str, idx: int, cfg: dict[str, Any], sh: Shared) -> None:
    from airflow_dbqueue.engine import DbQueue

    batch, cap = cfg["batch"], cfg["cap"]
    start, end = cfg["window"]
    with DbQueue(cfg["dsn"], schema=cfg["schema"], pool_size=1, recycle_interval=None) as dbq:
        q = dbq.queue("bench")
        if role == "producer":
            n = 0
            while time.time() < end:
                if sh.pushed.value - sh.popped.value > cap:
                    time.sleep(0.001)
                    continue
                ps = [make(HEADER, fillers(PAYLOAD_BYTES, HEADER.size), idx, n + i) for i in range(batch)]
                q.push_batch(ps)
                n += batch
                _add(sh.pushed, batch)
                _add_sum(sh.sum_pushed, sum(map(check, ps)))
            return
        while True:
            got = q.pop_payloads(batch)
            if not got:
                if not sh.producing.value and sh.pushed.value == sh.popped.value:
                    return
                time.sleep(0.001)
                continue
            now = time.time()
            _add(sh.popped, len(got))
            if start <= now < end:
                _add(sh.in_window, len(got))
            _add_sum(sh.sum_popped, sum(map(check, got)))


def worker(side: str, role: str, idx: int, cfg: dict[str, Any], sh: Shared) -> None:
    if side == "sync":
        _sworker(role, idx, cfg, sh)
    else:
        asyncio.run(_aworker(side, role, idx, cfg, sh))


def run_side(dsn: str, side: str, point: tuple[int, int, int], seconds: float) -> dict[str, Any]:
    producers, consumers, batch = point
    from airflow_dbqueue.engine import DbQueue

    schema = f"b_{uuid.uuid4().hex[:8]}"
    with DbQueue(dsn, schema=schema, pool_size=1, recycle_interval=None) as dbq:
        if side == "naive-async":
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute(f'CREATE SCHEMA "{schema}"')
                c.execute(f'CREATE TABLE "{schema}".t (id bigserial PRIMARY KEY, payload bytea)')
        else:
            dbq.install()
            dbq.create_queue("bench", payload_type="bytes", notify="never", archive=False)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("CHECKPOINT")
        ctx = mp.get_context("spawn")
        sh = Shared(ctx)
        t0 = time.time() + 3.0  # spawned interpreters import meanwhile
        cfg = {
            "dsn": dsn,
            "schema": schema,
            "batch": batch,
            "cap": max(1000, 50 * batch * consumers),
            "window": (t0 + 1.0, t0 + 1.0 + seconds),
        }
        procs = [ctx.Process(target=worker, args=(side, "producer", i, cfg, sh)) for i in range(producers)]
        procs += [ctx.Process(target=worker, args=(side, "consumer", i, cfg, sh)) for i in range(consumers)]
        for p in procs:
            p.start()
        for p in procs[:producers]:
            p.join()
        sh.producing.value = 0
        for p in procs[producers:]:
            p.join(120)
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        if side == "naive-async":
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute(f'DROP SCHEMA "{schema}" CASCADE')
        else:
            dbq.uninstall()
    valid = not failed and sh.pushed.value == sh.popped.value and sh.sum_pushed.value == sh.sum_popped.value
    return {
        "side": side,
        "point": f"{producers}x{consumers}x{batch}",
        "cycles_per_s": round(sh.in_window.value / seconds),
        "pushed": sh.pushed.value,
        "popped": sh.popped.value,
        "valid": valid,
    }


async def latency(dsn: str, waiters: int, seconds: float, interval: float) -> dict[str, Any]:
    from airflow_dbqueue.engine.aio import AsyncDbQueue

    schema = f"l_{uuid.uuid4().hex[:8]}"
    async with AsyncDbQueue(dsn, schema=schema) as dbq:
        await dbq.install()
        q = await dbq.create_queue("lat", payload_type="json")
        pushed_at: dict[int, float] = {}
        taken_at: dict[int, float] = {}

        async def waiter() -> None:
            while True:
                msgs = await q.pop(1, wait=30)
                now = time.monotonic()
                for m in msgs:
                    if m.payload == "stop":
                        return
                    if m.id in taken_at:
                        raise AssertionError(f"message {m.id} taken twice")
                    taken_at[m.id] = now

        tasks = [asyncio.create_task(waiter()) for _ in range(waiters)]
        await asyncio.sleep(1.0)
        end = time.monotonic() + seconds
        n = 0
        next_at = time.monotonic()
        while time.monotonic() < end:
            [mid] = await q.push_batch([{"n": n}])
            pushed_at[mid] = time.monotonic()  # after the push returned: its commit
            n += 1
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        await asyncio.sleep(2.0)
        await q.push_batch(["stop"] * waiters)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await dbq.uninstall()
    # A pop may return before the pushing task resumes after its commit: its latency counts as 0.
    took = sorted(max(0.0, taken_at[i] - pushed_at[i]) for i in pushed_at if i in taken_at)
    return {
        "waiters": waiters,
        "messages": n,
        "delivered": len(taken_at),
        "valid": sorted(taken_at) == sorted(pushed_at),
        "p50_ms": round(1000 * statistics.median(took), 2),
        "p99_ms": round(1000 * took[int(0.99 * (len(took) - 1))], 2),
        "max_ms": round(1000 * took[-1], 2),
    }


@contextmanager
def database(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    import shutil
    import tempfile

    from airflow_dbqueue.engine.embedded import EmbeddedPostgres

    tmp = Path(tempfile.mkdtemp(prefix="dbqueue-asyncface-"))
    server = EmbeddedPostgres(tmp / "data")
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", nargs="*", default=["2x2x100", "4x4x1"], help="PxCxB points")
    ap.add_argument("--sides", nargs="*", default=list(SIDES), choices=SIDES)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--waiters", type=int, default=200)
    ap.add_argument("--interval", type=float, default=0.02)
    ap.add_argument("--latency-only", action="store_true")
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--dsn", default=os.environ.get("DBQUEUE_TEST_DSN"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ok = True
    with database(args.dsn) as dsn:
        if not args.latency_only:
            for point in args.points:
                p, c, b = (int(x) for x in point.split("x"))
                runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.sides}
                for _ in range(args.repeat):
                    for side in args.sides:
                        r = run_side(dsn, side, (p, c, b), args.seconds)
                        ok &= r["valid"]
                        runs[side].append(r)
                        print(json.dumps(r), file=sys.stderr)
                out = {s: statistics.median(r["cycles_per_s"] for r in rs) for s, rs in runs.items()}
                line = {"point": point, "cycles_per_s": out, "load": os.getloadavg()}
                print(
                    json.dumps(line)
                    if args.json
                    else f"{point}: " + ", ".join(f"{k} {v:,.0f}/s" for k, v in out.items())
                )
        if not args.no_latency:
            lat = asyncio.run(latency(dsn, args.waiters, args.seconds, args.interval))
            ok &= lat["valid"]
            lat["load"] = os.getloadavg()
            print(json.dumps(lat) if args.json else f"wake-up latency: {lat}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
