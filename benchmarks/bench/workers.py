"""The producer and consumer processes of a run, and the check that every message came exactly once."""

from __future__ import annotations

import dataclasses
import struct
import time
import traceback
from typing import Any

from payloads import Fillers  # benchmarks/ is a folder of scripts

from airflow_dbqueue.engine import LeaseExpiredError
from bench.backends import Backend, Target, open_backend

# A payload starts with (producer index, sequence number); the rest is a filler from a pool of random
# ones (payloads.py): payloads differ in every byte position, as real ones do.
HEADER = struct.Struct(">IQ")

# Run phases, in a shared integer that the parent advances.
WAIT, RUN, STOP_PRODUCERS, STOP = 0, 1, 2, 3


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
    rate: float | None = None
    """Messages a second all producers together push at most (``--rate``); None: as fast as they can."""


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
    # --rate: this producer's batches are due every n / (rate / producers) seconds from its start. A
    # producer that fell behind pushes at once, but catches up on at most a second of its schedule.
    interval = n * cfg.producers / cfg.rate if cfg.rate else 0.0
    due = time.monotonic()
    while phase.value == RUN:
        if sum(pushed) * groups - sum(popped) > cap * groups:  # the groups' mean backlog
            throttled += 1
            time.sleep(0.0005)
            continue
        if interval:
            now = time.monotonic()
            if now < due:
                time.sleep(min(due - now, 0.05))
                continue
            due = max(due, now - 1.0) + interval
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
    # pops that returned nothing: no part of the percentiles, but a pop that waited on a lock and then
    # found nothing is still a long pop (the largest pop call of a --hold-horizon run)
    empty_pop_lat: list[tuple[float, float]] | None = [] if cfg.latencies else None
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
            if empty_pop_lat is not None:
                empty_pop_lat.append((time.monotonic() - took, took))
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
        "empty_pop_lat": empty_pop_lat,
        "ack_lat": ack_lat,
    }


def worker_main(role: str, idx: int, cfg: RunConfig, shm: Shared) -> None:
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
