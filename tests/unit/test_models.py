"""Engine pieces that need no database: names, payload codecs, backoff, SQL files."""

from __future__ import annotations

import datetime as dt

import pytest

from airflow_dbqueue.engine import (
    ConfigurationError,
    InvalidNameError,
    PayloadTooLargeError,
    PayloadType,
    PayloadTypeError,
    QueueSettings,
    Semantics,
)
from airflow_dbqueue.engine.models import Message, messages_from_columns
from airflow_dbqueue.engine.names import validate_queue_name, validate_schema_name
from airflow_dbqueue.engine.sqlfile import load_queries, parse_named_queries


@pytest.mark.parametrize("good", ["orders", "_x", "a1_b2", "x" * 48])
def test_valid_queue_names(good: str) -> None:
    assert validate_queue_name(good) == good


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("", "must not be empty"),
        ("Orders", "not valid"),
        ("9lives", "not valid"),
        ('x"; drop', "not valid"),
        ("x" * 49, "limit is 48"),
        ("pg_stat", "reserved"),
        (3, "must be a string"),
    ],
)
def test_invalid_queue_names_say_why(bad: object, why: str) -> None:
    with pytest.raises(InvalidNameError, match=why):
        validate_queue_name(bad)


def test_schema_name_limit() -> None:
    assert validate_schema_name("x" * 40)
    with pytest.raises(InvalidNameError, match="limit is 40"):
        validate_schema_name("x" * 41)


def test_json_codec_roundtrip_and_errors() -> None:
    s = QueueSettings(name="q", queue_id=1, max_payload_bytes=20)
    assert s.decode(s.encode({"a": [1, "é"]})) == {"a": [1, "é"]}
    with pytest.raises(PayloadTypeError, match=r"queue 'q': payload #3 is not JSON-serialisable"):
        s.encode(object(), 3)
    with pytest.raises(PayloadTypeError):
        s.encode(float("nan"))
    with pytest.raises(PayloadTooLargeError, match=r"payload #0 is 22 bytes encoded; .* is 20"):
        s.encode("x" * 20)


def test_bytes_and_text_codecs() -> None:
    b = QueueSettings(name="b", queue_id=1, payload_type=PayloadType.BYTES)
    assert b.decode(b.encode(bytearray(b"\x00\x01"))) == b"\x00\x01"
    with pytest.raises(PayloadTypeError, match="takes bytes payloads"):
        b.encode("str")
    t = QueueSettings(name="t", queue_id=1, payload_type=PayloadType.TEXT)
    assert t.decode(t.encode("ü")) == "ü"
    with pytest.raises(PayloadTypeError, match="takes text payloads"):
        t.encode(b"x")


def test_semantics_parse_rejects_unknown() -> None:
    with pytest.raises(ConfigurationError, match="at-most-once, at-least-once, exactly-once"):
        Semantics.parse("twice")


def test_named_query_parser() -> None:
    q = parse_named_queries("ignored\n-- name: a\nSELECT 1;\n-- name: b\n-- comment\nSELECT 2\n")
    assert q == {"a": "SELECT 1", "b": "-- comment\nSELECT 2"}
    with pytest.raises(ValueError, match="defined twice"):
        parse_named_queries("-- name: a\nSELECT 1\n-- name: a\nSELECT 2\n")


def test_postgres_queries_load() -> None:
    queries = load_queries("airflow_dbqueue.engine.dialects.postgres", "queries")
    assert {"push", "pop_take", "pop_lease", "ack", "nack", "reclaim_expired", "stats"} <= set(queries)
    assert all(body.strip() for body in queries.values())


def test_messages_from_columns_are_the_messages_the_constructor_builds() -> None:
    t0 = dt.datetime(2026, 11, 24, 3, 0, tzinfo=dt.UTC)
    t1 = dt.datetime(2026, 11, 24, 3, 1, tzinfo=dt.UTC)
    args = (7, "orders", ("k", 1), -3, 2, 5, t0, t1)
    columns = [[a] for a in args]
    del columns[1]  # the queue's name is given once
    [made] = messages_from_columns(columns[0], "orders", *columns[1:])
    built = Message(*args)
    assert type(made) is Message
    assert made == built and not made != built  # noqa: SIM202 - both operators are defined
    assert hash(made) == hash(built)
    # every field in its place (distinct values, so a swapped pair would show)
    assert [getattr(made, name) for name in Message._fields] == list(args)
    assert made.receipt == (7, 5)
    with pytest.raises(AttributeError):
        made.id = 8  # type: ignore[misc]
    # a message is never equal to a plain tuple of its fields, from either side
    assert made != args and args != made and not made == args  # noqa: SIM201
    assert Message(7, "q", b"x", 0, 1, 1, t0).lease_until is None
    assert messages_from_columns([], "q", [], [], [], [], [], []) == []
