#!/usr/bin/env python
"""Server instructions a message: what each side of a queue costs PostgreSQL, counted, not timed.

    python benchmarks/instructions.py [--design ring ring-rows table] [--batch 1 100 1000] [--json]
        [--client] [--semantics at-least-once [--archive]] [--hold no|yes|both] [--rows-capacity N]
        [--notify never|auto|always]

``run.py`` and ``cost.py`` time what they measure, so on a shared machine their figures move with
whatever else runs (runs of 10 s vary by 15% here). This counts instead: it starts a throwaway
PostgreSQL server under valgrind's cachegrind (``--cache-sim=no``: instructions only, the same count
for the same work whatever the load), and for each design and batch size runs sessions of its own,
each one connection that pushes or pops and then closes, so that its backend exits and cachegrind
writes what that backend executed. A session of ``--calls`` calls and one of four times as many
differ only by the calls between them (connecting, reading the queue and closing cancel out), so

    instructions a message = (long session - short session) / (extra calls x batch)

for a push (``push`` or ``push_batch``) and a pop at most once (``pop``), through the engine's API, and
for the naive queue's statements (``run.py``'s, in binary) in the same server. Only the backend's own
work is counted: parse, plan, execute and commit, with its WAL insertion and flush calls; not the WAL
writer, the checkpointer or the client. Autovacuum is off, so that no background worker runs meanwhile
(the naive queue's dead rows cost it nothing here that VACUUM would later do). Every pop session's
payloads are counted and checksummed against what its push session sent, as ``cost.py`` does.

The queues are created with ``notify="never"`` unless ``--notify`` says ``auto`` (the engine's default:
a push asks whether the queue had a ready message before it, and notifies when it had none) or
``always``; the naive queue never notifies.

With ``--semantics at-least-once`` a pop session acks each pop after it (the ``pop`` side counts both),
and the reference is PGMQ's statements instead (``run.py --pgmq``'s: a read that sets the visibility
time, then the delete of what it read, or with ``--archive`` its move to the archive table, as the
table design's queue then keeps finished messages for the archiver).

With ``--pop claim`` (and ``--semantics at-least-once``) a pop session claims batches of ``--batch``
messages instead (``claim_batch``), reads each by its receipts (``leased()``) and acks it whole
(``ack_batch``): what a batch's cycle costs the server, on the reference's read and delete.

With ``--feature`` the table design (and a ring of the rows layout, which has all three) is
also counted with one of the push options on every message, each in a queue of its own beside the
default one, in the same server: ``ordering`` (a queue created with ``ordering="per_key"``, every
push naming one of ``--ordering-keys`` keys in turn, 1,000 unless told, a row for each count given),
``dedup`` (a deduplication key on every message, none seen before) and
``ttl`` (a queue created with a time to live, which every message then carries). Each such row names its
feature (``none`` for the default queue) and, for ``ordering``, its ``ordering_keys``; the difference to
the ``none`` row of the same batch is what the feature costs on the hot path. With fewer keys than a
batch, a pop gets at most one message a key that is not in flight (at most once, the head of each key),
so an ordering pop session pops until it has every message of its push session: its count is still
instructions a message, over more calls. The pops' expiry sweep is not
counted (as the lease reclaim, it runs at most once a reclaim interval, not once a pop).

With ``--client`` each session runs instead in a Python process of its own under cachegrind too, and
the client's instructions a message are counted the same way: psycopg's encoding and decoding and,
for the engine, its API (pool checkout, checks, building a ``Message`` a message), against the naive
queue's bare psycopg calls. The pop sessions send what they popped back to be checked.

``ring`` is the ring of the slots layout, ``ring-rows`` a ring of the rows layout
(``create_queue(..., design="ring", layout="rows")``, PostgreSQL only). ``--rows-capacity`` sets the
rows ring's capacity in pushes (default: room for every push of its sessions, so that none rotates a
segment); a small one (a multiple of 4, at least 64) makes the pushes rotate segments, as a ring under
a steady load does, once the sessions have pushed more rows than it holds (each row says how many
rotations all its sessions made, ``rows_rotations``).

With ``--hold yes`` every count (the reference's and each design's) is taken with the xmin horizon
held, as ``run.py --hold-horizon`` holds it: a session of its own, not counted, opens a ``REPEATABLE
READ`` transaction, takes a transaction id and a snapshot (a read of ``pg_class``, no lock on the
queue's tables) before the warm-up, and keeps them until the count's sessions are done; ``--hold
both`` counts every batch without the hold and then with it, in the same server. Each row says
``hold`` and, held, the holder's ``xmin`` age when its sessions ended (``hold_xmin_age``).

Needs valgrind (Debian's ``valgrind``) and the PostgreSQL binaries the embedded default uses. Under
cachegrind the server runs about 50 times slower: the default run takes a few minutes, about three
times as long with ``--client`` (each session starts a Python under cachegrind).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from array import array
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.backends import (  # benchmarks/ is a folder of scripts
    BASELINE,
    PGMQ,
    RING_ROWS,
    PgmqBackend,
    Target,
    naive_statements,
    setup_target,
    teardown_target,
)
from cost import check, payloads

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.embedded import EmbeddedPostgres, free_port
from airflow_dbqueue.engine.ring_base import RING_DEFAULT_LANES

QUEUE = "instr_q"
FEATURES = ("none", "ordering", "dedup", "ttl")
"""The table design's push options --feature counts, each on every message (see the docstring)."""
RING_ROWS_FEATURES = ("none", "ordering", "dedup", "ttl")
"""The push options a ring of the rows layout has, which --feature counts on it too."""
ORDERING_KEYS = 1000
"""How many ordering keys the pushes of ``ordering`` name in turn unless --ordering-keys says."""
QUEUE_OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "ordering": {"ordering": "per_key"},
    "dedup": {},
    "ttl": {"ttl": 3600.0},
}
# The pop sessions collect payloads in C (map), so that the client's count is the queue's work.
_payload = attrgetter("payload")
_first = itemgetter(0)
SIDES = ("push", "pop")


class CountedServer:
    """A PostgreSQL server whose every process runs under cachegrind; each backend's count is read
    from the file cachegrind writes when it exits."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.out = root / "counts"
        self.pg = EmbeddedPostgres(root / "data", port=free_port())
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> str:
        valgrind = shutil.which("valgrind")
        if valgrind is None:
            raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
        self.pg.initdb()
        bin_dir = self.pg._prepare()  # the embedded server's binaries, and its user when root
        self.out.mkdir(mode=0o777)
        self.out.chmod(0o777)
        cmd = [
            valgrind,
            "--tool=cachegrind",
            "--cache-sim=no",
            "--trace-children=yes",
            f"--cachegrind-out-file={self.out}/backend.%p",
            str(bin_dir / "postgres"),
            "-D",
            str(self.pg.data_dir),
        ]
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.pg.port),
            "unix_socket_directories": "",
            "shared_buffers": "256MB",
            "autovacuum": "off",
            "max_connections": "20",
            "logging_collector": "off",
        }
        for k, v in settings.items():
            cmd += ["-c", f"{k}={v}"]
        with open(self.root / "server.log", "ab") as log:
            self.process = subprocess.Popen(  # type: ignore[call-overload]
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **self.pg._run_kwargs()
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.pg.dsn, connect_timeout=5):
                    return self.pg.dsn
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(
                        f"the server under cachegrind did not start; see {self.root / 'server.log'}"
                    ) from None
                time.sleep(0.5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            # SIGQUIT: an immediate shutdown. Every count was read before, and the data directory is
            # deleted next: a fast shutdown's checkpoint, which took about 5 s under cachegrind, is of
            # no use.
            os.killpg(self.process.pid, signal.SIGQUIT)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()

    def counted(self, pids: set[int], timeout: float = 120.0) -> int:
        """The instructions of the backends ``pids``, once each has ended and cachegrind has written
        its file (as the process exits)."""
        deadline = time.monotonic() + timeout
        while True:
            total, complete = 0, True
            for pid in pids:
                path = self.out / f"backend.{pid}"
                lines = path.read_text().splitlines() if path.exists() else []
                summary = [line for line in lines if line.startswith("summary:")]
                if not summary:
                    complete = False
                    break
                total += int(summary[0].split()[1])
            if complete:
                return total
            if time.monotonic() > deadline:
                raise SystemExit(f"the counts of backends {sorted(pids)} were not written in time")
            time.sleep(0.1)


@contextlib.contextmanager
def counted_server() -> Iterator[CountedServer]:
    root = Path(tempfile.mkdtemp(prefix="dbqueue-instr-"))
    root.chmod(0o755)
    server = CountedServer(root)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def sent_for(batch: int, calls: int, size: int, tag: int) -> list[list[bytes]]:
    return [payloads(batch, size, tag, k) for k in range(calls)]


Sessions = tuple[Callable[[list[list[bytes]]], set[int]], Callable[[int], tuple[list[bytes], set[int]]]]


def _pid(dbq: DbQueue) -> int:
    with dbq.db.connection() as c:  # type: ignore[attr-defined] # its backend, to count it
        return int(c.info.backend_pid)


def claim_cycle(q: Any, batch: int) -> list[bytes]:
    """A batch's cycle: up to ``batch`` messages claimed, read by their receipts, acked whole; their
    payloads."""
    claimed = q.claim_batch(batch)
    if claimed is None:
        return []
    got = list(map(_payload, q.leased(claimed.receipts)))
    q.ack_batch(claimed.batch_id)
    return got


def engine_sessions(
    dsn: str,
    schema: str,
    batch: int,
    semantics: str = "at-most-once",
    pop_api: str = "payloads",
    *,
    pooler: str = "none",
    feature: str = "none",
    ordering_keys: int = ORDERING_KEYS,
) -> Sessions:
    """A push session and a pop session through the engine, each on one pooled connection; each
    returns the backends it used. At least once, the pop session acks each pop after it; at most once
    it pops with ``pop_payloads`` (``pop_api`` "payloads") or with ``pop``, which builds messages;
    ``pop_api`` "claim" (at least once): it claims batches instead, reads each by ``leased()`` and acks it
    with ``ack_batch``.
    ``pooler="transaction"``: the engine as it runs behind a transaction pooler (nothing prepared).
    ``feature``: the push option every message carries (``FEATURES``; the queue was created for it);
    ``ordering_keys``: how many keys the pushes of ``ordering`` name in turn."""

    def push(sent: list[list[bytes]]) -> set[int]:
        # Keys are made before the session's first push, so that the client's count (--client) of a
        # feature is the engine's work with them, not the making of the strings.
        n = sum(map(len, sent))
        okeys = [f"k{i % ordering_keys}" for i in range(n)] if feature == "ordering" else None
        dkeys = [f"{uuid.uuid4().hex}-{i}" for i in range(n)] if feature == "dedup" else None
        at = 0
        with DbQueue(dsn, schema=schema, pool_size=1, pooler=pooler, recycle_interval=None) as dbq:
            q = dbq.queue(QUEUE)
            pids = {_pid(dbq)}
            for b in sent:
                keys = None if okeys is None else okeys[at : at + len(b)]
                dedup = None if dkeys is None else dkeys[at : at + len(b)]
                at += len(b)
                if batch == 1 and keys is None and dedup is None:
                    q.push(b[0])
                else:
                    q.push_batch(b, keys=keys, dedup_keys=dedup)
            pids.add(_pid(dbq))
        return pids

    def pop(calls: int) -> tuple[list[bytes], set[int]]:
        got: list[bytes] = []
        with DbQueue(dsn, schema=schema, pool_size=1, pooler=pooler, recycle_interval=None) as dbq:
            q = dbq.queue(QUEUE)
            q.reclaim_every = float("inf")  # type: ignore[attr-defined] # no reclaim between pops
            pids = {_pid(dbq)}
            for _ in range(calls):
                if pop_api == "claim":
                    got.extend(claim_cycle(q, batch))
                    continue
                if payloads_only:
                    got.extend(q.pop_payloads(batch))
                    continue
                msgs = q.pop(batch, semantics=semantics)
                got.extend(map(_payload, msgs))
                if lease:
                    q.ack(msgs)
            # Ordered per key, a pop takes at most one message a key that is not in flight: with fewer
            # keys than a batch, the calls above leave messages, which further pops take (a pop that
            # finds none ends the session, and the check of what came out then fails).
            while feature == "ordering" and len(got) < calls * batch:
                if payloads_only:
                    more = q.pop_payloads(batch)
                    got.extend(more)
                    if not more:
                        break
                    continue
                msgs = q.pop(batch, semantics=semantics)
                if not msgs:
                    break
                got.extend(map(_payload, msgs))
                if lease:
                    q.ack(msgs)
            pids.add(_pid(dbq))
        return got, pids

    lease = semantics == "at-least-once"
    payloads_only = not lease and pop_api == "payloads"
    return push, pop


def naive_sessions(dsn: str, schema: str, batch: int, pooler: str = "none") -> Sessions:
    push_sql, pop_sql = naive_statements(schema)
    # Behind a transaction pooler nothing may be prepared. Otherwise each statement is prepared at its
    # first run, as the engine prepares its hot statements: prepared after five runs (psycopg's default),
    # a short session of four calls ran each one unprepared and the long session five, so the difference
    # of the two counted a parse and a plan more than the calls between them (about 500 instructions a
    # message of a naive push of 100, cachegrind).
    threshold = None if pooler == "transaction" else 0

    def push(sent: list[list[bytes]]) -> set[int]:
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=threshold) as c:
            for b in sent:
                c.execute(push_sql, (b,))
            return {c.info.backend_pid}

    def pop(calls: int) -> tuple[list[bytes], set[int]]:
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=threshold) as c:
            got: list[bytes] = []
            for _ in range(calls):
                got.extend(map(_first, c.execute(pop_sql, (batch,), binary=True).fetchall()))
            return got, {c.info.backend_pid}

    return push, pop


def pgmq_sessions(target: Target, batch: int) -> Sessions:
    """PGMQ's statements (run.py's, in binary) as a push session and a pop session: at least once, each
    pop (a read that sets the visibility time) followed by the delete of what it read, or its archive
    when ``target.archive``."""

    def push(sent: list[list[bytes]]) -> set[int]:
        b = PgmqBackend(target)
        try:
            for payloads_ in sent:
                b.push(payloads_)
            return {b.conn.info.backend_pid}
        finally:
            b.close()

    def pop(calls: int) -> tuple[list[bytes], set[int]]:
        b = PgmqBackend(target)
        got: list[bytes] = []
        try:
            for _ in range(calls):
                payloads_, token = b.pop(batch)
                got.extend(payloads_)
                b.ack(token)
            return got, {b.conn.info.backend_pid}
        finally:
            b.close()

    return push, pop


def sessions_of(who: str, dsn: str, schema: str, batch: int, pop_api: str) -> Sessions:
    if who == "naive":
        return naive_sessions(dsn, schema, batch)
    return engine_sessions(dsn, schema, batch, pop_api=pop_api)


class CountedClient:
    """Sessions run each in a Python process of its own under cachegrind (``--child``): ``counts``
    collects, per side, the client's instructions of each session in turn."""

    def __init__(self, root: Path, who: str, dsn: str, schema: str, batch: int, *, pop_api: str) -> None:
        self.root, self.who, self.dsn, self.schema, self.batch = root, who, dsn, schema, batch
        self.pop_api = pop_api
        self.counts: dict[str, list[int]] = {side: [] for side in SIDES}
        self._runs = 0

    def _child(self, spec: dict[str, Any]) -> dict[str, Any]:
        self._runs += 1
        out = self.root / f"client.{self._runs}"
        proc = subprocess.run(
            [
                "valgrind",
                "--tool=cachegrind",
                "--cache-sim=no",
                f"--cachegrind-out-file={out}",
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
            ],
            input=json.dumps(
                {
                    "who": self.who,
                    "dsn": self.dsn,
                    "schema": self.schema,
                    "batch": self.batch,
                    "pop_api": self.pop_api,
                    **spec,
                }
            ),
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},  # the same dicts' layout in every session
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"{self.who} {spec['side']} session failed:\n{proc.stderr[-3000:]}")
        summary = [line for line in out.read_text().splitlines() if line.startswith("summary:")]
        self.counts[spec["side"]].append(int(summary[0].split()[1]))
        result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
        return result

    def sessions(self) -> Sessions:
        # Payloads travel through files, joined and split in C: a few hundred instructions a message
        # in the child, the same for both queues, against tens of thousands through JSON.
        def push(sent: list[list[bytes]]) -> set[int]:
            path = self.root / "sent.bin"
            flat = [p for b in sent for p in b]
            path.write_bytes(b"".join(flat))
            sizes = self.root / "sent.len"
            sizes.write_bytes(array("I", map(len, flat)).tobytes())
            spec = {"side": "push", "calls": len(sent), "path": str(path), "sizes": str(sizes)}
            return set(self._child(spec)["pids"])

        def pop(calls: int) -> tuple[list[bytes], set[int]]:
            path, sizes = self.root / "got.bin", self.root / "got.len"
            r = self._child({"side": "pop", "calls": calls, "path": str(path), "sizes": str(sizes)})
            return split(path.read_bytes(), array("I", sizes.read_bytes())), set(r["pids"])

        return push, pop


def split(blob: bytes, sizes: Iterable[int]) -> list[bytes]:
    out, at = [], 0
    for n in sizes:
        out.append(blob[at : at + n])
        at += n
    return out


def child(spec: dict[str, Any]) -> None:
    """One session of a ``CountedClient``, in this process: print its backends as one JSON line; a pop
    writes what it popped to the files named."""
    push, pop = sessions_of(spec["who"], spec["dsn"], spec["schema"], spec["batch"], spec["pop_api"])
    path, sizes = Path(spec["path"]), Path(spec["sizes"])
    if spec["side"] == "push":
        flat = split(path.read_bytes(), array("I", sizes.read_bytes()))
        batch = spec["batch"]
        pids = push([flat[k * batch : (k + 1) * batch] for k in range(spec["calls"])])
    else:
        got, pids = pop(spec["calls"])
        path.write_bytes(b"".join(got))
        sizes.write_bytes(array("I", map(len, got)).tobytes())
    print(json.dumps({"pids": sorted(pids)}))


def measure(
    server: CountedServer,
    sessions: Sessions,
    *,
    batch: int,
    calls: int,
    size: int,
    who: str,
    client: CountedClient | None = None,
) -> dict[str, float]:
    """Instructions a message, per side: the server's, and with ``client`` (whose sessions these are)
    the client's as ``client_push`` and ``client_pop``."""
    push, pop = sessions
    counts: dict[str, list[int]] = {"push": [], "pop": []}
    for tag, n in enumerate((calls, 4 * calls)):
        sent = sent_for(batch, n, size, tag)
        counts["push"].append(server.counted(push(sent)))
        got, pids = pop(n)
        counts["pop"].append(server.counted(pids))
        check(sent, got, who)
    extra = 3 * calls * batch
    got_per = {side: (counts[side][1] - counts[side][0]) / extra for side in SIDES}
    if client is not None:
        for side in SIDES:
            short, long = client.counts[side][-2:]
            got_per[f"client_{side}"] = (long - short) / extra
    return got_per


class HeldHorizon:
    """A held xmin horizon (``--hold``): a ``REPEATABLE READ`` transaction on a connection of its own
    that took a transaction id and a snapshot, open until :meth:`release`."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, application_name="dbqueue-instr-hold")
        self.conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        row = self.conn.execute("SELECT txid_current(), pg_backend_pid()").fetchone()
        assert row is not None
        self.pid = int(row[1])
        self.conn.execute("SELECT count(*) FROM pg_catalog.pg_class").fetchone()

    def age(self, dsn: str) -> int:
        """The holder's xmin age now; fails when the hold is not held any more."""
        with psycopg.connect(dsn, autocommit=True) as c:
            row = c.execute(
                "SELECT age(backend_xmin), state FROM pg_stat_activity WHERE pid = %s", (self.pid,)
            ).fetchone()
        if row is None or row[0] is None or row[1] != "idle in transaction":
            raise SystemExit(f"the held horizon was not held to the end of the count: {row}")
        return int(row[0])

    def release(self) -> None:
        if not self.conn.closed:
            self.conn.rollback()
            self.conn.close()


HOLDS = {"no": (False,), "yes": (True,), "both": (False, True)}
"""--hold: the counts of each batch, without and with the horizon held."""

DESIGNS = ("ring", RING_ROWS, "table")
"""The engine designs counted: the ring (slots layout), the ring of the rows layout, the table design."""


def variants(args: argparse.Namespace) -> list[tuple[str, str, int | None]]:
    """What each batch counts, a row each, in order: every design; the table design once a feature
    (``--feature``), a ring of the rows layout once a feature it has (all three); ``ordering`` once a
    number of keys (``--ordering-keys``), which it names."""
    return [
        (d, f, k)
        for d in args.design
        for f in (
            args.feature
            if d == "table"
            else [f for f in args.feature if f in RING_ROWS_FEATURES]
            if d == RING_ROWS
            else ["none"]
        )
        for k in (args.ordering_keys if f == "ordering" else [None])
    ]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with counted_server() as server, contextlib.ExitStack() as holds:
        dsn = server.pg.dsn
        lease = args.semantics == "at-least-once"
        ref_name = PGMQ if lease else BASELINE
        for batch, held in [(b, h) for b in args.batch for h in HOLDS[args.hold]]:
            hold = HeldHorizon(dsn) if held else None
            if hold is not None:
                holds.callback(hold.release)
            calls = args.calls or (40 if batch == 1 else 4)
            naive_schema = f"instr_{ref_name}_{uuid.uuid4().hex[:8]}"
            reference = Target(
                ref_name, dsn, naive_schema, args.semantics, args.archive, "never", pooler=args.pooler
            )
            setup_target(reference)
            naive_client = (
                CountedClient(server.root, "naive", dsn, naive_schema, batch, pop_api=args.pop)
                if args.client
                else None
            )
            in_process = (
                pgmq_sessions(reference, batch)
                if lease
                else naive_sessions(dsn, naive_schema, batch, args.pooler)
            )
            naive = naive_client.sessions() if naive_client else in_process
            # The warm-up writes the table's first pages and sequence values; its counts are not kept, so
            # its sessions run in this process even with --client (a Python under cachegrind takes
            # seconds to start).
            measure(
                server,
                in_process,
                batch=batch,
                calls=max(1, calls // 4),
                size=args.payload_bytes,
                who=ref_name,
            )
            ref = measure(
                server,
                naive,
                batch=batch,
                calls=calls,
                size=args.payload_bytes,
                who=ref_name,
                client=naive_client,
            )
            for design, feature, keys in variants(args):
                schema = f"instr_{uuid.uuid4().hex[:10]}"
                with DbQueue(dsn, schema=schema) as dbq:
                    dbq.install()
                    if design == "ring":
                        dbq.create_queue(
                            QUEUE,
                            design="ring",
                            layout="slots",
                            capacity=max(1024, 8 * calls * batch),
                            payload_type="bytes",
                            max_payload_bytes=max(args.payload_bytes, 16),
                            notify=args.notify,
                        )
                    elif design == RING_ROWS:
                        # capacity counts rows: every push of the warm-up's and the two counted
                        # sessions' (5 x calls, then 5 x calls / 4) with room to spare, so that no
                        # push waits for a segment; ordered per key, a push takes a row a lane
                        # (RING_DEFAULT_LANES of them), and a segment holds a whole number of pushes
                        rows_per_push = RING_DEFAULT_LANES if feature == "ordering" else 1
                        dbq.create_queue(
                            QUEUE,
                            design="ring",
                            layout="rows",
                            capacity=(args.rows_capacity or max(64, 32 * calls)) * rows_per_push,
                            payload_type="bytes",
                            max_payload_bytes=max(args.payload_bytes, 16),
                            notify=args.notify,
                            **QUEUE_OPTIONS[feature],
                        )
                    else:
                        dbq.create_queue(
                            QUEUE,
                            payload_type="bytes",
                            notify=args.notify,
                            archive=args.archive,
                            **QUEUE_OPTIONS[feature],
                        )
                try:
                    engine_client = (
                        CountedClient(server.root, design, dsn, schema, batch, pop_api=args.pop)
                        if args.client
                        else None
                    )
                    in_proc = engine_sessions(
                        dsn,
                        schema,
                        batch,
                        args.semantics,
                        args.pop,
                        pooler=args.pooler,
                        feature=feature,
                        ordering_keys=keys or ORDERING_KEYS,
                    )
                    sessions = engine_client.sessions() if engine_client else in_proc
                    measure(  # warm-up, in this process (as above)
                        server,
                        in_proc,
                        batch=batch,
                        calls=max(1, calls // 4),
                        size=args.payload_bytes,
                        who=design,
                    )
                    got = measure(
                        server,
                        sessions,
                        batch=batch,
                        calls=calls,
                        size=args.payload_bytes,
                        who=design,
                        client=engine_client,
                    )
                finally:
                    with DbQueue(dsn, schema=schema) as dbq:
                        # the rows ring's segments rotated in by all its sessions: a segment k labelled
                        # generation g was emptied (g - k) / 4 times
                        gens = (
                            dbq.queue(QUEUE).stats().extra["segment_generations"]
                            if design == RING_ROWS
                            else None
                        )
                        dbq.uninstall()
                results.append(
                    {
                        "design": design,
                        "feature": feature,
                        "ordering_keys": keys,
                        "batch": batch,
                        "hold": held,
                        "hold_xmin_age": None if hold is None else hold.age(dsn),
                        "rows_capacity": (args.rows_capacity or max(64, 32 * calls))
                        if design == RING_ROWS
                        else None,
                        "rows_rotations": None
                        if gens is None
                        else sum((g - k) // 4 for k, g in enumerate(gens)),
                        "payload_bytes": args.payload_bytes,
                        "semantics": args.semantics,
                        "archive": args.archive,
                        "pop": args.pop if args.semantics == "at-most-once" else "messages",
                        # the reference's figures are under naive_*, whichever it is
                        "reference": ref_name,
                        "pooler": args.pooler,
                        "notify": args.notify,
                        **{f"{s}_instructions": round(got[s]) for s in SIDES},
                        **{f"naive_{s}_instructions": round(ref[s]) for s in SIDES},
                        "cycle_instructions": round(got["push"] + got["pop"]),
                        "naive_cycle_instructions": round(ref["push"] + ref["pop"]),
                    }
                )
                if args.client:
                    for side in SIDES:
                        results[-1][f"client_{side}_instructions"] = round(got[f"client_{side}"])
                        results[-1][f"naive_client_{side}_instructions"] = round(ref[f"client_{side}"])
                    for prefix in ("", "naive_"):
                        r = results[-1]
                        r[f"{prefix}client_cycle_instructions"] = (
                            r[f"{prefix}client_push_instructions"] + r[f"{prefix}client_pop_instructions"]
                        )
                what = feature if keys is None else f"{feature} over {keys} keys"
                print(
                    f"measured {design} ({what}) batch {batch}{' held' if held else ''}",
                    file=sys.stderr,
                    flush=True,
                )
            teardown_target(reference)
            if hold is not None:
                hold.release()
    return results


def table(results: list[dict[str, Any]]) -> str:
    first = results[0] if results else {}
    ref = first.get("reference", "naive")
    lines = [
        f"server instructions a message (backend only; cachegrind), {first.get('semantics')}"
        f"{', archive' if first.get('archive') else ''}"
        f"{', notify ' + str(first['notify']) if first.get('notify', 'never') != 'never' else ''}"
        f", {first.get('payload_bytes')}-byte payloads"
        + (" (pop: a pop and its ack)" if first.get("semantics") == "at-least-once" else "")
        if results
        else "",
        f"{'design':8s}{'feature':>15s}{'batch':>7s}{'held':>5s}  "
        f"{'side':6s}{'design':>12s}{ref:>12s}{'ratio':>8s}",
    ]
    for r in results:
        for side in (*SIDES, "cycle"):
            d, b = r[f"{side}_instructions"], r[f"naive_{side}_instructions"]
            feature = r["feature"] if r.get("ordering_keys") is None else f"ordering/{r['ordering_keys']}"
            where = f"{r['design']:8s}{feature:>15s}{r['batch']:>7d}{'yes' if r.get('hold') else 'no':>5s}"
            lines.append(f"{where}  {side:6s}{d:>12,d}{b:>12,d}{d / b:>8.2f}")
    clients = [r for r in results if "client_cycle_instructions" in r]
    if clients:
        lines += ["", "client instructions a message (the Python process; cachegrind)"]
        for r in clients:
            for side in (*SIDES, "cycle"):
                d, b = r[f"client_{side}_instructions"], r[f"naive_client_{side}_instructions"]
                lines.append(f"{r['design']:8s}{r['batch']:>7d}  {side:6s}{d:>12,d}{b:>12,d}{d / b:>8.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--design",
        nargs="+",
        choices=DESIGNS,
        help=f"designs to count (default: {', '.join(DESIGNS)})",
    )
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 100, 1000])
    ap.add_argument(
        "--calls", type=int, default=0, help="calls of the short session (default 40 at batch 1, else 4)"
    )
    ap.add_argument("--payload-bytes", type=int, default=300)
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    ap.add_argument("--client", action="store_true", help="count the client's instructions too")
    ap.add_argument(
        "--semantics",
        choices=("at-most-once", "at-least-once"),
        default="at-most-once",
        help="at least once, a pop session acks each pop, and the reference is PGMQ's read and delete",
    )
    ap.add_argument(
        "--archive",
        action="store_true",
        help="the table design keeps finished messages for the archiver; PGMQ archives instead of deleting",
    )
    ap.add_argument(
        "--pop",
        choices=("payloads", "messages", "claim"),
        default="payloads",
        help="at most once, the engine pops with pop_payloads (default) or with pop, which builds messages; "
        "claim (with --semantics at-least-once): it claims batches, reads each by leased() and acks it "
        "with ack_batch (the reference still reads and deletes)",
    )
    ap.add_argument(
        "--notify",
        choices=("never", "auto", "always"),
        default="never",
        help="every design's queue is created with this notify setting (default never; the engine's "
        "default is auto: a push asks whether the queue had a ready message, and notifies when not)",
    )
    ap.add_argument(
        "--pooler",
        choices=("none", "transaction"),
        default="none",
        help="transaction: every side as it runs behind a transaction pooler, nothing prepared (the "
        "server's work is what a pooler in transaction mode passes on; the pooler's own is not counted)",
    )
    ap.add_argument(
        "--feature",
        nargs="+",
        choices=FEATURES,
        default=["none"],
        help="the table design's queues to count: none (the default queue) and each push option on every "
        "message (ordering per key over --ordering-keys keys, a dedup key, a ttl), each a queue of its own",
    )
    ap.add_argument(
        "--ordering-keys",
        nargs="+",
        type=int,
        default=[ORDERING_KEYS],
        help=f"keys the pushes of --feature ordering name in turn, a row each (default {ORDERING_KEYS})",
    )
    ap.add_argument(
        "--hold",
        choices=tuple(HOLDS),
        default="no",
        help="count with the xmin horizon held (a REPEATABLE READ transaction with a snapshot, open over "
        "the sessions, as run.py --hold-horizon holds it): yes, or both (without, then with, each batch)",
    )
    ap.add_argument(
        "--rows-capacity",
        type=int,
        default=0,
        help="the rows ring's capacity in pushes, a multiple of 4, at least 64 (default: room for every "
        "push of its sessions, so that none rotates a segment; a smaller one makes pushes rotate)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a session of --client (stdin)
    args = ap.parse_args(argv)
    if args.design is None:
        args.design = list(DESIGNS)
    if any(b < 1 for b in args.batch) or args.calls < 0 or args.payload_bytes < 16:
        ap.error("batches must be at least 1, --calls at least 0, --payload-bytes at least 16")
    if args.rows_capacity and (args.rows_capacity < 64 or args.rows_capacity % 4):
        ap.error("--rows-capacity must be a multiple of 4, at least 64")
    if args.client and args.semantics != "at-most-once":
        ap.error("--client counts pops at most once only")
    if args.pop == "claim" and args.semantics != "at-least-once":
        ap.error("--pop claim needs --semantics at-least-once (a batch is leased)")
    if any(k < 1 for k in args.ordering_keys):
        ap.error("--ordering-keys must be at least 1")
    if args.client and args.feature != ["none"]:
        ap.error("--client counts the default queue only (--feature none)")
    if args.client and args.pooler != "none":
        ap.error("--client counts the clients straight to the server only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(json.load(sys.stdin))
        return 0
    results = run(args)
    print(json.dumps(results) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
