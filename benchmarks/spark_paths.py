"""The two Spark paths of the pipeline side by side: a batch on Spark Connect, a batch with spark-submit.

For each path it pushes ``--messages`` sample orders into a queue of its own, then takes batches of up
to ``--batch`` one after the other exactly as ``DbQueueSparkSubmitOperator`` does, without Airflow
around it: claim the batch, run the ``order_rollup`` job on it (``batch_job`` in a new session of a
local Spark Connect server whose id is the batch id, or ``spark-submit`` of ``order_rollup.py`` in
``local[*]``), then publish the staged rollup and ack the batch in one transaction (release it on any
failure). It measures each batch from claim to ack, and checks at the end that the results hold every
pushed order exactly once (orders, units and EUR amount) and the queue is drained. Each batch's time is
also split into its claim, its job (the JDBC read, the Spark work and the staging writes) and its
publish-and-ack transaction (``claim_p50_s``, ``job_p50_s``, ``publish_ack_p50_s``).

With ``--designs table,ring`` each path runs once a queue design, one after the other in the same run
(on Connect, on the same server): the table design, and a ring of as many slots as orders (every
order is pushed before the first claim), whose batches are its default group's, read by the ring's
batch query. The batch read is also measured alone: after each claim, outside the batch's time, the
batch query run from Python (psycopg, every row fetched: ``read_psql_p50_s``) and, on Connect, the
job's own partitioned JDBC read of the batch with its payload bytes summed in Spark
(``read_jdbc_p50_s``).

    .venv/bin/python benchmarks/spark_paths.py                        # 20,000 orders, batches of 5,000
    .venv/bin/python benchmarks/spark_paths.py --messages 200000 --batch 20000 --paths connect
    .venv/bin/python benchmarks/spark_paths.py --paths connect --designs table,ring  # both designs
    .venv/bin/python benchmarks/spark_paths.py --json
    .venv/bin/python benchmarks/spark_paths.py --paths connect --events 10  # and push to results

With ``--events N`` it then measures, on each path, the time from a push to its results published
through Airflow: an ``AIRFLOW_HOME`` of its own (SQLite, LocalExecutor) with the api-server (execution
API), the triggerer and the scheduler as separate processes, and the event-driven DAG
``benchmarks/dags/dbqueue_bench_order_events.py`` (an ``AssetWatcher`` on the queue; a run of one
``DbQueueSparkSubmitOperator`` task). It pushes ``--batch`` orders N times, each once the run of the
previous push has ended, and takes from the database's clock the time from just before the push to
the commit that published its last batch (``published_at``). On Connect the server is the one the
batches above ran on, warm by then.

The Connect server is started once per run (its start is reported apart, not in any batch) with
``local[2]`` and 1 GiB, as ``scripts/demo`` starts it; the first batch on it warms it up, and the
``warm p50`` leaves that batch out. Exit status: 0 when every path's check passed, 1 when one did not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import psycopg.conninfo

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.embedded import EmbeddedPostgres, free_ports
from airflow_dbqueue.spark import ORDER_ROLLUP_JOB, find_jdbc_jar, jdbc_options
from airflow_dbqueue.spark.connect_server import LocalConnectServer, spark_submit
from airflow_dbqueue.spark.orders import OrderRollup, expected_totals, sample_orders

PATHS = ("connect", "submit")
DESIGNS = ("table", "ring")
EVENTS_DAGS = Path(__file__).with_name("dags")
EVENTS_DAG_ID = "dbqueue_bench_order_events"
AIRFLOW = Path(sys.executable).with_name("airflow")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Submit:
    """A batch's job as one spark-submit of order_rollup.py in local[*], the password in its environment."""

    def __init__(self, jdbc: dict[str, str]) -> None:
        jar = find_jdbc_jar()
        assert jar is not None, "no PostgreSQL JDBC driver"
        self.cmd = [
            str(spark_submit()),
            "--master",
            "local[*]",
            "--driver-memory",
            "1g",
            "--jars",
            jar,
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.sql.shuffle.partitions=4",
            "--conf",
            "spark.driver.extraJavaOptions=-Duser.timezone=UTC",
            ORDER_ROLLUP_JOB,
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE")}
        env.update(DBQUEUE_JDBC_URL=jdbc["url"], PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
        if "user" in jdbc:
            env["DBQUEUE_JDBC_USER"] = jdbc["user"]
        if "password" in jdbc:
            env["DBQUEUE_JDBC_PASSWORD"] = jdbc["password"]
        self.env = env

    def run(self, argv: list[str], batch_id: str) -> None:
        proc = subprocess.run([*self.cmd, *argv], env=self.env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(
                f"spark-submit of batch {batch_id} exited {proc.returncode}: {proc.stderr[-2000:]}"
            )


class _Connect:
    """A batch's job as ``batch_job`` in a Connect session, one session for every batch of the run, as
    the operator keeps one for every batch of a task run (the server compiles a plan's code once per
    session); the made-up warm-up batches run in a session of their own, as a demo's warm-up does."""

    def __init__(self, url: str, jdbc: dict[str, str]) -> None:
        from airflow_dbqueue.spark import order_rollup

        self.url, self.jdbc, self.job = url, jdbc, order_rollup.batch_job
        self._session: Any = None

    def session(self) -> Any:
        from pyspark.sql import SparkSession

        return SparkSession.builder.remote(f"{self.url}/;session_id={uuid.uuid4()}").create()

    def run(self, argv: list[str], batch_id: str) -> None:
        if self._session is None:
            self._session = self.session()
        self.job(self._session, argv, self.jdbc)

    def close(self) -> None:
        if self._session is not None:
            self._session.stop()
            self._session = None

    def read(self, query: str, size: int) -> float:
        """Seconds the job's JDBC read of a batch takes in this run's session (its partitions, as the job
        reads them), every payload fetched: their bytes summed in Spark."""
        import argparse as _argparse

        from pyspark.sql import functions as F

        from airflow_dbqueue.spark import order_rollup

        if self._session is None:
            self._session = self.session()
        args = _argparse.Namespace(batch_query=query, batch_size=size, partitions=2)
        jdbc = {**self.jdbc, "driver": "org.postgresql.Driver"}
        t0 = time.monotonic()
        order_rollup.read_batch(self._session, jdbc, args).agg(F.sum(F.length("payload"))).collect()
        return time.monotonic() - t0

    def warm_up(self, results: OrderRollup, dsn: str, rounds: int, size: int) -> list[float]:
        """The server's warm-up: ``rounds`` made-up batches of ``size`` through the job."""
        session = self.session()
        try:
            with psycopg.connect(dsn) as conn:
                return results.warm_up(session, self.jdbc, conn, rounds=rounds, size=size)
        finally:
            session.stop()


def _read_psql(dsn: str, query: str) -> float:
    """Seconds the batch query takes from Python: run as text, every row fetched."""
    with psycopg.connect(dsn, autocommit=True) as c:
        t0 = time.monotonic()
        c.execute(query.encode()).fetchall()
        return time.monotonic() - t0


def run_path(  # noqa: PLR0915
    path: str,
    dsn: str,
    messages: int,
    batch: int,
    connect_url: str | None,
    *,
    warm_up: int = 0,
    design: str = "table",
    measure_reads: bool = False,
) -> dict[str, Any]:
    """Push, then claim, run and publish-and-ack batch after batch; return what was measured.

    Long on purpose: one path measured in order (set up, push, batches, check), sharing its timings.
    """
    schema, results = f"bench_spark_{path}", OrderRollup(f"bench_results_{path}")
    ring = design == "ring"
    orders = list(sample_orders(messages, seed=17))
    jdbc = jdbc_options(dsn)
    runner: _Connect | _Submit = _Connect(connect_url, jdbc) if connect_url is not None else _Submit(jdbc)
    with DbQueue(dsn, schema=schema, pool_size=2) as dbq:
        dbq.uninstall()
        dbq.install()
        ring_options = {"design": "ring", "layout": "slots", "capacity": max(messages, 16)}
        q = dbq.create_queue("orders", **(ring_options if ring else {}))
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{results.schema}" CASCADE')
            results.install(c)
        t0 = time.monotonic()
        for i in range(0, messages, 10_000):
            q.push_batch(orders[i : i + 10_000])
        push_s = time.monotonic() - t0
        _say(f"{path}: {messages:,} pushed in {push_s:.1f}s")
        warm_s: list[float] = []
        if isinstance(runner, _Connect) and warm_up:
            warm_s = runner.warm_up(results, dsn, warm_up, batch)
            _say(f"{path}: server warmed up with {warm_up} made-up batch(es) of {batch:,}: {_secs(warm_s)}")
        per_batch: list[float] = []
        claims: list[float] = []  # the claim's part of each batch
        jobs: list[float] = []  # the job's (its JDBC read, its Spark work and its staging writes)
        acks: list[float] = []  # publish and ack, one transaction
        reads_psql: list[float] = []
        reads_jdbc: list[float] = []
        failed = 0
        t_first = time.monotonic()
        aside = 0.0  # the reads measured alone, left out of every time below
        while True:
            t0 = time.monotonic()
            b = q.claim_batch(batch, visibility_timeout=600, consumer=f"bench.{path}")
            if b is None:
                break
            t_claimed = time.monotonic()
            if measure_reads:
                t_aside = time.monotonic()
                reads_psql.append(_read_psql(dsn, q.batch_query(b.batch_id)))
                if isinstance(runner, _Connect):
                    reads_jdbc.append(runner.read(q.batch_query(b.batch_id), b.size))
                t_aside = time.monotonic() - t_aside
                aside += t_aside
                t0 += t_aside
                t_claimed += t_aside
            argv = [
                "--results-schema",
                results.schema,
                "--batch-id",
                b.batch_id,
                "--batch-size",
                str(b.size),
                "--batch-query",
                q.batch_query(b.batch_id),
            ]
            try:
                runner.run(argv, b.batch_id)
                t_job = time.monotonic()
                with dbq.transaction() as conn:
                    results.publish(conn, b)
                    q.ack_batch(b.batch_id, conn=conn)
            except Exception as exc:
                failed += 1
                _say(f"{path}: batch {b.batch_id} failed, released: {exc}")
                with dbq.transaction() as conn:
                    results.discard(conn, b)
                    q.release_batch(b.batch_id, delay=0, error=str(exc)[:2000], conn=conn)
                if failed > 3:
                    break
                continue
            per_batch.append(time.monotonic() - t0)
            claims.append(t_claimed - t0)
            jobs.append(t_job - t_claimed)
            acks.append(t0 + per_batch[-1] - t_job)
            _say(f"{path}: batch {len(per_batch)} ({b.size:,}) claim to ack {per_batch[-1]:.2f}s")
        all_s = time.monotonic() - t_first - aside
        if isinstance(runner, _Connect):
            runner.close()
        with psycopg.connect(dsn) as c:
            totals = results.totals(c)
        st = q.stats(exact=True)  # a state of more than 50,000 is otherwise estimated
        want = expected_totals(orders)
        ok = (
            failed == 0
            and (totals.messages, totals.orders, totals.quantity, totals.amount_eur) == (messages, *want)
            # a ring keeps no finished messages: drained is nothing ready, in flight or failed
            and (st.ready, st.in_flight, st.failed, st.finished) == (0, 0, 0, 0 if ring else messages)
        )
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{results.schema}" CASCADE')
        dbq.uninstall()
    warm = per_batch[1:] or per_batch
    return {
        "path": path,
        "design": design,
        "messages": messages,
        "batch": batch,
        "batches": len(per_batch),
        "push_s": round(push_s, 2),
        "warm_up_s": [round(x, 2) for x in warm_s],
        "first_batch_s": round(per_batch[0], 2) if per_batch else None,
        "p50_s": round(statistics.median(per_batch), 2) if per_batch else None,
        "warm_p50_s": round(statistics.median(warm), 2) if warm else None,
        "max_s": round(max(per_batch), 2) if per_batch else None,
        "claim_to_last_ack_s": round(all_s, 2),
        "orders_per_s": round(messages / all_s) if all_s else None,
        "claim_p50_s": round(statistics.median(claims), 3) if claims else None,
        "job_p50_s": round(statistics.median(jobs), 3) if jobs else None,
        "publish_ack_p50_s": round(statistics.median(acks), 3) if acks else None,
        "read_psql_p50_s": round(statistics.median(reads_psql), 3) if reads_psql else None,
        "read_jdbc_p50_s": round(statistics.median(reads_jdbc), 3) if reads_jdbc else None,
        "exactly_once": ok,
    }


class _Airflow:
    """Airflow as a deployment runs it, in ``home`` (SQLite, LocalExecutor): the api-server (its
    execution API only), the triggerer and the scheduler as separate processes, each logging to
    ``home/<name>.log``, with the event-driven DAG and the connections ``dbqueue_default`` (``dsn``,
    queues in ``schema``) and ``spark_default`` (the Connect server at ``connect_url``, else
    ``local[*]`` for spark-submit)."""

    COMPONENTS = ("api-server", "triggerer", "scheduler")

    def __init__(
        self, home: Path, dsn: str, schema: str, results_schema: str, connect_url: str | None
    ) -> None:
        self.home = home
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        dbqueue = {
            "conn_type": "postgres",
            "host": info.get("host", "127.0.0.1"),
            "port": int(info.get("port") or 5432),
            "login": info.get("user"),
            "password": info.get("password"),
            "schema": info.get("dbname"),
            "extra": {"dbqueue_schema": schema},
        }
        if connect_url is not None:
            host, port = connect_url.rsplit(":", 1)
            spark: dict[str, Any] = {"conn_type": "spark_connect", "host": host, "port": int(port)}
        else:
            spark = {"conn_type": "spark", "host": "local[*]"}
        # The execution API, and the log servers of the scheduler (LocalExecutor) and the triggerer,
        # whose default ports (8793, 8794) another Airflow on this machine may hold: free ports each.
        self.api_port, worker_logs, trigger_logs = free_ports(3)
        env = {k: v for k, v in os.environ.items() if k not in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE")}
        self.env = dict(
            env,
            PATH=f"{AIRFLOW.parent}{os.pathsep}{os.environ.get('PATH', '')}",
            AIRFLOW_HOME=str(home),
            AIRFLOW__CORE__LOAD_EXAMPLES="False",
            AIRFLOW__CORE__DAGS_FOLDER=str(EVENTS_DAGS),
            # the watcher's trigger is registered when the DAG is serialized unpaused
            AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",
            AIRFLOW__CORE__EXECUTOR="LocalExecutor",
            AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{self.api_port}/execution/",
            AIRFLOW__API_AUTH__JWT_SECRET=uuid.uuid4().hex,
            AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=str(worker_logs),
            AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT=str(trigger_logs),
            AIRFLOW_CONN_DBQUEUE_DEFAULT=json.dumps(dbqueue),
            AIRFLOW_CONN_SPARK_DEFAULT=json.dumps(spark),
            DBQUEUE_BENCH_QUEUE="orders",
            DBQUEUE_RESULTS_SCHEMA=results_schema,
            SPARK_LOCAL_IP="127.0.0.1",
        )
        self._procs: list[subprocess.Popen[bytes]] = []

    def _cli(self, *args: str) -> None:
        proc = subprocess.run(
            [str(AIRFLOW), *args], env=self.env, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"airflow {' '.join(args)} exited {proc.returncode}: {proc.stderr[-3000:]}")

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        for args in (["db", "migrate"], ["dags", "reserialize"]):
            self._cli(*args)
        for name in self.COMPONENTS:
            args = [name]
            if name == "api-server":
                args += ["--apps", "execution", "-H", "127.0.0.1", "-p", str(self.api_port)]
            with (self.home / f"{name}.log").open("wb") as out:
                self._procs.append(
                    subprocess.Popen(
                        [str(AIRFLOW), *args],
                        env=self.env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def stop(self) -> None:
        """Stop every component and everything it started (its process group)."""
        for proc in reversed(self._procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self._procs = []

    def busy(self) -> bool:
        """Whether a run of the DAG is queued or running, or an asset event waits to start one."""
        with contextlib.closing(sqlite3.connect(self.home / "airflow.db", timeout=30)) as c:
            runs = c.execute(
                "SELECT count(*) FROM dag_run WHERE dag_id = ? AND state IN ('queued', 'running')",
                (EVENTS_DAG_ID,),
            ).fetchone()
            waiting = c.execute(
                "SELECT count(*) FROM asset_dag_run_queue WHERE target_dag_id = ?", (EVENTS_DAG_ID,)
            ).fetchone()
        return bool(runs[0] or waiting[0])

    def runs(self) -> dict[str, int]:
        with contextlib.closing(sqlite3.connect(self.home / "airflow.db", timeout=30)) as c:
            rows = c.execute(
                "SELECT state, count(*) FROM dag_run WHERE dag_id = ? GROUP BY state", (EVENTS_DAG_ID,)
            ).fetchall()
        return {str(state): int(n) for state, n in rows}

    def log_tails(self) -> str:
        logs = [self.home / f"{name}.log" for name in self.COMPONENTS]
        logs += sorted((self.home / "logs").rglob("*.log")) if (self.home / "logs").exists() else []
        return "\n".join(f"== {p}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())


def _wait(what: str, check: Any, timeout: float, airflow: _Airflow, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}\n{airflow.log_tails()}")


def _trigger_waiting(dsn: str) -> bool:
    """Whether a DbQueueTrigger's stream connection is open and idle (waiting for a notification)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'airflow-dbqueue-trigger' "
            "AND state = 'idle'"
        ).fetchone()
    return bool(row and row[0])


def run_events(
    path: str, dsn: str, connect_url: str | None, home: Path, *, pushes: int, size: int
) -> dict[str, Any]:
    """Push ``size`` orders ``pushes`` times to the event-driven DAG running under Airflow; return the
    seconds from each push to its results published, and whether every order was counted once."""
    schema, results = f"bench_events_{path}", OrderRollup(f"bench_events_results_{path}")
    orders = list(sample_orders(pushes * size, seed=23))
    airflow = _Airflow(home, dsn, schema, results.schema, connect_url)
    latencies: list[float] = []
    with DbQueue(dsn, schema=schema, pool_size=2) as dbq:
        dbq.uninstall()
        dbq.install()
        q = dbq.create_queue("orders")
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{results.schema}" CASCADE')
            results.install(c)
        t0 = time.monotonic()
        airflow.start()
        try:
            _wait("the triggerer to watch the queue", lambda: _trigger_waiting(dsn), 300, airflow, 0.5)
            _say(f"{path} events: Airflow up, the trigger waiting, after {time.monotonic() - t0:.1f}s")
            with psycopg.connect(dsn, autocommit=True) as c:
                for i in range(pushes):
                    _wait("the previous run to end", lambda: not airflow.busy(), 600, airflow, 0.2)
                    [(before,)] = c.execute("SELECT clock_timestamp()").fetchall()
                    q.push_batch(orders[i * size : (i + 1) * size])
                    want = (i + 1) * size

                    def published(want: int = want) -> Any:
                        row = c.execute(
                            f'SELECT sum(messages), max(published_at) FROM "{results.schema}".batches'
                        ).fetchone()
                        return row if row and row[0] is not None and row[0] >= want else None

                    _, last = _wait(f"push {i + 1}'s results", published, 180, airflow)
                    latencies.append((last - before).total_seconds())
                    _say(
                        f"{path} events: push {i + 1} of {size:,} orders, results published after "
                        f"{latencies[-1]:.2f}s"
                    )
            _wait("the last run to end", lambda: not airflow.busy(), 600, airflow, 0.2)
            runs = airflow.runs()
        finally:
            airflow.stop()
        with psycopg.connect(dsn) as c:
            totals = results.totals(c)
        st = q.stats(exact=True)  # a state of more than 50,000 is otherwise estimated
        ok = (
            (totals.messages, totals.orders, totals.quantity, totals.amount_eur)
            == (len(orders), *expected_totals(orders))
            and (st.ready, st.in_flight, st.failed, st.finished) == (0, 0, 0, len(orders))
            and runs.get("failed", 0) == 0
        )
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{results.schema}" CASCADE')
        dbq.uninstall()
    return {
        "events_pushes": pushes,
        "events_runs": runs,
        "events_s": [round(x, 2) for x in latencies],
        "events_p50_s": round(statistics.median(latencies), 2),
        "events_max_s": round(max(latencies), 2),
        "events_exactly_once": ok,
    }


def _secs(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs) + " s"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spark_paths", description=__doc__.split("\n", 1)[0])
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=5_000)
    p.add_argument("--paths", default="connect,submit", help="comma-separated: connect, submit")
    p.add_argument(
        "--designs",
        default="table",
        help="comma-separated queue designs each path runs on, one after the other: table, ring "
        "(default table); with more than one, each batch's read is also measured alone",
    )
    p.add_argument("--dsn", default=os.environ.get("DBQUEUE_TEST_DSN"), help="default: embedded")
    p.add_argument(
        "--connect-url",
        help="a running Spark Connect server (sc://host:port) with PostgreSQL's JDBC driver, instead of "
        "starting a local one",
    )
    p.add_argument(
        "--warm-up",
        type=int,
        default=3,
        help="made-up batches of --batch the Connect server runs before the first claim (default 3)",
    )
    p.add_argument(
        "--events",
        type=int,
        default=0,
        help="then push --batch orders this many times to the event-driven DAG under Airflow's scheduler "
        "and triggerer, and measure each push to its results published (default 0: not measured)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per path on stdout")
    args = p.parse_args(argv)
    args.paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    args.designs = [x.strip() for x in args.designs.split(",") if x.strip()]
    if (
        args.messages < 1
        or args.batch < 1
        or args.events < 0
        or not args.paths
        or set(args.paths) - set(PATHS)
        or not args.designs
        or set(args.designs) - set(DESIGNS)
    ):
        p.error(
            "--messages and --batch must be positive, --events at least 0, "
            f"--paths a list of {', '.join(PATHS)}, --designs a list of {', '.join(DESIGNS)}"
        )
    return args


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0912
    args = parse_args(argv)
    paths = args.paths
    tmp = Path(tempfile.mkdtemp(prefix="dbqueue-bench-spark-"))
    pg = None
    server = None
    rows: list[dict[str, Any]] = []
    try:
        dsn = args.dsn
        if not dsn:
            pg = EmbeddedPostgres(tmp / "pg")
            dsn = pg.start()
        for path in paths:
            start_s = None
            url = None
            if path == "connect" and args.connect_url:
                url = args.connect_url
            elif path == "connect":
                server = LocalConnectServer(log_file=tmp / "connect.log")
                t0 = time.monotonic()
                url = server.start()
                start_s = round(time.monotonic() - t0, 1)
                _say(f"connect: server {server.url} listening after {start_s}s")
            for k, design in enumerate(args.designs):
                row = run_path(
                    path,
                    dsn,
                    args.messages,
                    args.batch,
                    url,
                    warm_up=args.warm_up,
                    design=design,
                    measure_reads=len(args.designs) > 1,
                )
                row["server_start_s"] = start_s if k == 0 else None
                row["load"] = round(os.getloadavg()[0], 1)
                if k < len(args.designs) - 1:
                    rows.append(row)
            if args.events:
                row.update(
                    run_events(path, dsn, url, tmp / f"airflow-{path}", pushes=args.events, size=args.batch)
                )
                row["events_load"] = round(os.getloadavg()[0], 1)
            rows.append(row)
            if server is not None:
                server.stop()
                server = None
    finally:
        if server is not None:
            server.stop()
        if pg is not None:
            pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(table(rows))
    return 0 if all(r["exactly_once"] and r.get("events_exactly_once", True) for r in rows) else 1


def table(rows: list[dict[str, Any]]) -> str:
    """The paths side by side, as a Markdown table."""
    fields = [
        ("messages / batch", lambda r: f"{r['messages']:,} / {r['batch']:,}"),
        (
            "server start (once)",
            lambda r: f"{r['server_start_s']} s" if r["server_start_s"] is not None else "-",
        ),
        (
            "warm-up (once, made-up batches)",
            lambda r: f"{sum(r['warm_up_s']):.1f} s ({len(r['warm_up_s'])})" if r["warm_up_s"] else "-",
        ),
        ("batches", lambda r: str(r["batches"])),
        ("first batch, claim to ack", lambda r: f"{r['first_batch_s']} s"),
        ("p50 claim to ack", lambda r: f"{r['p50_s']} s"),
        ("p50 without the first batch", lambda r: f"{r['warm_p50_s']} s"),
        ("slowest batch", lambda r: f"{r['max_s']} s"),
        ("first claim to last ack", lambda r: f"{r['claim_to_last_ack_s']} s"),
        ("orders/s (claim to last ack)", lambda r: f"{r['orders_per_s']:,}"),
        ("exactly once, queue drained", lambda r: "yes" if r["exactly_once"] else "NO"),
        ("load average (1 min) at the end", lambda r: str(r["load"])),
    ]
    if any("events_p50_s" in r for r in rows):
        fields += [
            (
                "push to results published, event-driven DAG: p50 (pushes)",
                lambda r: f"{r['events_p50_s']} s ({r['events_pushes']})" if "events_p50_s" in r else "-",
            ),
            ("each push to its results", lambda r: _secs(r["events_s"]) if "events_s" in r else "-"),
            (
                "events: exactly once, queue drained, no run failed",
                lambda r: ("yes" if r["events_exactly_once"] else "NO") if "events_s" in r else "-",
            ),
            ("load average (1 min) after the pushes", lambda r: str(r.get("events_load", "-"))),
        ]
    if any(r.get("claim_p50_s") is not None for r in rows):
        fields += [
            ("p50 of the claim", lambda r: f"{r['claim_p50_s']} s"),
            ("p50 of the job (its JDBC read, Spark work, staging writes)", lambda r: f"{r['job_p50_s']} s"),
            ("p50 of publish and ack (one transaction)", lambda r: f"{r['publish_ack_p50_s']} s"),
        ]
    if any(r.get("read_psql_p50_s") is not None for r in rows):
        fields += [
            ("batch read alone, p50: the batch query from Python", lambda r: f"{r['read_psql_p50_s']} s"),
            (
                "batch read alone, p50: the job's JDBC read, payloads fetched",
                lambda r: f"{r['read_jdbc_p50_s']} s" if r.get("read_jdbc_p50_s") is not None else "-",
            ),
        ]
    designs = {r.get("design", "table") for r in rows}
    head = (
        "| | "
        + " | ".join(
            ("Spark Connect" if r["path"] == "connect" else "spark-submit")
            + (f", {r.get('design', 'table')}" if len(designs) > 1 else "")
            for r in rows
        )
        + " |"
    )
    lines = [head, "| --- |" + " --- |" * len(rows)]
    lines += ["| " + name + " | " + " | ".join(f(r) for r in rows) + " |" for name, f in fields]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
