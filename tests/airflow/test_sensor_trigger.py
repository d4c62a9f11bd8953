"""DbQueueTrigger (run in an asyncio loop here) and DbQueueSensor (poke, deferral, claim)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg.conninfo
import pytest
from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
from airflow.sdk.exceptions import AirflowException, AirflowSensorTimeout, TaskDeferred

from airflow_dbqueue.engine import ConfigurationError, DbQueue, QueueNotFoundError
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.sensors.dbqueue import DbQueueSensor
from airflow_dbqueue.triggers.dbqueue import DbQueueTrigger
from tests.airflow.conftest import CONN_ID, conn_json, trigger_is_listening, trigger_is_waiting
from tests.dialects import expire_leases, run_sql
from tests.helpers import checksum, drained
from tests.pgbouncer import PgBouncer

pytestmark = pytest.mark.integration

TRIGGER_PATH = "airflow_dbqueue.triggers.dbqueue.DbQueueTrigger"


class Runner:
    """Run a trigger's ``run()`` on an event loop in a thread; collect its events with arrival times."""

    def __init__(self, trigger: DbQueueTrigger) -> None:
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._trigger = trigger
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        async def consume() -> None:
            gen: AsyncIterator[Any] = self._trigger.run()
            async for ev in gen:
                self.events.append((time.monotonic(), ev.payload))

        self._task = self._loop.create_task(consume())
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except BaseException as exc:
            self.error = exc

    def wait_events(self, n: int, timeout: float) -> list[tuple[float, dict[str, Any]]]:
        deadline = time.monotonic() + timeout
        while len(self.events) < n and self.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.error is not None:
            raise self.error
        return self.events

    def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)


def wait_until_waiting(dsn: str, timeout: float = 60.0) -> None:
    """Block until the trigger sits in its wait (LISTEN or sleep) after its first check."""
    deadline = time.monotonic() + timeout
    while not trigger_is_waiting(dsn):
        assert time.monotonic() < deadline, "the trigger never reached its wait"
        time.sleep(0.02)


@pytest.mark.parametrize("design", ["table", "ring"])
def test_a_trigger_between_checks_is_seen_waiting(airflow_conn: str, dbq: DbQueue, design: str) -> None:
    """The tests' ``trigger_is_waiting`` sees a trigger between its checks on either design, not only in
    an instant of them: on an empty ring too, a check is its one readiness query."""
    dbq.create_queue("idle", **({"design": "ring", "capacity": 16} if design == "ring" else {}))
    assert not trigger_is_waiting(dbq.db.dsn)
    runner = Runner(DbQueueTrigger(queue_name="idle", poll_interval=0.2, rearm=False))
    try:
        wait_until_waiting(dbq.db.dsn, timeout=20)
        seen = 0
        for _ in range(20):  # a check every 0.2 s, each a millisecond or two
            seen += trigger_is_waiting(dbq.db.dsn)
            time.sleep(0.03)
        assert seen >= 15, f"seen waiting in {seen} of 20 looks"
    finally:
        runner.stop()
    assert runner.events == [] and runner.error is None


def test_serialize_round_trips() -> None:
    t = DbQueueTrigger(queue_name="q", min_messages=3, min_priority=2, poll_interval=0.5, rearm=False)
    path, kwargs = t.serialize()
    assert path == TRIGGER_PATH
    assert DbQueueTrigger(**kwargs).serialize() == (path, kwargs)
    assert all(isinstance(v, str | int | float | bool | type(None)) for v in kwargs.values())
    # through common-messaging: MessageQueueTrigger(scheme="dbqueue") is a DbQueueTrigger
    mq = MessageQueueTrigger(
        scheme="dbqueue", queue_name="q", min_messages=3, min_priority=2, poll_interval=0.5
    )
    mq_path, mq_kwargs = mq.serialize()
    assert mq_path == TRIGGER_PATH and mq_kwargs == {**kwargs, "rearm": True}
    assert DbQueueTrigger(**mq_kwargs).serialize() == (mq_path, mq_kwargs)
    with pytest.raises(ConfigurationError, match="min_messages"):
        DbQueueTrigger(queue_name="q", min_messages=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_message": 50}, r"unknown argument\(s\) 'min_message' \(did you mean 'min_messages'\?\)"),
        (
            {"max_messages": 500, "wait_time": 30},
            r"'max_messages' \(did you mean 'min_messages'\?\), 'wait_time'",
        ),
    ],
)
def test_unknown_trigger_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        DbQueueTrigger(queue_name="q", **kwargs)
    # MessageQueueTrigger hands its other keywords on when it builds (and serializes) the trigger
    mq = MessageQueueTrigger(scheme="dbqueue", queue_name="q", **kwargs)
    with pytest.raises(ConfigurationError, match=match):
        mq.serialize()
    with pytest.raises(ConfigurationError, match="min_messages must be >= 1"):
        DbQueueTrigger(queue_name="q", min_messages=0)


@pytest.mark.parametrize("poll_interval", [0, -1, float("nan"), float("inf"), "soon"])
def test_a_poll_interval_that_is_not_a_positive_finite_number_is_refused(poll_interval: Any) -> None:
    with pytest.raises(ConfigurationError, match="poll_interval must be a"):
        DbQueueTrigger(queue_name="q", poll_interval=poll_interval)


NOTIFY_POLL_S = 60.0
"""The NOTIFY test's poll interval. It waits for the event a third of that after the push: only the
NOTIFY can fire the trigger in time, and a loaded machine has twenty seconds to deliver it."""

POLL_S = 1.0
"""The polling test's poll interval; its event must come within ten of them."""


def test_notify_wakes_the_trigger_long_before_its_poll(airflow_conn: str, dbq: DbQueue) -> None:
    q = dbq.create_queue("wake")  # notify="auto": a push into an empty queue notifies
    runner = Runner(DbQueueTrigger(queue_name="wake", poll_interval=NOTIFY_POLL_S, rearm=False))
    try:
        wait_until_waiting(dbq.db.dsn)  # its first check found the queue empty
        pushed_at = time.monotonic()
        [mid] = q.push_batch([{"x": 1}])
        events = runner.wait_events(1, timeout=NOTIFY_POLL_S / 3)
        assert events, (
            f"no event within {NOTIFY_POLL_S / 3:g} s of the push: no NOTIFY woke the trigger "
            f"(it polls every {NOTIFY_POLL_S:g} s)"
        )
        [(fired_at, event)] = events
        print(f"NOTIFY wake-up latency: {(fired_at - pushed_at) * 1000:.1f} ms")
        assert event == {
            "status": "success",
            "queue_name": "wake",
            "ready": 1,
            "head": [mid, 0],
            "min_messages": 1,
            "min_priority": None,
            "reason": "ready",
        }
        assert q.stats().ready == 1  # the trigger only observed
    finally:
        runner.stop()


def test_fires_by_polling_when_notify_is_off(airflow_conn: str, dbq: DbQueue) -> None:
    q = dbq.create_queue("quiet", notify="never")
    runner = Runner(DbQueueTrigger(queue_name="quiet", poll_interval=POLL_S, rearm=False))
    try:
        wait_until_waiting(dbq.db.dsn)
        pushed_at = time.monotonic()
        q.push_batch([1, 2])
        events = runner.wait_events(1, timeout=10 * POLL_S)
        assert events, f"no event within ten poll intervals ({10 * POLL_S:g} s) of the push"
        [(fired_at, event)] = events
        print(f"polling wake-up latency: {(fired_at - pushed_at) * 1000:.1f} ms (poll_interval {POLL_S:g} s)")
        assert event["ready"] == 1 and q.stats().ready == 2
    finally:
        runner.stop()


@pytest.mark.parametrize("listen", [True, False], ids=["listen-host", "no-listen-host"])
def test_trigger_through_a_transaction_pooler(
    pg_dsn: str, pgbouncer: PgBouncer, dbq: DbQueue, monkeypatch: pytest.MonkeyPatch, listen: bool
) -> None:
    """An Airflow connection to PgBouncer in transaction mode (``dbqueue_pooler``): with a listen host
    and port (the server) the trigger LISTENs there and a push wakes it long before its poll; without
    one it observes through the pooler by polling."""
    server = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    extra: dict[str, Any] = {"dbqueue_pooler": "transaction"}
    if listen:
        extra.update(
            dbqueue_listen_host=server.get("host"), dbqueue_listen_port=int(server.get("port") or 5432)
        )
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{CONN_ID.upper()}", conn_json(pgbouncer.dsn("transaction"), dbq.schema, **extra)
    )
    q = dbq.create_queue("pooled")
    poll = NOTIFY_POLL_S if listen else POLL_S
    runner = Runner(DbQueueTrigger(queue_name="pooled", poll_interval=poll, rearm=False))
    try:
        if listen:  # its listening connection is the server's: pg_stat_activity shows it
            deadline = time.monotonic() + 20
            while not trigger_is_listening(dbq.db.dsn):
                assert time.monotonic() < deadline, "the trigger never LISTENed"
                time.sleep(0.02)
        else:
            time.sleep(2 * POLL_S)  # through the pooler no server connection stays the trigger's
        [mid] = q.push_batch([{"x": 1}])
        events = runner.wait_events(1, timeout=poll / 3 if listen else 10 * POLL_S)
        assert events, "no event: the trigger neither woke on the NOTIFY nor polled through the pooler"
        [(_, event)] = events
        assert (event["ready"], event["head"]) == (1, [mid, 0])
        assert q.stats().ready == 1
    finally:
        runner.stop()


def test_rearmed_trigger_fires_again_only_when_the_head_moves(airflow_conn: str, dbq: DbQueue) -> None:
    q = dbq.create_queue("events", retry_backoff=0)
    ids = q.push_batch([{"n": i} for i in range(4)])
    q.push({"low": True}, priority=-1)
    runner = Runner(DbQueueTrigger(queue_name="events", min_messages=2, min_priority=0, poll_interval=0.1))
    try:
        assert [e["head"] for _, e in runner.wait_events(1, timeout=10)] == [[ids[0], 0]]
        time.sleep(0.5)  # five polls of an untouched queue: no new event
        assert len(runner.events) == 1
        [m] = q.pop(1, semantics="at-least-once")
        q.ack([m])  # consumed: the head moves on
        assert runner.wait_events(2, timeout=10)[1][1]["head"] == [ids[1], 0]
        q.pop(2)  # one message of priority >= 0 left: below min_messages, nothing fires
        seen = len(runner.events)
        time.sleep(0.5)
        assert len(runner.events) == seen
        assert q.stats().ready == 2  # {"n": 3} and the low-priority message
    finally:
        runner.stop()


def test_rearmed_trigger_fires_again_for_a_nacked_head(airflow_conn: str, dbq: DbQueue) -> None:
    q = dbq.create_queue("single", retry_backoff=0)
    mid = q.push("only")
    runner = Runner(DbQueueTrigger(queue_name="single", poll_interval=0.1))
    try:
        assert runner.wait_events(1, timeout=10)[0][1]["head"] == [mid, 0]
        [m] = q.pop(1, semantics="at-least-once")
        q.nack([m], delay=0)  # the same message, one delivery later: it fires again
        assert runner.wait_events(2, timeout=10)[1][1]["head"] == [mid, 1]
        assert [m.payload for m in q.pop(5)] == ["only"]
    finally:
        runner.stop()


def test_trigger_missing_queue_raises(airflow_conn: str, dbq: DbQueue) -> None:
    runner = Runner(DbQueueTrigger(queue_name="absent", poll_interval=0.1))
    with pytest.raises(QueueNotFoundError, match="absent"):
        runner.wait_events(1, timeout=20)
    runner.stop()


def test_sensor_observes_by_default(airflow_conn: str, dbq: DbQueue) -> None:
    q = dbq.create_queue("obs")
    pushed = [{"i": i} for i in range(5)]
    q.push_batch(pushed)
    sensor = DbQueueSensor(task_id="s", queue_name="obs", min_messages=5, poke_interval=0.05, timeout=5)
    assert sensor.execute({}) == {"queue_name": "obs", "ready": 5}
    assert checksum(m.payload for m in q.peek(10)) == checksum(pushed)  # nothing taken
    too_many = DbQueueSensor(task_id="s2", queue_name="obs", min_messages=6, poke_interval=0.05, timeout=0.2)
    with pytest.raises(AirflowSensorTimeout):
        too_many.execute({})
    hi = DbQueueSensor(task_id="s3", queue_name="obs", min_priority=1, poke_interval=0.05, timeout=0.2)
    with pytest.raises(AirflowSensorTimeout):
        hi.execute({})
    assert q.stats().ready == 5


def test_sensor_on_a_ring_ordered_per_key_waits_for_a_held_lane(airflow_conn: str, dbq: DbQueue) -> None:
    """A ring ordered per key whose only messages wait behind a lane a lease holds: the sensor does not
    fire (a pop would get nothing); once the lease is acked it fires, and a pop gets the lane's run."""
    q = dbq.create_queue("keyed", design="ring", layout="rows", capacity=64, lanes=4, ordering="per_key")
    pushed = [{"i": i} for i in range(3)]
    q.push_batch(pushed, keys=["customer-1"] * 3)
    first = q.pop(1, semantics="at-least-once")
    held = DbQueueSensor(task_id="s", queue_name="keyed", poke_interval=0.05, timeout=0.3)
    with pytest.raises(AirflowSensorTimeout):
        held.execute({})
    assert q.pop(10, semantics="at-least-once") == []
    assert q.ack(first) == 1
    freed = DbQueueSensor(task_id="s2", queue_name="keyed", min_messages=2, poke_interval=0.05, timeout=5)
    assert freed.execute({}) == {"queue_name": "keyed", "ready": 2}
    rest = q.pop(10, semantics="at-least-once")
    assert q.ack(rest) == 2 and drained(q)
    assert [m.payload for m in first + rest] == pushed and checksum(
        m.payload for m in first + rest
    ) == checksum(pushed)


def test_sensor_claims_at_least_once(airflow_conn: str, dbq: DbQueue) -> None:
    q = dbq.create_queue("claims")
    pushed = [{"i": i} for i in range(30)]
    q.push_batch(pushed)
    sensor = DbQueueSensor(
        task_id="s", queue_name="claims", min_messages=10, claim=True, max_messages=20, xcom_max_messages=5
    )
    claim = sensor.execute({})
    assert claim["count"] == 20 and claim["messages"] is None and len(claim["receipts"]) == 20
    stats = q.stats()
    assert (stats.ready, stats.in_flight) == (10, 20)  # leased, not gone: a failed consumer loses nothing
    with DbQueueHook(airflow_conn) as hook:
        got = [m["payload"] for m in hook.claimed_messages(claim)]
        assert hook.nack_claim(claim, delay=0) == 20  # downstream failed: all back
        got_again = [m.payload for m in q.pop(30)]
    assert checksum(got_again) == checksum(pushed) and len(got) == 20


def test_deferrable_sensor_defers_and_completes(airflow_conn: str, dbq: DbQueue) -> None:
    q = dbq.create_queue("later")
    sensor = DbQueueSensor(
        task_id="s", queue_name="later", min_messages=2, claim=True, deferrable=True, poll_interval=0.2
    )
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    trigger = deferred.value.trigger
    assert deferred.value.method_name == "execute_complete"
    path, kwargs = trigger.serialize()
    assert path == TRIGGER_PATH and kwargs["rearm"] is False and kwargs["min_messages"] == 2
    q.push_batch([{"a": 1}, {"a": 2}])

    async def first_event() -> dict[str, Any]:
        async for ev in DbQueueTrigger(**kwargs).run():
            return dict(ev.payload)
        raise AssertionError("no event")

    event = asyncio.run(asyncio.wait_for(first_event(), 20))
    claim = sensor.execute_complete({}, event)
    assert claim["count"] == 2 and checksum(m["payload"] for m in claim["messages"]) == checksum(
        [{"a": 1}, {"a": 2}]
    )
    # Raced: another consumer emptied the queue between the event and the claim: defer again.
    with pytest.raises(TaskDeferred):
        sensor.execute_complete({}, event)
    with pytest.raises(AirflowException, match="unexpected trigger event"):
        sensor.execute_complete({}, {"status": "error"})


def test_deferrable_sensor_keeps_one_deadline_across_defers(airflow_conn: str, dbq: DbQueue) -> None:
    """A sensor raced out of its batch defers again with what is left of its timeout, not a fresh one."""
    dbq.create_queue("raced")
    sensor = DbQueueSensor(
        task_id="s", queue_name="raced", min_messages=1, claim=True, deferrable=True, timeout=60
    )
    t0 = time.time()
    with pytest.raises(TaskDeferred) as first:
        sensor.execute({})
    deadline = first.value.kwargs["deadline"]
    assert t0 + 59 <= deadline <= time.time() + 60
    event = {"status": "success", "queue_name": "raced", "ready": 1}
    with pytest.raises(TaskDeferred) as again:
        sensor.execute_complete({}, event, deadline=deadline - 45)  # as if 45 s had passed
    assert again.value.kwargs["deadline"] == deadline - 45
    assert again.value.timeout.total_seconds() <= 15.5
    with pytest.raises(AirflowSensorTimeout, match="raced"):
        sensor.execute_complete({}, event, deadline=time.time() - 1)


def _expire_whole_ring_leases(dbq: DbQueue, q: Any) -> None:
    """Run a ring's leases (one row a pop: ring_leases on the slots layout, the ring's own lease tables
    on the rows layout) out, as a consumer killed holding them leaves them: nothing else changes."""
    if q.settings.layout == "rows":
        for k in range(4):
            run_sql(
                dbq,
                f"UPDATE {{schema}}.ring_{q.settings.queue_id}_rl{k} "
                "SET lease_until = now() - interval '1 second'",
            )
        return
    run_sql(
        dbq,
        "UPDATE {schema}.ring_leases SET lease_until = now() - interval '1 second' "
        "WHERE queue_id = %(queue_id)s",
        {"queue_id": q.settings.queue_id},
    )


def _stalled_queue(dbq: DbQueue, name: str, how: str, **settings: Any) -> Any:
    """A queue of the design ``how`` names: ``table``; ``ring-*`` a ring of the slots layout, ``rows-*``
    one of the rows layout (``*-lease``: its leases are run out whole, ``*-retry``: split first, each
    message's leased retry row run out)."""
    if how == "table":
        return dbq.create_queue(name, **settings)
    layout = "rows" if how.startswith("rows") else "slots"
    return dbq.create_queue(name, design="ring", layout=layout, capacity=64, **settings)


LEASE_DRILLS = ["table", "ring-lease", "ring-retry", "rows-lease", "rows-retry"]
"""How a consumer's leases run out, on each design and ring layout (:func:`_stalled_queue`)."""


@pytest.mark.parametrize("how", LEASE_DRILLS)
def test_expired_leases_wake_the_deferred_sensor_which_gets_them(
    airflow_conn: str, dbq: DbQueue, how: str
) -> None:
    """A consumer popped every message and died: its leases run out. Readiness counts them at once (not
    only after a reclaim: no pop, no maintenance runs), the trigger fires, and the sensor's claim
    reclaims and gets every one."""
    q = _stalled_queue(dbq, "stalled", how, max_attempts=3)
    pushed = [{"order": i} for i in range(10)]
    q.push_batch(pushed)
    held = q.pop(10, semantics="at-least-once")  # the consumer that dies
    assert len(held) == 10 and q.readiness() == (0, None)
    sensor = DbQueueSensor(
        task_id="s", queue_name="stalled", min_messages=10, claim=True, deferrable=True, poll_interval=0.2
    )
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})  # nothing ready: it defers
    runner = Runner(DbQueueTrigger(**deferred.value.trigger.serialize()[1]))
    try:
        wait_until_waiting(dbq.db.dsn)
        if how.endswith("-lease"):
            _expire_whole_ring_leases(dbq, q)  # the pop's one lease row
        else:
            expire_leases(dbq, [m.id for m in held], q)  # table rows; a ring's leased retry rows
        head = min(m.id for m in held)
        assert q.readiness() == (10, (head, 1))  # the head a pop takes first, delivered once before
        assert q.count_ready() == 10 and q.stats().in_flight == 10  # counted, not reclaimed
        [(_, event)] = runner.wait_events(1, timeout=20)
        assert (event["ready"], event["head"]) == (10, [head, 1])
    finally:
        runner.stop()
    claim = sensor.execute_complete({}, event)
    assert claim["count"] == 10
    assert sorted(d for _, d in claim["receipts"]) == [2] * 10  # delivered again
    assert checksum(m["payload"] for m in claim["messages"]) == checksum(pushed)
    with DbQueueHook(airflow_conn) as hook:
        assert hook.ack_claim(claim) == 10
    assert drained(q) and q.stats().failed == 0


@pytest.mark.parametrize("how", LEASE_DRILLS)
def test_expired_leases_out_of_attempts_are_not_ready(airflow_conn: str, dbq: DbQueue, how: str) -> None:
    """An expired lease that used its last attempt goes to the failed state when reclaimed, so readiness
    does not count it, and a pop gets nothing."""
    q = _stalled_queue(dbq, "spent", how, max_attempts=1)
    pushed = [{"n": i} for i in range(4)]
    q.push_batch(pushed)
    held = q.pop(4, semantics="at-least-once")
    if how.endswith("-lease"):
        _expire_whole_ring_leases(dbq, q)
    else:
        expire_leases(dbq, [m.id for m in held], q)
    assert q.readiness() == (0, None) and q.count_ready() == 0
    sensor = DbQueueSensor(task_id="s", queue_name="spent", poke_interval=0.05, timeout=0.3)
    with pytest.raises(AirflowSensorTimeout):
        sensor.execute({})
    assert _fresh_pop(dbq, "spent", 4, "at-most-once") == []  # a new handle: its first pop reclaims
    failed = q.list_failed()
    assert checksum(f.payload for f in failed) == checksum(pushed) and drained(q)


@pytest.mark.parametrize("how", ["table", "ring-retry", "rows-retry"])
def test_every_pop_reclaims_what_readiness_counted(dbq: DbQueue, how: str) -> None:
    """What readiness counts is what a pop gets, whatever its semantics: an at-most-once pop and an
    exactly-once pop of a fresh handle reclaim the expired leases first."""
    q = _stalled_queue(dbq, "mixed", how)
    pushed = [{"n": i} for i in range(6)]
    q.push_batch(pushed)
    held = q.pop(6, semantics="at-least-once")
    expire_leases(dbq, [m.id for m in held], q)
    assert q.count_ready() == 6
    got = _fresh_pop(dbq, "mixed", 3, "at-most-once")
    assert len(got) == 3
    expire_leases(dbq, [m.id for m in q.pop(3, semantics="at-least-once")], q)  # redelivered, and lost again
    got += _fresh_pop(dbq, "mixed", 6, "exactly-once")
    assert checksum(m.payload for m in got) == checksum(pushed) and drained(q)


def _fresh_pop(dbq: DbQueue, name: str, n: int, semantics: str) -> list[Any]:
    """Pop through a new handle (whose first pop always reclaims), in a transaction of its own."""
    fresh = DbQueue(dbq.db.dsn, schema=dbq.schema, pool_size=2)
    try:
        with fresh.transaction() as conn:
            return fresh.queue(name).pop(n, semantics=semantics, conn=conn)
    finally:
        fresh.close()


MAX_WAIT_S = 1.5
"""max_wait of the firing tests: long against their poll interval (0.1 s), short for the suite."""


def test_max_wait_fires_again_when_the_triggered_run_took_nothing(airflow_conn: str, dbq: DbQueue) -> None:
    """The event-driven stall: a watcher fired, the run it started failed before it claimed, and the
    queue's head never moved. Without max_wait the watcher never fires again; with it, it fires again
    every max_wait while the head stays, and stops once the queue is consumed."""
    q = dbq.create_queue("inbox")
    pushed = [{"mail": i} for i in range(3)]
    ids = q.push_batch(pushed)
    stalled = Runner(DbQueueTrigger(queue_name="inbox", poll_interval=0.1))
    waiting = Runner(DbQueueTrigger(queue_name="inbox", poll_interval=0.1, max_wait=MAX_WAIT_S))
    try:
        [(first_at, first)] = waiting.wait_events(1, timeout=10)
        assert (first["head"], first["reason"]) == ([ids[0], 0], "ready")
        # the run that event started failed before it popped anything: nothing changes in the queue
        events = waiting.wait_events(2, timeout=10 * MAX_WAIT_S)
        assert len(events) == 2, "no second event: the watcher stalled"
        (again_at, again) = events[1]
        assert (again["head"], again["reason"]) == ([ids[0], 0], "max_wait")
        assert again_at - first_at >= MAX_WAIT_S - 0.05
        assert len(stalled.events) == 1  # without max_wait: one event, then silence
        got = q.pop(10, semantics="at-least-once")  # the next run takes and acks everything
        q.ack(got)
        seen = len(waiting.events)
        time.sleep(2 * MAX_WAIT_S)
        assert len(waiting.events) == seen and len(stalled.events) == 1  # drained: quiet
        assert checksum(m.payload for m in got) == checksum(pushed) and drained(q)
    finally:
        waiting.stop()
        stalled.stop()


def test_batch_size_fires_for_a_full_batch_or_after_max_wait(airflow_conn: str, dbq: DbQueue) -> None:
    """batch_size=5: two messages do not fire at once; five do. A single message fires once it has
    waited max_wait (a flush of a short batch)."""
    q = dbq.create_queue("batched", notify="always")
    runner = Runner(
        DbQueueTrigger(queue_name="batched", batch_size=5, max_wait=MAX_WAIT_S * 2, poll_interval=0.1)
    )
    try:
        wait_until_waiting(dbq.db.dsn)
        first = q.push_batch([{"n": i} for i in range(2)])
        time.sleep(MAX_WAIT_S)  # below the batch size, not waited max_wait yet: quiet
        assert runner.events == []
        q.push_batch([{"n": i} for i in range(2, 5)])
        [(_, full)] = runner.wait_events(1, timeout=10)
        assert (full["ready"], full["head"], full["reason"]) == (5, [first[0], 0], "ready")
        got = q.pop(5, semantics="at-most-once")
        assert len(got) == 5
        pushed_at = time.monotonic()
        [single] = q.push_batch([{"n": 5}])
        events = runner.wait_events(2, timeout=10 * MAX_WAIT_S)
        (fired_at, flushed) = events[1]
        assert (flushed["ready"], flushed["head"], flushed["reason"]) == (1, [single, 0], "max_wait")
        # max_wait counts from the first check that saw the message ready, or from the last firing when
        # no check saw the queue drained between the pop and this push (a poll every 0.1 s).
        assert fired_at - events[0][0] >= MAX_WAIT_S * 2 - 0.05
        assert fired_at - pushed_at <= MAX_WAIT_S * 2 + 2.0
    finally:
        runner.stop()


def test_batch_size_and_max_wait_through_message_queue_trigger() -> None:
    """MessageQueueTrigger(scheme="dbqueue", batch_size=..., max_wait=...) builds a DbQueueTrigger with
    them; values that cannot work are refused."""
    mq = MessageQueueTrigger(scheme="dbqueue", queue_name="q", batch_size=500, max_wait=30)
    path, kwargs = mq.serialize()
    assert path == TRIGGER_PATH and (kwargs["batch_size"], kwargs["max_wait"]) == (500, 30.0)
    assert DbQueueTrigger(**kwargs).serialize() == (path, kwargs)
    with pytest.raises(ConfigurationError, match=r"batch_size \(2\) must be at least min_messages \(3\)"):
        DbQueueTrigger(queue_name="q", min_messages=3, batch_size=2)
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ConfigurationError, match="max_wait must be a"):
            DbQueueTrigger(queue_name="q", max_wait=bad)
    with pytest.raises(ConfigurationError, match="batch_size must be >= 1"):
        DbQueueTrigger(queue_name="q", batch_size=0)


def test_trigger_and_sensor_watch_and_claim_a_consumer_group(airflow_conn: str, dbq: DbQueue) -> None:
    """group=: the trigger counts the group's messages (the default group took them all), its event and
    serialization name the group; the claiming sensor leases the group's messages and its claim acks
    them in that group, leaving the default group's untouched. (1 s)"""
    q = dbq.create_queue("stream", design="ring", notify="never")
    q.add_group("audit")  # type: ignore[attr-defined]
    pushed = [{"i": i} for i in range(12)]
    ids = q.push_batch(pushed)
    assert checksum(m.payload for m in q.pop(12)) == checksum(pushed)  # the default group is done
    trigger = DbQueueTrigger(
        queue_name="stream", group="audit", min_messages=12, poll_interval=POLL_S, rearm=False
    )
    path, kwargs = trigger.serialize()
    assert kwargs["group"] == "audit" and DbQueueTrigger(**kwargs).serialize() == (path, kwargs)
    runner = Runner(trigger)
    try:
        [(_, event)] = runner.wait_events(1, timeout=10 * POLL_S)
        # the group's head, as the engine peeks it: its first message, never delivered in the group
        head = q.group("audit").peek(1)[0]  # type: ignore[attr-defined]
        assert head.id == ids[0]
        assert (event["group"], event["ready"], event["head"]) == ("audit", 12, list(head.receipt))
    finally:
        runner.stop()
    sensor = DbQueueSensor(
        task_id="s", queue_name="stream", group="audit", min_messages=12, claim=True, max_messages=12
    )
    claim = sensor.execute({})
    assert claim["group"] == "audit" and claim["count"] == 12
    assert checksum(m["payload"] for m in claim["messages"]) == checksum(pushed)
    audit = q.group("audit")
    assert audit.stats().in_flight == 12 and q.stats().in_flight == 0
    with DbQueueHook(airflow_conn) as hook:
        assert hook.ack_claim(claim) == 12
        assert hook.stats("stream", group="audit")["lag_messages"] == 0
    with pytest.raises(AirflowSensorTimeout):
        DbQueueSensor(
            task_id="s2", queue_name="stream", group="audit", poke_interval=0.05, timeout=0.2
        ).execute({})
