#!/usr/bin/env python
"""Server instructions a message of a push of 100, by layout element: a ladder of plain tables, counted.

    python benchmarks/layout_count.py [--rungs a0 a b ...] [--calls 10] [--depth 0] [--json]

The table design's push costs more than the naive queue's INSERT. This splits the difference by what
the table design's ``meta`` has that the naive table has not, one element at a time: each rung is a
table of its own in one schema (``lad``) and one prepared INSERT of ``--batch`` payloads (300 bytes,
every one different, ``cost.payloads``), ids from a sequence, ``RETURNING id`` unless the rung says
otherwise, run on a connection of its own under the counted server of ``instructions.py``
(cachegrind, autovacuum off). As there, a session of one call first (its pages and plans), then a
session of ``--calls`` calls and one of four times as many:

    instructions a message = (long session - short session) / (3 x calls x batch)

The rungs, named as the run prints them: ``a0`` the naive queue's table and statement (run.py's, no
ids back), ``a`` the same with ``RETURNING id``, ``a1`` that table in the ladder's statement form;
``b`` meta's 13 columns with a bigint primary key; ``c`` partitioned by gen as meta is (LIST, 8
partitions, the key (id, gen)); ``d`` the ready index instead of the key; ``e`` the three other partial
indexes too: meta's layout, the engine's INSERT as a bare statement. ``*_noidx`` rungs have no index,
``e_*`` rungs are ``e`` with one thing changed (what each prints). ``g*`` put the naive table inside
``table_push()``'s shell (a PL/pgSQL function with its settings, the queue's push lock, its floor, the
queue's row read in the INSERT), with and without the lock and the floor. The ``f_*`` rungs are the
engine's own push into a queue of a schema that ``DbQueue.install()`` made (engine defaults otherwise):
its INSERT as a statement of its own, that INSERT in the shell without ids back (a count), and
``table_push()`` called as the client calls it, with ``notify`` never (0) and auto (1).

With ``--depth N`` every rung's table (and the engine's queue) holds ``1.5 N`` rows before the counts,
the oldest ``N / 2`` deleted after a VACUUM (the engine's popped by its pop), as ``depth_count.py``
builds its queues: filled on a server of its own, which is then started again under cachegrind.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cost import payloads
from instructions import CountedServer

from airflow_dbqueue.engine import DbQueue

ENGINE = "eng"
QUEUE = "layout_q"

META_COLUMNS = (
    ("id", "bigint NOT NULL"),
    ("queue_id", "integer NOT NULL"),
    ("state", "smallint NOT NULL DEFAULT 0"),
    ("priority", "smallint NOT NULL DEFAULT 0"),
    ("attempts", "integer NOT NULL DEFAULT 0"),
    ("process_at", "timestamptz NOT NULL"),
    ("enqueued_at", "timestamptz NOT NULL"),
    ("lease_until", "timestamptz"),
    ("consumer", "text"),
    ("last_error", "text"),
    ("deliveries", "integer NOT NULL DEFAULT 0"),
    ("payload", "bytea"),
    ("gen", "smallint NOT NULL"),
)
VALUES = {
    "id": "y.id",
    "queue_id": "1",
    "state": "0::smallint",
    "priority": "0::smallint",
    "attempts": "0",
    "process_at": "now()",
    "enqueued_at": "now()",
    "lease_until": "NULL::timestamptz",
    "consumer": "NULL::text",
    "last_error": "NULL::text",
    "deliveries": "0",
    "payload": "y.payload",
    "gen": "((y.id >> 14) & 7)::smallint",
}
LEASE_SIDE = ("attempts", "enqueued_at", "lease_until", "consumer", "last_error", "deliveries")
"""The columns a push writes nothing of its own into (NULL or zero), which a side table could hold."""

READY = "(queue_id, priority DESC, process_at, id)"
OTHERS = (
    "(queue_id, lease_until) WHERE state = 1",
    "(id) WHERE lease_until IS NOT NULL",
    "(queue_id, id) WHERE state = 2",
)


class Rung:
    """One table and its INSERT: ``ddl`` makes the table ``lad.<name>`` (and its sequence), ``stmt`` is
    the INSERT with the payloads as ``%b``."""

    def __init__(
        self,
        name: str,
        what: str,
        *,
        columns: tuple[str, ...] | None = None,
        partitioned: bool = False,
        pk: str | None = None,
        ready: str | None = None,
        ready_where: str | None = "state = 0",
        others: tuple[str, ...] = (),
        heap_ff: int | None = None,
        returning: bool = True,
        gen_const: bool = False,
        gen_zero: bool = False,
        nullable: bool = False,
        stmt: str | None = None,
        ddl: list[str] | None = None,
    ) -> None:
        self.name, self.what = name, what
        self.columns = columns
        self.partitioned, self.pk, self.ready, self.ready_where = partitioned, pk, ready, ready_where
        self.others, self.heap_ff, self.returning, self.gen_const = others, heap_ff, returning, gen_const
        self._stmt, self._ddl = stmt, ddl
        self.gen_zero, self.nullable = gen_zero, nullable

    def ddl(self) -> list[str]:
        if self._ddl is not None:
            return self._ddl
        assert self.columns is not None
        t = f"lad.{self.name}"
        cols = ", ".join(
            f"{c} {d.replace(' NOT NULL', '') if self.nullable else d}"
            for c, d in META_COLUMNS
            if c in self.columns
        )
        with_ff = f" WITH (fillfactor = {self.heap_ff})" if self.heap_ff else ""
        out = [f"CREATE SEQUENCE lad.{self.name}_seq AS bigint"]
        if self.partitioned:
            out.append(f"CREATE TABLE {t} ({cols}) PARTITION BY LIST (gen)")
            for g in range(8):
                out.append(f"CREATE TABLE {t}_{g} PARTITION OF {t} FOR VALUES IN ({g}){with_ff}")
        else:
            out.append(f"CREATE TABLE {t} ({cols}){with_ff}")
        if self.pk:
            out.append(f"ALTER TABLE {t} ADD PRIMARY KEY {self.pk}")
        if self.ready:
            where = f" WHERE {self.ready_where}" if self.ready_where else ""
            if self.partitioned:
                for g in range(8):
                    out.append(
                        f"CREATE INDEX ON {t}_{g} {self.ready} "
                        "WITH (fillfactor = 100, deduplicate_items = off)"
                        f"{where}"
                    )
            opts = "" if self.partitioned else " WITH (fillfactor = 100, deduplicate_items = off)"
            out.append(f"CREATE INDEX ON {t} {self.ready}{opts}{where}")
        for o in self.others:
            out.append(f"CREATE INDEX ON {t} {o}")
        return out

    def stmt(self) -> str:
        if self._stmt is not None:
            return self._stmt
        assert self.columns is not None
        cols = [c for c, _ in META_COLUMNS if c in self.columns]
        vals = [VALUES[c] for c in cols]
        if self.gen_const:
            vals = [
                f"((currval('lad.{self.name}_seq') >> 14) & 7)::smallint" if c == "gen" else v
                for c, v in zip(cols, vals, strict=True)
            ]
        if self.gen_zero:
            vals = ["0::smallint" if c == "gen" else v for c, v in zip(cols, vals, strict=True)]
        ret = " RETURNING id" if self.returning else ""
        return (
            f"INSERT INTO lad.{self.name} ({', '.join(cols)}) SELECT {', '.join(vals)} "
            f"FROM (SELECT nextval('lad.{self.name}_seq') AS id, unnest(%b::bytea[]) AS payload) y{ret}"
        )


ALL = tuple(c for c, _ in META_COLUMNS)
NARROW = tuple(c for c in ALL if c not in LEASE_SIDE)


def ladder() -> list[Rung]:
    part = {"columns": ALL, "partitioned": True, "heap_ff": 90}
    return [
        Rung(
            "a0",
            "the naive queue's table and statement (no RETURNING)",
            ddl=["CREATE TABLE lad.a0 (id bigserial PRIMARY KEY, payload bytea NOT NULL)"],
            stmt="INSERT INTO lad.a0 (payload) SELECT unnest(%b::bytea[])",
        ),
        Rung(
            "a",
            "(a) naive table, RETURNING id",
            ddl=["CREATE TABLE lad.a (id bigserial PRIMARY KEY, payload bytea NOT NULL)"],
            stmt="INSERT INTO lad.a (payload) SELECT unnest(%b::bytea[]) RETURNING id",
        ),
        Rung("a1", "(a) in the ladder's statement form", columns=("id", "payload"), pk="(id)"),
        Rung("a1_noidx", "(a1) without its primary key", columns=("id", "payload")),
        Rung("b", "(b) meta's 13 columns, bigint PK", columns=ALL, pk="(id)"),
        Rung("b_noidx", "13 columns, no index", columns=ALL),
        Rung("c_noidx", "13 columns, partitioned by gen (8), no index", **part),
        Rung("c", "(c) 13 columns, partitioned, PK (id, gen)", pk="(id, gen)", **part),
        Rung("d", "(d) partitioned, the ready index alone", ready=READY, **part),
        Rung("e", "(e) + the three other partial indexes: meta's layout", ready=READY, others=OTHERS, **part),
        Rung("e_noret", "(e) without RETURNING", ready=READY, others=OTHERS, returning=False, **part),
        Rung(
            "e_unpart",
            "(e) not partitioned",
            columns=ALL,
            heap_ff=90,
            ready=READY,
            others=OTHERS,
        ),
        Rung("e_ff100", "(e) heap fillfactor 100", columns=ALL, partitioned=True, ready=READY, others=OTHERS),
        Rung(
            "e_genconst",
            "(e) gen from currval, not the row's id",
            ready=READY,
            others=OTHERS,
            gen_const=True,
            **part,
        ),
        Rung(
            "e_gen0",
            "(e) gen a constant (every row in partition 0)",
            ready=READY,
            others=OTHERS,
            gen_zero=True,
            **part,
        ),
        Rung(
            "e_nullable",
            "(e) without NOT NULL constraints",
            ready=READY,
            others=OTHERS,
            nullable=True,
            **part,
        ),
        Rung(
            "e_r3",
            "(e), ready index (queue_id, process_at, id)",
            ready="(queue_id, process_at, id)",
            others=OTHERS,
            **part,
        ),
        Rung("e_r2", "(e), ready index (queue_id, id)", ready="(queue_id, id)", others=OTHERS, **part),
        Rung("e_r1", "(e), ready index (id)", ready="(id)", others=OTHERS, **part),
        Rung(
            "e_rnoid",
            "(e), ready index (queue_id, priority DESC, process_at)",
            ready="(queue_id, priority DESC, process_at)",
            others=OTHERS,
            **part,
        ),
        Rung(
            "e_rnopred",
            "(e), ready index without its predicate",
            ready=READY,
            ready_where=None,
            others=OTHERS,
            **part,
        ),
        Rung(
            "e_lease_side",
            "7 columns (no attempts, enqueued_at, lease_until, consumer, last_error, deliveries), "
            "ready + failed index",
            columns=NARROW,
            partitioned=True,
            heap_ff=90,
            ready=READY,
            others=("(queue_id, id) WHERE state = 2",),
        ),
        Rung(
            "e_notext",
            "(e) without consumer and last_error (11 columns)",
            columns=tuple(c for c in ALL if c not in ("consumer", "last_error")),
            partitioned=True,
            heap_ff=90,
            ready=READY,
            others=OTHERS,
        ),
        Rung(
            "floor_7",
            "7 columns, not partitioned, ready index only",
            columns=NARROW,
            heap_ff=90,
            ready=READY,
        ),
    ]


def engine_rungs(qid: int) -> list[Rung]:
    s = ENGINE
    insert = (
        f"INSERT INTO {s}.meta (id, queue_id, state, priority, attempts, process_at, enqueued_at, "
        "lease_until, consumer, last_error, deliveries, payload, gen) "
        "SELECT y.id, y.queue_id, 0::smallint, 0::smallint, 0, now(), now(), NULL::timestamptz, NULL::text, "
        "NULL::text, 0, y.payload, ((y.id >> 14) & 7)::smallint "
        f"FROM (SELECT nextval('{s}.message_id_seq') AS id, x.queue_id, x.payload "
        f"FROM (SELECT q.queue_id, unnest(%b::bytea[]) AS payload FROM {s}.queues q "
        f"WHERE q.queue_id = {qid}) x) y "
        "RETURNING id"
    )

    def call(notify: int) -> str:
        return (
            f"SELECT * FROM {s}.table_push({qid}::integer, %b::bytea[], 0::smallint, 0::double precision, "
            f"{notify}::integer, 'layout_chan'::text, true)"
        )

    def g_shell(name: str, lock: bool, floor: bool) -> str:
        decl = ""
        if lock:
            decl += (
                "v_locked text := pg_advisory_xact_lock_shared(hashtext('dbqueue.queue.' || 'eng'), "
                "p_queue_id)::text; "
            )
        if floor:
            decl += f"v_floor timestamptz := {s}.table_floor(p_queue_id); "
        return (
            f"CREATE FUNCTION lad.push_{name}(p_queue_id integer, p_payloads bytea[]) RETURNS SETOF bigint "
            "LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$ "
            f"DECLARE {decl}BEGIN "
            f"RETURN QUERY INSERT INTO lad.{name} (id, payload) SELECT y.id, y.payload FROM (SELECT "
            f"nextval('lad.{name}_seq') AS id, x.payload "
            "FROM (SELECT q.queue_id, unnest(p_payloads) AS payload "
            f"FROM {s}.queues q WHERE q.queue_id = p_queue_id) x) y RETURNING id; END $$"
        )

    def g_rung(name: str, what: str, lock: bool, floor: bool) -> Rung:
        return Rung(
            name,
            what,
            ddl=[
                f"CREATE SEQUENCE lad.{name}_seq AS bigint",
                f"CREATE TABLE lad.{name} (id bigint PRIMARY KEY, payload bytea NOT NULL)",
                g_shell(name, lock, floor),
            ],
            stmt=f"SELECT * FROM lad.push_{name}({qid}, %b::bytea[])",
        )

    noids = (
        "CREATE FUNCTION lad.push_noids(p_queue_id integer, p_payloads bytea[]) RETURNS integer "
        "LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$ "
        "DECLARE v_locked text := pg_advisory_xact_lock_shared(hashtext('dbqueue.queue.' || 'eng'), "
        f"p_queue_id)::text; v_floor timestamptz := {s}.table_floor(p_queue_id); "
        "v_at timestamptz := greatest(now(), v_floor); v_n integer; BEGIN "
        f"INSERT INTO {s}.meta (id, queue_id, state, priority, attempts, process_at, enqueued_at, "
        "lease_until, consumer, last_error, deliveries, payload, gen) "
        "SELECT y.id, y.queue_id, 0::smallint, 0::smallint, 0, v_at, now(), NULL::timestamptz, NULL::text, "
        "NULL::text, 0, y.payload, ((y.id >> 14) & 7)::smallint "
        f"FROM (SELECT nextval('{s}.message_id_seq') AS id, x.queue_id, x.payload "
        f"FROM (SELECT q.queue_id, unnest(p_payloads) AS payload FROM {s}.queues q "
        "WHERE q.queue_id = p_queue_id) x) y; GET DIAGNOSTICS v_n = ROW_COUNT; RETURN v_n; END $$"
    )
    shell = (
        "CREATE FUNCTION lad.push_g(p_queue_id integer, p_payloads bytea[]) RETURNS SETOF bigint "
        "LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$ "
        "DECLARE v_locked text := pg_advisory_xact_lock_shared(hashtext('dbqueue.queue.' || 'eng'), "
        f"p_queue_id)::text; v_floor timestamptz := {s}.table_floor(p_queue_id); BEGIN "
        "RETURN QUERY INSERT INTO lad.g (id, payload) SELECT y.id, y.payload FROM (SELECT "
        "nextval('lad.g_seq') AS id, x.payload FROM (SELECT q.queue_id, unnest(p_payloads) AS payload "
        f"FROM {s}.queues q WHERE q.queue_id = p_queue_id) x) y RETURNING id; END $$"
    )
    return [
        Rung(
            "g",
            "the naive table (2 columns, bigint PK) inside table_push()'s shell: function, push lock, "
            "floor, queue row",
            ddl=[
                "CREATE SEQUENCE lad.g_seq AS bigint",
                "CREATE TABLE lad.g (id bigint PRIMARY KEY, payload bytea NOT NULL)",
                shell,
            ],
            stmt=f"SELECT * FROM lad.push_g({qid}, %b::bytea[])",
        ),
        g_rung("g_nolock", "(g) without the push lock", False, True),
        g_rung("g_nofloor", "(g) without the floor", True, False),
        g_rung(
            "g_bare", "(g) without the push lock and the floor (PL/pgSQL and the queue row)", False, False
        ),
        Rung(
            "f_noids",
            "(f) never, table_push()'s INSERT with no ids returned (a count instead)",
            ddl=[noids],
            stmt=f"SELECT lad.push_noids({qid}, %b::bytea[])",
        ),
        Rung("f_insert", "(f) the engine's INSERT as a statement of its own, real meta", stmt=insert, ddl=[]),
        Rung("f_never", "(f) table_push(), notify never", stmt=call(0), ddl=[]),
        Rung("f_auto", "(f) table_push(), notify auto (the default)", stmt=call(1), ddl=[]),
    ]


def setup(dsn: str, rungs: list[Rung]) -> int:
    with DbQueue(dsn, schema=ENGINE, recycle_interval=None) as dbq:
        dbq.install()
        dbq.create_queue(QUEUE, payload_type="bytes")  # engine defaults: archive, notify auto
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE SCHEMA lad")
        for r in rungs:
            for d in r.ddl():
                c.execute(d)
        row = c.execute(f"SELECT queue_id FROM {ENGINE}.queues WHERE name = %s", (QUEUE,)).fetchone()
    assert row is not None
    return int(row[0])


def fill(dsn: str, rungs: list[Rung], depth: int) -> None:
    """Every rung's table: 1.5 x depth rows, VACUUM, the oldest depth / 2 deleted; the engine's queue
    (once, for all its rungs) filled through its own INSERT and popped by its pop."""
    total, chunk = depth + depth // 2, 1000
    engine = [r for r in rungs if r.name.startswith("f_")]
    with psycopg.connect(dsn, autocommit=True) as c:
        for r in [r for r in rungs if not r.name.startswith("f_")] + engine[:1]:
            for k in range(0, total, chunk):
                c.execute(r.stmt(), (payloads(chunk, 300, 7, k // chunk),))
            if r.name.startswith("f_"):
                c.execute("VACUUM (ANALYZE) eng.meta")
                continue
            c.execute(f"VACUUM (ANALYZE) lad.{r.name}")
            c.execute(
                f"DELETE FROM lad.{r.name} WHERE id IN "
                f"(SELECT id FROM lad.{r.name} ORDER BY id LIMIT {depth // 2})"
            )
    if engine:
        with DbQueue(dsn, schema=ENGINE, recycle_interval=None) as dbq:
            q = dbq.queue(QUEUE)
            popped = 0
            while popped < depth // 2:
                n = len(q.pop_payloads(min(chunk, depth // 2 - popped)))
                if n == 0:
                    raise SystemExit("the engine's queue ran dry")
                popped += n


def per_message(
    server: CountedServer, dsn: str, rung: Rung, *, calls: int, batch: int, keep: Path | None = None
) -> float:
    stmt = rung.stmt()
    tag = [0]

    def session(n: int) -> set[int]:
        tag[0] += 1
        sent = [payloads(batch, 300, 100 + tag[0], k) for k in range(n)]
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as c:
            c.execute("SET plan_cache_mode = force_generic_plan")
            for b in sent:
                cur = c.execute(stmt, (b,))
                if cur.description is not None:
                    got = cur.fetchall()
                    if len(got) != len(b) and got != [(len(b),)]:  # ids, or f_noids's count
                        raise SystemExit(f"{rung.name}: {len(got)} ids for {len(b)} payloads")
            return {int(c.info.backend_pid)}

    server.counted(session(1))
    pids_short = session(calls)
    short = server.counted(pids_short)
    pids_long = session(4 * calls)
    long = server.counted(pids_long)
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        for which, pids in (("short", pids_short), ("long", pids_long)):
            for pid in pids:
                shutil.copy(server.out / f"backend.{pid}", keep / f"{rung.name}.{which}")
    return (long - short) / (3 * calls * batch)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rungs", nargs="*", help="names of the rungs to count (default: all)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--depth", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", type=Path, help="a folder to copy each rung's two cachegrind files into")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="dbqueue-layout-"))
    root.chmod(0o755)
    server = CountedServer(root)
    out: list[dict[str, Any]] = []
    try:
        started = time.monotonic()
        dsn = server.pg.start() if args.depth else server.start()
        rungs = ladder()
        qid = setup(dsn, rungs)
        extra = engine_rungs(qid)
        with psycopg.connect(dsn, autocommit=True) as c:
            for r in extra:
                for d in r.ddl():
                    c.execute(d)
        rungs += extra
        if args.rungs:
            rungs = [r for r in rungs if r.name in args.rungs]
        if args.depth:
            fill(dsn, rungs, args.depth)
            server.pg.stop()
            dsn = server.start(timeout=600)
        fill_s = time.monotonic() - started
        with psycopg.connect(dsn) as c:
            version = c.execute("SHOW server_version").fetchone()
        for r in rungs:
            n = per_message(server, dsn, r, calls=args.calls, batch=args.batch, keep=args.keep)
            line = {
                "point": "layout_count",
                "rung": r.name,
                "what": r.what,
                "instructions": round(n),
                "batch": args.batch,
                "calls": args.calls,
                "depth": args.depth,
                "payload_bytes": 300,
                "server_version": version[0] if version else None,
                "fill_s": round(fill_s, 1),
            }
            out.append(line)
            print(json.dumps(line) if args.json else f"{r.name:14} {round(n):>8,}  {r.what}", flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
