"""What the Spark jobs of :class:`~airflow_dbqueue.operators.spark.DbQueueSparkSubmitOperator` are given,
on either path: the operator's rendered arguments, checked before anything is claimed, the job's setup
for a task run, and what a failed job says about its cause."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine import Batch, ConfigurationError, DbQueueError
from airflow_dbqueue.engine.dialects.base import DbConnection

if TYPE_CHECKING:
    import logging
    import threading

    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from airflow_dbqueue.engine import Queue

BatchCallback = Callable[[DbConnection, Batch], None]

# Lines of a job's output that say why it failed: our jobs' "REJECTED" verdicts, Python exceptions.
_JOB_ERROR = re.compile(r"REJECTED|^\s*(?:[\w.]+\.)?\w*(?:Error|Exception)\b:?")

JDBC_PASSWORD_ENV = "DBQUEUE_JDBC_PASSWORD"
JDBC_PASSWORD_FILE_ENV = "DBQUEUE_JDBC_PASSWORD_FILE"

# SparkSubmitHook arguments that make submit() return while the job still runs (the hook then
# expects its caller to poll the cluster), so the batch would be published and acked early.
_EARLY_RETURN_KWARGS = ("track_driver_via_k8s_api", "yarn_track_via_rm_api")
# Spark settings that make spark-submit exit once the application is submitted, for the same reason.
_EARLY_RETURN_CONF = ("spark.yarn.submit.waitAppCompletion", "spark.kubernetes.submission.waitAppCompletion")
# SparkSubmitHook arguments the operator sets itself, each from one of its own parameters.
_OWN_KWARGS = {
    "conf": "spark_conf",
    "conn_id": "spark_conn_id",
    "application_args": "application_args",
    "env_vars": "env_vars",
}


def refuse_early_return(task_id: str, kwargs: Mapping[str, Any], conf: object) -> None:
    """Raise when ``spark_submit_kwargs`` or ``spark_conf`` would let ``submit()`` return before the job
    has ended: the operator publishes and acks the batch as soon as it returns."""
    for key in _EARLY_RETURN_KWARGS:
        if kwargs.get(key):
            raise ConfigurationError(
                f"{task_id}: spark_submit_kwargs {key}=True makes spark-submit return once the job is "
                "submitted, and the batch would be acked before the job ends; leave it out (spark-submit "
                "then waits for the application, and the lease heartbeat holds the batch meanwhile)"
            )
    for key, param in _OWN_KWARGS.items():
        if key in kwargs:
            raise ConfigurationError(
                f"{task_id}: spark_submit_kwargs must not set {key!r}: use the operator's {param}="
            )
    if isinstance(conf, Mapping):
        for key in _EARLY_RETURN_CONF:
            if str(conf.get(key, "")).strip().lower() == "false":
                raise ConfigurationError(
                    f"{task_id}: spark_conf {key}=false makes spark-submit return once the job is "
                    "submitted, and the batch would be acked before the job ends; leave it out"
                )


def as_list(task_id: str, name: str, value: object) -> list[str]:
    """A rendered list argument: a list or tuple as it is, or the text of one (JSON, or the Python
    literal Jinja prints for a list); each item becomes one argument."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        parsed: object = None
        with contextlib.suppress(ValueError):
            parsed = json.loads(text)
        if not isinstance(parsed, list):
            with contextlib.suppress(ValueError, SyntaxError, MemoryError, RecursionError):
                parsed = ast.literal_eval(text)
        if not isinstance(parsed, list | tuple):
            raise ConfigurationError(
                f"{task_id}: {name} rendered to {value[:200]!r}, which is not a list of arguments; pass a "
                "list (items may be templates), an XComArg of a list, or a template that renders one"
            )
        value = parsed
    if not isinstance(value, list | tuple):
        raise ConfigurationError(
            f"{task_id}: {name} must be a list of arguments, got {type(value).__name__}: {value!r:.200}"
        )
    out = []
    for item in value:
        if isinstance(item, dict | list | tuple | set) or item is None:
            raise ConfigurationError(
                f"{task_id}: each of {name} must be a string or a number, got {item!r:.200}"
            )
        out.append(str(item))
    return out


def as_conf(task_id: str, value: object) -> dict[str, str]:
    """The rendered ``spark_conf``: a mapping, or the JSON text of one."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{task_id}: spark_conf must be a mapping of Spark settings")
    return {str(k): str(v) for k, v in value.items()}


class PathState:
    """What the Spark paths (spark-submit and Connect, mixins of
    :class:`~airflow_dbqueue.operators.spark.DbQueueSparkSubmitOperator`) read of the operator: its
    parameters and job state, declared once for the type checker."""

    if TYPE_CHECKING:
        log: logging.Logger
        task_id: str
        queue_name: str
        application: str
        application_args: Any
        spark_conn_id: str
        spark_conf: Any
        spark_submit_kwargs: dict[str, Any]
        env_vars: Any
        jdbc_jar: str | None
        jdbc_password_file: str | None
        _spark: SparkSubmitHook | None
        _session: Any
        _tag: str | None

        def _heartbeat(
            self, queue: Queue, batch: Batch, stop: threading.Event, lost: list[BaseException]
        ) -> None: ...

        def _kill_job(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class JobSetup:
    """What every batch of one task run is submitted with."""

    env: dict[str, str]  # the job's environment, without the password
    password: str | None  # None: none, or the job reads it from jdbc_password_file
    jars: str | None
    master: str
    cluster: bool  # the driver runs on the cluster
    connect_url: str | None = None  # the Spark Connect server (None: spark-submit)
    session_id: str | None = None  # the task run's Spark Connect session


class SparkBatchError(DbQueueError):
    """The Spark job of a batch failed; the batch was released for another try."""


def why(exc: BaseException) -> str:
    """What a failed submit says about its cause: the job's error lines from the tail of spark-submit's
    output that the provider's exception quotes, else its last line."""
    lines = str(exc).splitlines()
    errors = [line.strip()[:500] for line in lines if _JOB_ERROR.search(line)]
    if errors:
        return " | ".join(errors[-6:])
    return (lines[-1] if lines else type(exc).__name__)[:500]
