"""The Queues page: the plugin's JSON API behind Airflow's own authentication, served by a real
``airflow api-server`` (SimpleAuthManager with a viewer, a user and an op) on the real PostgreSQL, and
the page itself in a real headless Chromium.

A queue with known counts (7 ready, 2 delayed, 3 in flight, 4 failed) shows those counts, through the
API and in the page's DOM; a requeue from the page moves exactly the message it names back to ready
and nothing else (counts and a checksum of the payloads); a ring's consumer groups show their positions
and lag, under the ring; refused callers change nothing; each action
is in Airflow's audit log; no database connection stays open between requests. The page's screenshot
is saved under ``$DBQUEUE_TEST_ARTIFACTS`` (default ``test-artifacts/`` in the repository).

The charts: after maintenance sampled a table queue and a ring three times, with known pushes and
pops between the samples and a REPEATABLE READ transaction held across the last, the page draws for
each queue an SVG chart whose points are the samples' depths and rates, a horizon chart whose points
are the samples' horizon figures, and names the holder while it is held (and not once it ends),
loading nothing from outside the server.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import socket
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.plugins.queues import PREVIEW_CHARS
from tests.airflow.conftest import AIRFLOW, REPO, conn_json, migrated_airflow_env
from tests.browser import Chromium, find_chromium
from tests.dialects import run_sql
from tests.helpers import checksum, engine_sessions, require

pytestmark = pytest.mark.integration

CONN_ID = "dbqueue_ui"
USERS = {"nobody": "", "viewer": "viewer", "runner": "user", "operator": "op"}
"""User name: SimpleAuthManager role. A viewer may look; a user (runs DAGs) and a viewer may not act; a
user without a role is signed in but may do nothing."""
ARTIFACTS = Path(os.environ.get("DBQUEUE_TEST_ARTIFACTS") or REPO / "test-artifacts")


@dataclass
class Server:
    url: str
    home: Path
    schema: str
    dsn: str
    passwords: dict[str, str]
    env: dict[str, str]

    def token(self, user: str) -> str:
        status, body = request(
            self.url + "/auth/token",
            method="POST",
            body={"username": user, "password": self.passwords[user]},
        )
        assert status == 201, body
        return str(body["access_token"])

    def audit(self) -> list[tuple[str, str, dict[str, Any]]]:
        """The plugin's entries in Airflow's audit log (the Log table), oldest first."""
        with sqlite3.connect(self.home / "airflow.db") as db:
            rows = db.execute(
                "SELECT event, owner, extra FROM log WHERE event LIKE 'dbqueue.%' ORDER BY id"
            ).fetchall()
        return [(e, o, json.loads(x)) for e, o, x in rows]


def request(url: str, *, method: str = "GET", token: str | None = None, body: Any = None) -> tuple[int, Any]:
    """One HTTP request; return (status, decoded JSON body or text)."""
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real ``airflow api-server`` with the plugin, serving ``dbqueue_ui`` on a schema of its own."""
    home = tmp_path_factory.mktemp("airflow-ui-home")
    dags = tmp_path_factory.mktemp("dags")
    (dags / "dbqueue_maintenance.py").symlink_to(REPO / "dags" / "dbqueue_maintenance.py")
    schema = f"t_ui_{uuid.uuid4().hex[:10]}"
    with DbQueue(pg_dsn, schema=schema, pool_size=1) as dbq:
        dbq.install()
    passwords = {user: secrets.token_urlsafe(12) for user in USERS}
    (home / "passwords.json").write_text(json.dumps(passwords))
    env = migrated_airflow_env(
        home,
        dags,
        AIRFLOW__CORE__AUTH_MANAGER="airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS=",".join(f"{u}:{r}" for u, r in USERS.items()),
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(home / "passwords.json"),
        AIRFLOW__API_AUTH__JWT_SECRET=secrets.token_urlsafe(32),
        AIRFLOW__CORE__LAZY_LOAD_PLUGINS="False",
    )
    env[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = conn_json(pg_dsn, schema)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (home / "api-server.log").open("wb")
    proc = subprocess.Popen(
        [str(AIRFLOW), "api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if request(url + "/api/v2/monitor/health")[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    "the API server did not start:\n" + (home / "api-server.log").read_text()[-4000:]
                )
            time.sleep(0.5)
        yield Server(url=url, home=home, schema=schema, dsn=pg_dsn, passwords=passwords, env=env)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
        with DbQueue(pg_dsn, schema=schema, pool_size=1) as dbq:
            dbq.uninstall()


@dataclass
class KnownQueue:
    name: str
    payloads: list[dict[str, Any]]
    failed_ids: list[int]
    failed_payloads: dict[int, Any]


def known_queue(server: Server, name: str) -> KnownQueue:
    """A table queue with 7 ready, 2 delayed, 3 in flight and 4 failed messages (16 in all)."""
    payloads = [{"order": i, "note": "x" * i} for i in range(16)]
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        q = dbq.create_queue(name, max_attempts=1, visibility_timeout=3600)
        q.push_batch(payloads[:4])
        doomed = q.pop(4, semantics="at-least-once")
        assert len(doomed) == 4
        q.nack(doomed, error="card declined: insufficient funds")
        q.push_batch(payloads[4:7])
        assert len(q.pop(3, semantics="at-least-once")) == 3
        q.push_batch(payloads[7:14])
        q.push_batch(payloads[14:], delay=3600)
        failed = q.list_failed(100)
        st = q.stats()
        assert (st.ready, st.delayed, st.in_flight, st.failed) == (7, 2, 3, 4)
    return KnownQueue(
        name=name,
        payloads=payloads,
        failed_ids=[m.id for m in failed],
        failed_payloads={m.id: m.payload for m in failed},
    )


def figures(server: Server, name: str) -> tuple[int, int, int, int]:
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        st = dbq.queue(name).stats()
    return st.ready, st.delayed, st.in_flight, st.failed


def ready_payloads(server: Server, name: str) -> dict[int, Any]:
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        return {m.id: m.payload for m in dbq.queue(name).peek(1000)}


def failed_payloads(server: Server, name: str) -> dict[int, Any]:
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        return {m.id: m.payload for m in dbq.queue(name).list_failed(1000)}


def no_sessions_left(dsn: str, timeout: float = 10.0, *, before: int = 0) -> bool:
    """Whether the engine's sessions on the test database come back to ``before`` (those open before the
    requests, which earlier tests of the same process may have left) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while engine_sessions(dsn) > before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def queue_row(body: dict[str, Any], name: str) -> dict[str, Any]:
    (conn,) = [c for c in body["connections"] if c["conn_id"] == CONN_ID]
    assert conn["error"] is None, conn["error"]
    (row,) = [q for q in conn["queues"] if q["name"] == name]
    return row


def test_the_api_behind_airflows_authentication(server: Server) -> None:  # noqa: PLR0915
    """Long on purpose: one scenario told in order, whose checks at the end need everything it built along the
    way; split, the parts would pass all of it around."""
    k = known_queue(server, "api_orders")
    sessions_before = engine_sessions(server.dsn)
    api = server.url + "/dbqueue/api"
    failed_url = f"{api}/connections/{CONN_ID}/queues/{k.name}/failed"
    first, second = k.failed_ids[0], k.failed_ids[1]

    # Airflow lists the plugin, and its page in the navigation.
    status, plugins = request(server.url + "/api/v2/plugins", token=server.token("operator"))
    assert status == 200, plugins
    (plugin,) = [p for p in plugins["plugins"] if p["name"] == "dbqueue"]
    assert plugin["fastapi_apps"][0]["url_prefix"] == "/dbqueue"
    assert plugin["external_views"][0]["href"] == "dbqueue/"
    status, page = request(server.url + "/dbqueue/")
    assert status == 200 and "<title>Queues" in page

    # Refused: no token, a forged token; and a viewer or a user acting changes nothing.
    assert request(api + "/queues")[0] == 401
    assert request(failed_url)[0] == 401
    assert request(failed_url + "/requeue", method="POST", body={"ids": [first]})[0] == 401
    forged = server.token("viewer")[:-4] + "AAAA"
    assert request(api + "/queues", token=forged)[0] == 403
    nobody = server.token("nobody")
    for url in (api + "/queues", failed_url):
        status, body = request(url, token=nobody)
        assert status == 403 and "may not use Airflow's UI" in body["detail"], body
    assert request(failed_url + "/requeue", method="POST", token=nobody, body={"ids": [first]})[0] == 403
    for who in ("viewer", "runner"):
        token = server.token(who)
        for action in ("requeue", "delete"):
            status, body = request(
                f"{failed_url}/{action}", method="POST", token=token, body={"ids": [first]}
            )
            assert status == 403, (who, action, body)
    assert figures(server, k.name) == (7, 2, 3, 4)
    assert failed_payloads(server, k.name) == k.failed_payloads

    # A viewer reads the figures, and the failed messages without their payloads.
    viewer = server.token("viewer")
    status, body = request(api + "/queues", token=viewer)
    assert status == 200, body
    row = queue_row(body, k.name)
    assert (row["ready"], row["delayed"], row["in_flight"], row["failed"], row["expired"]) == (7, 2, 3, 4, 0)
    assert row["design"] == "table" and row["oldest_ready_age_s"] is not None
    assert row["pushed_per_s"] == round(16 / 300, 3)
    (conn,) = [c for c in body["connections"] if c["conn_id"] == CONN_ID]
    assert (conn["can_read_payloads"], conn["can_act"]) == (False, False)
    assert {"meta", "data"} <= set(conn["tables"]) and conn["indexes"]
    status, page1 = request(failed_url + "?limit=3", token=viewer)
    assert status == 200, page1
    assert [m["id"] for m in page1["messages"]] == k.failed_ids[:3]
    assert page1["payloads_shown"] is False
    assert all(m["payload_preview"] is None for m in page1["messages"])
    assert all(m["last_error"] == "card declined: insufficient funds" for m in page1["messages"])
    assert all(m["attempts"] == 1 for m in page1["messages"])
    status, page2 = request(f"{failed_url}?limit=3&after_id={page1['next_after_id']}", token=viewer)
    assert [m["id"] for m in page2["messages"]] == k.failed_ids[3:] and page2["next_after_id"] is None

    # An op may read the connection: payloads shown; and may act.
    op = server.token("operator")
    status, body = request(failed_url, token=op)
    assert body["payloads_shown"] is True
    assert [m["payload_preview"] for m in body["messages"]] == [
        json.dumps(k.failed_payloads[i], separators=(",", ":")) for i in k.failed_ids
    ]
    status, body = request(failed_url + "/requeue", method="POST", token=op, body={"ids": [first]})
    assert (status, body["requeued"]) == (200, 1), body
    status, body = request(failed_url + "/delete", method="POST", token=op, body={"ids": [second]})
    assert (status, body["deleted"]) == (200, 1), body
    assert figures(server, k.name) == (8, 2, 3, 2)
    assert ready_payloads(server, k.name)[first] == k.failed_payloads[first]
    assert failed_payloads(server, k.name) == {
        i: p for i, p in k.failed_payloads.items() if i not in (first, second)
    }
    # Long payloads are cut to a preview; bytes are shown in base64.
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        blobs = dbq.create_queue("api_blobs", payload_type="bytes", max_attempts=1)
        blobs.push(bytes(range(256)) * 4)
        blobs.nack(blobs.pop(1, semantics="at-least-once"), error="x" * 50)
    status, body = request(f"{api}/connections/{CONN_ID}/queues/api_blobs/failed", token=op)
    (blob,) = body["messages"]
    assert blob["payload_preview"].startswith("base64:AAECAwQF") and blob["payload_preview"].endswith(
        "\u2026"
    )
    assert len(blob["payload_preview"]) == PREVIEW_CHARS

    # An id that is no longer failed moves nothing.
    status, body = request(failed_url + "/requeue", method="POST", token=op, body={"ids": [first]})
    assert (status, body["requeued"]) == (200, 0)

    # Bad input: a clear error, nothing moved.
    for bad in ({"ids": []}, {"ids": [-1]}, {"ids": ["x"]}, {}):
        status, body = request(failed_url + "/requeue", method="POST", token=op, body=bad)
        assert status in (400, 422), (bad, body)
    status, body = request(f"{api}/connections/{CONN_ID}/queues/no_such_queue/failed", token=op)
    assert status == 404 and "no_such_queue" in body["detail"]
    status, body = request(f"{api}/connections/not_a_queue_db/queues/{k.name}/failed", token=op)
    assert status == 404 and "not_a_queue_db" in body["detail"]
    status, body = request(f"{api}/connections/{CONN_ID}/queues/bad%20name/failed", token=op)
    assert status == 400, body
    assert figures(server, k.name) == (8, 2, 3, 2)

    # A connection of the provider's own type in Airflow's metadata database is served too.
    other = f"t_ui_{uuid.uuid4().hex[:10]}"
    with DbQueue(server.dsn, schema=other, pool_size=1) as dbq:
        dbq.install()
        dbq.create_queue("meta_orders").push_batch([{"n": i} for i in range(3)])
    try:
        fields = json.loads(conn_json(server.dsn, other))
        status, body = request(
            server.url + "/api/v2/connections",
            method="POST",
            token=op,
            body={
                "connection_id": "dbqueue_meta",
                "conn_type": "dbqueue",
                "host": fields["host"],
                "port": fields["port"],
                "login": fields["login"],
                "password": fields["password"],
                "schema": fields["schema"],
                "extra": json.dumps({"dialect": "postgresql", "dbqueue_schema": other}),
            },
        )
        assert status == 201, body
        # And one whose database does not answer: its error takes its place, the others are shown.
        status, body = request(
            server.url + "/api/v2/connections",
            method="POST",
            token=op,
            body={
                "connection_id": "dbqueue_down",
                "conn_type": "postgres",
                "host": "127.0.0.1",
                "port": free_port(),
                "login": "nobody",
                "schema": "nothing",
                "extra": json.dumps({"dbqueue_schema": "dbqueue"}),
            },
        )
        assert status == 201, body
        status, body = request(api + "/queues", token=viewer)
        assert status == 200, body
        (meta,) = [c for c in body["connections"] if c["conn_id"] == "dbqueue_meta"]
        assert (meta["conn_type"], meta["schema"], meta["error"]) == ("dbqueue", other, None)
        assert [(q["name"], q["ready"]) for q in meta["queues"]] == [("meta_orders", 3)]
        (down,) = [c for c in body["connections"] if c["conn_id"] == "dbqueue_down"]
        assert down["error"].startswith("DatabaseUnavailableError: ") and "queues" not in down
        assert queue_row(body, k.name)["failed"] == 2
    finally:
        request(server.url + "/api/v2/connections/dbqueue_down", method="DELETE", token=op)
        request(server.url + "/api/v2/connections/dbqueue_meta", method="DELETE", token=op)
        with DbQueue(server.dsn, schema=other, pool_size=1) as dbq:
            dbq.uninstall()

    # Only the op's actions are in Airflow's audit log, with what they did.
    assert server.audit() == [
        (
            "dbqueue.requeue_failed",
            "operator",
            {"conn_id": CONN_ID, "queue": k.name, "ids": [first], "requeued": 1},
        ),
        (
            "dbqueue.delete_failed",
            "operator",
            {"conn_id": CONN_ID, "queue": k.name, "ids": [second], "deleted": 1},
        ),
        (
            "dbqueue.requeue_failed",
            "operator",
            {"conn_id": CONN_ID, "queue": k.name, "ids": [first], "requeued": 0},
        ),
    ]
    # Every request closed the database connection it opened.
    left = no_sessions_left(server.dsn, before=sessions_before)
    assert left, (sessions_before, engine_sessions(server.dsn))


MAINTENANCE_STEPS = (
    "check_horizon",
    "upkeep",
    "archive",
    "vacuum",
    "compact_rings",
    "rebuild_indexes",
    "sample",
    "metrics",
)


def test_a_rows_ring_with_a_ttl_through_the_api(server: Server) -> None:
    """A ring of the rows layout whose messages expire: the API's figures count the expired messages no
    pop has reached yet and, once a pop reached them, the failed ones by expiry (the page's "expired"
    column); its failed list shows them with last_error "expired", and an operator requeues one by id,
    the ring's first message (id 0) included."""
    api = server.url + "/dbqueue/api"
    name = "api_rows_quotes"
    failed_url = f"{api}/connections/{CONN_ID}/queues/{name}/failed"
    payloads = [{"quote": i} for i in range(5)]
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        q = dbq.create_queue(name, design="ring", layout="rows", capacity=64, lanes=1, ttl=3600)
        doomed = q.push_batch(payloads[:3], ttl=30)
        kept = q.push_batch(payloads[3:])
        rows = sorted({i >> 16 for i in doomed})
        run_sql(
            dbq,
            f"UPDATE {{schema}}.ring_{q.settings.queue_id}_rq0 SET expires_at = now() - interval '1 s' "
            "WHERE r = ANY (%(rows)s)",
            {"rows": rows},
        )
    viewer, op = server.token("viewer"), server.token("operator")
    status, body = request(api + "/queues", token=viewer)
    assert status == 200, body
    row = queue_row(body, name)
    assert row["design"] == "ring" and row["layout"] == "rows"
    assert (row["ready"], row["failed"], row["expired"], row["expired_pending"]) == (2, 0, 0, 3)
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        got = dbq.queue(name).pop(10)
    assert [m.id for m in got] == kept
    row = queue_row(request(api + "/queues", token=viewer)[1], name)
    assert (row["ready"], row["failed"], row["expired"], row["expired_pending"]) == (0, 3, 3, 0)
    status, body = request(failed_url, token=op)
    assert status == 200, body
    assert [(m["id"], m["last_error"]) for m in body["messages"]] == [(i, "expired") for i in doomed]
    assert doomed[0] == 0
    status, body = request(failed_url + "/requeue", method="POST", token=op, body={"ids": [0]})
    assert (status, body["requeued"]) == (200, 1), body
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        [again] = dbq.queue(name).pop(10)
        assert again.payload == payloads[0] and again.id not in doomed
        left = dbq.queue(name).list_failed()
    assert checksum(f.payload for f in left) == checksum(payloads[1:3])
    assert checksum([m.payload for m in got] + [again.payload]) == checksum([payloads[0], *payloads[3:]])


def test_a_ring_ordered_per_key_through_the_api(server: Server) -> None:
    """A ring of the rows layout ordered per key: the API's ready is what a pop could take now, and
    blocked (the page's "+N blocked" beside it) the messages waiting behind a held lane."""
    api = server.url + "/dbqueue/api"
    name = "api_rows_keyed"
    sent = [{"order": i} for i in range(4)]
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        q = dbq.create_queue(name, design="ring", layout="rows", capacity=64, lanes=4, ordering="per_key")
        key = "customer-1"
        q.push_batch(sent, keys=[key, key, key, None])  # the last: lane 3, its place in the batch
        first = q.pop(1, semantics="at-least-once")
        assert q.lane_of(key) != 3 and [m.payload for m in first] == sent[:1]
    row = queue_row(request(api + "/queues", token=server.token("viewer"))[1], name)
    assert (row["ready"], row["blocked"], row["in_flight"]) == (1, 2, 1)
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        q = dbq.queue(name)
        assert q.ack(first) == 1
        rest = q.pop(10, semantics="at-least-once")
        assert q.ack(rest) == 3
    assert checksum(m.payload for m in first + rest) == checksum(sent)
    row = queue_row(request(api + "/queues", token=server.token("viewer"))[1], name)
    assert (row["ready"], row["blocked"], row["in_flight"]) == (0, 0, 0)


def test_the_last_maintenance_run(server: Server) -> None:
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        q = dbq.create_queue("maint_orders")
        q.push_batch([{"n": i} for i in range(5)])
        assert q.ack(q.pop(5, semantics="at-least-once")) == 5
    viewer = server.token("viewer")
    status, body = request(server.url + "/dbqueue/api/queues", token=viewer)
    assert (status, body["maintenance"]) == (200, None)
    assert queue_row(body, "maint_orders")["finished"] == 5
    (conn,) = [c for c in body["connections"] if c["conn_id"] == CONN_ID]
    finished = sum(q["finished"] for q in conn["queues"])  # the other tests' deletions finish messages too

    run = subprocess.run(
        [
            str(AIRFLOW),
            "dags",
            "test",
            "dbqueue_maintenance",
            "-c",
            json.dumps({"conn_id": CONN_ID, "archive_after_s": 0}),
        ],
        env=server.env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    status, body = request(server.url + "/dbqueue/api/queues", token=viewer)
    m = body["maintenance"]
    assert (m["state"], m["conn_id"]) == ("success", CONN_ID), m
    assert m["tasks"] == dict.fromkeys(MAINTENANCE_STEPS, "success")
    assert m["archived"] == finished and m["archive_skipped"] is None
    assert m["start_date"] and m["end_date"] and m["xmin_holders"] == []
    assert m["ring_compactions"] == []  # no ring outgrew its size
    assert m["samples"]["recorded"] == len(conn["queues"]) and m["samples"]["skipped"] is None
    assert m["horizon"]["held"] is False and m["horizon"]["not_removable"] == []
    (conn,) = [c for c in body["connections"] if c["conn_id"] == CONN_ID]
    assert [q["finished"] for q in conn["queues"]] == [0] * len(conn["queues"])


def test_the_page_in_a_headless_browser(server: Server) -> None:  # noqa: PLR0915
    """Long on purpose: one scenario told in order, whose checks at the end need everything it built along the
    way; split, the parts would pass all of it around."""
    chromium = find_chromium()
    require(None if chromium else "Chromium is missing", "apt-get install chromium; scripts/test installs it")
    assert chromium is not None
    k = known_queue(server, "page_orders")
    ticks = [{"tick": i} for i in range(16)]
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        ring = dbq.create_queue("page_ticks", design="ring", layout="slots", capacity=64)  # its positions
        audit = ring.add_group("audit", on_lag="drop_group", lag_timeout=600)  # a consumer group
        ring.push_batch(ticks)
        audited = audit.pop(6)
        # A queue with a time to live, two of whose three messages expired and were swept to failed.
        quotes = dbq.create_queue("page_quotes", ttl=3600)
        ids = quotes.push_batch(["q0", "q1", "q2"])
        run_sql(
            dbq, "UPDATE {schema}.meta_opt SET expires_at = now() WHERE id = ANY (%(ids)s)", {"ids": ids[:2]}
        )
        assert quotes.maintain()["expired"] == 2
        assert checksum([m.payload for m in quotes.list_failed()]) == checksum(["q0", "q1"])
        assert quotes.stats().extra == {"expired": 2} and [m.payload for m in quotes.peek(10)] == ["q2"]
        # A ring of the rows layout made with a ttl: an expired push a pop passed (failed by expiry), one
        # no pop has reached yet (pending), and the message the pop took between them.
        rows_quotes = dbq.create_queue(
            "page_rows_quotes", design="ring", layout="rows", capacity=64, lanes=1, ttl=3600
        )
        passed, taken, pending = (
            rows_quotes.push_batch(p) for p in (["r0", "r1"], ["r2"], ["r3", "r4", "r5"])
        )
        run_sql(
            dbq,
            f"UPDATE {{schema}}.ring_{rows_quotes.settings.queue_id}_rq0 "
            "SET expires_at = now() - interval '1 s' WHERE r = ANY (%(rows)s)",
            {"rows": [passed[0] >> 16, pending[0] >> 16]},
        )
        assert [m.id for m in rows_quotes.pop(1)] == taken
        extra = rows_quotes.stats().extra
        assert (extra["expired"], extra["expired_pending"]) == (2, 3)
        assert checksum(f.payload for f in rows_quotes.list_failed()) == checksum(["r0", "r1"])
    assert checksum([m.payload for m in audited]) == checksum(ticks[:6])
    # Through the API: the ring's groups with their positions and lag; none for a table queue.
    status, body = request(server.url + "/dbqueue/api/queues", token=server.token("viewer"))
    assert status == 200 and queue_row(body, k.name)["groups"] is None
    groups = queue_row(body, "page_ticks")["groups"]
    assert [
        (g["group"], g["pop_position"], g["lag_messages"], g["on_lag"], g["lag_timeout_s"]) for g in groups
    ] == [
        ("default", 1, 16, None, None),
        ("audit", 7, 10, "drop_group", 600.0),
    ]
    assert groups[0]["idle_s"] is None and groups[1]["idle_s"] >= 0 and groups[1]["lag_seconds"] >= 0
    target = k.failed_ids[1]
    before_ready = ready_payloads(server, k.name)

    def cell(queue: str, field: str, doc: str = "document") -> str:
        return f'{doc}.querySelector(\'tr[data-queue="{queue}"] td[data-field="{field}"]\')?.textContent'

    frame = "document.querySelector('iframe')?.contentDocument"

    with Chromium(chromium) as b:
        # Without Airflow's session cookie the page shows nothing but that.
        b.goto(server.url + "/dbqueue/")
        b.wait_for("document.getElementById('status').textContent.includes('Not signed in')")
        assert b.evaluate("document.querySelectorAll('tr[data-queue]').length") == 0

        b.set_cookie(server.url, "_token", server.token("operator"))

        # In Airflow's own UI: Browse > Queues frames the page, which shows the queue's counts.
        b.goto(server.url + "/")
        b.wait_for("[...document.querySelectorAll('button')].some(e => e.innerText.trim() === 'Browse')")
        b.evaluate(
            "[...document.querySelectorAll('button')].find(e => e.innerText.trim() === 'Browse').click()"
        )
        item = "[...document.querySelectorAll('[role=menuitem]')].find(e => e.innerText.trim() === 'Queues')"
        b.wait_for(f"!!{item}")
        assert b.evaluate(f"{item}.getAttribute('href')") == "/plugin/dbqueue"
        b.evaluate(f"{item}.click()")
        b.wait_for(f"{cell(k.name, 'failed', frame)} === '4'")
        assert [b.evaluate(cell(k.name, f, frame)) for f in ("ready", "delayed", "in_flight")] == [
            "7",
            "2",
            "3",
        ]
        b.evaluate(
            f'{frame}.querySelector(\'tr[data-queue="{k.name}"] td[data-field="failed"] button\').click()'
        )
        b.wait_for(f"{frame}.querySelectorAll('#failed-rows tr[data-message-id]').length === 4")
        b.screenshot(ARTIFACTS / "queues-in-airflow.png")

        # The page on its own, for the rest.
        b.goto(server.url + "/dbqueue/?refresh=5")
        b.wait_for(cell(k.name, "ready"))
        shown = {
            f: b.evaluate(cell(k.name, f)) for f in ("design", "ready", "delayed", "in_flight", "failed")
        }
        assert shown == {"design": "table", "ready": "7", "delayed": "2", "in_flight": "3", "failed": "4"}
        assert b.evaluate(cell("page_ticks", "ready")) == "16"
        # What failed by expiry, a table queue's figure (none of a ring made without a ttl)
        expired = [b.evaluate(cell(q, "expired")) for q in ("page_quotes", k.name, "page_ticks")]
        assert expired == ["2", "0", ""]
        # A rows ring's: those failed by expiry, and beside them those no pop has reached yet
        assert b.evaluate(cell("page_rows_quotes", "expired")) == "2 +3 pending"
        pending_span = 'tr[data-queue="page_rows_quotes"] span[data-field="expired_pending"]'
        assert "not reached by a pop yet" in b.evaluate(f"document.querySelector('{pending_span}').title")
        none_pending = "!document.querySelector('tr[data-queue=\"{}\"] span[data-field=expired_pending]')"
        assert all(b.evaluate(none_pending.format(q)) for q in ("page_quotes", k.name, "page_ticks"))
        assert b.evaluate(cell("page_quotes", "failed")) == "2"
        assert "25% of 64" in b.evaluate(cell("page_ticks", "ring"))
        # Under the ring, its consumer groups with their lag; none under the table queue.
        group = (
            'document.querySelector(\'tr[data-group-of="page_ticks"][data-group="{}"] td[data-field="{}"]\')'
        )
        shown_groups = [
            [
                b.evaluate(group.format(g, f) + "?.textContent")
                for f in ("pop_position", "lag_messages", "on_lag")
            ]
            for g in ("default", "audit")
        ]
        assert shown_groups == [["1", "16", "not watched"], ["7", "10", "drop_group after 10.0 min"]]
        assert b.evaluate(f"document.querySelectorAll('tr[data-group-of=\"{k.name}\"]').length") == 0
        assert "signed in as operator" in b.evaluate("document.getElementById('who').textContent")

        # The failed messages, then a requeue of one of them, confirmed in the page's dialog.
        b.evaluate(
            f'document.querySelector(\'tr[data-queue="{k.name}"] td[data-field="failed"] button\').click()'
        )
        b.wait_for("document.querySelectorAll('#failed-rows tr[data-message-id]').length === 4")
        rows = b.evaluate(
            "[...document.querySelectorAll('#failed-rows tr[data-message-id]')].map(r => "
            "[Number(r.dataset.messageId), r.querySelector('td.payload').textContent, "
            "r.querySelector('td.lasterror').textContent])"
        )
        assert rows == [
            [i, json.dumps(k.failed_payloads[i], separators=(",", ":")), "card declined: insufficient funds"]
            for i in k.failed_ids
        ]
        b.screenshot(ARTIFACTS / "queues-page.png")
        requeue_button = f'tr[data-message-id="{target}"] button[data-action="requeue"]'
        b.evaluate(f"document.querySelector('{requeue_button}').click()")
        b.wait_for("document.getElementById('confirm').open")
        assert f"Requeue message {target} of queue {k.name}" in b.evaluate(
            "document.getElementById('confirm-text').textContent"
        )
        # Nothing moves before the confirmation.
        assert figures(server, k.name) == (7, 2, 3, 4)
        b.evaluate("document.getElementById('confirm-yes').click()")
        b.wait_for("document.getElementById('status').textContent.includes('Requeued 1 of 1')")
        b.wait_for(f"{cell(k.name, 'ready')} === '8' && {cell(k.name, 'failed')} === '3'")
        b.wait_for("document.querySelectorAll('#failed-rows tr[data-message-id]').length === 3")
        b.screenshot(ARTIFACTS / "queues-page-after-requeue.png")

        # Two selected messages deleted at once, after the confirmation; the third stays failed.
        keep, *gone = sorted(set(k.failed_ids) - {target})
        for i in gone:
            b.evaluate(f"document.querySelector('#failed-rows input[value=\"{i}\"]').click()")
        b.evaluate("document.getElementById('delete-selected').click()")
        b.wait_for("document.getElementById('confirm').open")
        assert f"Delete 2 messages of queue {k.name}" in b.evaluate(
            "document.getElementById('confirm-text').textContent"
        )
        b.evaluate("document.getElementById('confirm-yes').click()")
        b.wait_for("document.getElementById('status').textContent.includes('Deleted 2 of 2')")
        b.wait_for(f"{cell(k.name, 'failed')} === '1'")
        assert set(failed_payloads(server, k.name)) == {keep}
        assert figures(server, k.name) == (8, 2, 3, 1)

        # A viewer sees the same figures, the failed messages without payloads, and no actions.
        b.set_cookie(server.url, "_token", server.token("viewer"))
        b.goto(server.url + "/dbqueue/?refresh=0")
        b.wait_for(f"{cell(k.name, 'failed')} === '1'")
        b.evaluate(
            f'document.querySelector(\'tr[data-queue="{k.name}"] td[data-field="failed"] button\').click()'
        )
        b.wait_for("document.querySelectorAll('#failed-rows tr[data-message-id]').length === 1")
        assert b.evaluate(
            "[...document.querySelectorAll('#failed-rows tr[data-message-id]')].map(r => "
            "[Number(r.dataset.messageId), r.querySelector('td.payload').textContent])"
        ) == [[keep, "hidden"]]
        assert b.evaluate("document.querySelectorAll('#failed-rows button[data-action]').length") == 0
        assert b.evaluate("document.getElementById('requeue-selected').hidden") is True
        assert "may not read this connection" in b.evaluate(
            "document.getElementById('failed-note').textContent"
        )

    # Exactly the requeued message is ready again, with its payload; the deleted two are gone and the
    # fourth is still failed: nothing else moved.
    assert figures(server, k.name) == (8, 2, 3, 1)
    after_ready = ready_payloads(server, k.name)
    assert after_ready == {**before_ready, target: k.failed_payloads[target]}
    still_failed = failed_payloads(server, k.name)
    assert still_failed == {keep: k.failed_payloads[keep]}
    assert checksum(
        [after_ready[target], still_failed[keep], *(k.failed_payloads[i] for i in gone)]
    ) == checksum(k.failed_payloads.values())
    audit = server.audit()
    assert (
        "dbqueue.requeue_failed",
        "operator",
        {"conn_id": CONN_ID, "queue": k.name, "ids": [target], "requeued": 1},
    ) in audit
    assert (
        "dbqueue.delete_failed",
        "operator",
        {"conn_id": CONN_ID, "queue": k.name, "ids": gone, "deleted": 2},
    ) in audit
    assert (ARTIFACTS / "queues-page.png").stat().st_size > 10_000


def test_the_charts_and_a_held_horizon_in_a_headless_browser(server: Server) -> None:  # noqa: PLR0915
    """One scenario in order: samples with known figures, then the page's charts and horizon line."""
    chromium = find_chromium()
    require(None if chromium else "Chromium is missing", "apt-get install chromium; scripts/test installs it")
    assert chromium is not None
    went_in: dict[str, list[Any]] = {"chart_orders": [], "chart_ticks": []}
    came_out: dict[str, list[Any]] = {"chart_orders": [], "chart_ticks": []}
    plan = [(30, 10, 16, 16), (12, 25, 20, 8)]  # per step: table pushes, table pops, ring pushes, ring pops
    holder = None
    with DbQueue(server.dsn, schema=server.schema, pool_size=1) as dbq:
        queues = {
            "chart_orders": dbq.create_queue("chart_orders", archive=True),
            "chart_ticks": dbq.create_queue("chart_ticks", design="ring", capacity=64),
        }
        m = dbq.maintenance()
        m.sample(["chart_orders", "chart_ticks"])
        for i, (tp, tpop, rp, rpop) in enumerate(plan):
            for name, n, take in (("chart_orders", tp, tpop), ("chart_ticks", rp, rpop)):
                batch = [{"q": name, "step": i, "n": j} for j in range(n)]
                queues[name].push_batch(batch)
                went_in[name] += batch
                came_out[name] += [x.payload for x in queues[name].pop(take)]
            if i == len(plan) - 1:  # the last sample is taken under a held horizon
                holder = psycopg.connect(server.dsn, application_name="report-job")
                holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                holder.execute("SELECT count(*) FROM pg_class")
                queues["chart_orders"].push_batch([{"q": "chart_orders", "late": 1}])  # ages its snapshot
                went_in["chart_orders"].append({"q": "chart_orders", "late": 1})
                time.sleep(1.1)
            time.sleep(0.05)
            m.sample(["chart_orders", "chart_ticks"])
        kept = m.samples(window=3600, queues=["chart_orders", "chart_ticks"])
    assert holder is not None
    pid = holder.info.backend_pid
    for name in went_in:  # nothing lost or changed: what came out is what went in first
        assert checksum(came_out[name]) == checksum(went_in[name][: len(came_out[name])])
    orders, ticks = kept["chart_orders"], kept["chart_ticks"]
    assert [s["pushed"] for s in orders] == [None, 30, 13] and [s["popped"] for s in orders] == [None, 10, 25]
    assert [s["pushed"] for s in ticks] == [None, 16, 20] and [s["popped"] for s in ticks] == [None, 16, 8]
    assert [s["ready"] for s in orders] == [0, 20, 8] and [s["ready"] for s in ticks] == [0, 0, 12]
    assert orders[-1]["horizon_age_s"] >= 1.0 and orders[-1]["horizon_xid_age"] >= 1

    status, body = request(
        server.url + f"/dbqueue/api/connections/{CONN_ID}/samples?window_s=3600", token=server.token("viewer")
    )
    assert status == 200 and body["queues"]["chart_orders"] == orders and body["window_s"] == 3600

    def points(queue: str, chart: str, series: str) -> Any:
        return (
            f'[...document.querySelectorAll(\'svg[data-chart="{chart}"][data-queue="{queue}"] '
            f'g[data-series="{series}"] circle\')].map(c => [Number(c.dataset.t), Number(c.dataset.v)])'
        )

    try:
        with Chromium(chromium) as b:
            b.set_cookie(server.url, "_token", server.token("viewer"))
            b.goto(server.url + "/dbqueue/?refresh=0&window=3600")
            b.wait_for(f"{points('chart_orders', 'depth', 'ready')}.length === 3")
            assert b.evaluate(points("chart_orders", "depth", "ready")) == [
                [s["at"], s["ready"]] for s in orders
            ]
            assert b.evaluate(points("chart_ticks", "depth", "ready")) == [
                [s["at"], s["ready"]] for s in ticks
            ]
            assert b.evaluate(points("chart_orders", "oldest", "age")) == [
                [s["at"], s["oldest_age_s"]] for s in orders if s["oldest_age_s"] is not None
            ]
            # Rates: the pushes and pops since the sample before, over the seconds between them.
            pushed = b.evaluate(points("chart_orders", "rates", "push/s"))
            expected = [(s["at"], s["pushed"] / (s["at"] - p["at"])) for p, s in itertools.pairwise(orders)]
            assert [t for t, _ in pushed] == [t for t, _ in expected]
            assert all(abs(v - e) < 0.001 for (_, v), (_, e) in zip(pushed, expected, strict=True))
            assert len(b.evaluate(points("chart_ticks", "rates", "pop/s"))) == 2
            # The horizon over the same time: a point a run, the last one under the held transaction.
            horizon = (
                '[...document.querySelectorAll(\'div[data-horizon-of] svg[data-chart="horizon-age"] '
                "circle')].map(c => [Number(c.dataset.t), Number(c.dataset.v)])"
            )
            shown = dict(b.evaluate(horizon))  # the runs of the other tests' samples too
            assert {s["at"]: shown.get(s["at"]) for s in orders} == {
                s["at"]: s["horizon_age_s"] for s in orders
            }
            assert shown[orders[-1]["at"]] >= 1.0
            assert b.evaluate("document.querySelectorAll('svg.chart polyline').length") >= 6
            # The holder, named while it holds the horizon.
            line = "document.querySelector('p[data-field=\"horizon\"]')?.textContent || ''"
            b.wait_for(f"({line}).includes('pid {pid}')")
            assert "report-job" in b.evaluate(line) and "idle in transaction" in b.evaluate(line)
            b.screenshot(ARTIFACTS / "queues-charts-held-horizon.png")
            holder.close()
            b.evaluate("document.getElementById('refresh').click()")
            b.wait_for(f"!({line}).includes('pid {pid}')")
            # 1 h -> 24 h: the same samples, drawn over the wider window.
            b.evaluate(
                "const w = document.getElementById('window'); w.value = '86400'; "
                "w.dispatchEvent(new Event('change'))"
            )
            b.wait_for("document.querySelector('.charts h3')?.textContent.includes('1.0 d')")
            assert b.evaluate(points("chart_orders", "depth", "ready")) == [
                [s["at"], s["ready"]] for s in orders
            ]
            # Offline: every resource the page loaded came from the Airflow server itself.
            loaded = b.evaluate("performance.getEntriesByType('resource').map(e => e.name)")
            assert loaded and all(u.startswith(server.url) for u in loaded), loaded
    finally:
        holder.close()
