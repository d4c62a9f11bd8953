"""``DbQueueSensor``: wait until a queue can pop at least ``min_messages``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.configuration import conf
from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowSensorTimeout

from airflow_dbqueue.engine import ConfigurationError
from airflow_dbqueue.hooks.claims import XCOM_MAX_MESSAGES
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.operators.dbqueue import _optional_float
from airflow_dbqueue.triggers.dbqueue import POLL_INTERVAL_S, DbQueueTrigger

if TYPE_CHECKING:
    from airflow.sdk import Context


class DbQueueSensor(BaseSensorOperator):  # type: ignore[misc]
    """Wait until a queue can pop at least ``min_messages`` (of at least ``min_priority``).

    The sensor is not the processor. By default it only *observes*: it succeeds when enough messages
    are ready and takes none of them, so a downstream failure loses nothing (the lesson of SqsSensor's
    delete-on-reception). Its XCom is ``{"queue_name", "ready"}``.

    With ``claim=True`` it also pops up to ``max_messages`` at-least-once, *leasing* them for
    ``visibility_timeout`` seconds, and returns the claim (see :meth:`DbQueueHook.claim`) for the next
    task to process and ack; messages whose task fails come back when their lease expires. The claim
    always happens in the worker, never in the trigger. If other consumers took the messages between
    the check and the claim, the sensor keeps waiting, within the same ``timeout``: a deferrable
    sensor that resumes and defers again keeps its original deadline.

    Modes: ``poke``, ``reschedule``, and ``deferrable=True`` (default from ``[operators]
    default_deferrable``), which waits in the triggerer on LISTEN/NOTIFY with polling every
    ``poll_interval`` seconds as the fallback.

    :param queue_name: the queue to watch.
    :param group: the consumer group of a ring to watch and claim for (default: its default group).
    :param dbqueue_conn_id: the Airflow connection to the queue's database.
    :param min_messages: succeed when at least this many messages are ready.
    :param min_priority: count only messages of at least this priority.
    :param claim: lease a batch and hand it on (at-least-once) instead of only observing.
    :param max_messages: largest batch to claim (default: ``min_messages``).
    :param visibility_timeout: lease of claimed messages in seconds (default: the queue's).
    :param xcom_max_messages: a claimed batch larger than this leaves its payloads in the database.
    :param deferrable: wait in the triggerer instead of a worker slot.
    :param poll_interval: seconds between the trigger's checks when no NOTIFY arrives.
    :param use_notify: let the trigger wait on LISTEN/NOTIFY (``False``: poll only).
    :param dbqueue_schema: schema of the queue tables; overrides the connection extra.
    """

    template_fields: Sequence[str] = (
        "queue_name",
        "min_messages",
        "min_priority",
        "max_messages",
        "visibility_timeout",
        "xcom_max_messages",
        "group",
    )

    def __init__(
        self,
        *,
        queue_name: str,
        group: str | None = None,
        dbqueue_conn_id: str = DbQueueHook.default_conn_name,
        min_messages: int = 1,
        min_priority: int | None = None,
        claim: bool = False,
        max_messages: int | None = None,
        visibility_timeout: float | None = None,
        xcom_max_messages: int = XCOM_MAX_MESSAGES,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        poll_interval: float = POLL_INTERVAL_S,
        use_notify: bool = True,
        dbqueue_schema: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.queue_name = queue_name
        self.group = group
        self.dbqueue_conn_id = dbqueue_conn_id
        self.min_messages = min_messages
        self.min_priority = min_priority
        self.claim = claim
        self.max_messages = max_messages
        self.visibility_timeout = visibility_timeout
        self.xcom_max_messages = xcom_max_messages
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.use_notify = use_notify
        self.dbqueue_schema = dbqueue_schema

    def _hook(self) -> DbQueueHook:
        return DbQueueHook(self.dbqueue_conn_id, dbqueue_schema=self.dbqueue_schema)

    def _min(self) -> int:
        n = int(self.min_messages)
        if n < 1:
            raise ConfigurationError(f"min_messages must be >= 1, got {self.min_messages!r}")
        return n

    def _min_priority(self) -> int | None:
        value: object = self.min_priority
        if value is None or (isinstance(value, str) and value.strip() in ("", "None")):
            return None
        if not isinstance(value, int | str):
            raise ConfigurationError(f"min_priority must be an integer, got {value!r}")
        return int(value)

    def _check(self, hook: DbQueueHook) -> PokeReturnValue:
        """Check once; claim when asked. Return whether the sensor is done and its XCom value."""
        want = self._min()
        ready = hook.count_ready(self.queue_name, self._min_priority(), cap=want, group=self.group or None)
        self.log.info("queue %s: %s ready message(s) of at least %s wanted", self.queue_name, ready, want)
        if ready < want:
            return PokeReturnValue(False)
        if not self.claim:
            return PokeReturnValue(True, {"queue_name": self.queue_name, "ready": ready})
        claim = hook.claim(
            self.queue_name,
            int(self.max_messages or want),
            semantics="at-least-once",
            visibility_timeout=_optional_float(self.visibility_timeout),
            xcom_max_messages=int(self.xcom_max_messages),
            group=self.group or None,
        )
        if claim["count"] == 0:
            self.log.info("queue %s: other consumers took the messages first; waiting on", self.queue_name)
            return PokeReturnValue(False)
        self.log.info("queue %s: claimed %s message(s)", self.queue_name, claim["count"])
        return PokeReturnValue(True, claim)

    def poke(self, context: Context) -> PokeReturnValue:
        """Check the queue once (poke and reschedule modes)."""
        with self._hook() as hook:
            return self._check(hook)

    def execute(self, context: Context) -> Any:
        """Poke or reschedule as usual; when deferrable, check once and then wait in the triggerer."""
        if not self.deferrable:
            return super().execute(context)
        result = self.poke(context)
        if result.is_done:
            return result.xcom_value
        self._defer(time.time() + float(self.timeout))

    def _defer(self, deadline: float) -> None:
        """Wait in the triggerer until ``deadline`` (epoch seconds): one timeout for the whole wait,
        however many times the sensor resumes and defers again."""
        remaining = deadline - time.time()
        if remaining <= 0:
            raise AirflowSensorTimeout(
                f"queue {self.queue_name!r}: fewer than {self._min()} ready message(s) could be had "
                f"within the sensor's timeout of {self.timeout}s"
            )
        self.defer(
            trigger=DbQueueTrigger(
                queue_name=self.queue_name,
                group=self.group or None,
                dbqueue_conn_id=self.dbqueue_conn_id,
                min_messages=self._min(),
                min_priority=self._min_priority(),
                poll_interval=self.poll_interval,
                use_notify=self.use_notify,
                rearm=False,
                dbqueue_schema=self.dbqueue_schema,
            ),
            method_name="execute_complete",
            kwargs={"deadline": deadline},
            timeout=timedelta(seconds=remaining),
        )

    def execute_complete(
        self, context: Context, event: dict[str, Any] | None = None, deadline: float | None = None
    ) -> Any:
        """Resume after the trigger fired: check (and claim) in the worker, or wait again if raced."""
        if not event or event.get("status") != "success" or event.get("queue_name") != self.queue_name:
            raise AirflowException(f"DbQueueSensor got an unexpected trigger event: {event!r}")
        result = self.poke(context)
        if result.is_done:
            return result.xcom_value
        self._defer(time.time() + float(self.timeout) if deadline is None else deadline)
        return None
