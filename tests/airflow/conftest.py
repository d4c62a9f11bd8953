"""Fixtures for the Airflow face: a throwaway AIRFLOW_HOME, and Airflow connections to the test database.

AIRFLOW_HOME is set when this file is imported, before any test module imports Airflow, so the
in-process Airflow (hooks, operators, triggers) never touches a real home. Tests that run the
``airflow`` command get their own homes (see :func:`airflow_env`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import psycopg.conninfo
import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.embedded import free_ports
from airflow_dbqueue.spark import DEBIAN_JDBC_JAR, JDBC_JAR_ENV, find_jdbc_jar
from airflow_dbqueue.spark.connect_server import LocalConnectServer
from tests.helpers import require

_HOME = tempfile.mkdtemp(prefix="dbqueue-airflow-home-")
os.environ["AIRFLOW_HOME"] = _HOME
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"

REPO = Path(__file__).resolve().parents[2]
AIRFLOW = Path(sys.executable).with_name("airflow")
CONN_ID = "dbqueue_default"


def conn_json(pg_dsn: str, schema: str, **extra: Any) -> str:
    """An Airflow connection (JSON form) of type postgres for a libpq DSN, queues in ``schema``."""
    info = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    return json.dumps(
        {
            "conn_type": "postgres",
            "host": info.get("host", "127.0.0.1"),
            "port": int(info.get("port", 5432)),
            "login": info.get("user"),
            "password": info.get("password"),
            "schema": info.get("dbname"),
            "extra": {"dbqueue_schema": schema, **extra},
        }
    )


def find_java() -> str | None:
    """The Java runtime spark-submit would start: ``$JAVA_HOME/bin/java``, else ``java`` on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home:
        java = Path(home) / "bin" / "java"
        return str(java) if java.is_file() and os.access(java, os.X_OK) else None
    return shutil.which("java")


@pytest.fixture
def java_runtime() -> None:
    """Java, which spark-submit starts: a test without it skips, or fails under scripts/test, which
    installs it."""
    require(
        None if find_java() else "no Java runtime ($JAVA_HOME/bin/java, or java on PATH)",
        "apt-get install openjdk-17-jre-headless; scripts/test installs it",
    )


@pytest.fixture
def jdbc_driver() -> None:
    """PostgreSQL's JDBC driver, which the Spark operator hands every spark-submit (``--jars``): a test
    without it skips, or fails under scripts/test, which installs it."""
    jar = find_jdbc_jar()
    found = jar is not None and Path(jar).is_file()
    require(
        None if found else f"PostgreSQL's JDBC driver is missing ({jar or DEBIAN_JDBC_JAR})",
        f"apt-get install libpostgresql-jdbc-java, or set ${JDBC_JAR_ENV}; scripts/test installs it",
    )


@pytest.fixture
def spark_system(java_runtime: None, jdbc_driver: None) -> None:
    """Java and PostgreSQL's JDBC driver, which the pipeline's Spark job reads the queue through: a test
    without them skips, or fails under scripts/test, which installs both."""


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalConnectServer]:
    """One local Spark Connect server (``local[2]``, PostgreSQL's JDBC driver) for the whole test session:
    its JVM takes about 20 s to start, a session on it half a second. It writes an uncompressed Spark
    event log (every plan and statement it runs, as Spark records them) to ``event_log_dir``, where
    the credentials test looks for the password."""
    require(
        None if find_java() else "no Java runtime ($JAVA_HOME/bin/java, or java on PATH)",
        "apt-get install openjdk-17-jre-headless; scripts/test installs it",
    )
    jar = find_jdbc_jar()
    missing = f"PostgreSQL's JDBC driver is missing ({jar or DEBIAN_JDBC_JAR})"
    require(
        None if jar and Path(jar).is_file() else missing,
        f"apt-get install libpostgresql-jdbc-java, or set ${JDBC_JAR_ENV}; scripts/test installs it",
    )
    root = tmp_path_factory.mktemp("spark-connect")
    (root / "events").mkdir()
    server = LocalConnectServer(
        log_file=root / "server.log",
        conf={
            "spark.eventLog.enabled": "true",
            "spark.eventLog.dir": str(root / "events"),
            "spark.eventLog.compress": "false",
        },
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def event_log_text(server: LocalConnectServer) -> str:
    """Everything the Connect server's event log holds so far."""
    assert server.log_file is not None
    files = (server.log_file.parent / "events").rglob("events_*")
    return "\n".join(p.read_text(errors="replace") for p in files)


def trigger_is_waiting(dsn: str) -> bool:
    """Whether a DbQueueTrigger's checking connection sits idle after a readiness check (so it waits).

    A check's last statement is the readiness query (``head_deliveries``) on every design (on an empty
    ring of the slots layout the same statement also tells an empty ring from a dropped one).
    """
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT count(*) FROM pg_stat_activity a WHERE a.application_name = %(app)s "
            "AND a.state = 'idle' "
            "AND a.query LIKE '%%head_deliveries%%'",
            {"app": "airflow-dbqueue-trigger"},
        ).fetchone()
    return bool(row and row[0])


def trigger_is_listening(dsn: str) -> bool:
    """Whether a DbQueueTrigger's listening connection (on the server itself, also when its checks go
    through a transaction pooler) has LISTENed and sits idle: its last statement its LISTEN or the
    queue's waiters' lock it takes after it."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND state = 'idle' "
            "AND (query LIKE %s OR query LIKE %s)",
            ("airflow-dbqueue-trigger-listen", "LISTEN%", "%hashtext('dbqueue.waiters.%"),
        ).fetchone()
    return bool(row and row[0])


@pytest.fixture(scope="session", autouse=True)
def _airflow_home() -> Iterator[str]:
    yield _HOME
    shutil.rmtree(_HOME, ignore_errors=True)


@pytest.fixture
def airflow_conn(pg_dsn: str, dbq: DbQueue, monkeypatch: pytest.MonkeyPatch) -> str:
    """``dbqueue_default``: an Airflow postgres connection to the test database, on ``dbq``'s schema."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", conn_json(pg_dsn, dbq.schema))
    return CONN_ID


def migrated_airflow_env(home: Path, dags_folder: Path, **extra: str) -> dict[str, str]:
    """Environment of a throwaway AIRFLOW_HOME (SQLite, migrated: a copy of the database that
    :func:`migrated_template` migrated under the same settings) with DAGs from ``dags_folder``.

    The scheduler (LocalExecutor) and the triggerer each serve their logs over HTTP, by default on the
    fixed ports 8793 and 8794: each environment gets free ports of its own, so that deployments of
    tests running at the same time (pytest-xdist workers) never take each other's."""
    worker_logs, trigger_logs = free_ports(2)
    env = dict(
        os.environ,
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGS_FOLDER=str(dags_folder),
        AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",
        AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=str(worker_logs),
        AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT=str(trigger_logs),
        **extra,
    )
    home.mkdir(parents=True, exist_ok=True)
    copy_sqlite(migrated_template(env), home / "airflow.db")
    return env


MIGRATION_EXEMPT = (
    "AIRFLOW_HOME",
    "AIRFLOW__CORE__DAGS_FOLDER",
    "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION",
    "AIRFLOW__CORE__EXECUTOR",
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS",
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE",
    "AIRFLOW__API_AUTH__JWT_SECRET",
    "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT",
    "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT",
)
"""Settings of an environment that ``airflow db migrate`` does not read (where DAGs and logs live, the
executor, the API's address, secret and users): environments that differ only in these are migrated
alike. Any other ``AIRFLOW__`` setting (the auth manager, whose database manager the migration runs;
the external database managers; the log template it records) gets a migration of its own."""

_TEMPLATES: dict[tuple[tuple[str, str], ...], Path] = {}
"""Migrated SQLite databases of this process, by :func:`migrated_template`'s key."""


def migrated_template(env: dict[str, str]) -> Path:
    """The ``airflow.db`` of a throwaway AIRFLOW_HOME that ``airflow db migrate`` made under ``env``'s
    settings, once a process (under ``$AIRFLOW_HOME``, removed at the session's end) for each set of
    the settings the migration reads (see :data:`MIGRATION_EXEMPT`)."""
    key = tuple(
        sorted((k, v) for k, v in env.items() if k.startswith("AIRFLOW__") and k not in MIGRATION_EXEMPT)
    )
    template = _TEMPLATES.get(key)
    if template is None:
        home = Path(tempfile.mkdtemp(prefix="migrated-", dir=_HOME))
        subprocess.run(
            [str(AIRFLOW), "db", "migrate"],
            env={**env, "AIRFLOW_HOME": str(home)},
            check=True,
            capture_output=True,
            timeout=300,
        )
        template = _TEMPLATES[key] = home / "airflow.db"
    return template


def copy_sqlite(source: Path, target: Path) -> None:
    """Copy the SQLite database ``source`` to ``target`` (SQLite's online backup: whole and consistent)."""
    with (
        contextlib.closing(sqlite3.connect(source)) as src,
        contextlib.closing(sqlite3.connect(target)) as to,
    ):
        src.backup(to)


def spark_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus what the Spark tasks need: a local[*] spark_default and this venv's spark-submit."""
    return dict(
        env,
        AIRFLOW_CONN_SPARK_DEFAULT=json.dumps({"conn_type": "spark", "host": "local[*]"}),
        SPARK_LOCAL_IP="127.0.0.1",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )


def connect_env(env: dict[str, str], server: LocalConnectServer) -> dict[str, str]:
    """``spark_env(env)`` with ``spark_default`` naming the Spark Connect ``server`` instead (the
    operator then runs each batch as a job of a session there)."""
    assert server.port is not None
    conn = {"conn_type": "spark_connect", "host": "sc://127.0.0.1", "port": server.port}
    return dict(spark_env(env), AIRFLOW_CONN_SPARK_DEFAULT=json.dumps(conn))


def dags_test(
    env: dict[str, str],
    pg_dsn: str,
    schema: str,
    dag_id: str,
    conf: dict[str, Any] | None = None,
    *,
    command: list[str] | None = None,
    **extra: str,
) -> tuple[bool, str]:
    """Run ``airflow dags test`` with ``dbqueue_default`` on ``schema``; return (succeeded, output).

    ``command`` replaces the ``airflow`` command line (the ``dbqueue pipeline`` demo's, for one);
    ``extra`` adds environment variables, and may replace ``dbqueue_default`` itself."""
    run_env = {**env, f"AIRFLOW_CONN_{CONN_ID.upper()}": conn_json(pg_dsn, schema), **extra}
    proc = subprocess.run(
        command or [str(AIRFLOW), "dags", "test", dag_id, "-c", json.dumps(conf or {})],
        env=run_env,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    return proc.returncode == 0 and "state=success" in out, out


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment of a migrated throwaway AIRFLOW_HOME (SQLite) whose DAGs folder is the repo's dags/."""
    return migrated_airflow_env(tmp_path_factory.mktemp("airflow-home"), REPO / "dags")


def deployment_env(home: Path, dags_folder: Path) -> dict[str, str]:
    """A migrated AIRFLOW_HOME for Airflow as separate processes (see :func:`deployment`): LocalExecutor,
    and the execution API of an api-server on a free local port, with a JWT secret they share."""
    [port] = free_ports(1)
    return migrated_airflow_env(
        home,
        dags_folder,
        AIRFLOW__CORE__EXECUTOR="LocalExecutor",
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
        AIRFLOW__API_AUTH__JWT_SECRET="test-only-jwt-secret",
        DBQUEUE_TEST_API_PORT=str(port),
    )


@contextlib.contextmanager
def deployment(env: dict[str, str], logs: Path, *components: str) -> Iterator[None]:
    """Run Airflow's ``components`` (``api-server``: its execution API only; ``scheduler``,
    ``triggerer``...) as separate processes with ``env``, each logging to ``logs/<name>.log``; stop
    them and everything they started at the end."""
    procs: list[tuple[subprocess.Popen[bytes], Any]] = []
    try:
        for name in components:
            args = [name]
            if name == "api-server":
                args += ["--apps", "execution", "-H", "127.0.0.1", "-p", env["DBQUEUE_TEST_API_PORT"]]
            out = (logs / f"{name}.log").open("w")
            procs.append(
                (
                    subprocess.Popen(
                        [str(AIRFLOW), *args],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    ),
                    out,
                )
            )
        yield
    finally:
        for proc, out in reversed(procs):
            stop_process_group(proc)
            out.close()


def stop_process_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started in a session of its own, and everything it started."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def log_tails(logs: Path) -> str:
    """The last lines of each log in ``logs``, for a failure message."""
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.iterdir()))
