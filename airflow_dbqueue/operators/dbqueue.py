"""Operators that push batches to a queue and pop batches from it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from airflow_dbqueue.engine import ConfigurationError, LeaseExpiredError, PayloadTypeError, Semantics
from airflow_dbqueue.hooks.claims import XCOM_MAX_MESSAGES
from airflow_dbqueue.hooks.dbqueue import DbQueueHook

if TYPE_CHECKING:
    from airflow.sdk import Context


class DbQueuePushOperator(BaseOperator):  # type: ignore[misc]
    """Push a batch of payloads to a queue in one statement (all or nothing); return their ids.

    The batch comes from exactly one of:

    - ``payloads``: a templated value. A list (or tuple) is the batch, e.g. an ``XComArg``
      (``other_task.output``) or a template rendered as a native object. A string, as Jinja renders
      templates by default, must be a JSON array, e.g. ``'{{ ti.xcom_pull("t") | tojson }}'``; anything
      else is refused before anything is pushed, with the rendered text in the error.
    - ``payloads_callable``: called with the task context; returns an iterable of payloads.

    Each payload must fit the queue's payload type (JSON values by default); one bad payload fails the
    whole batch and nothing is written.

    :param queue_name: the queue to push to.
    :param payloads: the batch (templated).
    :param payloads_callable: a callable ``(context) -> iterable of payloads``.
    :param priority: priority of every message in the batch (higher pops first).
    :param delay: seconds before the messages become ready.
    :param dedup_key: a Jinja template rendered once a message, with the task context and ``payload``
        (the message's payload) and ``index`` (its place in the batch), e.g.
        ``"order-{{ payload.order_id }}"``: the message's deduplication key, so that a retried task
        pushes nothing twice within the queue's ``dedup_window``.
    :param key: a Jinja template rendered as ``dedup_key`` is: the message's ordering key, on a queue
        created with ``ordering="per_key"`` (an empty rendering: the message has none).
    :param ttl: seconds the messages may wait to be popped (templated; the queue must have a ``ttl``).
    :param dbqueue_conn_id: the Airflow connection to the queue's database.
    :param dbqueue_schema: schema of the queue tables; overrides the connection extra.
    """

    template_fields: Sequence[str] = ("queue_name", "payloads", "priority", "delay", "ttl")

    def __init__(
        self,
        *,
        queue_name: str,
        payloads: Any = None,
        payloads_callable: Callable[[Context], Iterable[Any]] | None = None,
        priority: int = 0,
        delay: float = 0.0,
        dedup_key: str | None = None,
        key: str | None = None,
        ttl: float | None = None,
        dbqueue_conn_id: str = DbQueueHook.default_conn_name,
        dbqueue_schema: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        for name, template in (("dedup_key", dedup_key), ("key", key)):
            if template is not None and not isinstance(template, str):
                raise ValueError(f"{name} must be a Jinja template string, got {type(template).__name__}")
        if (payloads is None) == (payloads_callable is None):
            raise ValueError(
                f"{type(self).__name__} {kwargs.get('task_id')!r}: give exactly one of payloads and "
                "payloads_callable"
            )
        if payloads_callable is not None and not callable(payloads_callable):
            raise ValueError(f"payloads_callable must be callable, got {type(payloads_callable).__name__}")
        self.queue_name = queue_name
        self.payloads = payloads
        self.payloads_callable = payloads_callable
        self.priority = priority
        self.delay = delay
        self.dedup_key = dedup_key
        self.key = key
        self.ttl = ttl
        self.dbqueue_conn_id = dbqueue_conn_id
        self.dbqueue_schema = dbqueue_schema

    def _batch(self, context: Context) -> list[Any]:
        if self.payloads_callable is not None:
            produced = self.payloads_callable(context)
            if isinstance(produced, str | bytes | dict) or not isinstance(produced, Iterable):
                raise PayloadTypeError(
                    f"payloads_callable must return an iterable of payloads (a list), "
                    f"got {type(produced).__name__}"
                )
            return list(produced)
        value = self.payloads
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                shown = value if len(value) <= 200 else value[:200] + "..."
                raise PayloadTypeError(
                    f"payloads rendered to a string that is not JSON ({exc}): {shown!r}; render a JSON "
                    "array (e.g. with '| tojson'), pass an XComArg, or set render_template_as_native_obj"
                ) from None
        if not isinstance(value, list | tuple):
            raise PayloadTypeError(
                f"payloads must be a list of payloads (a batch), got {type(value).__name__}: {value!r:.200}"
            )
        return list(value)

    def _keys(self, template: str | None, batch: list[Any], context: Context) -> list[Any] | None:
        """``template`` rendered once a message (with ``payload`` and ``index``), or None without one."""
        if template is None:
            return None
        out = []
        for i, payload in enumerate(batch):
            rendered = self.render_template(template, {**context, "payload": payload, "index": i})
            out.append(str(rendered) if rendered not in (None, "") else None)
        return out

    def execute(self, context: Context) -> list[int]:
        """Push the batch and return the message ids in payload order."""
        batch = self._batch(context)
        dedup_keys = self._keys(self.dedup_key, batch, context)
        with DbQueueHook(self.dbqueue_conn_id, dbqueue_schema=self.dbqueue_schema) as hook:
            ids = hook.push(
                self.queue_name,
                batch,
                priority=int(self.priority),
                delay=float(self.delay),
                dedup_keys=dedup_keys,  # a message whose key rendered empty is refused there
                ttl=None if self.ttl is None or self.ttl == "" else float(self.ttl),  # type: ignore[comparison-overlap]
                keys=self._keys(self.key, batch, context),
            )
        self.log.info("pushed %s message(s) to queue %s", len(ids), self.queue_name)
        return ids


class DbQueuePopOperator(BaseOperator):  # type: ignore[misc]
    """Pop up to ``max_messages`` from a queue and hand them to the next task as a *claim* (XCom).

    - ``semantics="at-least-once"`` (the default) leases the messages for ``visibility_timeout``
      seconds. The claim carries their receipts; the next task processes them and acks the claim with
      :meth:`DbQueueHook.ack_claim` (or releases them with ``nack_claim``). If it never does, the
      leases expire and the messages are delivered again: nothing is lost when downstream fails.
    - ``semantics="at-most-once"`` finishes the messages as it pops them, so they exist only in the
      claim: allowed only for batches of at most ``xcom_max_messages``.
    - exactly-once needs the processing in the pop's own transaction, which a hand-over through XCom
      cannot give: use :meth:`DbQueueHook.transaction` inside the task that writes the results.

    Batches of at most ``xcom_max_messages`` carry their messages (id, attempts, delivery, priority, payload,
    enqueued_at) in the claim. Larger ones stay claimed in the database and the claim holds only the
    receipts; the next task reads the payloads with :meth:`DbQueueHook.claimed_messages`.

    :param queue_name: the queue to pop from.
    :param max_messages: most messages to pop.
    :param semantics: ``at-least-once`` or ``at-most-once``.
    :param visibility_timeout: lease in seconds (default: the queue's).
    :param wait: seconds to wait for a first message when the queue is empty.
    :param xcom_max_messages: largest batch whose payloads go to XCom.
    :param group: the consumer group of a ring to pop for (default: its default group); the claim
        carries it, so that the ack operator finishes the group's leases.
    :param dbqueue_conn_id: the Airflow connection to the queue's database.
    :param dbqueue_schema: schema of the queue tables; overrides the connection extra.
    """

    template_fields: Sequence[str] = (
        "queue_name",
        "max_messages",
        "visibility_timeout",
        "wait",
        "xcom_max_messages",
        "group",
    )

    def __init__(
        self,
        *,
        queue_name: str,
        max_messages: int = 100,
        semantics: str = "at-least-once",
        visibility_timeout: float | None = None,
        wait: float = 0.0,
        xcom_max_messages: int = XCOM_MAX_MESSAGES,
        group: str | None = None,
        dbqueue_conn_id: str = DbQueueHook.default_conn_name,
        dbqueue_schema: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        sem = Semantics.parse(semantics)
        if sem is Semantics.EXACTLY_ONCE:
            raise ConfigurationError(
                "DbQueuePopOperator cannot pop exactly-once: the processing must share the pop's "
                "transaction; use DbQueueHook.transaction() in the task that writes the results"
            )
        self.queue_name = queue_name
        self.max_messages = max_messages
        self.semantics = sem.value
        self.visibility_timeout = visibility_timeout
        self.wait = wait
        self.xcom_max_messages = xcom_max_messages
        self.group = group
        self.dbqueue_conn_id = dbqueue_conn_id
        self.dbqueue_schema = dbqueue_schema

    def execute(self, context: Context) -> dict[str, Any]:
        """Pop the batch and return its claim."""
        ti = context.get("ti")
        consumer = None
        if ti is not None:
            consumer = f"airflow:{ti.dag_id}/{ti.run_id}/{ti.task_id}/{ti.map_index}/{ti.try_number}"[:200]
        vt = _optional_float(self.visibility_timeout)
        with DbQueueHook(self.dbqueue_conn_id, dbqueue_schema=self.dbqueue_schema) as hook:
            claim = hook.claim(
                self.queue_name,
                int(self.max_messages),
                semantics=self.semantics,
                visibility_timeout=vt,
                wait=float(self.wait),
                xcom_max_messages=int(self.xcom_max_messages),
                consumer=consumer,
                group=self.group or None,
            )
        self.log.info(
            "popped %s message(s) from queue %s%s (%s)%s",
            claim["count"],
            self.queue_name,
            f", group {self.group}" if self.group else "",
            self.semantics,
            "" if claim["messages"] is not None else "; payloads left in the database",
        )
        return claim


class DbQueueAckOperator(BaseOperator):  # type: ignore[misc]
    """Finish a claim handed on by :class:`DbQueuePopOperator` or a claiming :class:`DbQueueSensor`.

    ``action="ack"`` acks every leased message of the claim, all or nothing (raising, with nothing
    acked, when a lease was lost: those messages are being delivered again). ``action="nack"`` gives
    the still-held messages back for another try after ``delay`` seconds (default: the queue's
    backoff); it is meant for a failure path, e.g. ``trigger_rule="one_failed"``, and releases what it
    can. At-most-once claims have nothing left to finish (a no-op). Returns how many were finished.

    :param claim: the claim (templated), e.g. ``pop.output``, or its JSON text.
    :param action: ``"ack"`` or ``"nack"``.
    :param delay: seconds before nacked messages are ready again (``None``: the queue's backoff).
    :param error: note stored with nacked messages (templated).
    :param dbqueue_conn_id: the Airflow connection to the queue's database.
    :param dbqueue_schema: schema of the queue tables; overrides the connection extra.
    """

    template_fields: Sequence[str] = ("claim", "delay", "error")

    def __init__(
        self,
        *,
        claim: Any,
        action: str = "ack",
        delay: float | None = None,
        error: str | None = None,
        dbqueue_conn_id: str = DbQueueHook.default_conn_name,
        dbqueue_schema: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if action not in ("ack", "nack"):
            raise ValueError(
                f"{type(self).__name__} {kwargs.get('task_id')!r}: action is 'ack' or 'nack', got {action!r}"
            )
        self.claim = claim
        self.action = action
        self.delay = delay
        self.error = error
        self.dbqueue_conn_id = dbqueue_conn_id
        self.dbqueue_schema = dbqueue_schema

    def _claim(self) -> dict[str, Any]:
        claim = self.claim
        if isinstance(claim, str):
            try:
                claim = json.loads(claim)
            except ValueError:
                raise ConfigurationError(f"{self.task_id}: the claim is not JSON: {claim[:200]!r}") from None
        if not isinstance(claim, dict) or "queue_name" not in claim or "receipts" not in claim:
            raise ConfigurationError(
                f"{self.task_id}: expected a claim (a dict with queue_name and receipts, as "
                f"DbQueuePopOperator returns), got {str(claim)[:200]!r}"
            )
        return claim

    def execute(self, context: Context) -> int:
        claim = self._claim()
        with DbQueueHook(self.dbqueue_conn_id, dbqueue_schema=self.dbqueue_schema) as hook:
            if self.action == "ack":
                n = hook.ack_claim(claim)
            else:
                delay = _optional_float(self.delay)
                try:
                    n = hook.nack_claim(claim, delay=delay, error=self.error)
                except LeaseExpiredError as exc:
                    group = claim.get("group")
                    held = hook.leased(claim["queue_name"], claim.get("receipts") or [], group=group)
                    self.log.warning("%s; releasing the %d still held", exc, len(held))
                    n = (
                        hook.nack_receipts(
                            claim["queue_name"],
                            [list(m.receipt) for m in held],
                            delay=delay,
                            error=self.error,
                            group=group,
                        )
                        if held
                        else 0
                    )
        self.log.info("%sed %d message(s) of queue %s", self.action, n, claim["queue_name"])
        return n


def _optional_float(value: object) -> float | None:
    """A templated optional number: ``None`` (or a template that rendered to "" or "None") is None."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "None")):
        return None
    return float(value)  # type: ignore[arg-type]
