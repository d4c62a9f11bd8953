"""Server instructions a message of the rows prototype (flat_rows.sql), the engine's ring and the naive
queue, counted on one server under cachegrind exactly as ``benchmarks/instructions.py`` counts them.

    PYTHONPATH=. python benchmarks/prototypes/flat_rows_instructions.py [--batch 100 1000] [--pop-batch N]

For each batch size: push sessions of ``calls`` and ``4 x calls`` pushes, then pop sessions that pop
them all again (at most once), every payload checked against what was sent; a message's cost is the
difference of the two sessions' counts over the extra messages. ``--pop-batch`` pops in batches of its
own (default: the push batch), to see what a pop that ends inside a pushed row costs. The prototype's
segments are sized so that the long session's pushes rotate one segment.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.backends import BASELINE, Target, setup_target, teardown_target  # noqa: E402
from cost import payloads  # noqa: E402
from instructions import (  # noqa: E402
    QUEUE,
    Sessions,
    counted_server,
    engine_sessions,
    measure,
    naive_sessions,
)

from airflow_dbqueue.engine import DbQueue  # noqa: E402

LANES = 8


def rows_sessions(dsn: str, schema: str, pop_batch: int, lease: bool = False) -> Sessions:
    pushed_per_call = [0]

    def push(sent: list[list[bytes]]) -> set[int]:
        pushed_per_call[0] = len(sent[0])
        with psycopg.connect(dsn, autocommit=True) as c:
            for b in sent:
                while True:
                    first, need = c.execute(f"SELECT r_first, r_need FROM {schema}.push(%b)", (b,)).fetchone()
                    if first is not None:
                        break
                    if not c.execute(f"SELECT {schema}.rotate(%s, 'rows')", (need,)).fetchone()[0]:
                        raise SystemExit("flat-rows: the ring is full (pop sessions come after the pushes)")
            return {c.info.backend_pid}

    def pop(calls: int) -> tuple[list[bytes], set[int]]:
        got: list[bytes] = []
        with psycopg.connect(dsn, autocommit=True) as c:
            # Pop what the push session pushed (the pop batch may differ from the push batch); a pop may
            # come back empty while messages remain, when the lanes it locked have none.
            want = calls * pushed_per_call[0]
            c.execute("SELECT setseed(0.5)")  # the lanes a pop starts at: the same in every run
            empty = 0
            while len(got) < want:
                rows = c.execute(
                    f"SELECT r_seq, r_payload FROM {schema}.pop(%s, 'rows', %s, 60)",
                    (pop_batch, lease),
                    binary=True,
                ).fetchall()
                empty = 0 if rows else empty + 1
                if empty > 1000:
                    raise SystemExit(f"flat-rows: {want - len(got)} messages never came out")
                if rows and lease and not c.execute(f"SELECT {schema}.ack(%s)", (rows[0][0],)).fetchone()[0]:
                    raise SystemExit("flat-rows: an ack found no open lease")
                got.extend(r[1] for r in rows)
            return got, {c.info.backend_pid}

    return push, pop


def setup_rows(dsn: str, seg_rows: int) -> str:
    schema = f"rows_{uuid.uuid4().hex[:8]}"
    sql = (
        (HERE / "flat_rows.sql")
        .read_text()
        .replace("{s}", schema)
        .replace("{lanes}", str(LANES))
        .replace("{seg_rows}", str(seg_rows))
    )
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql)
    return schema


def parts(server: Any, batch: int, seg_rows: int) -> None:
    """Server instructions of one pop of ``batch`` up to each of its parts: the pop function's
    ``p_variant`` 'stop0' returns at its start, 'stop1' once the lanes are locked and their positions
    read, 'stop2' once the rows to take are chosen, 'stop3' once the positions are logged; 'rows' is the
    whole pop. 40 pushes first; every pop then rolls back, so each does the same work. With a small
    ``--seg-rows`` the pushes span the four segments and the positions are three segments behind the
    newest (a consumer that lags)."""
    dsn = server.pg.dsn
    schema = setup_rows(dsn, seg_rows)
    push, _ = rows_sessions(dsn, schema, batch)
    server.counted(push([payloads(batch, 300, 0, k) for k in range(40)]))

    def session(variant: str, calls: int) -> int:
        with psycopg.connect(dsn) as c:
            for _ in range(calls):
                c.execute(
                    f"SELECT count(*) FROM {schema}.pop(%s, %s, false, 60)", (batch, variant)
                ).fetchone()
                c.rollback()
            pid = c.info.backend_pid
        return server.counted({pid})

    for variant in ("stop0", "stop1", "stop2", "stop3", "rows"):
        print(variant, round((session(variant, 40) - session(variant, 10)) / 30), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--pop-batch", type=int, default=None)
    ap.add_argument(
        "--semantics",
        choices=["at-most-once", "at-least-once"],
        default="at-most-once",
        help="at least once: each pop is acked after it (both counted on the pop side); no naive queue",
    )
    ap.add_argument("--calls", type=int, default=None, help="pushes in the short session (default 10)")
    ap.add_argument("--payload-bytes", type=int, default=300)
    ap.add_argument("--seg-rows", type=int, default=None, help="rows a segment (default: one rotation)")
    ap.add_argument(
        "--parts", action="store_true", help="what each part of one pop costs (see parts()), and nothing else"
    )
    ap.add_argument("--out", help="append the JSON lines here too")
    args = ap.parse_args()
    with counted_server() as server:
        dsn = server.pg.dsn
        if args.parts:
            parts(server, args.batch[0], args.seg_rows or 1000)
            return
        for batch in args.batch:
            calls = args.calls or 10
            pop_batch = args.pop_batch or batch
            out: dict[str, Any] = {
                "batch": batch,
                "pop_batch": pop_batch,
                "calls": calls,
                "semantics": args.semantics,
            }
            lease = args.semantics == "at-least-once"
            ref = f"instr_naive_{uuid.uuid4().hex[:8]}"
            naive = Target(BASELINE, dsn, ref, "at-most-once", False, "never")
            setup_target(naive)
            if not lease:
                ns = naive_sessions(dsn, naive.schema, batch)
                measure(
                    server, ns, batch=batch, calls=max(1, calls // 4), size=args.payload_bytes, who="naive"
                )
                out["naive"] = measure(
                    server, ns, batch=batch, calls=calls, size=args.payload_bytes, who="naive"
                )
            teardown_target(naive)

            schema = f"instr_{uuid.uuid4().hex[:10]}"
            with DbQueue(dsn, schema=schema) as dbq:
                dbq.install()
                dbq.create_queue(
                    QUEUE,
                    design="ring",
                    capacity=max(1024, 8 * calls * batch),
                    payload_type="bytes",
                    max_payload_bytes=max(args.payload_bytes, 16),
                    notify="never",
                )
            es = engine_sessions(dsn, schema, batch, args.semantics, "messages")
            measure(server, es, batch=batch, calls=max(1, calls // 4), size=args.payload_bytes, who="ring")
            out["ring"] = measure(server, es, batch=batch, calls=calls, size=args.payload_bytes, who="ring")
            with DbQueue(dsn, schema=schema) as dbq:
                dbq.uninstall()

            # Segments such that the long session's pushes (all before its pops) enter a fifth generation
            # exactly once: one rotation, which the consumers are far enough along for (the rows of
            # the warm-up's two sessions and the short one are popped by then).
            before = max(1, calls // 4) * 5 + calls
            seg_rows = -(-(before + 4 * calls) // 5)
            assert seg_rows + LANES <= before, "too few calls for one rotation"
            rows_schema = setup_rows(dsn, args.seg_rows or seg_rows)
            rs = rows_sessions(dsn, rows_schema, pop_batch, lease)
            measure(server, rs, batch=batch, calls=max(1, calls // 4), size=args.payload_bytes, who="rows")
            out["rows"] = measure(server, rs, batch=batch, calls=calls, size=args.payload_bytes, who="rows")
            for who in [w for w in ("naive", "ring", "rows") if w in out]:
                out[who] = {k: round(v) for k, v in out[who].items()}
                out[who]["cycle"] = out[who]["push"] + out[who]["pop"]
            line = json.dumps(out)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
