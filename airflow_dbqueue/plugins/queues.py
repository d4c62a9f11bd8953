"""The Queues page's JSON API and page, mounted by Airflow's API server under ``/dbqueue``.

Every request is authenticated by Airflow itself (the JWT of the UI's session cookie, or an
``Authorization: Bearer`` token from ``POST /auth/token``) and authorised by Airflow's auth manager:

- reading queue figures and failed messages needs access to Airflow's UI (``AccessView.WEBSITE``),
  which every viewer has, with SimpleAuthManager and with FAB alike;
- message payloads are shown only to users who may read the queue's Airflow connection; others see
  the failed messages without their payloads;
- requeueing or deleting failed messages needs the right to edit the connection (``PUT``): an op's or
  an admin's, not a viewer's or a user's. Each action is written to Airflow's audit log (the Log
  table).

The connections served are those of type ``dbqueue``, and those of type ``postgres``, ``mssql`` or
``odbc`` whose extra names a ``dbqueue_schema``, from the metadata database and from
``AIRFLOW_CONN_*`` environment variables. Each request opens the database connection it needs and
closes it before answering: nothing holds one between requests.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.core_api.security import get_user
from fastapi import Body, Depends, FastAPI, HTTPException, Query, status
from fastapi.responses import HTMLResponse

from airflow_dbqueue.engine import (
    ConfigurationError,
    DatabaseUnavailableError,
    DbQueue,
    DbQueueError,
    FailedMessage,
    PayloadType,
    PermissionDeniedError,
    QueueNotFoundError,
)
from airflow_dbqueue.engine.maintenance.config import RATE_WINDOW_S, SAMPLES_KEEP_S
from airflow_dbqueue.engine.maintenance.horizon import costs as horizon_costs
from airflow_dbqueue.engine.models import DEFAULT_GROUP
from airflow_dbqueue.hooks.connection import CONN_TYPE, SCHEMA_EXTRA, _extra, connection_target

if TYPE_CHECKING:
    from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
    from airflow.models.connection import Connection

URL_PREFIX = "/dbqueue"
MAINTENANCE_DAG = "dbqueue_maintenance"
MAINTENANCE_DEFAULT_CONN = "dbqueue_default"
"""The connection the maintenance DAG runs on when its run names none (its ``conn_id`` param)."""
PREVIEW_CHARS = 240
"""Characters of a payload shown in a list of failed messages."""
MAX_PAGE = 500
MAX_IDS = 1000
CONNECT_TIMEOUT_S = 5.0
"""Seconds a request waits for a database before it reports it unavailable."""
MAX_PARALLEL = 8
"""Connections read at once by one request for the queue figures."""
DATABASE_TYPES = ("postgres", "mssql", "odbc")
"""Connection types served when their extra names a ``dbqueue_schema``; ``dbqueue`` is always served."""
PAGE = Path(__file__).with_name("static") / "queues.html"

app = FastAPI(
    title="airflow-dbqueue Queues",
    description="Queue figures, failed messages, and their requeue and deletion.",
)


# -- authentication and authorisation, by Airflow ------------------------------------------------------


UserDep = Annotated["BaseUser", Depends(get_user)]
"""The caller, authenticated by Airflow (401 without a valid token)."""


def _auth_manager() -> Any:
    return get_auth_manager()


def may_view(user: BaseUser) -> bool:
    """Whether Airflow's auth manager lets ``user`` use Airflow's UI, which the Queues page is part of."""
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView

    return bool(_auth_manager().is_authorized_view(access_view=AccessView.WEBSITE, user=user))


def may_use_connection(user: BaseUser, conn_id: str, method: str) -> bool:
    """Whether Airflow's auth manager lets ``user`` read (``GET``) or edit (``PUT``) ``conn_id``."""
    from airflow.api_fastapi.auth.managers.models.resource_details import ConnectionDetails

    return bool(
        _auth_manager().is_authorized_connection(
            method=method, details=ConnectionDetails(conn_id=conn_id), user=user
        )
    )


def require_view(user: BaseUser) -> None:
    if not may_view(user):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "Forbidden: this user may not use Airflow's UI")


def may_act(user: BaseUser, conn_id: str) -> bool:
    """Whether ``user`` may requeue or delete failed messages of ``conn_id``: edit the connection."""
    return may_view(user) and may_use_connection(user, conn_id, "PUT")


def require_action(user: BaseUser, conn_id: str) -> None:
    if not may_act(user, conn_id):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"Forbidden: changing the failed messages of connection {conn_id!r} needs the right to edit "
            "that connection",
        )


# -- the connections served ----------------------------------------------------------------------------


def served(conn: Connection) -> bool:
    """Whether the page serves ``conn``: type ``dbqueue``, or a database type naming a queue schema."""
    if conn.conn_type == CONN_TYPE:
        return True
    if conn.conn_type not in DATABASE_TYPES:
        return False
    extra = conn.extra_dejson  # {} when the extra is not JSON (Airflow logs that)
    return isinstance(extra, dict) and bool(_extra(extra, SCHEMA_EXTRA))


def served_connections() -> dict[str, Connection]:
    """The connections the page serves, by id: environment variables first, then the metadata DB."""
    from airflow.models.connection import Connection
    from airflow.utils.session import create_session
    from sqlalchemy import select

    found: dict[str, Connection] = {}
    for key, value in sorted(os.environ.items()):
        if not key.startswith("AIRFLOW_CONN_"):
            continue
        conn_id = key[len("AIRFLOW_CONN_") :].lower()
        try:
            conn = (
                Connection.from_json(value, conn_id=conn_id)
                if value.lstrip().startswith("{")
                else Connection(conn_id=conn_id, uri=value)
            )
        except Exception:  # a malformed variable belongs to whoever set it; Airflow reports it itself
            continue
        if served(conn):
            found[conn_id] = conn
    with create_session() as session:
        rows = session.scalars(
            select(Connection).where(Connection.conn_type.in_((CONN_TYPE, *DATABASE_TYPES)))
        ).all()
        for conn in rows:
            if conn.conn_id not in found and served(conn):
                session.expunge(conn)
                found[conn.conn_id] = conn
    return found


def connection(conn_id: str) -> Connection:
    conn = served_connections().get(conn_id)
    if conn is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"no connection {conn_id!r} of type {CONN_TYPE!r}, or of type postgres, mssql or odbc with a "
            f"{SCHEMA_EXTRA!r} extra",
        )
    return conn


@contextmanager
def engine(conn: Connection) -> Iterator[DbQueue]:
    """The engine on ``conn`` for one request: one database connection at most, closed on the way out."""
    try:
        target = connection_target(conn)
    except DbQueueError as exc:  # the connection itself cannot serve queues (a refused extra, ...)
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"connection {conn.conn_id!r}: {exc}") from None
    dbq = DbQueue(target.dsn, **target.engine_kwargs(), pool_size=1, connect_timeout=CONNECT_TIMEOUT_S)
    try:
        yield dbq
    except QueueNotFoundError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    except PermissionDeniedError as exc:  # the connection's database role may not do this
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(exc)) from None
    except DatabaseUnavailableError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc)) from None
    except (ConfigurationError, ValueError) as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from None
    finally:
        dbq.close()


# -- what is shown -------------------------------------------------------------------------------------


def preview(payload: Any, payload_type: PayloadType) -> str:
    """The start of a payload as text: JSON as JSON, text as it is, bytes in base64."""
    if payload_type is PayloadType.BYTES:
        text = f"base64:{base64.b64encode(bytes(payload[:PREVIEW_CHARS])).decode('ascii')}"
    elif payload_type is PayloadType.TEXT:
        text = str(payload)
    else:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "\u2026"


def failed_row(m: FailedMessage, payload_type: PayloadType, show_payload: bool) -> dict[str, Any]:
    return {
        "id": m.id,
        "attempts": m.attempts,
        "priority": m.priority,
        "enqueued_at": m.enqueued_at.isoformat(),
        "last_error": m.last_error,
        "payload_preview": preview(m.payload, payload_type) if show_payload else None,
    }


def last_maintenance() -> dict[str, Any] | None:
    """The latest run of the maintenance DAG, from Airflow's metadata: when, its state, each step's state,
    and from the steps' results what they did (rows archived, ring tables compacted, indexes rebuilt)
    and what they warned about."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        run = session.scalars(
            select(DagRun)
            .where(DagRun.dag_id == MAINTENANCE_DAG)
            .order_by(DagRun.run_after.desc(), DagRun.id.desc())
            .limit(1)
        ).first()
        if run is None:
            return None
        tasks = {
            ti.task_id: str(ti.state) if ti.state else None
            for ti in session.scalars(
                select(TaskInstance).where(
                    TaskInstance.dag_id == MAINTENANCE_DAG, TaskInstance.run_id == run.run_id
                )
            )
        }
        results: dict[str, Any] = {}
        for x in session.scalars(
            select(XComModel).where(
                XComModel.dag_id == MAINTENANCE_DAG,
                XComModel.run_id == run.run_id,
                XComModel.key == "return_value",
            )
        ):
            results[x.task_id] = XComModel.deserialize_value(x)
        return _maintenance_summary(run, tasks, results)


def _maintenance_summary(run: Any, tasks: dict[str, str | None], results: dict[str, Any]) -> dict[str, Any]:
    """What the Queues page shows of a maintenance run (a ``DagRun``), its tasks' states and results."""
    conf = run.conf or {}
    archive = (results.get("archive") or {}).get("archive") or {}
    indexes = results.get("rebuild_indexes") or {}
    compact = results.get("compact_rings") or {}
    return {
        "run_id": run.run_id,
        "state": str(run.state) if run.state else None,
        "start_date": _iso(run.start_date),
        "end_date": _iso(run.end_date),
        "conn_id": conf.get("conn_id") or MAINTENANCE_DEFAULT_CONN,
        "tasks": tasks,
        "archived": archive.get("rows"),
        "archive_skipped": archive.get("skipped"),
        "index_actions": [
            {k: a.get(k) for k in ("index", "action", "ok", "reason", "error")}
            for a in indexes.get("actions") or []
        ],
        "index_skipped": indexes.get("skipped"),
        "ring_compactions": [
            {k: a.get(k) for k in ("table", "action", "ok", "bytes_before", "bytes_after", "reason", "error")}
            for a in compact.get("actions") or []
        ],
        "xmin_holders": (results.get("check_horizon") or {}).get("xmin_holders") or [],
        "horizon": horizon_costs(results),
        "samples": {
            k: v for k, v in (results.get("sample") or {}).items() if k in ("recorded", "deleted", "skipped")
        },
    }


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value else None


def _audit(user: BaseUser, event: str, extra: dict[str, Any]) -> None:
    """Write one action to Airflow's audit log (the Log table, shown under Browse > Audit Log)."""
    from airflow.models.log import Log
    from airflow.utils.session import create_session

    with create_session() as session:
        session.add(
            Log(
                event=event,
                owner=user.get_name(),
                owner_display_name=user.get_name(),
                extra=json.dumps(extra, sort_keys=True),
            )
        )


# -- the API -------------------------------------------------------------------------------------------


@app.get("/", response_class=HTMLResponse, include_in_schema=False)
def page() -> HTMLResponse:
    """The page: static HTML and script; every figure on it comes from the API, as the user."""
    return HTMLResponse(PAGE.read_text(encoding="utf-8"))


def ring_groups(figures: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A ring's consumer groups as the page lists them, the default one first (its figures are the
    queue's own, and maintenance does not watch it): each one's position, its lag (what it has still to
    finish, and the age of its oldest ready message), its idle time and what maintenance does when it
    lags. ``None`` for a queue of another design."""
    if figures.get("design") != "ring":
        return None
    rows = [
        {
            "group": DEFAULT_GROUP,
            "pop_position": figures.get("pop_position"),
            "lag_messages": figures.get("lag_messages"),
            "lag_seconds": figures.get("lag_seconds"),
            "idle_s": None,
            "on_lag": None,
            "lag_timeout_s": None,
        }
    ]
    for name, g in sorted((figures.get("groups") or {}).items()):
        rows.append({"group": name, **g})
    return rows


def connection_figures(conn: Connection, rate_window_s: float) -> dict[str, Any]:
    """The figures of one connection's queue schema, or in ``error`` the engine's reason it has none."""
    out: dict[str, Any] = {"error": None}
    try:
        target = connection_target(conn)
        out["schema"] = target.schema
        with DbQueue(
            target.dsn, **target.engine_kwargs(), pool_size=1, connect_timeout=CONNECT_TIMEOUT_S
        ) as dbq:
            out["dialect"] = dbq.dialect
            settings = {s.name: s for s in dbq.list_queues()}
            metrics = dbq.maintenance().metrics(rate_window=rate_window_s)
    except DbQueueError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    rows = []
    for name, figures in sorted(metrics["queues"].items()):
        s = settings.get(name)
        rows.append(
            {
                "name": name,
                **figures,
                "groups": ring_groups(figures),
                "payload_type": s.payload_type.value if s else None,
                "max_attempts": s.max_attempts if s else None,
            }
        )
    out.update(
        queues=rows,
        tables=metrics["tables"],
        indexes=metrics["indexes"],
        xmin_holders=metrics["xmin_holders"],
        horizon=metrics["horizon"],
        notes=metrics["notes"],
        at=metrics["at"],
        rate_window_s=metrics["rate_window_s"],
    )
    return out


@app.get("/api/queues")
def queues(
    user: UserDep,
    rate_window_s: Annotated[float, Query(gt=0, le=86_400)] = RATE_WINDOW_S,
) -> dict[str, Any]:
    """Every served connection with its queues: depth by state, oldest ready age, rates, ring fill and
    positions, a ring's consumer groups with their lag, table and index sizes with bloat, what holds
    back the xmin horizon; and the last run of the maintenance DAG. A connection that cannot be read
    says why in ``error``."""
    require_view(user)
    conns = sorted(served_connections().items())
    # One thread a connection: an unreachable database costs its own connect timeout, not the others'.
    with ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL, len(conns)))) as pool:
        figures = list(pool.map(lambda c: connection_figures(c[1], rate_window_s), conns))
    out = [
        {
            "conn_id": conn_id,
            "conn_type": conn.conn_type,
            "can_read_payloads": may_use_connection(user, conn_id, "GET"),
            "can_act": may_act(user, conn_id),
            **f,
        }
        for (conn_id, conn), f in zip(conns, figures, strict=True)
    ]
    return {"user": user.get_name(), "connections": out, "maintenance": last_maintenance()}


@app.get("/api/connections/{conn_id}/samples")
def samples(
    conn_id: str,
    user: UserDep,
    window_s: Annotated[float, Query(gt=0, le=SAMPLES_KEEP_S * 7)] = 6 * 3600.0,
) -> dict[str, Any]:
    """The samples maintenance recorded in the last ``window_s`` seconds, by queue, oldest first: depth by
    state, oldest ready age, pushes and pops since the queue's previous sample, a ring's totals and its
    groups' lag, and the schema's horizon then (the oldest holder's age in seconds and in transaction
    ids, the dead rows of the schema's tables). ``at`` and ``now`` are seconds since the epoch."""
    require_view(user)
    conn = connection(conn_id)
    with engine(conn) as dbq:
        kept = dbq.maintenance().samples(window=window_s)
    return {
        "conn_id": conn_id,
        "window_s": window_s,
        "now": dt.datetime.now(dt.UTC).timestamp(),
        "queues": kept,
    }


@app.get("/api/connections/{conn_id}/queues/{queue_name}/failed")
def failed(
    conn_id: str,
    queue_name: str,
    user: UserDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    after_id: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, Any]:
    """A page of the queue's failed messages by id, after ``after_id``: attempts, last error, and a
    payload preview (``null`` for a user who may not read the connection). ``next_after_id`` names the
    next page, ``null`` on the last."""
    require_view(user)
    conn = connection(conn_id)
    show = may_use_connection(user, conn_id, "GET")
    with engine(conn) as dbq:
        q = dbq.queue(queue_name)
        msgs = q.list_failed(limit + 1, after_id)
        kind = q.settings.payload_type
    more = len(msgs) > limit
    msgs = msgs[:limit]
    return {
        "conn_id": conn_id,
        "queue": queue_name,
        "payloads_shown": show,
        "messages": [failed_row(m, kind, show) for m in msgs],
        "next_after_id": msgs[-1].id if more else None,
    }


def _ids(ids: list[int]) -> list[int]:
    if not ids:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "ids: name at least one failed message")
    if len(ids) > MAX_IDS:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"ids: at most {MAX_IDS} at once, got {len(ids)}")
    # >= 0: a ring of the rows layout numbers its first message 0
    if any(isinstance(i, bool) or i < 0 for i in ids):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "ids: message ids are integers >= 0")
    return sorted(set(ids))


IdsBody = Annotated[list[int], Body(embed=True, description="ids of failed messages")]


@app.post("/api/connections/{conn_id}/queues/{queue_name}/failed/requeue")
def requeue(conn_id: str, queue_name: str, ids: IdsBody, user: UserDep) -> dict[str, Any]:
    """Make the named failed messages ready again; return how many moved (ids not failed are left)."""
    require_action(user, conn_id)
    wanted = _ids(ids)
    conn = connection(conn_id)
    with engine(conn) as dbq:
        moved = dbq.queue(queue_name).requeue_failed(wanted)
    _audit(
        user,
        "dbqueue.requeue_failed",
        {"conn_id": conn_id, "queue": queue_name, "ids": wanted, "requeued": moved},
    )
    return {"conn_id": conn_id, "queue": queue_name, "ids": wanted, "requeued": moved}


@app.post("/api/connections/{conn_id}/queues/{queue_name}/failed/delete")
def delete(conn_id: str, queue_name: str, ids: IdsBody, user: UserDep) -> dict[str, Any]:
    """Discard the named failed messages; return how many were deleted (ids not failed are left)."""
    require_action(user, conn_id)
    wanted = _ids(ids)
    conn = connection(conn_id)
    with engine(conn) as dbq:
        deleted = dbq.queue(queue_name).delete_failed(wanted)
    _audit(
        user,
        "dbqueue.delete_failed",
        {"conn_id": conn_id, "queue": queue_name, "ids": wanted, "deleted": deleted},
    )
    return {"conn_id": conn_id, "queue": queue_name, "ids": wanted, "deleted": deleted}
