"""``DbQueue``: the engine's entry point. Creates, opens and drops queues in one schema."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine.access import ACTIONS, check_actions
from airflow_dbqueue.engine.dialects.base import CONNECT_TIMEOUT_S, DEFAULT_SCHEMA, Database, DbConnection
from airflow_dbqueue.engine.dialects.factory import make_database
from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    NotSupportedError,
    PermissionDeniedError,
    QueueExistsError,
    QueueNotFoundError,
)
from airflow_dbqueue.engine.maintenance.config import (
    RECYCLE_LOCK_TIMEOUT_S,
    RECYCLE_MIN_BYTES,
    RECYCLE_MOVE_LIMIT,
)
from airflow_dbqueue.engine.maintenance.recycler import AutoRecycler
from airflow_dbqueue.engine.models import (
    DEFAULT_DEDUP_WINDOW_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_PAYLOAD,
    DEFAULT_RETRY_BACKOFF_MAX_S,
    DEFAULT_RETRY_BACKOFF_S,
    DEFAULT_VISIBILITY_TIMEOUT_S,
    Design,
    NotifyMode,
    OnExpiry,
    Ordering,
    PayloadType,
    QueueSettings,
    RingLayout,
)
from airflow_dbqueue.engine.names import validate_queue_name
from airflow_dbqueue.engine.queue import check_seconds
from airflow_dbqueue.engine.ring import (
    RING_DEFAULT_CAPACITY,
    RING_DEFAULT_LANES,
    RING_DEFAULT_PAYLOAD,
    RING_MAX_CAPACITY,
    RING_MAX_LANES,
    RING_MAX_PAYLOAD,
    RingQueue,
)
from airflow_dbqueue.engine.ring_rows import RowsRingQueue
from airflow_dbqueue.engine.table import TableQueue

if TYPE_CHECKING:
    from types import TracebackType

    from airflow_dbqueue.engine.maintenance import Maintenance, MaintenanceConfig
    from airflow_dbqueue.engine.queue import Queue

DSN_ENV = "DBQUEUE_DSN"
POOLER_ENV = "DBQUEUE_POOLER"
LISTEN_DSN_ENV = "DBQUEUE_LISTEN_DSN"
RECYCLE_INTERVAL_S = 1.0
"""How often a DbQueue that works on table-design queues recycles their partitions."""
MAX_PAYLOAD_LIMIT = 256 * 1024 * 1024

_SETTINGS_COLUMNS = (
    "queue_id",
    "name",
    "design",
    "payload_type",
    "max_payload_bytes",
    "max_attempts",
    "visibility_timeout_s",
    "retry_backoff_s",
    "retry_backoff_max_s",
    "notify",
    "archive",
    "capacity",
    "lanes",
    "dedup_window_s",
    "ttl_s",
    "on_expiry",
    "ordering",
    "layout",
)


def _settings_from_row(row: tuple[Any, ...]) -> QueueSettings:
    d = dict(zip(_SETTINGS_COLUMNS, row[: len(_SETTINGS_COLUMNS)], strict=True))
    return QueueSettings(
        name=d["name"],
        queue_id=d["queue_id"],
        design=Design(d["design"]),
        payload_type=PayloadType(d["payload_type"]),
        max_payload_bytes=d["max_payload_bytes"],
        max_attempts=d["max_attempts"],
        visibility_timeout_s=d["visibility_timeout_s"],
        retry_backoff_s=d["retry_backoff_s"],
        retry_backoff_max_s=d["retry_backoff_max_s"],
        notify=NotifyMode(d["notify"]),
        archive=d["archive"],
        capacity=d["capacity"],
        lanes=d["lanes"],
        dedup_window_s=d["dedup_window_s"],
        ttl_s=d["ttl_s"],
        on_expiry=OnExpiry(d["on_expiry"]),
        ordering=Ordering(d["ordering"]),
        layout=None if d["layout"] is None else RingLayout(d["layout"]),
    )


def _ring_shape(
    name: str,
    *,
    archive: bool | None,
    capacity: int | None,
    lanes: int | None,
    max_payload_bytes: int | None,
    layout: RingLayout,
) -> tuple[int, int]:
    """Check what a ring is asked for; return its capacity and lanes with the defaults filled in.

    A ring left to its default lanes gets :data:`RING_DEFAULT_LANES`, fewer where the capacity is too
    small for them: a slots ring has at most one lane a slot, a rows ring needs each of its four
    segments (capacity / 4 pushes) to hold at least two pushes a lane.

    :raise ConfigurationError: naming the first of archive, capacity, lanes and max_payload_bytes that a
        ring cannot have.
    """
    if archive:
        raise ConfigurationError(
            f"queue {name!r}: ring queues do not archive (a finished slot is reused); "
            "leave archive unset or False, or use the table design"
        )
    capacity = RING_DEFAULT_CAPACITY if capacity is None else capacity
    if not isinstance(capacity, int) or isinstance(capacity, bool):
        raise ConfigurationError(f"queue {name!r}: capacity must be an integer, got {capacity!r}")
    if not 1 <= capacity <= RING_MAX_CAPACITY:
        raise ConfigurationError(
            f"queue {name!r}: a ring's capacity must be in 1..{RING_MAX_CAPACITY}, got {capacity}"
        )
    if lanes is None:
        room = capacity if layout is RingLayout.SLOTS else max(1, capacity // 8)
        lanes = min(RING_DEFAULT_LANES, room)
    if not isinstance(lanes, int) or isinstance(lanes, bool):
        raise ConfigurationError(f"queue {name!r}: lanes must be an integer, got {lanes!r}")
    if not 1 <= lanes <= min(capacity, RING_MAX_LANES):
        raise ConfigurationError(
            f"queue {name!r}: a ring's lanes must be in 1..{min(capacity, RING_MAX_LANES)} "
            f"(at most its capacity and {RING_MAX_LANES}), got {lanes}"
        )
    if max_payload_bytes is not None and max_payload_bytes > RING_MAX_PAYLOAD:
        raise ConfigurationError(
            f"queue {name!r}: ring slots hold payloads inline, up to {RING_MAX_PAYLOAD} bytes "
            f"(about half a page); got max_payload_bytes={max_payload_bytes}. Use the table "
            "design for larger payloads"
        )
    return capacity, lanes


def _wanted_settings(
    name: str,
    kind: Design,
    *,
    payload_type: PayloadType | str,
    max_payload_bytes: int | None,
    max_attempts: int,
    visibility_timeout: float,
    retry_backoff: float,
    retry_backoff_max: float,
    notify: NotifyMode | str,
    archive: bool | None,
    capacity: int | None,
    lanes: int | None,
    dedup_window: float = DEFAULT_DEDUP_WINDOW_S,
    ttl: float | None = None,
    on_expiry: OnExpiry | str = OnExpiry.FAIL,
    ordering: Ordering | str = Ordering.NONE,
    layout: RingLayout | str | None = None,
    default_layout: RingLayout = RingLayout.SLOTS,
) -> QueueSettings:
    """The settings :meth:`DbQueue.create_queue` is asked for, with the defaults filled in (a ring left
    to its default layout gets ``default_layout``, the dialect's).

    :raise ConfigurationError: naming the first setting that is out of range or does not fit the design.
    """
    ring = kind is Design.RING
    ring_layout = _ring_layout(name, kind, layout, default_layout)
    if ring_layout is not None:
        capacity, lanes = _ring_shape(
            name,
            archive=archive,
            capacity=capacity,
            lanes=lanes,
            max_payload_bytes=max_payload_bytes,
            layout=ring_layout,
        )
        if ring_layout is RingLayout.ROWS and (capacity % 4 or capacity // 4 < 2 * lanes):
            # Named when the layout was left to its default, so the caller learns the way out.
            other = " (or choose layout='slots')" if layout is None else ""
            raise ConfigurationError(
                f"queue {name!r}: a ring of the rows layout holds four segments of capacity / 4 pushes, "
                f"each at least twice its lanes: capacity must be a multiple of 4 and at least 8 * lanes "
                f"({8 * lanes}), got {capacity}{other}"
            )
    elif capacity is not None or lanes is not None:
        which = "capacity" if capacity is not None else "lanes"
        raise ConfigurationError(f"queue {name!r}: {which} applies to ring queues only")
    if max_payload_bytes is None:
        max_payload_bytes = RING_DEFAULT_PAYLOAD if ring else DEFAULT_MAX_PAYLOAD
    visibility_timeout = check_seconds(
        f"queue {name!r}: visibility_timeout", visibility_timeout, positive=True
    )
    retry_backoff = check_seconds(f"queue {name!r}: retry_backoff", retry_backoff)
    retry_backoff_max = check_seconds(f"queue {name!r}: retry_backoff_max", retry_backoff_max)
    dedup_window = check_seconds(f"queue {name!r}: dedup_window", dedup_window, positive=True)
    expiring = ring_layout is RingLayout.ROWS
    if ring and not expiring and dedup_window != DEFAULT_DEDUP_WINDOW_S:
        raise NotSupportedError(
            f"queue {name!r}: dedup_window applies to table queues and rings of the rows layout only (a "
            "ring of the slots layout has no deduplication keys on push; docs/limits.md)"
        )
    if ring and not expiring and (ttl is not None or on_expiry != OnExpiry.FAIL):
        what = "ttl" if ttl is not None else f"on_expiry={on_expiry!r}"
        raise NotSupportedError(
            f"queue {name!r}: {what} applies to table queues and rings of the rows layout only (a ring "
            "of the slots layout has no expiry; docs/limits.md)"
        )
    if ttl is not None:
        ttl = check_seconds(f"queue {name!r}: ttl", ttl, positive=True)
    if ring and ordering != Ordering.NONE and ring_layout is not RingLayout.ROWS:
        raise NotSupportedError(
            f"queue {name!r}: ordering={ordering!r} applies to table queues and rings of the rows layout "
            "only (a ring of the slots layout deals its pushes to lanes by their number, not by a key; "
            "docs/limits.md)"
        )
    if ring and ordering == Ordering.PER_KEY and capacity is not None and lanes and (capacity // 4) % lanes:
        raise ConfigurationError(
            f"queue {name!r}: a ring of the rows layout ordered per key pushes blocks of one row a lane "
            f"({lanes} rows), a whole number of them a segment: capacity / 4 must be a multiple of "
            f"lanes, got capacity {capacity} and {lanes} lanes"
        )
    try:
        wanted = QueueSettings(
            name=name,
            queue_id=0,
            design=kind,
            payload_type=PayloadType(payload_type),
            max_payload_bytes=int(max_payload_bytes),
            max_attempts=int(max_attempts),
            visibility_timeout_s=float(visibility_timeout),
            retry_backoff_s=float(retry_backoff),
            retry_backoff_max_s=float(retry_backoff_max),
            notify=NotifyMode(notify),
            archive=(not ring) if archive is None else bool(archive),
            capacity=capacity if ring else None,
            lanes=lanes if ring else None,
            dedup_window_s=float(dedup_window),
            ttl_s=ttl,
            on_expiry=OnExpiry(on_expiry),
            ordering=Ordering(ordering),
            layout=ring_layout,
        )
    except ValueError as exc:
        raise ConfigurationError(f"queue {name!r}: {exc}") from None
    _check_ranges(wanted)
    return wanted


def _ring_layout(
    name: str, kind: Design, layout: RingLayout | str | None, default: RingLayout
) -> RingLayout | None:
    """A ring's layout (``default`` when not given); None for the table design, which has none."""
    if kind is not Design.RING:
        if layout is not None:
            raise ConfigurationError(f"queue {name!r}: layout={layout!r} applies to ring queues only")
        return None
    try:
        return default if layout is None else RingLayout(layout)
    except ValueError:
        raise ConfigurationError(
            f"queue {name!r}: a ring's layout is one of "
            f"{', '.join(m.value for m in RingLayout)}, got {layout!r}"
        ) from None


def _check_ranges(wanted: QueueSettings) -> None:
    """Raise :class:`ConfigurationError` naming the first of ``wanted``'s settings out of its range."""
    name = wanted.name
    if not 0 < wanted.max_payload_bytes <= MAX_PAYLOAD_LIMIT:
        raise ConfigurationError(
            f"queue {name!r}: max_payload_bytes must be in 1..{MAX_PAYLOAD_LIMIT}, "
            f"got {wanted.max_payload_bytes}"
        )
    if wanted.max_attempts < 1 or wanted.visibility_timeout_s <= 0 or wanted.retry_backoff_s < 0:
        raise ConfigurationError(
            f"queue {name!r}: need max_attempts >= 1, visibility_timeout > 0 and retry_backoff >= 0"
        )
    if wanted.retry_backoff_max_s < wanted.retry_backoff_s:
        raise ConfigurationError(f"queue {name!r}: retry_backoff_max must be >= retry_backoff")


def _as_declared(asked: Callable[..., QueueSettings], existing: QueueSettings) -> QueueSettings:
    """What a declaration asks of a queue that exists: a ring declared without a layout takes the
    existing ring's, with that layout's defaults, so a declaration that leaves the layout to whoever
    made the ring (or was written when the default was the other layout) still finds its ring."""
    return asked(default_layout=existing.layout or RingLayout.SLOTS)


def _check_same_settings(existing: QueueSettings, wanted: QueueSettings, schema: str) -> None:
    """Raise :class:`QueueExistsError` listing what differs unless an existing queue has ``wanted``'s
    settings (its id aside)."""
    existing = dataclasses.replace(existing, queue_id=0)
    if existing != wanted:
        diff = {
            f.name: (getattr(existing, f.name), getattr(wanted, f.name))
            for f in dataclasses.fields(wanted)
            if getattr(existing, f.name) != getattr(wanted, f.name)
        }
        raise QueueExistsError(
            f"queue {wanted.name!r} exists in schema {schema!r} with other settings "
            f"(existing, requested): {diff}"
        )


class DbQueue:
    """Queues in one schema of one database.

    Constructing it does no I/O; the connection pool opens on first use. Use it as a context
    manager, or call :meth:`close`.

    :param dsn: connection string (libpq keyword/value or URI). Defaults to ``$DBQUEUE_DSN``.
    :param schema: schema holding the queue tables.
    :param pool_size: most connections the pool opens.
    :param connect_timeout: seconds before an unreachable database raises DatabaseUnavailableError.
    :param dialect: ``postgresql`` or ``mssql``; by default read from the DSN (an ``mssql://`` URL or an
        ODBC connection string selects SQL Server, anything else is PostgreSQL).
    :param pooler: ``transaction`` when ``dsn`` reaches a pooler in transaction mode (PgBouncer's
        ``pool_mode = transaction``, RDS Proxy, Supavisor, pgcat, Odyssey): no statement is prepared and
        no connection gets a session setting. ``none`` (the default) or ``session`` otherwise. Defaults
        to ``$DBQUEUE_POOLER``. PostgreSQL only.
    :param listen_dsn: a connection string that reaches the same database with a session of its own
        (directly, or through a pooler in session mode): waiting pops LISTEN there and maintenance holds
        its lock there. Behind a transaction pooler without one, waiting pops poll (a warning says so
        once) and maintenance raises :class:`ConfigurationError`. Defaults to ``$DBQUEUE_LISTEN_DSN``.
        PostgreSQL only.
    :param recycle_interval: seconds between the passes of the table design's partition recycling
        that this object runs while it pushes, pops or acks table-design queues (PostgreSQL): a daemon
        thread empties with ``TRUNCATE`` the partitions whose messages are all gone, also while the
        xmin horizon is held (see :class:`~airflow_dbqueue.engine.maintenance.recycler.AutoRecycler`).
        ``None`` or 0: none (maintenance's ``vacuum`` step still recycles).
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str = DEFAULT_SCHEMA,
        pool_size: int = 10,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        dialect: str | None = None,
        pooler: str | None = None,
        listen_dsn: str | None = None,
        recycle_interval: float | None = RECYCLE_INTERVAL_S,
    ) -> None:
        dsn = dsn or os.environ.get(DSN_ENV)
        pooler = pooler or os.environ.get(POOLER_ENV) or None
        listen_dsn = listen_dsn or os.environ.get(LISTEN_DSN_ENV) or None
        if not dsn:
            raise ConfigurationError(
                f"no database given: pass a DSN or set ${DSN_ENV} (or use airflow_dbqueue.engine.embedded)"
            )
        connect_timeout = check_seconds("connect_timeout", connect_timeout, positive=True)
        if not isinstance(pool_size, int) or isinstance(pool_size, bool) or pool_size < 1:
            raise ConfigurationError(f"pool_size must be an integer >= 1, got {pool_size!r}")
        self.db: Database = make_database(
            dsn,
            dialect=dialect,
            schema=schema,
            pool_size=pool_size,
            connect_timeout=connect_timeout,
            pooler=pooler,
            listen_dsn=listen_dsn,
        )
        self.dialect = self.db.dialect_name
        self.schema = self.db.schema
        self._queues: dict[str, Queue] = {}
        self.recycler: AutoRecycler | None = None
        if recycle_interval is not None and recycle_interval != 0:
            recycle_interval = check_seconds("recycle_interval", recycle_interval, positive=True)
            if self.db.table_recycling_skipped is None:
                self.recycler = AutoRecycler(
                    self.db,
                    interval_s=recycle_interval,
                    move_limit=RECYCLE_MOVE_LIMIT,
                    min_bytes=RECYCLE_MIN_BYTES,
                    lock_timeout_s=RECYCLE_LOCK_TIMEOUT_S,
                )

    def __enter__(self) -> DbQueue:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def default_ring_layout(self) -> RingLayout:
        """The layout a ring gets when :meth:`create_queue` is not told one: the rows layout where the
        dialect has it (PostgreSQL: no dead row on the hot path under a held xmin horizon), the slots
        layout otherwise (SQL Server)."""
        return RingLayout.ROWS if RingLayout.ROWS.value in self.db.ring_layouts else RingLayout.SLOTS

    def close(self) -> None:
        """Stop the partition recycling and close the connection pool."""
        if self.recycler is not None:
            self.recycler.close()
        self.db.close()

    # -- schema ------------------------------------------------------------------------------------

    def install(self) -> int:
        """Create or migrate the queue schema (idempotent, safe to run concurrently); return its version.

        The schema is created when it does not exist. An existing schema without an install must be
        empty: one that holds anything raises :class:`ForeignObjectsError`, naming what it holds, and
        nothing is installed. What the install creates is recorded in the schema's catalogue
        (``owned_objects``), which :meth:`uninstall` reads.
        """
        return self.db.install()

    def uninstall(self) -> None:
        """Drop every queue and message: the objects the engine created in the schema, and the schema.

        Only what the engine's catalogue lists is dropped; the schema goes too when the engine created
        it and nothing else is left in it. An object that is not the engine's but depends on one of its
        own (a view over its tables) makes this raise :class:`ForeignObjectsError`, dropping nothing.
        """
        with self.recycler.suspended() if self.recycler is not None else contextlib.nullcontext():
            self.db.drop_schema()
        self._queues.clear()

    # -- queues ------------------------------------------------------------------------------------

    def create_queue(
        self,
        name: str,
        *,
        design: Design | str = Design.TABLE,
        payload_type: PayloadType | str = PayloadType.JSON,
        max_payload_bytes: int | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT_S,
        retry_backoff: float = DEFAULT_RETRY_BACKOFF_S,
        retry_backoff_max: float = DEFAULT_RETRY_BACKOFF_MAX_S,
        notify: NotifyMode | str = NotifyMode.AUTO,
        archive: bool | None = None,
        capacity: int | None = None,
        lanes: int | None = None,
        exist_ok: bool = True,
        dedup_window: float = DEFAULT_DEDUP_WINDOW_S,
        ttl: float | None = None,
        on_expiry: OnExpiry | str = OnExpiry.FAIL,
        ordering: Ordering | str = Ordering.NONE,
        layout: RingLayout | str | None = None,
    ) -> Queue:
        """Create a queue (idempotently) and return it.

        With ``exist_ok`` (the default) an existing queue with the same settings is returned; one
        with different settings raises :class:`QueueExistsError`, so a DAG cannot silently run
        against a queue configured differently from what it declares.

        ``design="ring"`` creates a bounded ring of ``capacity`` (default ``RING_DEFAULT_CAPACITY``;
        messages on the slots layout, pushes on the rows layout, below): pushes past it wait or raise
        :class:`QueueFullError`. A ring keeps payloads inline, so
        ``max_payload_bytes`` is at most ``RING_MAX_PAYLOAD`` (default ``RING_DEFAULT_PAYLOAD``); set it
        to about your largest payload. A ring does not archive. ``lanes`` (ring only, at most
        ``RING_MAX_LANES``) is how many consumers can take messages at the same moment: the ring's
        numbers are dealt to lanes, and concurrent pops take from different lanes. Set it to about the
        number of consumers that pop a message at a time. The table design's defaults are a 1 MiB
        payload limit and ``archive=True``.

        ``layout`` (ring only) is how the ring stores its messages; :attr:`default_ring_layout` when
        left out. ``"rows"`` (PostgreSQL's default, PostgreSQL only): a row a push in insert-only
        segment tables emptied with ``TRUNCATE``, so that a held xmin horizon leaves no dead row behind
        the hot path; ``capacity`` counts pushes (a multiple of 4, at least 8 * lanes) and the default
        lanes are ``min(RING_DEFAULT_LANES, capacity // 8)``. ``"slots"`` (SQL Server's, and the only
        one there): ``capacity`` preallocated slots updated in place, laid out for payloads of
        ``max_payload_bytes``; default lanes ``min(RING_DEFAULT_LANES, capacity)``, at most the
        capacity. A declaration that leaves the layout out matches an existing ring of either layout.

        ``dedup_window`` (seconds, default 300) is how long a push's ``dedup_key`` is remembered: a
        second push of the key within it pushes nothing and returns the first push's id (table design
        and a ring of the rows layout; see :meth:`Queue.push`). ``ttl`` (seconds, table design and a
        ring of the rows layout, default none) is how long a message may wait to be popped unless its
        push names another: a message not popped by then is never delivered, and goes to the failed
        state with ``last_error`` ``"expired"`` (``on_expiry="fail"``, the default) or is dropped
        (``on_expiry="drop"``). ``ordering="per_key"`` (table design, and a ring of the rows layout)
        lets pushes give messages an ordering key (``push(key=...)``): a key's messages are handed out
        in push order, one at a time, while different keys go in parallel; on a ring a key maps to a
        lane, so at most ``lanes`` lanes are in flight and keys sharing a lane wait for each other
        (``capacity / 4`` a multiple of ``lanes``; docs/concepts.md).
        """
        name = validate_queue_name(name)
        try:
            kind = Design(design)
        except ValueError as exc:
            raise ConfigurationError(f"queue {name!r}: {exc}") from None
        asked = functools.partial(
            _wanted_settings,
            name,
            kind,
            payload_type=payload_type,
            max_payload_bytes=max_payload_bytes,
            max_attempts=max_attempts,
            visibility_timeout=visibility_timeout,
            retry_backoff=retry_backoff,
            retry_backoff_max=retry_backoff_max,
            notify=notify,
            archive=archive,
            capacity=capacity,
            lanes=lanes,
            dedup_window=dedup_window,
            ttl=ttl,
            on_expiry=on_expiry,
            ordering=ordering,
            layout=layout,
        )
        try:
            wanted = asked(default_layout=self.default_ring_layout)
        except ConfigurationError:
            # A shape the default layout cannot have may be that of an existing ring of the other one,
            # which a declaration that leaves the layout out still matches.
            existing = self._declared_ring(name) if kind is Design.RING and layout is None else None
            if existing is None:
                raise
            wanted = asked(default_layout=existing)
        if wanted.layout is not None and wanted.layout.value not in self.db.ring_layouts:
            raise NotSupportedError(
                f"queue {name!r}: the ring's {wanted.layout.value} layout is PostgreSQL-only; the "
                f"{self.db.dialect_name} dialect creates rings of the "
                f"{', '.join(self.db.ring_layouts)} layout (docs/limits.md)"
            )
        if (wanted.ttl_s is not None or wanted.ordering is Ordering.PER_KEY) and not self.db.push_options:
            what = "a time to live needs the expiry of messages" if wanted.ttl_s else "ordering per key"
            raise NotSupportedError(
                f"queue {name!r}: {what}, which the {self.db.dialect_name} dialect does not have "
                "(docs/sqlserver.md)"
            )
        if "admin" not in self.db.actions_on(None):
            # A role that may not create queues may still declare one that exists as it wants it.
            try:
                queue = self.queue(name)
            except QueueNotFoundError:
                raise PermissionDeniedError(
                    f"creating queue {name!r} needs 'admin' on every queue of schema {self.schema!r}, "
                    "which the connection's role does not hold (DbQueue.grant(role, None, ['admin']))",
                    queue=name,
                    action="admin",
                ) from None
            if not exist_ok:
                raise QueueExistsError(f"queue {name!r} already exists in schema {self.schema!r}")
            _check_same_settings(queue.settings, _as_declared(asked, queue.settings), self.schema)
            return queue
        created = self._insert_queue(wanted)
        self._queues.pop(name, None)
        queue = self.queue(name)
        if created is None:
            if not exist_ok:
                raise QueueExistsError(f"queue {name!r} already exists in schema {self.schema!r}")
            _check_same_settings(queue.settings, _as_declared(asked, queue.settings), self.schema)
        return queue

    def _declared_ring(self, name: str) -> RingLayout | None:
        """The layout of the ring ``name`` if it exists (None for a table queue or no queue)."""
        try:
            return self.queue(name).settings.layout
        except QueueNotFoundError:
            return None

    def _insert_queue(self, wanted: QueueSettings) -> tuple[Any, ...] | None:
        """Insert the queue's row (and a ring's slots, in the same transaction); return the new row, or
        None when a queue of that name exists already."""
        params = {f.name: getattr(wanted, f.name) for f in dataclasses.fields(wanted)}
        params.update(
            design=wanted.design.value,
            payload_type=wanted.payload_type.value,
            notify=wanted.notify.value,
            on_expiry=wanted.on_expiry.value,
            ordering=wanted.ordering.value,
            layout=None if wanted.layout is None else wanted.layout.value,
        )
        with self.db.transaction() as conn:  # a ring's slots are created with its row, or neither
            created = self.db.fetchone("create_queue", params, conn)
            if created is not None and wanted.layout is RingLayout.ROWS:
                self.db.execute(
                    "ring_rows_create",
                    {"queue_id": created[0], "capacity": wanted.capacity, "lanes": wanted.lanes},
                    conn,
                )
                self.db.grant_new_ring(conn, created[0])
            elif created is not None and wanted.design is Design.RING:
                self.db.execute(
                    "ring_create",
                    {
                        "schema": self.schema,
                        "queue_id": created[0],
                        "capacity": wanted.capacity,
                        "slot_bytes": wanted.max_payload_bytes,
                        "lanes": wanted.lanes,
                    },
                    conn,
                )
                self.db.grant_new_ring(conn, created[0])
            elif created is not None and self.db.table_recycling_skipped is None:
                # the floor its pops start from, which the recycling raises (PostgreSQL)
                self.db.execute("table_make_floor", {"queue_id": created[0]}, conn)
        return created

    def queue(self, name: str) -> Queue:
        """Return the named queue (settings loaded once); raise :class:`QueueNotFoundError` if missing."""
        q = self._queues.get(name)
        if q is None:
            row = self.db.fetchone("get_queue", {"name": validate_queue_name(name)})
            if row is None:
                raise QueueNotFoundError(name, self.schema)
            q = self._open(_settings_from_row(row))
            # What the connection's role may do to it (a column of its own on PostgreSQL): the handle
            # refuses the rest before sending anything; the database's policies refuse it anyway.
            actions = row[len(_SETTINGS_COLUMNS)] if len(row) > len(_SETTINGS_COLUMNS) else None
            q.restrict(None if actions is None or set(ACTIONS) <= set(actions) else frozenset(actions))
            self._queues[name] = q
        return q

    def _refresh_if_dropped(self, name: str, queue_id: int) -> bool:
        """Return whether queue ``name`` with ``queue_id`` was dropped (by anyone: the database is
        asked, not this object's cache); if so, forget the cached handle."""
        row = self.db.fetchone("get_queue", {"name": validate_queue_name(name)})
        gone = row is None or row[0] != queue_id
        if gone:
            cached = self._queues.get(name)
            if cached is not None and cached.settings.queue_id == queue_id:
                del self._queues[name]
        return gone

    def _open(self, settings: QueueSettings) -> Queue:
        if settings.layout is RingLayout.ROWS:
            return RowsRingQueue(self.db, settings)
        if settings.design is Design.RING:
            return RingQueue(self.db, settings)
        q = TableQueue(self.db, settings)
        q.recycler = self.recycler
        return q

    def list_queues(self) -> list[QueueSettings]:
        """Return the settings of every queue in the schema."""
        return [_settings_from_row(r) for r in self.db.fetchall("list_queues")]

    def drop_queue(self, name: str, *, missing_ok: bool = False) -> bool:
        """Drop a queue with all its messages (ready, in flight, failed, finished and archived).

        One transaction. It first waits for the pushes to the queue in progress (a push holds the
        queue's push lock, shared, until its transaction ends) and keeps new ones out until it commits;
        a push after it, through any handle, raises :class:`QueueNotFoundError` and writes nothing.
        """
        try:
            q = self.queue(name)
        except QueueNotFoundError:
            if missing_ok:
                return False
            raise
        q.require("admin")
        self._queues.pop(name, None)
        params = {"queue_id": q.settings.queue_id}
        with self.db.transaction() as conn:
            self.db.execute("drop_queue_lock", params, conn)
            if q.settings.design is Design.RING:
                self.db.execute("ring_drop", params, conn)
            # Separate statements, in this order: each one's snapshot comes after what the one before
            # waited for (see queries/queues.sql), so nothing written meanwhile is left behind.
            self.db.execute("drop_queue_messages", params, conn)
            self.db.execute("drop_queue_finished", params, conn)
            return self.db.fetchone("drop_queue", params, conn) is not None

    # -- maintenance -------------------------------------------------------------------------------

    def maintenance(self) -> Maintenance:
        """Return the maintenance steps of this schema (archiving, upkeep, VACUUM, reindex, metrics)."""
        from airflow_dbqueue.engine.maintenance import Maintenance

        return Maintenance(self.db, self)

    def maintain(self, config: MaintenanceConfig | None = None) -> dict[str, Any]:
        """Run every maintenance step once (see :meth:`Maintenance.run`); return the JSON-safe report.

        The connection's role needs ``admin`` on every queue (:meth:`grant`)."""
        self._require_everywhere("admin", "maintenance")
        return self.maintenance().run(config)

    # -- least-privilege roles ---------------------------------------------------------------------

    def grant(self, role: str, queue: str | None, actions: Iterable[str] | str) -> list[str]:
        """Let database role ``role`` take ``actions`` on queue ``queue`` (None: on every queue, present
        and future); return the actions it did not hold before.

        The actions: ``push``; ``pop`` (pop, ack, nack, claims and batches; implies ``read``); ``read``
        (stats, peek, counts, failed messages); ``admin`` (create and drop queues, requeue and delete
        failed messages, consumer groups, maintenance; implies ``pop`` and ``read``). The database
        enforces them (row-level security on PostgreSQL): a role sees and changes only the rows of
        queues it holds an action on. Only the schema's owner grants. PostgreSQL only.
        """
        wanted = check_actions(actions)
        queue_id = None if queue is None else self.queue(queue).settings.queue_id
        return self.db.grant(role, queue_id, wanted)

    def revoke(self, role: str, queue: str | None, actions: Iterable[str] | str) -> list[str]:
        """Take ``actions`` on ``queue`` (None: the grant on every queue) from ``role``; return the
        actions it held. A role left with no grant loses every privilege the grants gave it."""
        wanted = check_actions(actions)
        queue_id = None if queue is None else self.queue(queue).settings.queue_id
        return self.db.revoke(role, queue_id, wanted)

    def grants(self) -> list[tuple[str, str | None, str]]:
        """Every grant: ``(role, queue name or None for every queue, action)``."""
        return self.db.list_grants()

    def _require_everywhere(self, action: str, what: str) -> None:
        if action not in self.db.actions_on(None):
            raise PermissionDeniedError(
                f"{what} needs {action!r} on every queue of schema {self.schema!r}, which the connection's "
                "role does not hold (the schema's owner grants it: DbQueue.grant(role, None, ['admin']))",
                action=action,
            )

    # -- exactly-once ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[DbConnection]:
        """Yield a connection in a transaction for exactly-once work.

        Pop with ``semantics="exactly-once", conn=conn`` and write your results with the same
        ``conn``: both commit together when the block ends, or roll back together on an exception.
        """
        with self.db.transaction() as conn:
            yield conn
