"""The Spark Connect path of :class:`~airflow_dbqueue.operators.spark.DbQueueSparkSubmitOperator`: a
task run's session on a Spark Connect server, each batch's job run in it under the batch's tag, and the
session of a killed try found again by its consumer name."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

from airflow_dbqueue.engine import Batch, ConfigurationError
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.operators.spark_setup import JobSetup, PathState, SparkBatchError, as_conf, as_list, why

if TYPE_CHECKING:
    from airflow_dbqueue.engine import Queue

#: The Spark connection type that runs batches on a Spark Connect server (the provider's own).
SPARK_CONNECT_CONN_TYPE = "spark_connect"
#: What a job file defines to run on Spark Connect: ``batch_job(spark, argv, jdbc)``.
CONNECT_ENTRY = "batch_job"
# Redacts the value of every JDBC "password" option (and a SQL literal after the word password) in
# the text Spark records of a Connect session's plans and statements (its event log and UI): the
# plan travels as protobuf, whose text form Spark redacts only with this session setting. The
# setting holds no secret itself, so Spark may record it as it is.
_CONNECT_REDACTION = (
    r'(?i)key: "password"\s*value: "(?:[^"\\]|\\.)*"'
    r"|password\s*[:=]?\s*'(?:[^'\\]|\\.)*'"
)

# Names the Spark Connect session of each try (see connect_session_id).
_SESSION_NAMESPACE = uuid.UUID("5d1c2a57-6e0b-4d9b-9a43-0d5f3c8e2b71")

# Retries of a Spark Connect call that fails with a retryable error (the server unreachable):
# backoffs of 0.05, 0.2, 0.8 and 3.2 s, about 4 s a call.
_CONNECT_RETRIES = 4


def connect_session_id(consumer: str) -> str:
    """The id of the Spark Connect session in which the try ``consumer`` (the consumer name it claims
    under) runs its batches. It follows from the consumer name, which every batch records, so a later
    try can reach the session of a try that was killed, and stop what still runs there."""
    return str(uuid.uuid5(_SESSION_NAMESPACE, consumer))


def batch_tag(batch_id: str) -> str:
    """The tag of the Spark Connect operations that run the job of batch ``batch_id``."""
    return f"dbqueue-batch-{batch_id}"


def load_job(task_id: str, path: str) -> ModuleType:
    """Import the job file ``path`` as a module of its own (once per process and path)."""
    name = "dbqueue_job_" + hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not Path(path).is_file():
        raise ConfigurationError(f"{task_id}: the job file {path!r} is not a Python file here")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


class ConnectPath(PathState):
    """The Spark Connect path, a mixin of :class:`~airflow_dbqueue.operators.spark.DbQueueSparkSubmitOperator`
    (whose parameters and job state it reads)."""

    def _on_connect(self) -> bool:
        """Whether the Spark connection names a Spark Connect server (else: spark-submit)."""
        return bool(BaseHook.get_connection(self.spark_conn_id).conn_type == SPARK_CONNECT_CONN_TYPE)

    def _connect_url(self) -> str:
        from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook

        try:
            return str(SparkConnectHook(conn_id=self.spark_conn_id).get_connection_url())
        except (ValueError, AttributeError) as exc:
            raise ConfigurationError(
                f"{self.task_id}: the Spark Connect connection {self.spark_conn_id!r} does not name a "
                f"server (host sc://host, port): {exc}"
            ) from exc

    def _connect_setup(self, hook: DbQueueHook, consumer: str) -> JobSetup:
        """What a Connect job of this task run gets; refuse, before anything is claimed, what only
        spark-submit can deliver."""
        if self.env_vars:
            raise ConfigurationError(
                f"{self.task_id}: env_vars reach a spark-submit job's environment; on Spark Connect "
                f"({self.spark_conn_id!r}) the job runs inside the task, so pass what it needs in "
                "application_args"
            )
        if self.jdbc_password_file:
            raise ConfigurationError(
                f"{self.task_id}: jdbc_password_file is for a spark-submit driver on a cluster; on Spark "
                "Connect the password goes from the queue's connection into the session"
            )
        self._connect_job()  # the job file must define batch_job: fail before anything is claimed
        url, user, password = hook.jdbc()
        jdbc = {"url": url, **({"user": user} if user else {})}
        setup = JobSetup(
            jdbc,
            password,
            None,
            "connect",
            False,
            connect_url=self._connect_url(),
            session_id=connect_session_id(consumer),
        )
        self.log.info(
            "Spark connection %r is a Spark Connect server: batches run as jobs of sessions there "
            "(spark_submit_kwargs and non-spark.sql spark_conf settings apply to spark-submit only)",
            self.spark_conn_id,
        )
        return setup

    def _connect_job(self) -> Callable[..., Any]:
        """The job file's ``batch_job``, loaded into this process (the job's driver side on Connect)."""
        module = load_job(self.task_id, self.application)
        job = getattr(module, CONNECT_ENTRY, None)
        if not callable(job):
            raise ConfigurationError(
                f"{self.task_id}: {self.application} defines no {CONNECT_ENTRY}(spark, argv, jdbc), "
                "which a job needs to run on Spark Connect (see the job's contract in docs/airflow.md)"
            )
        return job  # type: ignore[no-any-return]

    def _connect_session(self, url: str, session_id: str) -> Any:
        """A Spark Connect session whose id is ``session_id``."""
        from pyspark.sql import SparkSession
        from pyspark.sql.connect.client.retries import DefaultPolicy

        sep = "" if ";" in url.split("//", 1)[-1] else ("" if url.endswith("/") else "/")
        session = SparkSession.builder.remote(f"{url}{sep};session_id={session_id}").create()
        # pyspark retries a call that finds no server for about ten minutes, while the batch stays
        # claimed; a batch whose server is gone is released within seconds instead (the job's call,
        # the interrupt and the session's release each give up after about 4 s), and the task's retry
        # tries again.
        session.client.set_retry_policies([DefaultPolicy(max_retries=_CONNECT_RETRIES, max_backoff=10_000)])
        return session

    def _task_session(self, setup: JobSetup) -> Any:
        """The task run's Spark Connect session, opened at its first batch and kept for the next ones.

        One session serves every batch of a task run because the server compiles the code of a
        query's plan once per session (each session has a class loader of its own): a session per
        batch would compile the job's two dozen classes again for every batch, and the JVM would run
        each new copy unoptimised. Its id follows from the try's consumer name
        (:func:`connect_session_id`); each batch's operations carry the batch's tag
        (:func:`batch_tag`), by which a lost lease, a timeout or a kill interrupts them."""
        if self._session is None:
            assert setup.connect_url is not None and setup.session_id is not None
            session = self._connect_session(setup.connect_url, setup.session_id)
            try:
                session.conf.set("spark.sql.redaction.string.regex", _CONNECT_REDACTION)
                for key, value in as_conf(self.task_id, self.spark_conf).items():
                    if key.startswith("spark.sql."):
                        session.conf.set(key, value)
            except BaseException:
                with contextlib.suppress(Exception):
                    session.stop()
                raise
            self._session = session
        return self._session

    def _close_connect_session(self) -> None:
        """Release the task run's session on the server (its state goes with it)."""
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                session.stop()

    def _run_connect_job(self, queue: Queue, batch: Batch, setup: JobSetup) -> None:
        """Run the job of ``batch`` in the task run's session on the Connect server, its operations
        tagged with the batch's tag; the lease heartbeat runs meanwhile, and a lost lease, a timeout
        or a kill interrupts the operations of that tag."""
        job = self._connect_job()
        argv = [
            *as_list(self.task_id, "application_args", self.application_args),
            "--batch-id",
            batch.batch_id,
            "--batch-size",
            str(batch.size),
            "--batch-query",
            queue.batch_query(batch.batch_id),
        ]
        jdbc = dict(setup.env)
        if setup.password:
            jdbc["password"] = setup.password
        stop = threading.Event()
        lost: list[BaseException] = []
        try:
            session = self._task_session(setup)
        except Exception as exc:
            raise SparkBatchError(
                f"batch {batch.batch_id} of queue {self.queue_name!r}: no session on the Spark Connect "
                f"server of {self.spark_conn_id!r}: {why(exc)}"
            ) from exc
        tag = batch_tag(batch.batch_id)
        session.addTag(tag)
        self._tag = tag
        beat = threading.Thread(
            target=self._heartbeat, args=(queue, batch, stop, lost), name="dbqueue-lease", daemon=True
        )
        beat.start()
        finished = False
        try:
            result = job(session, argv, jdbc)
            finished = True
            self.log.info("batch %s: the Spark Connect job returned %s", batch.batch_id, result)
        except Exception as exc:
            if lost:
                raise lost[0] from exc
            raise SparkBatchError(
                f"batch {batch.batch_id} of queue {self.queue_name!r}: the Spark Connect job failed: "
                f"{type(exc).__name__}: {why(exc)}"
            ) from exc
        finally:
            stop.set()
            if not finished:  # interrupted: a timeout, a kill, a lost lease
                self._kill_job()
            beat.join()
            self._tag = None
            with contextlib.suppress(Exception):
                session.removeTag(tag)
        if lost:
            raise lost[0]

    def _stop_connect_session(self, batch: Batch) -> int:
        """Interrupt the operations of the Connect session of the try that claimed ``batch`` (its job
        may still run there) and release that session; return 1 when it was reached, else 0."""
        try:
            session = self._connect_session(self._connect_url(), connect_session_id(batch.consumer or ""))
            try:
                session.interruptAll()
            finally:
                session.stop()
        except Exception as exc:  # closed already, or never opened: nothing of it runs
            self.log.info("batch %s: no Spark Connect session of it to stop (%s)", batch.batch_id, why(exc))
            return 0
        return 1
