"""DbQueuePushOperator and DbQueuePopOperator: templating, batches, claims, bad input.

The operators run their real ``execute`` against a real PostgreSQL; templates are rendered with the
operator's own ``render_template_fields``. Their runs inside a DAG are in test_dags.py.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_dbqueue.engine import (
    ConfigurationError,
    DbQueue,
    LeaseExpiredError,
    PayloadTypeError,
    QueueNotFoundError,
)
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.operators.dbqueue import DbQueueAckOperator, DbQueuePopOperator, DbQueuePushOperator
from tests.helpers import checksum

pytestmark = pytest.mark.integration


def run(op: Any, **context: Any) -> Any:
    """Render the operator's templates with ``context`` and execute it."""
    op.render_template_fields(context)
    return op.execute(context)


def test_push_list_template_callable_and_pop(airflow_conn: str, dbq: DbQueue) -> None:
    dbq.create_queue("orders")
    batch = [{"order": i, "note": "é"} for i in range(300)]
    ids = run(DbQueuePushOperator(task_id="p1", queue_name="orders", payloads=batch[:100]))
    assert len(ids) == 100
    ids += run(
        DbQueuePushOperator(
            task_id="p2", queue_name="{{ params.q }}", payloads="{{ params.batch | tojson }}"
        ),
        params={"q": "orders", "batch": batch[100:200]},
    )
    ids += run(
        DbQueuePushOperator(
            task_id="p3",
            queue_name="orders",
            payloads_callable=lambda ctx: iter(batch[200 + ctx["params"]["skip"] :]),
            priority="{{ params.prio }}",
        ),
        params={"skip": 0, "prio": 3},
    )
    assert len(set(ids)) == 300

    pop = DbQueuePopOperator(
        task_id="pop", queue_name="orders", max_messages="{{ params.n }}", xcom_max_messages=50
    )
    claim = run(pop, params={"n": 250})
    assert claim["count"] == 250 and claim["messages"] is None and claim["semantics"] == "at-least-once"
    assert [m["payload"] for m in DbQueueHook(airflow_conn).claimed_messages(claim)][:100] == batch[200:]
    small = run(
        DbQueuePopOperator(task_id="pop2", queue_name="orders", semantics="at-most-once", max_messages=100)
    )
    assert small["count"] == 50 and len(small["messages"]) == 50
    assert json.loads(json.dumps(small)) == small
    assert dt.datetime.fromisoformat(small["messages"][0]["enqueued_at"]).tzinfo is not None
    with DbQueueHook(airflow_conn) as hook:
        out = [m["payload"] for m in hook.claimed_messages(claim) + small["messages"]]
        assert checksum(out) == checksum(batch)
        assert hook.ack_claim(claim) == 250
        assert hook.stats("orders")["finished"] == 300


def test_pop_bytes_payloads_are_base64(airflow_conn: str, dbq: DbQueue) -> None:
    dbq.create_queue("blobs", payload_type="bytes").push_batch([b"\x00\xff", b"abc"])
    claim = run(DbQueuePopOperator(task_id="pop", queue_name="blobs", max_messages=10))
    assert [(m["payload"], m["payload_encoding"]) for m in claim["messages"]] == [
        ("AP8=", "base64"),
        ("YWJj", "base64"),
    ]


@pytest.mark.parametrize(
    "case",
    [
        (
            {"payloads": "{{ params.x }}"},
            {"params": {"x": [1, "a"]}},
            PayloadTypeError,
            r"not JSON.*\[1, 'a'\]",
        ),
        (
            {"payloads": "{{ params.x | tojson }}"},
            {"params": {"x": {"a": 1}}},
            PayloadTypeError,
            "must be a list",
        ),
        ({"payloads_callable": lambda ctx: [1, {2, 3}]}, {}, PayloadTypeError, "payload #1"),
        ({"payloads_callable": lambda ctx: [1, dt.datetime.now()]}, {}, PayloadTypeError, "not JSON"),
        ({"payloads_callable": lambda ctx: "abc"}, {}, PayloadTypeError, "iterable of payloads"),
        ({"payloads": [1, float("nan")]}, {}, PayloadTypeError, "payload #1"),
    ],
)
def test_push_bad_payloads_push_nothing(
    airflow_conn: str, dbq: DbQueue, case: tuple[dict[str, Any], dict[str, Any], type[Exception], str]
) -> None:
    kwargs, context, error, match = case
    q = dbq.create_queue("orders")
    with pytest.raises(error, match=match):
        run(DbQueuePushOperator(task_id="p", queue_name="orders", **kwargs), **context)
    assert q.stats().as_dict() | {"oldest_ready_age_s": None} == {
        "queue": "orders",
        "ready": 0,
        "delayed": 0,
        "in_flight": 0,
        "failed": 0,
        "finished": 0,
        "oldest_ready_age_s": None,
    }


def test_bad_arguments_fail_at_parse_time() -> None:
    with pytest.raises(ValueError, match="exactly one of payloads and payloads_callable"):
        DbQueuePushOperator(task_id="p", queue_name="q")
    with pytest.raises(ValueError, match="exactly one"):
        DbQueuePushOperator(task_id="p", queue_name="q", payloads=[1], payloads_callable=lambda ctx: [])
    with pytest.raises(ConfigurationError, match="exactly-once"):
        DbQueuePopOperator(task_id="p", queue_name="q", semantics="exactly-once")
    with pytest.raises(ConfigurationError, match="unknown semantics"):
        DbQueuePopOperator(task_id="p", queue_name="q", semantics="twice")


def test_missing_queue_unknown_and_wrong_connection(
    airflow_conn: str, dbq: DbQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(QueueNotFoundError, match="'absent' does not exist"):
        run(DbQueuePushOperator(task_id="p", queue_name="absent", payloads=[1]))
    with pytest.raises(QueueNotFoundError):
        run(DbQueuePopOperator(task_id="pop", queue_name="absent"))
    with pytest.raises(AirflowNotFoundException, match="nowhere"):
        run(DbQueuePushOperator(task_id="p", queue_name="q", payloads=[1], dbqueue_conn_id="nowhere"))
    monkeypatch.setenv("AIRFLOW_CONN_WEB", "http://example.com")
    with pytest.raises(ConfigurationError, match="type 'http'"):
        run(DbQueuePopOperator(task_id="pop", queue_name="q", dbqueue_conn_id="web"))
    dbq.create_queue("q")
    with pytest.raises(ConfigurationError, match="xcom_max_messages"):
        run(DbQueuePopOperator(task_id="pop", queue_name="q", semantics="at-most-once", max_messages=1000))


def test_ack_and_nack_operators_finish_a_claim(airflow_conn: str, dbq: DbQueue) -> None:
    q = dbq.create_queue("work", visibility_timeout=0.5)
    sent = [{"job": i} for i in range(30)]
    q.push_batch(sent)
    pop = DbQueuePopOperator(task_id="pop", queue_name="work", max_messages=20, xcom_max_messages=5)
    claim = run(pop)
    assert claim["count"] == 20 and claim["messages"] is None
    # nack on the failure path: back to ready at once, with the note kept
    nack = DbQueueAckOperator(
        task_id="nack", claim="{{ params.claim | tojson }}", action="nack", delay=0, error="{{ params.why }}"
    )
    assert run(nack, params={"claim": claim, "why": "downstream failed"}) == 20
    assert q.stats().ready == 30
    # ack on the success path (the claim as a native value, as pop.output resolves)
    claim = run(DbQueuePopOperator(task_id="pop2", queue_name="work", max_messages=30))
    assert run(DbQueueAckOperator(task_id="ack", claim=claim)) == 30
    st = q.stats()
    assert (st.ready, st.in_flight, st.finished) == (0, 0, 30)
    assert run(DbQueueAckOperator(task_id="ack2", claim=claim, action="nack")) == 0  # nothing held


def test_nack_operator_releases_what_is_still_held(airflow_conn: str, dbq: DbQueue) -> None:
    q = dbq.create_queue("work", visibility_timeout=0.4)
    q.push_batch([{"job": i} for i in range(4)])
    claim = run(DbQueuePopOperator(task_id="pop", queue_name="work", max_messages=2))
    held = q.pop(2, semantics="at-least-once", visibility_timeout=60)  # the other two, held longer
    time.sleep(0.6)
    q.reclaim_expired()
    [again] = q.pop(1, semantics="at-least-once", visibility_timeout=60)  # one of ours, redelivered
    with pytest.raises(LeaseExpiredError, match="lease"):
        run(DbQueueAckOperator(task_id="ack", claim=claim))  # all or nothing
    assert run(DbQueueAckOperator(task_id="nack", claim=claim, action="nack", delay=0)) == 0
    assert q.ack([*held, again]) == 3


def test_ack_operator_refuses_what_is_not_a_claim(airflow_conn: str, dbq: DbQueue) -> None:
    with pytest.raises(ConfigurationError, match="not JSON"):
        run(DbQueueAckOperator(task_id="a", claim="{{ params.x }}"), params={"x": "nonsense"})
    with pytest.raises(ConfigurationError, match="expected a claim"):
        run(DbQueueAckOperator(task_id="b", claim=[1, 2]))
    with pytest.raises(ValueError, match="'ack' or 'nack'"):
        DbQueueAckOperator(task_id="c", claim={}, action="delete")


def test_push_with_key_templates_and_a_ttl(airflow_conn: str, dbq: DbQueue) -> None:
    """The key templates are rendered once a message, with its payload: a retried task pushes nothing
    again (deduplication keys), and a customer's orders go one at a time (ordering keys)."""
    dbq.create_queue("orders", ordering="per_key", ttl=3600)
    batch = [{"order": i, "customer": f"c{i % 2}"} for i in range(4)]

    def push() -> list[int]:
        op = DbQueuePushOperator(
            task_id="p",
            queue_name="orders",
            payloads=batch,
            dedup_key="{{ params.day }}-{{ payload.order }}",
            key="{{ payload.customer }}",
            ttl="{{ params.ttl }}",
        )
        return list(run(op, params={"day": "d1", "ttl": 600}))

    ids = push()
    assert push() == ids and len(set(ids)) == 4  # the retry
    with DbQueueHook(airflow_conn) as hook:
        first = hook.pop("orders", 10)
        assert [m.payload for m in first] == batch[:2]  # one a customer
        assert hook.ack("orders", first) == 2
        rest = hook.pop("orders", 10)
        assert [m.payload for m in rest] == batch[2:]
        hook.ack("orders", rest)
        assert checksum(m.payload for m in first + rest) == checksum(batch)
    with pytest.raises(ValueError, match="dedup_key must be a Jinja template"):
        DbQueuePushOperator(task_id="bad", queue_name="orders", payloads=[1], dedup_key=7)  # type: ignore[arg-type]


def test_push_with_a_key_template_into_a_rows_ring(airflow_conn: str, dbq: DbQueue) -> None:
    """The push operator's deduplication key template on a ring of the rows layout (created through the
    hook): a retried task pushes nothing again, and a message whose key is new is pushed beside those
    already known."""
    with DbQueueHook(airflow_conn) as hook:
        hook.create_queue("stream", design="ring", layout="rows", capacity=64, lanes=2, dedup_window=600)
    batch = [{"order": i} for i in range(4)]

    def push(payloads: list[Any]) -> list[int]:
        op = DbQueuePushOperator(
            task_id="p",
            queue_name="stream",
            payloads=payloads,
            dedup_key="{{ params.day }}-{{ payload.order }}",
        )
        return list(run(op, params={"day": "d1"}))

    ids = push(batch)
    assert push(batch) == ids and len(set(ids)) == 4  # the retry
    more = push([*batch[:2], {"order": 9}])
    assert more[:2] == ids[:2] and more[2] not in ids
    with DbQueueHook(airflow_conn) as hook:
        got = hook.pop("stream", 10)
        hook.ack("stream", got)
        assert hook.push("stream", [{"order": 0}], dedup_keys=["d1-0"]) == [ids[0]]
    assert len(got) == 5 and checksum(m.payload for m in got) == checksum([*batch, {"order": 9}])


def test_push_with_a_ttl_into_a_rows_ring_and_the_hook_on_its_expiry(airflow_conn: str, dbq: DbQueue) -> None:
    """A ring of the rows layout created through the hook with a ttl: the push operator's templated ttl
    is each push's, the hook's stats count the expired messages no pop has reached yet and, after a pop
    reached them, the failed ones by expiry; the hook lists them with last_error "expired" and requeues
    one by id."""
    from tests.integration.test_expiry import _age_rows

    batch = [{"quote": i} for i in range(5)]
    with DbQueueHook(airflow_conn) as hook:
        hook.create_queue("quotes", design="ring", layout="rows", capacity=64, lanes=1, ttl=3600)
        short = DbQueuePushOperator(
            task_id="s", queue_name="quotes", payloads=batch[:3], ttl="{{ params.ttl }}"
        )
        doomed = list(run(short, params={"ttl": 30}))
        kept = list(run(DbQueuePushOperator(task_id="k", queue_name="quotes", payloads=batch[3:])))
        q = dbq.queue("quotes")
        expiries = run_sql_rows(dbq, q.settings.queue_id)
        assert len(expiries) == 2 and expiries[0] < expiries[1]  # the operator's ttl, then the queue's
        _age_rows(dbq, q, doomed, -1.0)
        st = hook.stats("quotes")
        assert (st["ready"], st["failed"], st["expired"], st["expired_pending"]) == (2, 0, 0, 3)
        assert hook.count_ready("quotes") == 2
        got = hook.pop("quotes", 10, semantics="at-least-once")
        assert [m.id for m in got] == kept and hook.ack("quotes", got) == 2
        st = hook.stats("quotes")
        assert (st["ready"], st["failed"], st["expired"], st["expired_pending"]) == (0, 3, 3, 0)
        failed = hook.list_failed("quotes")
        assert [(f.id, f.payload, f.last_error) for f in failed] == [
            (i, p, "expired") for i, p in zip(doomed, batch[:3], strict=True)
        ]
        assert hook.requeue_failed("quotes", [doomed[1]]) == 1
        [again] = hook.pop("quotes", 10)
        assert again.payload == batch[1] and again.id not in doomed
        assert checksum([m.payload for m in got] + [again.payload]) == checksum([*batch[3:], batch[1]])
        assert sorted(f.id for f in hook.list_failed("quotes")) == [doomed[0], doomed[2]]


def run_sql_rows(dbq: DbQueue, queue_id: int) -> list[Any]:
    """The expiries of a rows ring's pushes, by row."""
    from tests.dialects import run_sql

    return [
        r[0]
        for r in run_sql(
            dbq,
            f"SELECT expires_at FROM {{schema}}.ring_{queue_id}_rq0 ORDER BY r",
        )
    ]
