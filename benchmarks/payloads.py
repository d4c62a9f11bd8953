"""Benchmark payloads that vary from message to message, as real payloads do.

A payload is a header that names it (two integers: who sent it and its number) followed by a filler
drawn from a pool of random byte strings. A fixed filler would flatter any design that updates rows
in place: PostgreSQL logs only the changed middle of an UPDATE whose new version stays on the old
one's page (the prefix and suffix it shares with the old version are left out of the WAL record), so
a slot rewritten with the same filler as before logs a few bytes instead of the whole payload. With
fillers drawn from a pool of random strings, two messages share a byte position no more often than
random data would, and each filler is found again from the header, so a consumer checks every byte
of what it received.
"""

from __future__ import annotations

import functools
import random
import struct

POOL = 4096
"""Fillers in the pool: enough that a slot's next message has another filler than its last one."""
_SEED = 0x5EED_DB0


class Fillers:
    """The pool of random fillers for payloads of ``payload_bytes`` with a header of ``header`` bytes.

    Every process builds the same pool from the same seed, so a consumer can check a payload it did
    not make.
    """

    def __init__(self, payload_bytes: int, header: int) -> None:
        self.size = max(0, payload_bytes - header)
        rng = random.Random(_SEED + self.size)
        self.pool = [rng.randbytes(self.size) for _ in range(POOL)]

    def pick(self, a: int, b: int) -> bytes:
        """The filler of the message numbered ``b`` of sender ``a`` (a fixed mix of both)."""
        return self.pool[((a * 0x9E3779B1) ^ (b * 0x85EBCA77) ^ (b >> 12)) % POOL]


def make(header: struct.Struct, fillers: Fillers, a: int, b: int) -> bytes:
    """The payload numbered ``b`` of sender ``a``: ``header.pack(a, b)`` and its filler."""
    return header.pack(a, b) + fillers.pick(a, b)


@functools.cache
def fillers(payload_bytes: int, header: int) -> Fillers:
    """The pool for payloads of ``payload_bytes`` with a header of ``header`` bytes (built once)."""
    return Fillers(payload_bytes, header)
