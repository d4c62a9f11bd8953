"""Bad input gets an error of the engine's own family at once, naming the problem, and leaves the data
as it was: payloads that cannot be encoded, numbers that are not finite or are negative, a malformed
connection string, and a payload on the command line that is not JSON. On a real PostgreSQL."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from airflow_dbqueue.engine import (
    ConfigurationError,
    DbQueue,
    DbQueueError,
    MaintenanceConfig,
    PayloadTypeError,
)
from airflow_dbqueue.engine.embedded import free_port

pytestmark = pytest.mark.integration

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("payload_type", ["text", "json"])
def test_a_lone_surrogate_is_a_payload_type_error_and_nothing_is_written(
    dbq: DbQueue, payload_type: str
) -> None:
    q = dbq.create_queue("notes", payload_type=payload_type)
    with pytest.raises(
        PayloadTypeError, match=r"payload #1 is not (valid text|JSON-serialisable).*surrogate"
    ):
        q.push_batch(["fine", "a\ud800b"])
    assert q.stats().ready == 0
    q.push("a\u00e9b")  # a real character outside ASCII is fine
    [m] = q.pop()
    assert m.payload == "a\u00e9b"


BAD_CALLS: dict[str, Callable[[Any, Any], Any]] = {
    "push delay nan": lambda q, d: q.push({"n": 1}, delay=NAN),
    "push delay inf": lambda q, d: q.push({"n": 1}, delay=INF),
    "push delay negative": lambda q, d: q.push({"n": 1}, delay=-1),
    "push_batch delay nan": lambda q, d: q.push_batch([{"n": 1}], delay=NAN),
    "pop wait negative": lambda q, d: q.pop(wait=-5),
    "pop wait nan": lambda q, d: q.pop(wait=NAN),
    "pop wait inf": lambda q, d: q.pop(wait=INF),
    "pop poll_interval negative": lambda q, d: q.pop(wait=1, poll_interval=-1),
    "pop poll_interval nan": lambda q, d: q.pop(poll_interval=NAN),
    "pop visibility_timeout nan": lambda q, d: q.pop(semantics="at-least-once", visibility_timeout=NAN),
    "pop visibility_timeout inf": lambda q, d: q.pop(semantics="at-least-once", visibility_timeout=INF),
    "pop visibility_timeout zero": lambda q, d: q.pop(semantics="at-least-once", visibility_timeout=0),
    "claim_batch visibility_timeout inf": lambda q, d: q.claim_batch(5, visibility_timeout=INF),
    "nack delay nan": lambda q, d: q.nack(q.pop(semantics="at-least-once"), delay=NAN),
    "nack delay inf": lambda q, d: q.nack(q.pop(semantics="at-least-once"), delay=INF),
    "nack delay negative": lambda q, d: q.nack(q.pop(semantics="at-least-once"), delay=-1),
    "create_queue visibility_timeout nan": lambda q, d: d.create_queue("other", visibility_timeout=NAN),
    "create_queue retry_backoff inf": lambda q, d: d.create_queue("other", retry_backoff=INF),
    "create_queue retry_backoff_max nan": lambda q, d: d.create_queue("other", retry_backoff_max=NAN),
    "archive archive_after nan": lambda q, d: d.maintenance().archive(archive_after=NAN),
    "metrics rate_window inf": lambda q, d: d.maintenance().metrics(rate_window=INF),
}


@pytest.mark.parametrize("call", list(BAD_CALLS), ids=list(BAD_CALLS))
def test_numbers_that_are_not_finite_or_are_negative_are_refused_at_once(dbq: DbQueue, call: str) -> None:
    q = dbq.create_queue("orders")
    ids = q.push_batch([{"n": i} for i in range(3)])
    t0 = time.monotonic()
    with pytest.raises(ConfigurationError, match=r"(finite number|>= 0|> 0)"):
        BAD_CALLS[call](q, dbq)
    assert time.monotonic() - t0 < 1.0  # refused, not waited on
    # the data is as it was (a nack's own pop leased one message, and its lease is still held)
    stats = q.stats()
    assert (stats.ready + stats.in_flight, stats.delayed, stats.finished) == (3, 0, 0)
    assert sorted(m.id for m in q.peek(10)) + [m.id for m in q.leased([(i, 1) for i in ids])] in (
        ids,
        ids[1:] + ids[:1],
    )
    assert [s.name for s in dbq.list_queues()] == ["orders"]


@pytest.mark.parametrize(
    "field",
    ["archive_after_s", "pause_s", "time_budget_s", "lock_wait_s", "horizon_min_age_s", "rate_window_s"],
)
@pytest.mark.parametrize("value", [NAN, INF, -1.0])
def test_maintenance_settings_are_finite(field: str, value: float) -> None:
    with pytest.raises(ConfigurationError, match=field):
        MaintenanceConfig(**{field: value})


@pytest.mark.parametrize(
    ("dsn", "words"),
    [
        ("host=127.0.0.1 port=notaport user=postgres dbname=app", "port 'notaport' is not a port number"),
        ("postgresql://app:secret@127.0.0.1:99999/app", "port '99999' is not a port number"),
        ("host=127.0.0.1 dbname", 'missing "=" after "dbname"'),
        ("host=127.0.0.1 nosuchoption=1", 'invalid connection option "nosuchoption"'),
        ("host=127.0.0.1 connect_timeout=soon", "connect_timeout 'soon' is not an integer"),
        ("host=127.0.0.1 sslmode=sometimes", "sslmode 'sometimes' is not one of"),
        ("mssql://sa:secret@127.0.0.1:notaport/queues", "its port is not a port number"),
    ],
)
def test_a_malformed_connection_string_is_a_configuration_error_at_once(dsn: str, words: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ConfigurationError, match=r"connection (string|URL) is not valid") as info:
        DbQueue(dsn, connect_timeout=10)
    assert time.monotonic() - t0 < 1.0  # not retried until the connect timeout
    assert words in str(info.value) and "secret" not in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "words"), [({"connect_timeout": NAN}, "connect_timeout"), ({"pool_size": 0}, "pool_size")]
)
def test_client_settings_are_checked_at_construction(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        DbQueue(f"host=127.0.0.1 port={free_port()} user=postgres dbname=app", **kwargs)


def run_cli(pg_dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "airflow_dbqueue.cli", "--dsn", pg_dsn, "--schema", schema, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_cli_says_which_payload_is_not_json_and_pushes_nothing(dbq: DbQueue, pg_dsn: str) -> None:
    q = dbq.create_queue("orders")
    proc = run_cli(pg_dsn, dbq.schema, "push", "orders", '{"ok": 1}', "not json")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("dbqueue: error: payload #1 is not JSON"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert q.stats().ready == 0
    ok = run_cli(pg_dsn, dbq.schema, "push", "orders", '{"ok": 1}')
    assert ok.returncode == 0 and q.stats().ready == 1


def test_errors_of_the_family_are_also_the_python_kinds_callers_catch() -> None:
    assert issubclass(ConfigurationError, ValueError) and issubclass(ConfigurationError, DbQueueError)
    assert issubclass(PayloadTypeError, TypeError) and issubclass(PayloadTypeError, DbQueueError)
