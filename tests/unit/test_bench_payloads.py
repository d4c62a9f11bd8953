"""benchmarks/payloads.py: payloads differ from message to message in every byte position."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from payloads import POOL, Fillers, fillers, make  # benchmarks/ is a folder of scripts

HEADER = struct.Struct(">IQ")


def test_consecutive_and_a_ring_apart_payloads_share_few_bytes() -> None:
    pool = Fillers(300, HEADER.size)
    for a in range(4):
        for b in range(0, 20_000, 997):
            for other in (b + 1, b + 4096, b + 16384):
                x, y = pool.pick(a, b), pool.pick(a, other)
                same = sum(1 for i, j in zip(x, y, strict=True) if i == j)
                assert same < 10, (a, b, other, same)  # random bytes agree at 1 position in 256


def test_every_filler_of_the_pool_is_used_and_rebuilt_alike() -> None:
    pool = Fillers(64, HEADER.size)
    used = {pool.pick(a, b) for a in range(2) for b in range(20_000)}
    assert len(used) == POOL
    assert Fillers(64, HEADER.size).pool == pool.pool  # every process builds the same pool
    assert fillers(64, HEADER.size) is fillers(64, HEADER.size)


def test_a_payload_is_its_header_and_filler() -> None:
    pool = fillers(100, HEADER.size)
    p = make(HEADER, pool, 3, 12345)
    assert len(p) == 100
    assert HEADER.unpack_from(p) == (3, 12345)
    assert p[HEADER.size :] == pool.pick(3, 12345) != pool.pick(3, 12346)
