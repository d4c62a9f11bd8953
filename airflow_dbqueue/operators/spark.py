"""Pop-and-process on Spark: claim a batch, run ``spark-submit`` on it, ack it when its results are safe."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk import BaseHook, BaseOperator
from airflow.sdk.exceptions import AirflowSkipException

from airflow_dbqueue.engine import Batch, ConfigurationError, DbQueueError, LeaseExpiredError
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.spark import JDBC_HINT, find_jdbc_jar

if TYPE_CHECKING:
    import psycopg
    from airflow.sdk import Context

    from airflow_dbqueue.engine import Queue

BatchCallback = Callable[["psycopg.Connection[Any]", Batch], None]

# Lines of a job's output that say why it failed: our jobs' "REJECTED" verdicts, Python exceptions.
_JOB_ERROR = re.compile(r"REJECTED|^\s*(?:[\w.]+\.)?\w*(?:Error|Exception)\b:?")


class _SparkSubmit(SparkSubmitHook):  # type: ignore[misc]
    """SparkSubmitHook that also keeps the job's error lines, to say why a batch was released."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.error_lines: collections.deque[str] = collections.deque(maxlen=6)

    def _process_spark_submit_log(self, itr: Iterator[Any]) -> None:
        def tee() -> Iterator[Any]:
            for line in itr:
                if _JOB_ERROR.search(line):
                    self.error_lines.append(line.strip()[:500])
                yield line

        super()._process_spark_submit_log(tee())


class SparkBatchError(DbQueueError):
    """The Spark job of a batch failed; the batch was released for another try."""


class DbQueueSparkSubmitOperator(BaseOperator):  # type: ignore[misc]
    """Claim a batch from a queue, run a Spark application on it, and ack it once its results are safe.

    For each batch (up to ``max_batches`` per task run):

    1. claim up to ``max_messages`` ready messages under one lease and a batch id (no payload leaves the
       database; nothing of the batch goes through XCom);
    2. run ``spark-submit`` through the Spark provider's ``SparkSubmitHook`` with ``application`` and
       ``application_args`` followed by ``--batch-id ID --batch-size N --batch-query SQL``: the job
       reads the batch's ``ord, id, delivery, payload`` rows with Spark's JDBC source (partitioned on
       ``ord``), connecting with ``$DBQUEUE_JDBC_URL``, ``$DBQUEUE_JDBC_USER`` and
       ``$DBQUEUE_JDBC_PASSWORD`` (set from the queue's Airflow connection, never on the command line).
       While it runs, the batch's lease is extended every third of ``lease_timeout``;
    3. on success, in one database transaction: ``publish(conn, batch)`` (move what the job wrote into
       the results) and ack the batch. Results and ack commit together, so a batch counts once.
    4. on any failure (non-zero exit, ``publish`` refusing, a lost lease, a timeout, ``on_kill``):
       ``discard(conn, batch)`` and release the batch for another try, in one transaction, then fail
       the task (Airflow's retries take it from there; the messages' attempts count towards the
       queue's ``max_attempts``, after which they go to the failed state).

    The Spark master comes from the Spark connection alone (``local[*]``, ``spark://``, YARN,
    Kubernetes). For local masters the operator runs the job with this interpreter
    (``PYSPARK_PYTHON``) and binds Spark to 127.0.0.1 unless ``SPARK_LOCAL_IP`` is set.

    :param queue_name: the queue to take batches from.
    :param application: the PySpark file (or jar) to submit.
    :param application_args: arguments before the batch arguments (templated).
    :param max_messages: most messages in one batch.
    :param max_batches: most batches one task run processes (it stops early when the queue is empty).
    :param lease_timeout: seconds the batch stays claimed without a heartbeat.
    :param publish: ``(conn, batch)`` run inside the ack's transaction; raise to refuse the batch.
    :param discard: ``(conn, batch)`` run inside the release's transaction.
    :param release_delay: seconds before a released batch is ready again (None: the queue's backoff).
    :param if_empty: when no message is ready: ``"skip"`` (the task is skipped), ``"success"``, ``"fail"``.
    :param jdbc_jar: the JDBC driver jar for the job (default: ``$DBQUEUE_JDBC_JAR`` or Debian's).
    :param spark_conn_id: the Spark connection (master, deploy mode, ...).
    :param spark_conf: extra ``--conf`` settings (templated).
    :param spark_submit_kwargs: further ``SparkSubmitHook`` arguments (``driver_memory``, ``packages``...).
    :param env_vars: extra environment for the job.
    :param dbqueue_conn_id: the Airflow connection to the queue's database.
    :param dbqueue_schema: schema of the queue tables; overrides the connection extra.
    """

    template_fields: Sequence[str] = (
        "queue_name",
        "application",
        "application_args",
        "spark_conf",
        "max_messages",
        "max_batches",
    )
    ui_color = "#f0e4ec"

    def __init__(
        self,
        *,
        queue_name: str,
        application: str,
        application_args: Sequence[Any] | None = None,
        max_messages: int | str = 10_000,
        max_batches: int | str = 1,
        lease_timeout: float = 1800.0,
        publish: BatchCallback | None = None,
        discard: BatchCallback | None = None,
        release_delay: float | None = 0.0,
        if_empty: str = "skip",
        jdbc_jar: str | None = None,
        spark_conn_id: str = "spark_default",
        spark_conf: dict[str, Any] | None = None,
        spark_submit_kwargs: dict[str, Any] | None = None,
        env_vars: dict[str, str] | None = None,
        dbqueue_conn_id: str = DbQueueHook.default_conn_name,
        dbqueue_schema: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if if_empty not in ("skip", "success", "fail"):
            raise ValueError(
                f"{type(self).__name__}: if_empty must be 'skip', 'success' or 'fail', got {if_empty!r}"
            )
        if lease_timeout <= 0:
            raise ValueError(f"{type(self).__name__}: lease_timeout must be > 0, got {lease_timeout}")
        self.queue_name = queue_name
        self.application = application
        self.application_args = list(application_args or [])
        self.max_messages = max_messages
        self.max_batches = max_batches
        self.lease_timeout = lease_timeout
        self.publish = publish
        self.discard = discard
        self.release_delay = release_delay
        self.if_empty = if_empty
        self.jdbc_jar = jdbc_jar
        self.spark_conn_id = spark_conn_id
        self.spark_conf = dict(spark_conf or {})
        self.spark_submit_kwargs = dict(spark_submit_kwargs or {})
        self.env_vars = dict(env_vars or {})
        self.dbqueue_conn_id = dbqueue_conn_id
        self.dbqueue_schema = dbqueue_schema
        self._spark: SparkSubmitHook | None = None
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
        ti = context["ti"]
        consumer = f"{ti.dag_id}.{ti.task_id}.{ti.run_id}.{ti.map_index}.try{ti.try_number}"
        with DbQueueHook(self.dbqueue_conn_id, dbqueue_schema=self.dbqueue_schema) as hook:
            self._hook = hook
            try:
                done = self._process(hook, consumer, max_messages, max_batches)
            finally:
                self._hook = None
        if not done:
            self._on_empty()
        return {"queue": self.queue_name, "batches": done, "messages": sum(b["size"] for b in done)}

    def _process(
        self, hook: DbQueueHook, consumer: str, max_messages: int, max_batches: int
    ) -> list[dict[str, Any]]:
        """Claim, run, publish and ack up to ``max_batches`` batches; return their summaries."""
        done: list[dict[str, Any]] = []
        queue = hook.get_queue(self.queue_name)
        env = self._job_env(hook)
        jars = self._jars()
        for _ in range(max_batches):
            batch = queue.claim_batch(max_messages, visibility_timeout=self.lease_timeout, consumer=consumer)
            if batch is None:
                break
            self._batch = batch
            self.log.info(
                "claimed batch %s: %d message(s) of queue %r, lease until %s",
                batch.batch_id,
                batch.size,
                self.queue_name,
                batch.lease_until.isoformat(),
            )
            try:
                self._run_job(queue, batch, env, jars)
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
            done.append(queue.get_batch(batch.batch_id).as_dict())
        return done

    def _on_empty(self) -> None:
        msg = f"queue {self.queue_name!r} has no ready message to claim"
        if self.if_empty == "fail":
            raise SparkBatchError(msg)
        self.log.info(msg)
        if self.if_empty == "skip":
            raise AirflowSkipException(msg)

    def _jars(self) -> str | None:
        jar = self.jdbc_jar or find_jdbc_jar()
        extra = self.spark_submit_kwargs.get("jars")
        if jar is None and not extra and not self.spark_submit_kwargs.get("packages"):
            raise ConfigurationError(
                f"{self.task_id}: {JDBC_HINT}, or pass jdbc_jar= or "
                "spark_submit_kwargs={'packages': 'org.postgresql:postgresql:<version>'}"
            )
        if (
            jar is not None
            and not jar.startswith(("hdfs:", "s3a:", "gs:", "abfs:", "http"))
            and not Path(jar).is_file()
        ):
            raise ConfigurationError(f"{self.task_id}: the JDBC driver jar {jar!r} does not exist")
        return ",".join(j for j in (jar, extra) if j) or None

    def _job_env(self, hook: DbQueueHook) -> dict[str, str]:
        url, user, password = hook.jdbc()
        env = {"DBQUEUE_JDBC_URL": url, **self.env_vars}
        if user:
            env["DBQUEUE_JDBC_USER"] = user
        if password:
            env["DBQUEUE_JDBC_PASSWORD"] = password
        master = (BaseHook.get_connection(self.spark_conn_id).host or "").strip()
        if master.startswith("local"):
            # The job runs where we run: with this interpreter (it has pyspark), this PATH's
            # spark-submit, and Spark bound to loopback.
            env.setdefault("PYSPARK_PYTHON", sys.executable)
            here = str(Path(sys.executable).parent)
            if shutil.which("spark-submit") is None and (Path(here) / "spark-submit").exists():
                env.setdefault("PATH", f"{here}{os.pathsep}{os.environ.get('PATH', '')}")
            if "SPARK_LOCAL_IP" not in os.environ:
                env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        return env

    def _run_job(self, queue: Queue, batch: Batch, env: dict[str, str], jars: str | None) -> None:
        args = [
            *map(str, self.application_args),
            "--batch-id",
            batch.batch_id,
            "--batch-size",
            str(batch.size),
            "--batch-query",
            queue.batch_query(batch.batch_id),
        ]
        kwargs = {k: v for k, v in self.spark_submit_kwargs.items() if k != "jars"}
        kwargs.setdefault("name", f"dbqueue-{self.queue_name}-{batch.batch_id[:8]}")
        self._spark = spark = _SparkSubmit(
            conf=self.spark_conf,
            conn_id=self.spark_conn_id,
            jars=jars,
            application_args=args,
            env_vars=env,
            **kwargs,
        )
        stop = threading.Event()
        lost: list[BaseException] = []
        beat = threading.Thread(
            target=self._heartbeat, args=(queue, batch, stop, lost), name="dbqueue-lease", daemon=True
        )
        beat.start()
        try:
            # A session of its own: a kill reaches spark-submit's whole process group (the JVM and
            # the Python driver it starts), not only the process we started.
            spark.submit(self.application, start_new_session=True)
        except Exception as exc:
            why = " | ".join(spark.error_lines) or str(exc).splitlines()[-1][:500]
            raise SparkBatchError(
                f"batch {batch.batch_id} of queue {self.queue_name!r}: the Spark job failed: {why}"
            ) from exc
        finally:
            stop.set()
            proc = getattr(spark, "_submit_sp", None)
            if proc is not None and proc.poll() is None:  # interrupted: a timeout, a kill
                self._kill_job()
            beat.join()
            self._spark = None
        if lost:
            raise lost[0]

    def _heartbeat(
        self, queue: Queue, batch: Batch, stop: threading.Event, lost: list[BaseException]
    ) -> None:
        """Extend the batch's lease every third of ``lease_timeout`` until ``stop``; kill the job when
        the lease is lost (someone else may hold its messages now)."""
        while not stop.wait(self.lease_timeout / 3):
            try:
                until = queue.extend_batch(batch.batch_id, self.lease_timeout)
                self.log.debug("batch %s: lease extended to %s", batch.batch_id, until.isoformat())
            except LeaseExpiredError as exc:
                self.log.error("batch %s: lease lost while the job ran; stopping it: %s", batch.batch_id, exc)
                lost.append(exc)
                self._kill_job()
                return
            except DbQueueError as exc:  # a database hiccup: try again at the next beat
                self.log.warning("batch %s: could not extend the lease: %s", batch.batch_id, exc)

    def _kill_job(self) -> None:
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
            self._release(hook.get_queue(self.queue_name), batch, "task killed")
