"""What benchmarks/run.py measures: one design's queue on a fresh schema, and what a worker does to it.

The engine designs go through the public API (:class:`DbQueue`); the naive baseline and PGMQ are
their statements run with plain psycopg.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from typing import Any, Protocol

import psycopg
from psycopg import sql

from airflow_dbqueue.engine import DbQueue, LeaseExpiredError

BASELINE = "naive"
# A second reference: PGMQ's SQL (read = a visibility-time UPDATE, then delete or archive), measured
# like the baseline with plain psycopg, for the at-least-once comparison (--pgmq).
PGMQ = "pgmq"
REFERENCES = (BASELINE, PGMQ)
# The ring of the rows layout (create_queue(..., design="ring", layout="rows"), PostgreSQL only) is a
# design of its own here: its capacity counts pushes, not messages.
RING_ROWS = "ring-rows"
# Designs the engine implements, measured through DbQueue.
ENGINE_DESIGNS: tuple[str, ...] = ("table", "ring", RING_ROWS)
ALL_DESIGNS = ("table", "ring", RING_ROWS, BASELINE, PGMQ)
QUEUE_NAME = "bench_q"
# The table design's push options run.py --feature measures, each on every message of a queue of its own
# (named "table+FEATURE" among the run's designs): ordering per key over N keys ("ordering:N"), a
# deduplication key, a queue ttl.
FEATURES = ("ordering", "dedup", "ttl")
ORDERING_KEYS = 1000
"""The keys of ``ordering`` without ``:N``."""


def split_feature(name: str) -> tuple[str, str, int]:
    """A measured design's name as (design, feature, ordering keys): ``table+ordering:10`` is
    ("table", "ordering", 10), ``table+dedup`` ("table", "dedup", 0), ``ring`` ("ring", "none", 0).
    Raises ValueError for a feature that is not one of ``FEATURES`` or a key count below 1."""
    design, plus, feature = name.partition("+")
    if not plus:
        return design, "none", 0
    feature, colon, count = feature.partition(":")
    if feature not in FEATURES or (colon and feature != "ordering"):
        raise ValueError(f"{name!r}: a feature is ordering[:KEYS], dedup or ttl")
    keys = (int(count) if colon else ORDERING_KEYS) if feature == "ordering" else 0
    if feature == "ordering" and keys < 1:
        raise ValueError(f"{name!r}: ordering needs at least 1 key")
    return design, feature, keys


@dataclasses.dataclass(frozen=True)
class Target:
    """One design's queue on one fresh schema; picklable, handed to every worker."""

    design: str
    dsn: str
    schema: str
    semantics: str
    archive: bool
    notify: str
    capacity: int | None = None
    """Slots of a ring (ring design), or pushes a ring of the rows layout holds (ring-rows)."""
    payload_bytes: int = 300
    pop_api: str = "payloads"
    """At most once, how the engine's consumers pop: ``pop_payloads`` ("payloads"), which is what they
    need and what the naive queue returns, or ``pop`` ("messages"), which builds a :class:`Message` a
    message. At least once they pop messages, whose receipts they ack."""
    groups: int = 1
    """Consumer groups of a ring (``--groups``): each message is popped once in each, and consumer
    ``i`` pops for group ``i % groups`` (group 0 the ring's default one)."""
    pooler: str = "none"
    """``dsn`` reaches a pooler in this mode (``--pooler``): ``transaction`` makes the engine and the
    references prepare nothing (a prepared statement would outlive the transaction on its server
    connection), the fastest form each has there."""
    server_dsn: str | None = None
    """The server itself behind a pooler: the engine's listen DSN (maintenance's session), and the
    measurement's own connection (sizes, CHECKPOINT)."""
    recycle_interval: float | None = 1.0
    """Each engine process's own partition recycling (``DbQueue(recycle_interval=...)``, the engine's
    default 1 s; ``None``: off), as a deployment runs it."""
    feature: str = "none"
    """The table design's push option on every message (``FEATURES``; "none": no option): the queue
    is created for it (ordering per key, a ttl) and every push carries it."""
    ordering_keys: int = 0
    """With ``feature`` "ordering": how many keys the pushes name in turn."""

    def engine(self, pool_size: int) -> DbQueue:
        """The engine on this target's queue schema, as a deployment on this topology configures it."""
        pooled = self.pooler == "transaction"
        return DbQueue(
            self.dsn,
            schema=self.schema,
            pool_size=pool_size,
            pooler=self.pooler,
            listen_dsn=self.server_dsn if pooled else None,
            recycle_interval=self.recycle_interval,
        )

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        """A reference's connection (through the pooler, if any), in its fastest form there."""
        if self.pooler == "transaction":
            kwargs["prepare_threshold"] = None
        return psycopg.connect(self.dsn, **kwargs)

    def direct(self) -> psycopg.Connection[Any]:
        """An autocommit connection to the server itself, for what the measurement reads and runs."""
        return psycopg.connect(self.server_dsn or self.dsn, autocommit=True)

    def group_of(self, consumer: int) -> str | None:
        """The consumer group consumer ``consumer`` pops for (None: the default group)."""
        k = consumer % self.groups
        return f"g{k}" if k else None

    @property
    def lease(self) -> bool:
        return self.semantics == "at-least-once"


def setup_target(target: Target) -> None:
    """Create the target's schema and queue."""
    if target.design == BASELINE:
        with target.connect(autocommit=True) as conn:
            s = sql.Identifier(target.schema)
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
            conn.execute(
                sql.SQL("CREATE TABLE {}.t (id bigserial PRIMARY KEY, payload bytea NOT NULL)").format(s)
            )
        return
    if target.design == PGMQ:
        with target.connect(autocommit=True) as conn:
            for stmt in PGMQ_SCHEMA:
                conn.execute(sql.SQL(stmt).format(s=sql.Identifier(target.schema)))
        return
    with target.engine(1) as dbq:
        dbq.install()
        if target.design == "ring":  # pages laid out for the payload size; a ring does not archive
            dbq.create_queue(
                QUEUE_NAME,
                design="ring",
                layout="slots",
                payload_type="bytes",
                notify=target.notify,
                capacity=target.capacity,
                max_payload_bytes=target.payload_bytes,
            )
            for k in range(1, target.groups):
                dbq.queue(QUEUE_NAME).add_group(f"g{k}")  # type: ignore[attr-defined]
            return
        if target.design == RING_ROWS:
            dbq.create_queue(
                QUEUE_NAME,
                design="ring",
                layout="rows",
                payload_type="bytes",
                notify=target.notify,
                capacity=target.capacity,
            )
            return
        options: dict[str, Any] = {}
        if target.feature == "ordering":
            options["ordering"] = "per_key"
        elif target.feature == "ttl":  # an hour: every message carries it, none expires in a run
            options["ttl"] = 3600.0
        dbq.create_queue(
            QUEUE_NAME,
            design=target.design,
            payload_type="bytes",
            notify=target.notify,
            archive=target.archive,
            **options,
        )


def left_in_queue(target: Target, conn: psycopg.Connection[Any]) -> int:
    """Messages still in the queue (ready, delayed, leased or failed)."""
    if target.design in REFERENCES:
        table = "t" if target.design == BASELINE else "q"
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(target.schema, table))
        ).fetchone()
        return int(row[0]) if row else 0
    with target.engine(1) as dbq:
        left = 0
        for k in range(target.groups):
            st = dbq.queue(QUEUE_NAME).group(target.group_of(k)).stats()
            left += st.ready + st.delayed + st.in_flight + st.failed
        return left


def teardown_target(target: Target) -> None:
    """Drop the target's schema with everything in it."""
    if target.design in REFERENCES:
        with target.connect(autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(target.schema)))
        return
    with target.engine(1) as dbq:
        dbq.uninstall()


class Backend(Protocol):
    """What a worker does to one design's queue."""

    def push(self, payloads: list[bytes]) -> None: ...

    def pop(self, n: int) -> tuple[list[bytes], Any]:
        """Pop up to n messages; return their payloads and a token for :meth:`ack`."""
        ...

    def ack(self, token: Any) -> None:
        """Finish what pop returned (a no-op for at-most-once)."""
        ...

    def close(self) -> None: ...


class EngineBackend:
    """A queue of an engine design, through the public API."""

    def __init__(self, target: Target, consumer: int = 0) -> None:
        self.dbq = target.engine(1)
        self.queue = self.dbq.queue(QUEUE_NAME).group(target.group_of(consumer))
        self.semantics = target.semantics
        self.lease = target.lease
        self.payloads_only = not target.lease and target.pop_api == "payloads"
        self.feature = target.feature
        self.keys = target.ordering_keys
        # Ordering keys: each producer names the keys in turn from a start of its own, so that two
        # producers' batches do not begin on the same keys. Deduplication keys: none repeats.
        self.sent = random.randrange(self.keys) if self.feature == "ordering" else 0
        self.tag = uuid.uuid4().hex

    def push(self, payloads: list[bytes]) -> None:
        if self.feature == "none":
            self.queue.push_batch(payloads)
            return
        n, at = len(payloads), self.sent
        self.sent += n
        if self.feature == "ordering":
            self.queue.push_batch(payloads, keys=[f"k{(at + i) % self.keys}" for i in range(n)])
        elif self.feature == "dedup":
            self.queue.push_batch(payloads, dedup_keys=[f"{self.tag}-{at + i}" for i in range(n)])
        else:  # ttl: the queue's, which every push carries
            self.queue.push_batch(payloads)

    def pop(self, n: int) -> tuple[list[bytes], Any]:
        if self.payloads_only:
            return self.queue.pop_payloads(n, semantics=self.semantics), None
        msgs = self.queue.pop(n, semantics=self.semantics)
        return [m.payload for m in msgs], msgs

    def ack(self, token: Any) -> None:
        if self.lease and token:
            self.queue.ack(token)

    def close(self) -> None:
        self.dbq.close()


def naive_statements(schema: str) -> tuple[sql.Composed, sql.Composed]:
    """The naive baseline's push (payloads as a binary ``bytea[]``, ``%b``) and pop (a batch size), on
    the table ``schema.t (id bigserial primary key, payload bytea)``. Used by cost.py too."""
    t = sql.Identifier(schema, "t")
    push = sql.SQL("INSERT INTO {t} (payload) SELECT unnest(%b::bytea[])").format(t=t)
    pop = sql.SQL(
        "DELETE FROM {t} WHERE id = ANY (ARRAY("
        "SELECT id FROM {t} ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)) RETURNING payload"
    ).format(t=t)
    return push, pop


class NaiveBackend:
    """The naive baseline (as in hasql-queue): one table, INSERT to push, DELETE to pop.

    At-most-once pops are autocommit DELETE ... RETURNING. At-least-once pops run the same DELETE in
    a transaction that commits after the consumer has recorded the messages: the commit is the ack,
    the row locks are the lease, and a consumer dying before commit gives the messages back.
    """

    def __init__(self, target: Target, role: str) -> None:
        self.lease = target.lease and role == "consumer"
        # The claim is an array of locked ids taken once (an InitPlan), then index probes. The former
        # DELETE ... WHERE id IN (SELECT ... LIMIT %s FOR UPDATE SKIP LOCKED) was planned as a hash semi
        # join over a sequential scan of the whole table on every pop (EXPLAIN of its prepared, generic
        # plan at 80,000 rows), and once ran one DELETE for over 9 minutes at batch 1000 (a backlog of
        # 81,000 rows and 20,000 dead; why that long was not found).
        # Payload arrays go in binary (%b) and rows come back in binary, as the engine's hot queries do:
        # with a text array (%s) a naive producer spent 7.8 us of client CPU a message hex-quoting
        # payloads (split measurement at batch 1000), and the baseline made 85,624 cycles/s at 2x2
        # batch 1000 against 156,622 in binary, in runs minutes apart. The comparison is of queue designs,
        # not of wire formats.
        self.conn = target.connect(autocommit=not self.lease, application_name="dbqueue-bench")
        self.push_sql, self.pop_sql = naive_statements(target.schema)

    def push(self, payloads: list[bytes]) -> None:
        self.conn.execute(self.push_sql, (payloads,))

    def pop(self, n: int) -> tuple[list[bytes], Any]:
        rows = self.conn.execute(self.pop_sql, (n,), binary=True).fetchall()
        if not rows and self.lease:
            self.conn.rollback()
        return [r[0] for r in rows], None

    def ack(self, token: Any) -> None:
        if self.lease:
            self.conn.commit()

    def close(self) -> None:
        self.conn.close()


PGMQ_SCHEMA = (
    # As pgmq.create() lays out a queue (pgmq 1.x): q_<name> and a_<name>, msg_id from an identity,
    # an index on vt. The message column is bytea here (pgmq's is jsonb), the same bytes as the others.
    "CREATE SCHEMA {s}",
    "CREATE TABLE {s}.q (msg_id bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY, "
    "read_ct integer NOT NULL DEFAULT 0, enqueued_at timestamptz NOT NULL DEFAULT now(), "
    "vt timestamptz NOT NULL, message bytea)",
    "CREATE INDEX q_vt_idx ON {s}.q (vt ASC)",
    "CREATE TABLE {s}.a (msg_id bigint PRIMARY KEY, read_ct integer NOT NULL DEFAULT 0, "
    "enqueued_at timestamptz NOT NULL DEFAULT now(), archived_at timestamptz NOT NULL DEFAULT now(), "
    "vt timestamptz NOT NULL, message bytea)",
    "CREATE INDEX a_archived_at_idx ON {s}.a (archived_at)",
)


class PgmqBackend:
    """PGMQ's statements (pgmq 1.x ``send_batch``, ``read``, ``delete``/``archive``, ``pop``).

    At-least-once: ``read`` sets the visibility time of up to n visible messages (SKIP LOCKED), then the
    consumer deletes them by id, or archives them (one DELETE ... RETURNING feeding an INSERT) when the
    run archives. At-most-once: ``pop``, a DELETE ... RETURNING of visible messages. Every statement is
    autocommit, as pgmq's client runs them.
    """

    VT_S = 30

    def __init__(self, target: Target) -> None:
        self.lease = target.lease
        self.conn = target.connect(autocommit=True, application_name="dbqueue-bench")
        q, a = sql.Identifier(target.schema, "q"), sql.Identifier(target.schema, "a")
        self.push_sql = sql.SQL(
            "INSERT INTO {q} (vt, message) SELECT clock_timestamp(), unnest(%b::bytea[]) RETURNING msg_id"
        ).format(q=q)
        self.read_sql = sql.SQL(
            "WITH cte AS (SELECT msg_id FROM {q} WHERE vt <= clock_timestamp() ORDER BY msg_id ASC "
            "LIMIT %s FOR UPDATE SKIP LOCKED) "
            "UPDATE {q} m SET vt = clock_timestamp() + make_interval(secs => %s), read_ct = read_ct + 1 "
            "FROM cte WHERE m.msg_id = cte.msg_id "
            "RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.vt, m.message"
        ).format(q=q)
        self.pop_sql = sql.SQL(
            "WITH cte AS (SELECT msg_id FROM {q} WHERE vt <= clock_timestamp() ORDER BY msg_id ASC "
            "LIMIT %s FOR UPDATE SKIP LOCKED) "
            "DELETE FROM {q} WHERE msg_id = ANY (SELECT msg_id FROM cte) "
            "RETURNING msg_id, read_ct, enqueued_at, vt, message"
        ).format(q=q)
        if target.archive:
            self.ack_sql = sql.SQL(
                "WITH archived AS (DELETE FROM {q} WHERE msg_id = ANY (%b) "
                "RETURNING msg_id, vt, read_ct, enqueued_at, message) "
                "INSERT INTO {a} (msg_id, vt, read_ct, enqueued_at, message) "
                "SELECT msg_id, vt, read_ct, enqueued_at, message FROM archived RETURNING msg_id"
            ).format(q=q, a=a)
        else:
            self.ack_sql = sql.SQL("DELETE FROM {q} WHERE msg_id = ANY (%b) RETURNING msg_id").format(q=q)

    def push(self, payloads: list[bytes]) -> None:
        self.conn.execute(self.push_sql, (payloads,), binary=True).fetchall()

    def pop(self, n: int) -> tuple[list[bytes], Any]:
        if not self.lease:
            rows = self.conn.execute(self.pop_sql, (n,), binary=True).fetchall()
            return [r[4] for r in rows], None
        rows = self.conn.execute(self.read_sql, (n, self.VT_S), binary=True).fetchall()
        return [r[4] for r in rows], [r[0] for r in rows]

    def ack(self, token: Any) -> None:
        if self.lease and token:
            done = self.conn.execute(self.ack_sql, (token,), binary=True).fetchall()
            if len(done) != len(token):
                raise LeaseExpiredError(f"pgmq: {len(token) - len(done)} of {len(token)} messages were gone")

    def close(self) -> None:
        self.conn.close()


def open_backend(target: Target, role: str, idx: int = 0) -> Backend:
    if target.design == BASELINE:
        return NaiveBackend(target, role)
    if target.design == PGMQ:
        return PgmqBackend(target)
    return EngineBackend(target, idx if role == "consumer" else 0)
