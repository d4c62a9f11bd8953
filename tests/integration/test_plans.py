"""Query plans that keep the hot path fast. These check plan shapes and settings, never timings.

Both guard regressions that the benchmark found: pops stuck on a generic plan built while the queue
was empty (sequential scans of meta and data), and acks that walked every leased message.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import psycopg
import psycopg.sql
import pytest

from airflow_dbqueue.engine import DbQueue as Client
from airflow_dbqueue.engine.errors import LeaseExpiredError
from tests.helpers import checksum
from tests.integration.test_conformance import drain

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue, Message, Queue

pytestmark = pytest.mark.integration


GENERATIONS = 8
"""The partitions of each of the table design's meta, data and done (schema.sql)."""
_PARTITION = re.compile(r"^((?:meta|data|done)\w*)_[0-7]$")


def parent(name: str | None) -> str | None:
    """The table design's table or index that a partition (meta_3) or a partition's index
    (meta_ready_idx_3) is part of; any other name as it is."""
    m = _PARTITION.match(name or "")
    return m.group(1) if m else name


def plan_nodes(plan: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(node type, index name) of every node of an EXPLAIN (FORMAT JSON) plan; a partition's index by
    its partitioned index's name."""
    out = [(plan["Node Type"], parent(plan.get("Index Name")))]
    for child in plan.get("Plans", []):
        out += plan_nodes(child)
    return out


@pytest.fixture(autouse=True)
def no_recycling_pass(dbq: DbQueue) -> Iterator[None]:
    """The DbQueue's partition recycling (a thread that runs a pass after work) reads meta's partitions
    on a connection of its own, which the statistics below would count: no pass runs during a test."""
    assert dbq.recycler is not None
    with dbq.recycler.suspended():
        yield


def scans(conn: Any, schema: str, run: Callable[[], object]) -> dict[str, tuple[int, int]]:
    """What ``run`` read, from the statistics views: ``{table: (sequential scans, 0)}`` and
    ``{index: (index scans, entries read)}`` of the schema's tables. A statement inside a function is
    not shown by EXPLAIN; its reads are counted here all the same."""
    query = """
        SELECT relname, coalesce(seq_scan, 0), 0 FROM pg_stat_user_tables WHERE schemaname = %(s)s
        UNION ALL
        SELECT indexrelname, coalesce(idx_scan, 0), coalesce(idx_tup_read, 0)
        FROM pg_stat_user_indexes WHERE schemaname = %(s)s"""

    def read() -> dict[str, tuple[int, int]]:
        conn.execute("SELECT pg_stat_force_next_flush()")  # flushed when the backend is idle next
        conn.execute("SELECT 1")
        conn.execute("SELECT pg_stat_clear_snapshot()")
        out: dict[str, tuple[int, int]] = {}
        for name, n, read in conn.execute(query, {"s": schema}):
            key = parent(name) or name  # the table design's partitions count as their table
            was = out.get(key, (0, 0))
            out[key] = (was[0] + int(n), was[1] + int(read))
        return out

    before = read()
    run()
    after = read()
    return {k: (v[0] - before.get(k, (0, 0))[0], v[1] - before.get(k, (0, 0))[1]) for k, v in after.items()}


def no_reclaim(q: Queue) -> None:
    """Keep a table-design queue's pops from reclaiming expired leases. A pop reclaims first once its
    handle's ``reclaim_every`` (a second) has passed since the last: reclaim_expired walks
    meta_leased_idx and may scan the partitions of no pages in full (see
    test_lookups_by_id_probe_the_partial_index_of_their_state), and a window that opens a second after
    the last reclaim (the pushes before it take that long on a loaded machine) would count those reads
    with the claim's. The tests that count what table_take() reads pop without it."""
    q.reclaim_every = float("inf")  # type: ignore[attr-defined]


def test_only_calls_of_the_schemas_functions_are_prepared_and_they_run_generic_plans(dbq: DbQueue) -> None:
    """A pooled session prepares the statements that only call a function of the schema, and PostgreSQL
    turns those generic; every other statement (here the next due time and the nack, run more often than
    psycopg's prepare threshold on an empty queue) is sent unprepared, so it is planned for its
    parameters on every call and no plan made on an empty queue can stick."""
    from airflow_dbqueue.engine.dialects.postgres.statements import GENERIC_PLANS

    table = dbq.create_queue("plans_table")
    ring = dbq.create_queue("plans_ring", design="ring", layout="slots", capacity=64)
    with dbq.db.connection() as c:
        for i in range(12):
            assert table.pop(100, conn=c) == []
            assert ring.pop(100, conn=c) == []
            assert ring.pop(1, conn=c) == []
            assert table.pop_payloads(100, conn=c) == ring.pop_payloads(100, conn=c) == []
            dbq.db.fetchall("next_due", {"queue_id": table.settings.queue_id}, c)  # type: ignore[attr-defined]
            table.push({"i": i}, conn=c)
            [m] = table.pop(1, semantics="at-least-once", conn=c)
            table.nack([m], conn=c)
        prepared = c.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
        ).fetchall()

    def called(text: str) -> str:  # the schema's function a statement calls, or the statement
        m = re.search(r'"[^"]+"\."?(\w+)"?\(', text)
        return m.group(1) if m else text

    def query(name: str) -> str:  # a ring of the rows layout's statements call its own functions ({fn})
        ids = None
        if name == "ring_rows_ask":  # a waiting pop's question: its lanes' function, and two sequences
            ids = {"lanes": "ring_1_rlanes", "retrygen": "ring_1_rretrygen", "rows": "ring_1_rrows"}
        elif "ring_rows" in name:
            ids = {"fn": "ring_1_rtake"}
        return dbq.db.query(name, ids).decode()  # type: ignore[attr-defined,no-any-return]

    # A function's name stands for every statement that calls it (ring_take for ring_take,
    # ring_take_lease and ring_take_payloads): the statements prepared are compared by what they call.
    allowed = {called(query(name)) for name in GENERIC_PLANS}
    names = {called(stmt): (generic, custom) for stmt, generic, custom in prepared}
    assert set(names) <= allowed, names
    hot = {"table_take", "table_lease", "table_push", "ring_pop"}  # each run 12 times or more above
    assert hot <= set(names), names
    assert all(names[name][0] > 0 for name in hot), names


@pytest.mark.parametrize("archive", [True, False])
def test_the_pop_function_walks_the_ready_index_with_plans_made_on_an_empty_queue(
    dbq: DbQueue, archive: bool
) -> None:
    """table_take() keeps generic plans for the session: made here while the queue is empty and its
    statistics say so, they must still walk meta_ready_idx in claim order, reading about as many
    entries as the pop takes, and probe data by id, never scan a table."""
    q = dbq.create_queue("empty_plans", archive=archive)
    no_reclaim(q)
    with dbq.db.connection() as c:
        c.execute(f'ANALYZE "{dbq.schema}".meta, "{dbq.schema}".data, "{dbq.schema}".done')
        for _ in range(8):
            assert q.pop(100, conn=c) == []
        # Pushed on this session: a statistics view counts another session's scans only when that
        # session flushes them, which could fall inside the window measured below.
        q.push_batch([{"i": i} for i in range(20000)], conn=c)
        q.push_batch([{"big": i, "pad": "x" * 2000} for i in range(50)], priority=1, conn=c)
        c.commit()
        got: list[Any] = []
        read = scans(c, dbq.schema, lambda: got.extend(q.pop(100, conn=c)))
    assert [m.payload.get("big") for m in got[:50]] == list(range(50))
    assert [m.payload.get("i") for m in got[50:]] == list(range(50))
    assert all(n == 0 for name, (n, _) in read.items() if name in ("meta", "data")), read
    assert read["meta_ready_idx"][0] >= 1 and read["meta_ready_idx"][1] <= 200, read
    assert read["data_pkey"][1] <= 100, read


@pytest.mark.parametrize("archive", [True, False])
def test_pops_of_one_walk_the_ready_index_and_take_large_payloads_from_data(
    dbq: DbQueue, archive: bool
) -> None:
    """Pops of one through table_take(), with plans made on an empty queue: they walk meta_ready_idx in
    claim order and probe data by id only for the large payloads (data_take_of() without the archive, a
    scalar subquery with it); small and large payloads come back in claim order, each once; a large
    payload's row in data goes with its message (archive off) or stays for the archiver (archive on)."""
    q = dbq.create_queue("pops_of_one", archive=archive)
    no_reclaim(q)
    with dbq.db.connection() as c:
        c.execute(f'ANALYZE "{dbq.schema}".meta, "{dbq.schema}".data, "{dbq.schema}".done')
        for _ in range(8):
            assert q.pop(1, conn=c) == []
        c.commit()
        sent = [{"i": i, "pad": "x" * (2500 if i % 3 == 0 else 10)} for i in range(30)]
        q.push_batch(sent[:20], conn=c)  # on this session, as above
        for m in sent[20:]:
            q.push(m, conn=c)
        q.push_batch(
            [{"i": -1}] * 2000, priority=-1, conn=c
        )  # behind the others: what the walk must not read
        c.commit()
        got: list[Any] = []
        read = scans(c, dbq.schema, lambda: [got.extend(q.pop(1, conn=c)) for _ in range(30)])
        c.commit()
    assert [m.payload for m in got] == sent
    assert len({m.id for m in got}) == 30 and all(m.attempts == m.delivery == 1 for m in got)
    assert all(n == 0 for name, (n, _) in read.items() if name in ("meta", "data")), read
    # each pop walks the ready index of every generation's partition (schema.sql), in one ordered merge
    assert read["meta_ready_idx"][0] == 30 * GENERATIONS and read["meta_ready_idx"][1] <= 60, read
    assert read["data_pkey"][0] == 10, read
    with dbq.db.connection() as c:
        left = c.execute(f'SELECT count(*) FROM "{dbq.schema}".data').fetchone()
    assert left is not None and left[0] == (10 if archive else 0)
    assert q.stats().ready == 2000


@pytest.mark.parametrize("archive", [True, False])
def test_ack_probes_receipts_by_id_not_every_lease(dbq: DbQueue, archive: bool) -> None:
    """table_ack()'s plans are made once a session, here on an empty queue; no ANALYZE later:
    statistics from when the queue was empty are what a busy queue often has. An ack of one receipt
    among 20,000 leases probes meta_leased_id_idx, never walks the leases or scans a table."""
    q = dbq.create_queue("many_leases", archive=archive)
    with dbq.db.connection() as c:
        with pytest.raises(LeaseExpiredError):
            q.ack_receipts([(1, 1)], conn=c)  # the plans are made here, on an empty queue
        q.push_batch(list(range(20000)), conn=c)  # on this session, as above
        leased = q.pop(20000, semantics="at-least-once", conn=c)
        read = scans(c, dbq.schema, lambda: q.ack(leased[:1], conn=c))
        assert read["meta"][0] == 0 and read["meta_leased_idx"] == (0, 0), read
        assert read["meta_leased_id_idx"][0] >= 1 and read["meta_leased_id_idx"][1] <= 2, read
        assert q.ack(leased[1:], conn=c) == 19999


def _meta_reads(plan: dict[str, Any], empty: frozenset[str] = frozenset()) -> list[str]:
    """How each node of a plan reads meta: the index it walks (a bitmap's too), or the node type (a
    Seq Scan, a Tid Scan). A Seq Scan of a partition in ``empty`` (one of no pages when the statement
    was planned, so that the scan reads nothing) is left out."""
    out = []
    if plan.get("Index Name", "").startswith("meta_"):
        out.append(parent(plan["Index Name"]))
    elif (
        parent(plan.get("Relation Name")) == "meta"
        and plan["Node Type"] in ("Seq Scan", "Tid Scan")
        and not (plan["Node Type"] == "Seq Scan" and plan.get("Relation Name") in empty)
    ):
        out.append(plan["Node Type"])
    for child in plan.get("Plans", []):
        out += _meta_reads(child, empty)
    return out


@pytest.mark.parametrize("analyzed", ["empty", "full"])
def test_lookups_by_id_probe_the_partial_index_of_their_state(dbq: DbQueue, analyzed: str) -> None:
    """meta has no primary key: every statement that finds messages by id reads them through the
    partial index of the state it expects, planned for its parameters, whether the statistics are those
    of an empty queue or of 20,000 leases and 100 failed messages; never a scan of meta, nor a walk of
    the queue's leases through meta_leased_idx. Receipts and a batch's reads (leased messages) probe
    meta_leased_id_idx, failed messages (state 2) meta_failed_idx; the lookups of expired leases
    (reclaim, the readiness counts) still walk meta_leased_idx."""
    q = dbq.create_queue("by_id", max_attempts=1)
    schema = dbq.schema
    with dbq.db.connection() as c:
        if analyzed == "empty":
            c.execute(f'ANALYZE "{schema}".meta, "{schema}".data')
        q.push_batch([{"i": i} for i in range(20150)])
        failing = q.pop(100, semantics="at-least-once", conn=c)
        assert q.nack(failing, conn=c) == 100  # max_attempts 1: failed
        leased = q.pop(20000, semantics="at-least-once", conn=c)
        assert checksum(m.payload for m in failing + leased) == checksum({"i": i} for i in range(20100))
        batch = q.claim_batch(50)
        assert batch is not None and len(batch.receipts) == 50
        if analyzed == "full":
            c.execute(f'ANALYZE "{schema}".meta, "{schema}".data')
        qid = q.settings.queue_id

        def empty_partitions() -> frozenset[str]:
            """The planner may scan a partition of no pages (a generation no message is in) in full."""
            empty = frozenset(
                r[0]
                for r in c.execute(
                    "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = %s AND c.relname ~ '^meta_[0-7]$' AND pg_relation_size(c.oid) = 0",
                    [schema],
                )
            )
            assert len(empty) < GENERATIONS
            return empty

        def reads(name: str, params: dict[str, Any]) -> list[str]:
            empty = empty_partitions()
            row = c.execute(b"EXPLAIN (FORMAT JSON) " + dbq.db.query(name), params).fetchone()  # type: ignore[attr-defined]
            assert row is not None
            return _meta_reads(row[0][0]["Plan"], empty)

        for k in (1, 100):
            receipts = {"ids": [m.id for m in leased[:k]], "deliveries": [m.delivery for m in leased[:k]]}
            by_receipt = {**receipts, "queue_id": qid}
            nack = {**by_receipt, "delay_s": 0.0, "backoff_s": 1.0, "backoff_max_s": 1.0}
            for name, params in (
                ("held_receipts", by_receipt),
                ("leased", by_receipt),
                ("extend_leases", {**by_receipt, "secs": 30.0}),
                ("nack", {**nack, "max_attempts": 1, "error": None}),
            ):
                got = reads(name, params)
                assert got and set(got) <= {"meta_leased_id_idx", "Tid Scan"}, (name, k, got)
            failed = {"queue_id": qid, "all": False, "ids": [m.id for m in failing[:k]]}
            for name, params in (("requeue_failed", failed), ("delete_failed", {**failed, "archive": True})):
                # meta by meta_failed_idx; beside it, the messages' own meta_opt rows by its key
                got = set(reads(name, params))
                assert got - {"meta_opt_pkey"} == {"meta_failed_idx"}, (name, k, got)
        # opts False: a queue without a ttl or ordering keys, whose statements look at no meta_opt row
        by_expiry = {"queue_id": qid, "max_attempts": 1, "limit": 100, "min_priority": -32768, "cap": 100}
        by_expiry["opts"] = False
        for name in ("reclaim_expired", "count_ready", "ready_head"):  # by expiry, not by id
            got = reads(name, by_expiry)
            assert "meta_leased_idx" in got and not {"meta_leased_id_idx", "Seq Scan"} & set(got), (name, got)
        empty = empty_partitions()
        row = c.execute("EXPLAIN (FORMAT JSON) " + q.batch_query(batch.batch_id)).fetchone()
        assert row is not None and set(_meta_reads(row[0][0]["Plan"], empty)) == {"meta_leased_id_idx"}
        assert q.ack(leased, conn=c) == 20000 and q.ack_batch(batch.batch_id, conn=c) == 50
        assert len(q.list_failed(limit=200)) == 100 and q.delete_failed() == 100


def _walks_data(plan: dict[str, Any]) -> list[str]:
    """Plan nodes that read the data table without probing it by key."""
    bad = []
    keyed = "Index Cond" in plan or "Tid Cond" in plan
    if parent(plan.get("Relation Name")) == "data" and (
        plan["Node Type"] == "Seq Scan" or ("Index" in plan["Node Type"] and not keyed)
    ):
        bad.append(f"{plan['Node Type']} {plan.get('Index Name')}")
    for child in plan.get("Plans", []):
        bad += _walks_data(child)
    return bad


def test_payloads_are_probed_by_id_even_with_empty_table_statistics(dbq: DbQueue) -> None:
    """A drained queue analyzed while empty (as autovacuum does) must not make pops walk data. The
    payloads are over 1900 bytes, so they live in data (smaller ones stay in their meta rows)."""
    q = dbq.create_queue("drained", archive=False)
    q.push_batch([f"{i}:" + "x" * 1950 for i in range(2000)])
    while q.pop(500):
        pass
    with dbq.db.connection() as c:
        c.execute(f'ANALYZE "{dbq.schema}".meta, "{dbq.schema}".data, "{dbq.schema}".done')
        # table_lease() and table_take() keep generic plans, made here on the drained queue
        assert q.pop(1, semantics="at-least-once", conn=c) == q.pop(1, conn=c) == []
        q.push_batch([f"{i}:" + "x" * 1950 for i in range(20000)])
        qid = q.settings.queue_id
        read = scans(c, dbq.schema, lambda: q.pop(250, semantics="at-least-once", conn=c))
        assert read["data"][0] == 0 and read["data_pkey"][1] <= 250, read
        read = scans(c, dbq.schema, lambda: q.pop(250, conn=c))
        assert read["data"][0] == 0 and read["data_pkey"][1] <= 500, read
        row = c.execute(b"EXPLAIN (FORMAT JSON) " + dbq.db.query("drop_queue"), {"queue_id": qid}).fetchone()
        assert row is not None
        assert _walks_data(row[0][0]["Plan"]) == []


_LEASES_INDEX_SCANS = (
    "SELECT coalesce(idx_scan, 0) FROM pg_stat_user_indexes "
    "WHERE schemaname = %s AND indexrelname = 'ring_leases_pkey'"
)


def floor_reads(admin: psycopg.Connection[Any], one: Client, run: Callable[[], object]) -> int:
    """How many times ``run`` read a ring's floor (ring_floor: its scan of the leases' index is the
    only one a push makes), on ``one``'s single pooled connection."""
    schema = one.schema
    admin.execute("SELECT pg_stat_clear_snapshot()")
    before = admin.execute(_LEASES_INDEX_SCANS, [schema]).fetchone()[0]  # type: ignore[index]
    run()
    with one.db.connection() as c:  # type: ignore[attr-defined] # the pool's one connection
        c.execute("SELECT pg_stat_force_next_flush()")  # flushed when the backend is idle next
    with one.db.connection() as c:  # type: ignore[attr-defined]
        c.execute("SELECT 1")
    admin.execute("SELECT pg_stat_clear_snapshot()")
    return int(admin.execute(_LEASES_INDEX_SCANS, [schema]).fetchone()[0]) - int(before)  # type: ignore[index]


def test_pushes_of_one_read_the_rings_floor_only_when_a_slot_is_not_free(dbq: DbQueue) -> None:
    """A ring handle reads the floor (ring_floor: a scan of the lanes, the leases and the retry rows)
    once, then passes it to every push of one while the slots are free under it: 40 pushes into a ring
    of 64 scan the leases' index once. The 65th push finds its slot not free under that floor (the
    ring is full until a pop) and writes its number through ring_push, which reads the floor itself
    and returns it: the handle keeps that one, and the 66th push reads none."""
    dbq.create_queue(
        "floor_hint", design="ring", layout="slots", capacity=64, notify="never", payload_type="bytes"
    )
    sent = [os.urandom(40) for _ in range(66)]
    with (
        psycopg.connect(dbq.db.dsn, autocommit=True) as admin,
        Client(dbq.db.dsn, schema=dbq.schema, pool_size=1) as one,
    ):
        q = one.queue("floor_hint")
        assert floor_reads(admin, one, lambda: [q.push(p) for p in sent[:40]]) == 1
        assert floor_reads(admin, one, lambda: [q.push(p) for p in sent[40:64]]) == 0
        got: list[Message] = []
        floor_reads(admin, one, lambda: got.extend(q.pop(2)))  # the ring holds 64: room for two more
        # ring_push's read only: the 66th push finds its slot free under the floor that one returned
        assert floor_reads(admin, one, lambda: [q.push(p) for p in sent[64:]]) == 1
        got += drain(q)
        assert [m.payload for m in got] == sent
        assert [m.id for m in got] == list(range(1, 67))


def test_pushes_of_a_batch_read_the_rings_floor_only_when_the_handles_leaves_no_room(dbq: DbQueue) -> None:
    """A push of a batch checks its room against the floor its handle passes, and reads the ring's own
    only when that one leaves no room, returning it for the next pushes: into a ring of 64, the first
    of eight batches of 8 reads the floor (the handle has none yet) and the other seven none. After a
    pop of 16, the next batch needs room the old floor does not give: it reads the floor (17 now) and
    is written without waiting, and the batch after it finds room under the floor it returned."""
    dbq.create_queue(
        "floor_batches", design="ring", layout="slots", capacity=64, notify="never", payload_type="bytes"
    )
    sent = [os.urandom(40) for _ in range(80)]
    batches = [sent[k : k + 8] for k in range(0, 80, 8)]
    with (
        psycopg.connect(dbq.db.dsn, autocommit=True) as admin,
        Client(dbq.db.dsn, schema=dbq.schema, pool_size=1) as one,
    ):
        q = one.queue("floor_batches")
        assert floor_reads(admin, one, lambda: q.push_batch(batches[0])) == 1
        assert floor_reads(admin, one, lambda: [q.push_batch(b) for b in batches[1:8]]) == 0
        got: list[Message] = []
        floor_reads(admin, one, lambda: got.extend(q.pop(16)))  # (its statistics flushed before the next)
        assert [m.id for m in got] == list(range(1, 17))
        assert floor_reads(admin, one, lambda: q.push_batch(batches[8])) == 1  # once: no wait, no retry
        assert floor_reads(admin, one, lambda: q.push_batch(batches[9])) == 0
        got += drain(q)
        assert [m.payload for m in got] == sent
        assert [m.id for m in got] == list(range(1, 81))


def test_a_pooled_pop_of_one_is_one_prepared_statement_with_a_generic_plan_on_the_rings_indexes(
    dbq: DbQueue,
) -> None:
    """A pop of one at most once outside a caller's transaction is one statement (ring_take_one), not a
    function call: prepared, its plan turns generic, and that plan reads the ring's lanes, slots and
    messages due again by their keys, never by a sequential scan. Every message comes out once, in
    order. (1 s)"""
    sent = [{"i": i, "pad": os.urandom(8).hex()} for i in range(40)]
    with Client(dbq.db.dsn, schema=dbq.schema, pool_size=1) as one:
        ring = one.create_queue("one_plans", design="ring", layout="slots", capacity=64, lanes=4)
        assert ring.pop(1) == []
        ring.push_batch(sent)
        got = [m for _ in range(30) for m in ring.pop(1)]
        with one.db.connection() as c:  # type: ignore[attr-defined] # the pool's one connection
            [(name, generic)] = [
                (r[0], r[2])
                for r in c.execute("SELECT name, statement, generic_plans FROM pg_prepared_statements")
                if "ring_lanes" in r[1] and ".ring_take(" not in r[1]
            ]
            assert generic > 0
            qid = ring.settings.queue_id
            [[plan]] = c.execute(f"EXPLAIN (FORMAT JSON) EXECUTE {name}({qid}, {qid}, 64, 4)").fetchone()  # type: ignore[misc]
        nodes = plan_nodes(plan["Plan"])
        assert ("Seq Scan", None) not in nodes and ("Bitmap Heap Scan", None) not in nodes, repr(nodes)
        assert {i for _, i in nodes} >= {"ring_lanes_pkey", "ring_slots_pkey", "ring_retry_ready_idx"}, nodes
        got += drain(ring)
    assert [m.payload for m in got] == sent and checksum(m.payload for m in got) == checksum(sent)
    assert [m.id for m in got] == list(range(1, 41))


def test_a_notify_auto_push_reads_as_many_ready_entries_however_many_were_popped(
    dbq: DbQueue, pg_dsn: str
) -> None:
    """A push with notify="auto" asks whether the queue had a ready message when another push holds the
    queue's waiters' lock (here a transaction holds it throughout). Under a held xmin horizon
    (so that no index entry of a popped message can be removed or marked dead), the entries of the
    ready index that a push reads stay the same whether 100 or 30,000 messages were popped before it;
    a push into a queue that has messages waiting sends no NOTIFY, one into an empty queue does."""
    from tests.helpers import held_horizon, notified_so_far, push_holding_the_waiters_lock

    q = dbq.create_queue("auto_cost", notify="auto")
    payloads = [{"i": i} for i in range(40000)]
    hold = held_horizon(pg_dsn)
    pushing = push_holding_the_waiters_lock(pg_dsn, dbq.schema, q.settings.queue_id)
    listener = psycopg.connect(pg_dsn, autocommit=True)
    try:
        q.push_batch(payloads)
        listener.execute(f'LISTEN "{q.channel}"')
        out: list[Any] = []
        reads = []
        with dbq.db.connection() as c:
            for popped in (100, 30000):
                while len(out) < popped:
                    out += q.pop_payloads(min(1000, popped - len(out)))
                more = {"more": popped}
                read = scans(c, dbq.schema, lambda more=more: q.push(more, conn=c))
                reads.append(read["meta_ready_idx"][1])
        waiting = notified_so_far(listener, pg_dsn, q.channel)
        out += [m.payload for m in drain(q)]
        q.push({"last": True})
        empty = notified_so_far(listener, pg_dsn, q.channel)
    finally:
        pushing.close()
        hold.close()
        listener.close()
    assert (waiting, empty) == (0, 1)
    assert reads[1] <= reads[0] + 2 and reads[1] <= 10, reads
    got = out + [m.payload for m in drain(q)]
    assert len(got) == 40003
    assert checksum(got) == checksum([*payloads, {"more": 100}, {"more": 30000}, {"last": True}])


@pytest.mark.parametrize("options", [{}, {"ttl": 3600.0}], ids=["plain", "ttl"])
def test_a_notify_auto_push_into_a_drained_queue_reads_no_entry_below_its_floor(
    dbq: DbQueue, pg_dsn: str, options: dict[str, Any]
) -> None:
    """A push with notify="auto" that asks the question (another push holds the queue's waiters' lock:
    here a transaction holds it throughout) into a queue whose messages were all popped (under a held
    xmin horizon, so that none of their index entries can be removed or marked dead) walks the entries
    popped in the generation pushes write now, finding no ready message, and notifies; once the floor
    was raised past them, it reads none of them, and still notifies. A push into the queue with a
    message ready sends none. The same with a time to live (the push with options). Every message comes
    out once."""
    from tests.helpers import held_horizon, notified_so_far, push_holding_the_waiters_lock

    q = dbq.create_queue("auto_floor_" + ("ttl" if options else "plain"), notify="auto", **options)
    gen = 0
    sent: list[Any] = []
    hold = held_horizon(pg_dsn)
    pushing = push_holding_the_waiters_lock(pg_dsn, dbq.schema, q.settings.queue_id)
    listener = psycopg.connect(pg_dsn, autocommit=True)
    try:
        # at least 2,000 of the popped messages in the generation the next push writes (ids move through
        # the generations 16,384 at a time: a batch may have just crossed into the next one)
        while True:
            batch = [{"i": len(sent) + i} for i in range(3000)]
            ids = q.push_batch(batch)
            sent += batch
            gen = (ids[-1] >> 14) & 7
            if sum(1 for i in ids if (i >> 14) & 7 == gen) >= 2000:
                break
        out = [m.payload for m in drain(q)]
        listener.execute(f'LISTEN "{q.channel}"')
        reads = []
        notified = []
        with dbq.db.connection() as c:
            for step in ("drained", "floor raised", "one waiting"):
                if step == "floor raised":
                    out += [m.payload for m in drain(q)]
                    row = dbq.db.fetchone("table_raise_floors", conn=c)  # type: ignore[attr-defined]
                    assert row is not None and row[0] >= 1
                if step == "one waiting":
                    more: dict[str, Any] = {"step": "ready"}
                    q.push(more, conn=c)
                    sent.append(more)
                    list(listener.notifies(timeout=2, stop_after=1))
                message = {"step": step}
                sent.append(message)
                read = scans(c, dbq.schema, lambda message=message: q.push(message, conn=c))
                reads.append(read["meta_ready_idx"][1])
                notified.append(notified_so_far(listener, pg_dsn, q.channel))
    finally:
        pushing.close()
        hold.close()
        listener.close()
    out += [m.payload for m in drain(q)]
    assert notified == [1, 1, 0], notified
    assert reads[0] >= 2000 and reads[1] <= 2 and reads[2] <= 2, reads
    assert len(out) == len(sent) and checksum(out) == checksum(sent)


@pytest.mark.parametrize("where", ["", "WHERE b.ord >= 2001 AND b.ord < 4001"])
def test_a_ring_batchs_reader_reads_each_slot_of_its_range_at_most_once(dbq: DbQueue, where: str) -> None:
    """A ring batch's query, whole or as one partition of Spark's JDBC reader (a filter on ord, which
    leaves the planner expecting a row or so): the slots' key is read for at most the batch's range
    once, never once a number (a join on seq alone scanned the range once a number)."""
    q = dbq.create_queue("wide", design="ring", layout="slots", capacity=8000)
    sent = [{"n": i} for i in range(6000)]
    q.push_batch(sent)
    q.pop(1000)  # the batch starts mid-ring
    batch = q.claim_batch(4000)
    assert batch is not None
    query = f"SELECT * FROM ({q.batch_query(batch.batch_id)}) b {where}"
    with dbq.db.connection() as c:
        c.execute(psycopg.sql.SQL("ANALYZE {}.ring_slots").format(psycopg.sql.Identifier(dbq.schema)))
        rows: list[Any] = []
        read = scans(c, dbq.schema, lambda: rows.extend(c.execute(query.encode()).fetchall()))
    want = sent[1000:5000] if not where else sent[3000:5000]
    assert [json.loads(bytes(r[3])) for r in rows] == want
    assert read["ring_slots_pkey"][1] <= 4000 and read["ring_slots"][0] == 0, read
