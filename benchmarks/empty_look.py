#!/usr/bin/env python
"""Server instructions of a waiting pop's look that finds nothing: counted, not timed.

    python benchmarks/empty_look.py [--design table ring ring-rows naive] [--calls 50] [--json]

A waiting pop that is woken and finds nothing (at 50 waiters, the wake the taker of a message passes
on, about once a message: ``waiters.py``) costs one *look*: it asks whether a push is in progress
(``_pushing``), then pops (``pop_payloads(1)``) on the empty queue. This counts, for each design on
one empty queue with the engine's defaults (``notify="auto"``; ``ring`` is the slots layout,
``ring-rows`` the rows layout, as in ``run.py``), what the server executes for:

- ``ask``: the question alone;
- ``pop``: an empty pop of one alone (no lease reclaim, and on a rows ring no look for gaps: both run
  at most every so often, not once a pop);
- ``look``: a waiting pop's look as the engine makes it (``Queue._look``: the question, and the pop
  unless the answer says there is nothing to take);
- ``gaps`` (rows ring): the look for gaps an empty pop runs at most every 50 ms (a handle's);

and, for ``naive``, the reference's empty pop (``DELETE ... SKIP LOCKED ... RETURNING`` on an empty
table). Before the count each queue moves 200 messages, one push and one pop at a time, so that its
positions stand where a queue in use has them. The server runs under cachegrind as in
``instructions.py`` (whose server this uses): a session of ``--calls`` calls and one of four times as
many differ by the calls between them, so a call costs (long - short) / (3 x calls) instructions.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from instructions import _pid, counted_server  # benchmarks/ is a folder of scripts

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.models import Semantics

QUEUE = "look_q"
DESIGNS: dict[str, dict[str, str]] = {
    "table": {"design": "table"},
    "ring": {"design": "ring", "layout": "slots"},
    "ring-rows": {"design": "ring", "layout": "rows"},
}
WARM = 200
NAIVE_POP = (
    "DELETE FROM {t} WHERE id = (SELECT id FROM {t} ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) "
    "RETURNING payload"
)


def look(q: Any) -> list[Any]:
    """One look of a waiting pop, as the engine makes it (``Queue._look`` where the build has it;
    before it, the question and then the pop)."""

    def take() -> list[Any]:
        return list(q._pop_payloads_once(1, Semantics.AT_MOST_ONCE, None))

    if hasattr(q, "_look"):
        return list(q._look(take)[1])
    q._pushing()
    return take()


def quiet(q: Any) -> None:
    """No lease reclaim and no look for gaps in the calls counted (each runs at most so often)."""
    q.reclaim_every = float("inf")
    if hasattr(q, "_gaps_checked"):
        q._gaps_checked = float("inf")


ACTIONS: dict[str, Callable[[Any], Any]] = {
    "ask": lambda q: q._pushing(),
    "pop": lambda q: q.pop_payloads(1),
    "look": look,
    "gaps": lambda q: q._give_up_gaps(force=True),
}


def engine_session(dsn: str, schema: str, action: str, calls: int) -> set[int]:
    with DbQueue(dsn, schema=schema, pool_size=1, recycle_interval=None) as dbq:
        q = dbq.queue(QUEUE)
        quiet(q)
        pids = {_pid(dbq)}
        do = ACTIONS[action]
        for _ in range(calls):
            got = do(q)
            if isinstance(got, list) and got:
                raise SystemExit(f"{action} found a message in a queue that should be empty: {got!r}")
        pids.add(_pid(dbq))
    return pids


def naive_session(dsn: str, schema: str, calls: int) -> set[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        pid = conn.info.backend_pid
        text = NAIVE_POP.format(t=f"{schema}.naive")
        for _ in range(calls):
            if conn.execute(text, prepare=True).fetchone() is not None:
                raise SystemExit("the naive queue should be empty")
    return {pid}


def prepare(dsn: str, design: str) -> str:
    """A fresh schema whose queue of ``design`` moved WARM messages and is empty; its name."""
    schema = f"look_{design.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
    if design == "naive":
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
            conn.execute(f"CREATE TABLE {schema}.naive (id bigserial PRIMARY KEY, payload bytea NOT NULL)")
            for _ in range(WARM):
                conn.execute(f"INSERT INTO {schema}.naive (payload) VALUES (%s)", (b"x" * 300,))
                conn.execute(NAIVE_POP.format(t=f"{schema}.naive"))
        return schema
    with DbQueue(dsn, schema=schema, pool_size=1, recycle_interval=None) as dbq:
        dbq.install()
        q = dbq.create_queue(QUEUE, payload_type="bytes", **DESIGNS[design])
        moved = 0
        for i in range(WARM):
            q.push(i.to_bytes(4, "big") + b"x" * 296)
            moved += len(q.pop_payloads(1))
        if moved != WARM or q.pop_payloads(10):
            raise SystemExit(f"{design}: moved {moved} of {WARM} messages, or some are left")
    return schema


def count(server: Any, dsn: str, design: str, calls: int) -> dict[str, Any]:
    schema = prepare(dsn, design)
    actions = ["pop"] if design == "naive" else ["ask", "pop", "look"]
    if design == "ring-rows":
        actions.append("gaps")
    row: dict[str, Any] = {"benchmark": "empty_look", "design": design, "calls": calls}
    for action in actions:
        counts = []
        for n in (calls, 4 * calls):
            if design == "naive":
                pids = naive_session(dsn, schema, n)
            else:
                pids = engine_session(dsn, schema, action, n)
            counts.append(server.counted(pids))
        row[f"{action}_instructions"] = round((counts[1] - counts[0]) / (3 * calls))
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--design", nargs="+", choices=(*DESIGNS, "naive"), default=[*DESIGNS, "naive"])
    ap.add_argument("--calls", type=int, default=50, help="calls of the short session (the long: 4x)")
    ap.add_argument("--json", action="store_true", help="one JSON object a design on stdout")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with counted_server() as server:
        dsn = server.pg.dsn
        for design in args.design:
            row = count(server, dsn, design, args.calls)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                parts = [f"{k[:-13]} {v:,}" for k, v in row.items() if k.endswith("_instructions")]
                print(f"{design:9} server instructions a call: {', '.join(parts)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
