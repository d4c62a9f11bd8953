"""A local Spark Connect server from the pyspark wheel: the embedded default of the Connect path.

The wheel ships Spark Connect (``jars/spark-connect_2.13-<version>.jar``) and ``spark-submit``, so a
server needs nothing but Java 17: :class:`LocalConnectServer` runs ``spark-submit --class
org.apache.spark.sql.connect.service.SparkConnectServer`` with PostgreSQL's JDBC driver on its class
path, listening on 127.0.0.1 on a free port, in a process group of its own, and stops that whole
group. It is a development and test default (no authentication, loopback only); a deployment runs
its own Connect server (docker-compose.yml has one) and names it in a ``spark_connect`` connection.

Standard library only (no Airflow, no pyspark import), like the rest of ``airflow_dbqueue.spark``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from airflow_dbqueue.engine.errors import ConfigurationError, DbQueueError
from airflow_dbqueue.spark import JDBC_HINT, find_jdbc_jar

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


class ConnectServerError(DbQueueError):
    """The local Spark Connect server did not start, or stopped."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spark_submit() -> Path:
    """``spark-submit`` of the installed pyspark wheel (the one whose jars hold Spark Connect)."""
    try:
        import pyspark  # only to find the wheel's folder; nothing of it runs here
    except ImportError:
        raise ConfigurationError(
            "pyspark is not installed: install the spark extra (pip install 'airflow-dbqueue[spark]')"
        ) from None
    home = Path(pyspark.__file__).parent
    exe = home / "bin" / "spark-submit"
    if not exe.exists() or not list((home / "jars").glob("spark-connect_*.jar")):
        raise ConfigurationError(
            f"the pyspark installation in {home} has no spark-submit or Spark Connect jar"
        )
    return exe


class LocalConnectServer:
    """A Spark Connect server on 127.0.0.1, started by :meth:`start` and stopped by :meth:`stop`.

    :param master: Spark master of the server's own application (``local[2]``: two task threads).
    :param driver_memory: heap of the server's JVM (the driver, which runs the tasks in local mode).
    :param jdbc_jar: PostgreSQL's JDBC driver (default: ``$DBQUEUE_JDBC_JAR`` or Debian's).
    :param conf: further Spark settings of the server.
    :param log_file: where the server's output goes (default: a file in a temporary folder).
    """

    def __init__(
        self,
        *,
        master: str = "local[2]",
        driver_memory: str = "1g",
        jdbc_jar: str | None = None,
        conf: dict[str, str] | None = None,
        log_file: Path | None = None,
    ) -> None:
        self.master = master
        self.driver_memory = driver_memory
        self.jdbc_jar = jdbc_jar
        self.conf = dict(conf or {})
        self.log_file = log_file
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The ``sc://`` URL clients connect to."""
        if self.port is None:
            raise ConnectServerError("the Spark Connect server is not started")
        return f"sc://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def command(self, port: int) -> list[str]:
        """The server's command line (it holds no credential: clients bring theirs per session)."""
        jar = self.jdbc_jar or find_jdbc_jar()
        if jar is None or not Path(jar).is_file():
            raise ConfigurationError(f"Spark Connect server: {JDBC_HINT}")
        conf = {
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(port),
            "spark.ui.enabled": "false",
            "spark.sql.session.timeZone": "UTC",
            "spark.sql.shuffle.partitions": "4",
            "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
            **self.conf,
        }
        cmd = [
            str(spark_submit()),
            "--class",
            SERVER_CLASS,
            "--name",
            "dbqueue Spark Connect",
            "--master",
            self.master,
            "--driver-memory",
            self.driver_memory,
            "--jars",
            jar,
        ]
        for key, value in conf.items():
            cmd += ["--conf", f"{key}={value}"]
        return cmd

    def start(self, timeout: float = 180.0) -> str:
        """Start the server and wait until it answers on its port; return its URL."""
        if self._proc is not None and self._proc.poll() is None:
            return self.url
        port = _free_port()
        cmd = self.command(port)
        if self.log_file is None:
            self.log_file = Path(tempfile.mkdtemp(prefix="dbqueue-spark-connect-")) / "server.log"
        env = dict(os.environ)
        # Python UDFs run in workers of this interpreter (it has pyspark); Spark binds to loopback.
        env.setdefault("PYSPARK_PYTHON", sys.executable)
        env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        with self.log_file.open("wb") as out:
            self._proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.port = port
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ConnectServerError(
                    f"the Spark Connect server exited with {self._proc.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                return self.url
            time.sleep(0.25)
        self.stop()
        raise ConnectServerError(f"the Spark Connect server did not listen within {timeout:.0f}s")

    def log_tail(self, n: int = 30) -> str:
        if self.log_file is None or not self.log_file.exists():
            return ""
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server and everything it started (its process group): SIGTERM, then SIGKILL."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def __enter__(self) -> LocalConnectServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
