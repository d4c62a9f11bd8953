"""Pop-and-process on Spark: claim a batch, run its job (with ``spark-submit``, or in a session on a Spark
Connect server), ack it when its results are safe."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook, BaseOperator
from airflow.sdk.exceptions import AirflowSkipException

from airflow_dbqueue.engine import Batch, BatchStateError, ConfigurationError, DbQueueError, LeaseExpiredError
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.spark import JDBC_HINT, find_jdbc_jar

# SparkSubmitHook is imported where spark-submit is used: its module imports the Kubernetes clients
# when the cncf.kubernetes provider is installed (about a second), which every task process that
# parses a DAG with this operator would pay, a task on Spark Connect included.
if TYPE_CHECKING:
    import psycopg
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
    from airflow.sdk import Context

    from airflow_dbqueue.engine import Queue

BatchCallback = Callable[["psycopg.Connection[Any]", Batch], None]

# Lines of a job's output that say why it failed: our jobs' "REJECTED" verdicts, Python exceptions.
_JOB_ERROR = re.compile(r"REJECTED|^\s*(?:[\w.]+\.)?\w*(?:Error|Exception)\b:?")

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


def connect_session_id(consumer: str) -> str:
    """The id of the Spark Connect session in which the try ``consumer`` (the consumer name it claims
    under) runs its batches. It follows from the consumer name, which every batch records, so a later
    try can reach the session of a try that was killed, and stop what still runs there."""
    return str(uuid.uuid5(_SESSION_NAMESPACE, consumer))


def batch_tag(batch_id: str) -> str:
    """The tag of the Spark Connect operations that run the job of batch ``batch_id``."""
    return f"dbqueue-batch-{batch_id}"


def _refuse_early_return(task_id: str, kwargs: Mapping[str, Any], conf: object) -> None:
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


def _as_list(task_id: str, name: str, value: object) -> list[str]:
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


def _as_conf(task_id: str, value: object) -> dict[str, str]:
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


@dataclasses.dataclass(frozen=True)
class _JobSetup:
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


class DbQueueSparkSubmitOperator(BaseOperator):  # type: ignore[misc]
    """Claim a batch from a queue, run a Spark application on it, and ack it once its results are safe.

    For each batch (up to ``max_batches`` per task run):

    1. claim up to ``max_messages`` ready messages under one lease and a batch id (no payload leaves the
       database; nothing of the batch goes through XCom);
    2. run ``spark-submit`` through the Spark provider's ``SparkSubmitHook`` with ``application`` and
       ``application_args`` followed by ``--batch-id ID --batch-size N --batch-query SQL``: the job
       reads the batch's ``ord, id, delivery, payload`` rows with Spark's JDBC source (partitioned on
       ``ord``), connecting with ``$DBQUEUE_JDBC_URL``, ``$DBQUEUE_JDBC_USER`` and the password (see
       below). While it runs, the batch's lease is extended every third of ``lease_timeout``;
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
    :param application: the PySpark file (or jar) to submit; on Spark Connect, a Python file that
        defines ``batch_job(spark, argv, jdbc)``.
    :param application_args: arguments before the batch arguments (templated): a list, an ``XComArg``
        of a list, or a template that renders one (JSON, or the Python literal Jinja prints).
    :param max_messages: most messages in one batch.
    :param max_batches: most batches one task run processes (it stops early when the queue is empty).
    :param lease_timeout: seconds the batch stays claimed without a heartbeat.
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
        "application",
        "application_args",
        "spark_conf",
        "env_vars",
        "jdbc_password_file",
        "max_messages",
        "max_batches",
    )
    ui_color = "#f0e4ec"

    def __init__(
        self,
        *,
        queue_name: str,
        application: str,
        application_args: Any = None,
        max_messages: int | str = 10_000,
        max_batches: int | str = 1,
        lease_timeout: float = 1800.0,
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
        super().__init__(**kwargs)
        if if_empty not in ("skip", "success", "fail"):
            raise ValueError(
                f"{type(self).__name__}: if_empty must be 'skip', 'success' or 'fail', got {if_empty!r}"
            )
        if lease_timeout <= 0:
            raise ValueError(f"{type(self).__name__}: lease_timeout must be > 0, got {lease_timeout}")
        # Templated fields are kept as given (a Jinja string, an XComArg, a list) and read in execute,
        # once Airflow has rendered them.
        self.queue_name = queue_name
        self.application = application
        self.application_args = application_args
        self.max_messages = max_messages
        self.max_batches = max_batches
        self.lease_timeout = lease_timeout
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
        _refuse_early_return(self.task_id, self.spark_submit_kwargs, spark_conf)
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
        _refuse_early_return(self.task_id, self.spark_submit_kwargs, _as_conf(self.task_id, self.spark_conf))
        _as_list(self.task_id, "application_args", self.application_args)
        ti = context["ti"]
        tries = f"{ti.dag_id}.{ti.task_id}.{ti.run_id}.{ti.map_index}.try"  # every try of this instance
        consumer = f"{tries}{ti.try_number}"
        with DbQueueHook(self.dbqueue_conn_id, dbqueue_schema=self.dbqueue_schema) as hook:
            self._hook = hook
            try:
                queue = hook.get_queue(self.queue_name)
                self._release_earlier_tries(queue, tries, consumer)
                done = self._process(hook, consumer, max_messages, max_batches)
                self._check_nothing_left(queue, tries)
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
        if self._on_connect():
            setup = self._connect_setup(hook, consumer)
        else:
            env, password = self._job_env(hook)
            jars = self._jars()
            master, cluster = self._spark_target(password)
            setup = _JobSetup(env, password, jars, master, cluster)
        try:
            for _ in range(max_batches):
                batch = queue.claim_batch(
                    max_messages, visibility_timeout=self.lease_timeout, consumer=consumer
                )
                if batch is None:
                    break
                self._process_batch(hook, queue, batch, setup)
                done.append(queue.get_batch(batch.batch_id).as_dict())
        finally:
            self._close_connect_session()
        return done

    def _process_batch(self, hook: DbQueueHook, queue: Queue, batch: Batch, setup: _JobSetup) -> None:
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
                stopped = _stop_local_jobs(batch.batch_id)
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

    def _job_env(self, hook: DbQueueHook) -> tuple[dict[str, str], str | None]:
        """Return the job's environment without the password, and the password (None: none, or
        ``jdbc_password_file`` names where the driver finds it)."""
        url, user, password = hook.jdbc()
        extra = self.env_vars if self.env_vars is not None else {}
        if isinstance(extra, str):
            with contextlib.suppress(ValueError):
                extra = json.loads(extra)
        if not isinstance(extra, Mapping):
            raise ConfigurationError(
                f"{self.task_id}: env_vars must be a mapping of variable names to values"
            )
        for reserved in (JDBC_PASSWORD_ENV, JDBC_PASSWORD_FILE_ENV):
            if reserved in extra:
                raise ConfigurationError(
                    f"{self.task_id}: env_vars must not set {reserved}: the operator delivers the password "
                    "from the queue's connection (jdbc_password_file= names a file for cluster mode)"
                )
        env = {"DBQUEUE_JDBC_URL": url, **{str(k): str(v) for k, v in extra.items()}}
        if user:
            env["DBQUEUE_JDBC_USER"] = user
        if self.jdbc_password_file:
            env[JDBC_PASSWORD_FILE_ENV] = str(self.jdbc_password_file)
            password = None
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
        return env, password or None

    def _spark_target(self, password: str | None) -> tuple[str, bool]:
        """Return the master and whether the driver runs on the cluster, as the Spark provider resolves
        them; refuse, before anything is claimed, a password that cannot reach such a driver."""
        from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

        kwargs = {k: v for k, v in self.spark_submit_kwargs.items() if k in ("deploy_mode", "spark_binary")}
        target = SparkSubmitHook(conn_id=self.spark_conn_id, **kwargs)._connection
        master, cluster = str(target["master"]), target.get("deploy_mode") == "cluster"
        if cluster and password:
            raise ConfigurationError(
                f"{self.task_id}: the Spark connection {self.spark_conn_id!r} runs the driver on the cluster "
                f"({master}, deploy mode cluster), where spark-submit's environment does not reach it, and "
                "the JDBC password is never put on spark-submit's command line: set jdbc_password_file to "
                "a file holding it that the driver can read (for example a Kubernetes secret mounted with "
                "spark.kubernetes.driver.secrets.*, or a file on the YARN nodes), or use client mode"
            )
        return master, cluster

    def _submit_hook(
        self, batch: Batch, setup: _JobSetup, query: str
    ) -> tuple[SparkSubmitHook, dict[str, str]]:
        """Return the ``SparkSubmitHook`` for a batch and the environment of the spark-submit process.

        In client mode the driver is a child of spark-submit and inherits that environment, the
        password included. The hook's ``env_vars`` become ``--conf`` settings on YARN and Kubernetes, so
        they are used only where a cluster-mode driver needs them that way, and never hold a secret.
        """
        args = [
            *_as_list(self.task_id, "application_args", self.application_args),
            "--batch-id",
            batch.batch_id,
            "--batch-size",
            str(batch.size),
            "--batch-query",
            query,
        ]
        kwargs = {k: v for k, v in self.spark_submit_kwargs.items() if k != "jars"}
        kwargs.setdefault("name", f"dbqueue-{self.queue_name}-{batch.batch_id[:8]}")
        master, cluster, env = setup.master, setup.cluster, setup.env
        # A Spark Connect session made earlier in this process (pyspark marks the process with
        # SPARK_CONNECT_MODE_ENABLED) must not turn the spark-submit job into a Connect client.
        inherited = {
            k: v for k, v in os.environ.items() if k not in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE")
        }
        process_env = {**inherited, **env}
        if setup.password and not cluster:
            process_env[JDBC_PASSWORD_ENV] = setup.password
        from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

        spark = SparkSubmitHook(
            conf=_as_conf(self.task_id, self.spark_conf),
            conn_id=self.spark_conn_id,
            jars=setup.jars,
            application_args=args,
            # On YARN and Kubernetes a cluster-mode driver gets its variables as Spark settings. The
            # provider takes no env_vars in standalone cluster mode: there they stay in
            # spark-submit's environment.
            env_vars=env if cluster and ("yarn" in master or "k8s" in master) else None,
            **kwargs,
        )
        return spark, process_env

    # -- the Spark Connect path ---------------------------------------------------------------------

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

    def _connect_setup(self, hook: DbQueueHook, consumer: str) -> _JobSetup:
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
        setup = _JobSetup(
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
        module = _load_job(self.task_id, self.application)
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

    def _task_session(self, setup: _JobSetup) -> Any:
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
                for key, value in _as_conf(self.task_id, self.spark_conf).items():
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

    def _run_connect_job(self, queue: Queue, batch: Batch, setup: _JobSetup) -> None:
        """Run the job of ``batch`` in the task run's session on the Connect server, its operations
        tagged with the batch's tag; the lease heartbeat runs meanwhile, and a lost lease, a timeout
        or a kill interrupts the operations of that tag."""
        job = self._connect_job()
        argv = [
            *_as_list(self.task_id, "application_args", self.application_args),
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
                f"server of {self.spark_conn_id!r}: {_why(exc)}"
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
                f"{type(exc).__name__}: {_why(exc)}"
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
            self.log.info("batch %s: no Spark Connect session of it to stop (%s)", batch.batch_id, _why(exc))
            return 0
        return 1

    def _run_job(self, queue: Queue, batch: Batch, setup: _JobSetup) -> None:
        spark, process_env = self._submit_hook(batch, setup, queue.batch_query(batch.batch_id))
        self._spark = spark
        stop = threading.Event()
        lost: list[BaseException] = []
        beat = threading.Thread(
            target=self._heartbeat, args=(queue, batch, stop, lost), name="dbqueue-lease", daemon=True
        )
        beat.start()
        try:
            # A session of its own: a kill reaches spark-submit's whole process group (the JVM and
            # the Python driver it starts), not only the process we started.
            spark.submit(self.application, start_new_session=True, env=process_env)
            if spark._should_track_driver_status:
                # Standalone cluster mode: spark-submit has returned once the driver was submitted;
                # follow it with the provider's own status tracking until it has ended.
                spark._start_driver_status_tracking()
                if spark._driver_status != "FINISHED":
                    raise SparkBatchError(
                        f"batch {batch.batch_id} of queue {self.queue_name!r}: the Spark driver "
                        f"{spark._driver_id} ended in state {spark._driver_status}"
                    )
        except SparkBatchError:
            raise
        except Exception as exc:
            raise SparkBatchError(
                f"batch {batch.batch_id} of queue {self.queue_name!r}: the Spark job failed: {_why(exc)}"
            ) from exc
        finally:
            stop.set()
            proc = getattr(spark, "_submit_sp", None)
            running = proc is not None and proc.poll() is None
            driver_open = (
                spark._should_track_driver_status
                and spark._driver_id is not None
                and spark._driver_status not in _DRIVER_ENDED
            )
            if running or driver_open:  # interrupted: a timeout, a kill, a lost lease
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
            self._release(hook.get_queue(self.queue_name), batch, "task killed")


_MAX_OPEN_BATCHES = 1000
"""The most batches of one task instance looked at (a task claims max_batches at most per try)."""


def _stop_local_jobs(batch_id: str) -> int:
    """SIGKILL the processes on this machine whose command line carries ``--batch-id batch_id`` (the
    spark-submit and local driver of a killed try's job, with their process groups when they lead
    one); return how many were found. Only Linux's /proc is read; elsewhere nothing is stopped."""
    found = 0
    proc = Path("/proc")
    if not proc.is_dir():
        return 0
    own_group = os.getpgrp()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if not any(a == b"--batch-id" and b == batch_id.encode() for a, b in itertools.pairwise(argv)):
            continue
        pid = int(entry.name)
        found += 1
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(pid)
            if group == pid and group != own_group:
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    return found


def _load_job(task_id: str, path: str) -> ModuleType:
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


# Standalone driver states after which the driver is no longer running.
_DRIVER_ENDED = frozenset({"FINISHED", "KILLED", "FAILED", "ERROR"})


def _why(exc: BaseException) -> str:
    """What a failed submit says about its cause: the job's error lines from the tail of spark-submit's
    output that the provider's exception quotes, else its last line."""
    lines = str(exc).splitlines()
    errors = [line.strip()[:500] for line in lines if _JOB_ERROR.search(line)]
    if errors:
        return " | ".join(errors[-6:])
    return (lines[-1] if lines else type(exc).__name__)[:500]
