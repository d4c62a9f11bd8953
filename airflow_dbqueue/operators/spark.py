"""Pop-and-process on Spark: claim a batch, run its job (with ``spark-submit``, or in a session on a Spark
Connect server), ack it when its results are safe."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowSkipException

from airflow_dbqueue.engine import Batch, BatchStateError, ConfigurationError, DbQueueError, LeaseExpiredError
from airflow_dbqueue.engine.renames import take_renamed
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.operators.spark_connect import (
    CONNECT_ENTRY,
    SPARK_CONNECT_CONN_TYPE,
    ConnectPath,
    batch_tag,
    connect_session_id,
)
from airflow_dbqueue.operators.spark_setup import (
    JDBC_PASSWORD_ENV,
    JDBC_PASSWORD_FILE_ENV,
    BatchCallback,
    JobSetup,
    SparkBatchError,
    as_conf,
    as_list,
    refuse_early_return,
)
from airflow_dbqueue.operators.spark_submit import SubmitPath, stop_local_jobs

SPARK_VISIBILITY_TIMEOUT_S = 1800.0
"""Seconds a Spark batch stays claimed without a heartbeat, unless the operator names another number."""

if TYPE_CHECKING:
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
    from airflow.sdk import Context

    from airflow_dbqueue.engine import Queue

__all__ = [
    "CONNECT_ENTRY",
    "JDBC_PASSWORD_ENV",
    "JDBC_PASSWORD_FILE_ENV",
    "SPARK_CONNECT_CONN_TYPE",
    "BatchCallback",
    "DbQueueSparkSubmitOperator",
    "SparkBatchError",
    "batch_tag",
    "connect_session_id",
]

_MAX_OPEN_BATCHES = 1000
"""The most batches of one task instance looked at (a task claims max_batches at most per try)."""


class DbQueueSparkSubmitOperator(ConnectPath, SubmitPath, BaseOperator):  # type: ignore[misc]
    """Claim a batch from a queue, run a Spark application on it, and ack it once its results are safe.

    For each batch (up to ``max_batches`` per task run):

    1. claim up to ``max_messages`` ready messages under one lease and a batch id (no payload leaves the
       database; nothing of the batch goes through XCom);
    2. run ``spark-submit`` through the Spark provider's ``SparkSubmitHook`` with ``application`` and
       ``application_args`` followed by ``--batch-id ID --batch-size N --batch-query SQL``: the job
       reads the batch's ``ord, id, delivery, payload`` rows with Spark's JDBC source (partitioned on
       ``ord``), connecting with ``$DBQUEUE_JDBC_URL``, ``$DBQUEUE_JDBC_USER`` and the password (see
       below). While it runs, the batch's lease is extended every third of ``visibility_timeout``;
    3. on success, in one database transaction: ``publish(conn, batch)`` (move what the job wrote into
       the results) and ack the batch. Results and ack commit together, so a batch counts once.
    4. on any failure (non-zero exit, ``publish`` refusing, a lost lease, a timeout, ``on_kill``):
       ``discard(conn, batch)`` and release the batch for another try, in one transaction, then fail
       the task (Airflow's retries take it from there; the messages' attempts count towards the
       queue's ``max_attempts``, after which they go to the failed state).

    A try killed outright (SIGKILL, a lost worker) cannot release its batch. Before it claims, every
    try looks for batches that earlier tries of the same task instance (same DAG, run, task and map
    index) left claimed: it stops their jobs still running on this machine (spark-submit and the
    driver of a local or client-mode job, found by the batch id on their command line), runs
    ``discard`` and releases the batch at once, so its messages are claimed again now rather than
    when the lease runs out. A batch released that way can no longer be acked, so a job of the killed
    try that is still running elsewhere (a cluster-mode driver) can never publish. Before it reports
    success, a try checks that no batch of its task instance is still claimed, and fails if one is
    (an earlier try still running claimed it meanwhile), so a run never ends green with messages
    neither acked nor released.

    **Spark Connect.** When ``spark_conn_id`` is a ``spark_connect`` connection (the Spark provider's
    type: host ``sc://host``, port, optional user id, token and SSL), no spark-submit runs: the task
    run opens one Spark Connect session on that server (its id follows from the try's consumer name,
    :func:`connect_session_id`) and runs each batch's job there, the job's operations tagged with the
    batch's tag (:func:`batch_tag`); one session for every batch, because the server compiles a
    plan's code once per session. The job file's ``batch_job(spark, argv, jdbc)`` is loaded into the
    task's process and called with the session, the same arguments as under spark-submit, and the
    JDBC options (url, user, password) from the queue's connection; what it reads and writes runs on
    the server. Every step above holds as it is: the heartbeat, publish and ack in one transaction,
    release on any failure. A lost lease, a timeout or ``on_kill`` interrupts the operations of the
    batch's tag on the server; the session is released when the task run ends. A try that finds a
    batch an earlier try left claimed interrupts everything in that try's session and releases the
    session before releasing the batch. The password travels only inside the session (gRPC, TLS
    when the connection says ``use_ssl``); the operator sets the session's
    ``spark.sql.redaction.string.regex`` so that the plans and statements Spark records (event log,
    UI) show every JDBC password option redacted.
    The ``spark.sql.*`` settings of ``spark_conf`` become session settings; the other settings,
    ``spark_submit_kwargs`` and ``jdbc_jar`` concern starting an application and apply to
    spark-submit only (the server has the JDBC driver on its class path); ``env_vars`` and
    ``jdbc_password_file`` are refused.

    The Spark master and deploy mode come from the Spark connection (``local[*]``, ``spark://``,
    YARN, Kubernetes). No credential is ever put on spark-submit's command line. In client mode
    (the driver runs here, a child of spark-submit) the job's environment, ``$DBQUEUE_JDBC_PASSWORD``
    included, is spark-submit's own process environment. In cluster mode the driver runs on the
    cluster: the non-secret variables go the way Spark takes them there, and the password only as a
    file the driver reads, ``jdbc_password_file`` (``$DBQUEUE_JDBC_PASSWORD_FILE``); without one, a
    connection with a password is refused. ``submit`` returns only when the job has ended: in
    standalone cluster mode the operator follows the driver with the provider's status tracking, and
    settings that make spark-submit return early are refused. For local masters the operator runs
    the job with this interpreter (``PYSPARK_PYTHON``) and binds Spark to 127.0.0.1 unless
    ``SPARK_LOCAL_IP`` is set.

    :param queue_name: the queue to take batches from.
    :param group: the consumer group of a ring to take batches for (default: its default group). Each
        group sees every message of the ring, so two operators with two groups feed two pipelines from
        one stream, each batch of a group being that group's alone (claimed, extended, acked, released
        and cleaned up after a killed try through it). A ring's open batches hold its floor: see
        ``docs/operating.md`` (sizing a ring).
    :param application: the PySpark file (or jar) to submit; on Spark Connect, a Python file that
        defines ``batch_job(spark, argv, jdbc)``.
    :param application_args: arguments before the batch arguments (templated): a list, an ``XComArg``
        of a list, or a template that renders one (JSON, or the Python literal Jinja prints).
    :param max_messages: most messages in one batch.
    :param max_batches: most batches one task run processes (it stops early when the queue is empty).
    :param visibility_timeout: seconds the batch stays claimed without a heartbeat (the lease of its
        messages, as ``visibility_timeout`` is everywhere). Longer than a queue's own default: the
        lease is extended every third of it while the job runs, and a job whose driver stops
        answering keeps its batch that long.
    :param publish: ``(conn, batch)`` run inside the ack's transaction; raise to refuse the batch.
    :param discard: ``(conn, batch)`` run inside the release's transaction.
    :param release_delay: seconds before a released batch is ready again (None: the queue's backoff).
    :param if_empty: when no message is ready: ``"skip"`` (the task is skipped), ``"success"``, ``"fail"``.
    :param jdbc_jar: the JDBC driver jar for the job (default: ``$DBQUEUE_JDBC_JAR`` or Debian's).
    :param jdbc_password_file: a file holding the queue database's password, readable where the
        driver runs; needed in cluster mode when the connection has a password (templated).
    :param spark_conn_id: the Spark connection: a ``spark`` connection (master, deploy mode, ...) runs
        spark-submit, a ``spark_connect`` connection runs the job on that Spark Connect server.
    :param spark_conf: extra ``--conf`` settings (templated).
    :param spark_submit_kwargs: further ``SparkSubmitHook`` arguments (``driver_memory``, ``packages``...).
    :param env_vars: extra environment for the job (templated); never put secrets here in cluster
        mode on YARN or Kubernetes, where Spark takes them as ``--conf`` settings.
    :param dbqueue_conn_id: the Airflow connection to the queue's database.
    :param dbqueue_schema: schema of the queue tables; overrides the connection extra.
    """

    template_fields: Sequence[str] = (
        "queue_name",
        "group",
        "application",
        "application_args",
        "spark_conf",
        "env_vars",
        "jdbc_password_file",
        "max_messages",
        "max_batches",
    )
    ui_color = "#f0e4ec"
    renamed_arguments = {"lease_timeout": "visibility_timeout"}
    """Arguments under their old names (``{old: new}``), kept for one release with a warning."""

    def __init__(
        self,
        *,
        queue_name: str,
        application: str,
        group: str | None = None,
        application_args: Any = None,
        max_messages: int | str = 10_000,
        max_batches: int | str = 1,
        visibility_timeout: float = SPARK_VISIBILITY_TIMEOUT_S,
        publish: BatchCallback | None = None,
        discard: BatchCallback | None = None,
        release_delay: float | None = 0.0,
        if_empty: str = "skip",
        jdbc_jar: str | None = None,
        jdbc_password_file: str | None = None,
        spark_conn_id: str = "spark_default",
        spark_conf: Any = None,
        spark_submit_kwargs: dict[str, Any] | None = None,
        env_vars: Any = None,
        dbqueue_conn_id: str = DbQueueHook.default_conn_name,
        dbqueue_schema: str | None = None,
        **kwargs: Any,
    ) -> None:
        visibility_timeout = take_renamed(type(self).__name__, kwargs, self.renamed_arguments).get(
            "visibility_timeout", visibility_timeout
        )
        super().__init__(**kwargs)
        if if_empty not in ("skip", "success", "fail"):
            raise ValueError(
                f"{type(self).__name__}: if_empty must be 'skip', 'success' or 'fail', got {if_empty!r}"
            )
        if visibility_timeout <= 0:
            raise ValueError(
                f"{type(self).__name__}: visibility_timeout must be > 0, got {visibility_timeout}"
            )
        # Templated fields are kept as given (a Jinja string, an XComArg, a list) and read in execute,
        # once Airflow has rendered them.
        self.queue_name = queue_name
        self.group = group
        self.application = application
        self.application_args = application_args
        self.max_messages = max_messages
        self.max_batches = max_batches
        self.visibility_timeout = visibility_timeout
        self.publish = publish
        self.discard = discard
        self.release_delay = release_delay
        self.if_empty = if_empty
        self.jdbc_jar = jdbc_jar
        self.jdbc_password_file = jdbc_password_file
        self.spark_conn_id = spark_conn_id
        self.spark_conf = spark_conf
        self.spark_submit_kwargs = dict(spark_submit_kwargs or {})
        self.env_vars = env_vars
        self.dbqueue_conn_id = dbqueue_conn_id
        self.dbqueue_schema = dbqueue_schema
        refuse_early_return(self.task_id, self.spark_submit_kwargs, spark_conf)
        self._spark: SparkSubmitHook | None = None
        self._session: Any = None  # the task run's Spark Connect session, once it has one
        self._tag: str | None = None  # the tag of the batch job running in it
        self._hook: DbQueueHook | None = None
        self._batch: Batch | None = None

    # -- run ---------------------------------------------------------------------------------------

    def execute(self, context: Context) -> dict[str, Any]:
        try:
            max_messages, max_batches = int(self.max_messages), int(self.max_batches)
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"{self.task_id}: max_messages and max_batches must be integers, got "
                f"{self.max_messages!r} and {self.max_batches!r}"
            ) from None
        if max_batches < 1:
            raise ConfigurationError(f"{self.task_id}: max_batches must be >= 1, got {max_batches}")
        # Checked again as rendered, before anything is claimed.
        refuse_early_return(self.task_id, self.spark_submit_kwargs, as_conf(self.task_id, self.spark_conf))
        as_list(self.task_id, "application_args", self.application_args)
        ti = context["ti"]
        tries = f"{ti.dag_id}.{ti.task_id}.{ti.run_id}.{ti.map_index}.try"  # every try of this instance
        consumer = f"{tries}{ti.try_number}"
        with DbQueueHook(self.dbqueue_conn_id, dbqueue_schema=self.dbqueue_schema) as hook:
            self._hook = hook
            try:
                queue = self._queue(hook)
                self._release_earlier_tries(queue, tries, consumer)
                done = self._process(hook, consumer, max_messages, max_batches)
                self._check_nothing_left(queue, tries)
            finally:
                self._hook = None
        if not done:
            self._on_empty()
        out = {"queue": self.queue_name, "batches": done, "messages": sum(b["size"] for b in done)}
        if self.group:
            out["group"] = self.group
        return out

    def _queue(self, hook: DbQueueHook) -> Queue:
        """The handle batches are claimed through: the queue's, or its consumer group's."""
        return hook.get_queue(self.queue_name, self.group or None)

    def _process(
        self, hook: DbQueueHook, consumer: str, max_messages: int, max_batches: int
    ) -> list[dict[str, Any]]:
        """Claim, run, publish and ack up to ``max_batches`` batches; return their summaries."""
        done: list[dict[str, Any]] = []
        queue = self._queue(hook)
        if self._on_connect():
            setup = self._connect_setup(hook, consumer)
        else:
            env, password = self._job_env(hook)
            jars = self._jars()
            master, cluster = self._spark_target(password)
            setup = JobSetup(env, password, jars, master, cluster)
        try:
            for _ in range(max_batches):
                batch = queue.claim_batch(
                    max_messages, visibility_timeout=self.visibility_timeout, consumer=consumer
                )
                if batch is None:
                    break
                self._process_batch(hook, queue, batch, setup)
                done.append(queue.get_batch(batch.batch_id).as_dict())
        finally:
            self._close_connect_session()
        return done

    def _process_batch(self, hook: DbQueueHook, queue: Queue, batch: Batch, setup: JobSetup) -> None:
        """Run the job of a claimed batch, then publish and ack it; release it on any failure."""
        self._batch = batch
        self.log.info(
            "claimed batch %s: %d message(s) of queue %r, lease until %s",
            batch.batch_id,
            batch.size,
            self.queue_name,
            batch.lease_until.isoformat(),
        )
        try:
            if setup.connect_url is not None:
                self._run_connect_job(queue, batch, setup)
            else:
                self._run_job(queue, batch, setup)
            with hook.transaction() as conn:
                if self.publish is not None:
                    self.publish(conn, batch)
                queue.ack_batch(batch.batch_id, conn=conn)
        except BaseException as exc:  # _run_job has already stopped the job if it was running
            self._release(queue, batch, f"{type(exc).__name__}: {exc}"[:2000])
            raise
        finally:
            self._batch = None
        self.log.info("batch %s: job succeeded; results published and batch acked", batch.batch_id)

    def _release_earlier_tries(self, queue: Queue, tries: str, consumer: str) -> None:
        """Stop, discard and release at once the batches earlier tries of this task instance left
        claimed (a try killed before it could release); raise if one cannot be released."""
        for batch in queue.open_batches(_MAX_OPEN_BATCHES, consumer_prefix=tries):
            if batch.consumer == consumer:
                continue
            if self._on_connect():
                stopped = self._stop_connect_session(batch)
            else:
                stopped = stop_local_jobs(batch.batch_id)
            error = f"released by {consumer}: {batch.consumer} ended without acking or releasing it"
            assert self._hook is not None
            with self._hook.transaction() as conn:
                if self.discard is not None:
                    self.discard(conn, batch)
                n = queue.release_batch(batch.batch_id, delay=0, error=error, conn=conn)
            self.log.warning(
                "batch %s of an earlier try (%s) was still claimed: %d job(s) stopped, "
                "staging discarded, %d message(s) released at once",
                batch.batch_id,
                batch.consumer,
                stopped,
                n,
            )

    def _check_nothing_left(self, queue: Queue, tries: str) -> None:
        """Fail when a batch of this task instance is still claimed: its messages are neither acked nor
        released, and a run that ended green would leave them stranded until the lease runs out."""
        left = queue.open_batches(_MAX_OPEN_BATCHES, consumer_prefix=tries)
        if left:
            raise BatchStateError(
                f"queue {self.queue_name!r}: batch(es) "
                + ", ".join(f"{b.batch_id} ({b.consumer})" for b in left)
                + " of this task instance are still claimed (an earlier try still running claimed "
                "them); failing so that the next try releases them"
            )

    def _on_empty(self) -> None:
        msg = f"queue {self.queue_name!r} has no ready message to claim"
        if self.if_empty == "fail":
            raise SparkBatchError(msg)
        self.log.info(msg)
        if self.if_empty == "skip":
            raise AirflowSkipException(msg)

    def _heartbeat(
        self, queue: Queue, batch: Batch, stop: threading.Event, lost: list[BaseException]
    ) -> None:
        """Extend the batch's lease every third of ``visibility_timeout`` until ``stop``; kill the job when
        the lease is lost (someone else may hold its messages now)."""
        while not stop.wait(self.visibility_timeout / 3):
            try:
                until = queue.extend_batch(batch.batch_id, self.visibility_timeout)
                self.log.debug("batch %s: lease extended to %s", batch.batch_id, until.isoformat())
            except LeaseExpiredError as exc:
                self.log.error("batch %s: lease lost while the job ran; stopping it: %s", batch.batch_id, exc)
                lost.append(exc)
                self._kill_job()
                return
            except DbQueueError as exc:  # a database hiccup: try again at the next beat
                self.log.warning("batch %s: could not extend the lease: %s", batch.batch_id, exc)

    def _kill_job(self) -> None:
        session, tag = self._session, self._tag
        if session is not None and tag is not None:
            try:
                session.interruptTag(tag)  # every operation of the batch's job on the server
            except Exception:
                self.log.exception("could not interrupt the Spark Connect job")
        spark = self._spark
        if spark is None:
            return
        try:
            spark.on_kill()  # also stops a driver on a cluster (YARN, Kubernetes, standalone)
        except Exception:  # the process may be gone already
            self.log.exception("could not kill the Spark job")
        proc = getattr(spark, "_submit_sp", None)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # what spark-submit started locally

    def _release(self, queue: Queue, batch: Batch, error: str) -> None:
        hook = self._hook
        try:
            assert hook is not None
            with hook.transaction() as conn:
                if self.discard is not None:
                    self.discard(conn, batch)
                n = queue.release_batch(batch.batch_id, delay=self.release_delay, error=error, conn=conn)
            self.log.warning(
                "batch %s released (%d message(s) back for another try): %s", batch.batch_id, n, error
            )
        except Exception:
            self.log.exception(
                "batch %s: could not release it; its lease expires at %s and then it is delivered again",
                batch.batch_id,
                batch.lease_until.isoformat(),
            )

    def on_kill(self) -> None:
        self._kill_job()
        # execute()'s handler releases the batch when the kill interrupts it; this covers a kill that
        # arrives from another thread while execute is not in a position to.
        batch, hook = self._batch, self._hook
        if batch is not None and hook is not None:
            self._release(self._queue(hook), batch, "task killed")
