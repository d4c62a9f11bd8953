#!/usr/bin/env python
"""Server instructions of an observer's call on a ring of the rows layout: counted, not timed.

    python benchmarks/observe_count.py [--ordering none per_key] [--calls 20] [--pushes 100] [--batch 100]
        [--actions count_ready peek stats] [--layout rows] [--json]

An observer asks a queue how much a pop could take (``count_ready``, ``readiness``: what the sensor and
the trigger ask), what it would take (``peek(10)``) and its depth (``stats()``). On a ring ordered per
key those answers leave out the messages behind a held lane, which costs them a look at the lanes'
holds. This counts, for a ring of the rows layout without ordering (``none``) and one ordered per key
(``per_key``, 8 lanes, 1,000 keys), what the server executes for each call, with the ring in the state
a ring in use has: 100 pushes of 100 messages (``--pushes``, ``--batch``; each naming one of the keys
in turn on the ordered ring), then 3 pops of 20 at least once whose leases stay open (on the ordered ring
each holds the lanes it took from, two of the 8), the first of them acked, 5 messages of the second
nacked with an hour's delay (a retry row a message; on the ordered ring they keep its lanes held). The
server runs under cachegrind as in ``instructions.py`` (whose server this uses): a session of
``--calls`` calls and one of four times as many differ by the calls between them, so a call costs
(long - short) / (3 x calls) instructions (``--actions``: which calls). The state is read back after
the sessions and must be what it was before (the calls take nothing). ``--layout slots`` counts a ring
of the slots layout (twice as many slots as messages pushed, without ordering) in the same state.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from instructions import _pid, counted_server  # benchmarks/ is a folder of scripts

from airflow_dbqueue.engine import DbQueue

QUEUE = "observe_q"
PUSHES = 100
BATCH = 100
KEYS = 1000
POPS = 3
POP_N = 20
LANES = 8

ACTIONS: dict[str, Callable[[Any], Any]] = {
    "count_ready": lambda q: q.count_ready(),
    "peek": lambda q: q.peek(10),
    "stats": lambda q: q.stats(),
}


def prepare(
    dsn: str, ordering: str, pushes: int = PUSHES, batch: int = BATCH, layout: str = "rows"
) -> tuple[str, tuple[int, int, int]]:
    """A fresh schema whose ring is in the state the module describes, after ``pushes`` pushes of
    ``batch`` messages (on the slots layout: a ring of twice as many slots); its name and (count_ready,
    ready, in flight)."""
    schema = f"obs_{ordering}_{uuid.uuid4().hex[:8]}"
    with DbQueue(dsn, schema=schema, pool_size=1, recycle_interval=None) as dbq:
        dbq.install()
        q = dbq.create_queue(
            QUEUE,
            payload_type="bytes",
            design="ring",
            layout=layout,
            capacity=4 * pushes * LANES if layout == "rows" else 2 * pushes * batch,
            lanes=LANES,
            ordering=ordering,
            visibility_timeout=3600.0,
        )
        keyed = ordering == "per_key"
        n = 0
        for _ in range(pushes):
            keys = [f"k{(n + i) % KEYS}" for i in range(batch)] if keyed else None
            q.push_batch([(n + i).to_bytes(4, "big") + b"x" * 296 for i in range(batch)], keys=keys)
            n += batch
        leases = [q.pop(POP_N, semantics="at-least-once") for _ in range(POPS)]
        if not all(leases):
            raise SystemExit(f"{ordering}: a pop took nothing")
        q.ack(leases[0])
        q.nack(leases[1][:5], delay=3600.0)
        st = q.stats()
        state = (q.count_ready(), st.ready, st.in_flight)
    return schema, state


def session(dsn: str, schema: str, action: str, calls: int) -> set[int]:
    with DbQueue(dsn, schema=schema, pool_size=1, recycle_interval=None) as dbq:
        q = dbq.queue(QUEUE)
        pids = {_pid(dbq)}
        do = ACTIONS[action]
        for _ in range(calls):
            do(q)
        pids.add(_pid(dbq))
    return pids


def count(
    server: Any,
    dsn: str,
    ordering: str,
    calls: int,
    *,
    pushes: int = PUSHES,
    batch: int = BATCH,
    actions: tuple[str, ...] = tuple(ACTIONS),
    layout: str = "rows",
) -> dict[str, Any]:
    schema, state = prepare(dsn, ordering, pushes, batch, layout)
    row: dict[str, Any] = {
        "benchmark": "observe_count",
        "layout": layout,
        "ordering": ordering,
        "calls": calls,
        "pushes": pushes,
        "batch": batch,
        "count_ready": state[0],
        "ready": state[1],
        "in_flight": state[2],
    }
    for action in actions:
        counts = []
        for n in (calls, 4 * calls):
            counts.append(server.counted(session(dsn, schema, action, n)))
        row[f"{action}_instructions"] = round((counts[1] - counts[0]) / (3 * calls))
    with DbQueue(dsn, schema=schema, pool_size=1, recycle_interval=None) as dbq:
        q = dbq.queue(QUEUE)
        st = q.stats()
        if (q.count_ready(), st.ready, st.in_flight) != state:
            raise SystemExit(f"{ordering}: the calls changed the ring's state")
        row["blocked"] = st.extra.get("blocked")
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ordering", nargs="+", choices=("none", "per_key"), default=["none", "per_key"])
    ap.add_argument("--calls", type=int, default=20, help="calls of the short session (the long: 4x)")
    ap.add_argument("--pushes", type=int, default=PUSHES, help="pushes before the pops")
    ap.add_argument("--batch", type=int, default=BATCH, help="messages a push")
    ap.add_argument("--actions", nargs="+", choices=tuple(ACTIONS), default=list(ACTIONS))
    ap.add_argument("--layout", choices=("rows", "slots"), default="rows", help="slots: without ordering")
    ap.add_argument("--json", action="store_true", help="one JSON object a ring on stdout")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with counted_server() as server:
        dsn = server.pg.dsn
        for ordering in args.ordering:
            row = count(
                server,
                dsn,
                ordering,
                args.calls,
                pushes=args.pushes,
                batch=args.batch,
                actions=tuple(args.actions),
                layout=args.layout,
            )
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                parts = [f"{k[:-13]} {v:,}" for k, v in row.items() if k.endswith("_instructions")]
                print(f"{ordering:8} server instructions a call: {', '.join(parts)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
