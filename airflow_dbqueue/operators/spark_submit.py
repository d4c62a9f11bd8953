"""The spark-submit path of :class:`~airflow_dbqueue.operators.spark.DbQueueSparkSubmitOperator`: the job's
environment and jars, where its driver runs, the ``SparkSubmitHook`` of a batch, and the processes of a
killed try found again on this machine.

``SparkSubmitHook`` is imported where spark-submit is used: its module imports the Kubernetes clients
when the cncf.kubernetes provider is installed (about a second), which every task process that parses
a DAG with the operator would pay, a task on Spark Connect included.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from airflow.sdk import BaseHook

from airflow_dbqueue.engine import Batch, ConfigurationError
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.operators.spark_setup import (
    JDBC_PASSWORD_ENV,
    JDBC_PASSWORD_FILE_ENV,
    JobSetup,
    PathState,
    SparkBatchError,
    as_conf,
    as_list,
    why,
)
from airflow_dbqueue.spark import JDBC_HINT, find_jdbc_jar

if TYPE_CHECKING:
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from airflow_dbqueue.engine import Queue

# Standalone driver states after which the driver is no longer running.
_DRIVER_ENDED = frozenset({"FINISHED", "KILLED", "FAILED", "ERROR"})


def stop_local_jobs(batch_id: str) -> int:
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


class SubmitPath(PathState):
    """The spark-submit path, a mixin of :class:`~airflow_dbqueue.operators.spark.DbQueueSparkSubmitOperator`
    (whose parameters and job state it reads)."""

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
        self, batch: Batch, setup: JobSetup, query: str
    ) -> tuple[SparkSubmitHook, dict[str, str]]:
        """Return the ``SparkSubmitHook`` for a batch and the environment of the spark-submit process.

        In client mode the driver is a child of spark-submit and inherits that environment, the
        password included. The hook's ``env_vars`` become ``--conf`` settings on YARN and Kubernetes, so
        they are used only where a cluster-mode driver needs them that way, and never hold a secret.
        """
        args = [
            *as_list(self.task_id, "application_args", self.application_args),
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
            conf=as_conf(self.task_id, self.spark_conf),
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

    def _run_job(self, queue: Queue, batch: Batch, setup: JobSetup) -> None:
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
                f"batch {batch.batch_id} of queue {self.queue_name!r}: the Spark job failed: {why(exc)}"
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
