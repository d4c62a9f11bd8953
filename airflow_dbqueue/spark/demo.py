"""``dbqueue pipeline``: the README's main job. Push order events, run the Spark pipeline DAG, check.

It drives Airflow through its command line (``airflow db migrate``, ``airflow dags test``), so this
module imports no Airflow itself. Airflow's metadata database is its default SQLite one in a home of
its own (kept between runs, so only the first run migrates it); the queues live in the database
given (else the embedded PostgreSQL). Spark, by default: a local Spark Connect server from the pyspark
wheel (``local[2]``), stopped at the end. It starts at once and, while Airflow's database is migrated
and the orders are pushed, warms up on made-up batches of the demo's batch size
(:meth:`OrderRollup.warm_up`), so the DAG's batches do not pay the server's first, slow runs; the
DAG's task then runs every batch in one session there. With ``spark="submit"``: one
``spark-submit`` per batch in ``local[*]``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import psycopg.conninfo

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.embedded import default_data_dir
from airflow_dbqueue.spark import JDBC_HINT, find_jdbc_jar, jdbc_options
from airflow_dbqueue.spark.connect_server import ConnectServerError, LocalConnectServer
from airflow_dbqueue.spark.orders import OrderRollup, expected_totals, sample_orders

DAG_ID = "dbqueue_order_pipeline"
QUEUE = "orders"
#: The demo's own schemas: it drops and recreates them on every run, and touches nothing else.
QUEUE_SCHEMA = "dbqueue_demo"
RESULTS_SCHEMA = "order_results_demo"
#: Made-up batches the Connect server runs before the DAG (each of the demo's batch size).
WARM_UP_ROUNDS = 3

# Lines of the DAG run worth showing while it runs (the full log goes to a file).
_PROGRESS = re.compile(
    r"(\[DAG TEST\] (starting|end task)|claimed batch|results published|released \(|REJECTED|"
    r"Pausing task as DEFERRED|order_rollup: batch|Spark Connect job returned|\[error|Marking run)",
    re.IGNORECASE,
)


# Airflow's task log lines: "<time> [<level>] <message> [<logger>] loc=<file>:<line>".
_LOG_LINE = re.compile(r"^\S+ \[\w+\s*\] (.*?)\s+\[[\w.]+\]")


def _say(msg: str) -> None:
    print(msg, flush=True)


def _airflow() -> str:
    exe = Path(sys.executable).with_name("airflow")
    return str(exe) if exe.exists() else (shutil.which("airflow") or "airflow")


# `airflow dags test` as the `airflow` script runs it (Airflow's own `main`, the same arguments), with
# the interpreter's cyclic garbage collector told to pass over the objects that exist once Airflow's
# command line and its `dags` commands are imported (`gc.freeze`), and, at exit, over everything left
# (the process is ending; the system takes its memory back). Otherwise every full collection scans
# those few hundred thousand long-lived objects again (many run while the in-process Execution API
# builds its versioned routes before the first task), and the interpreter's shutdown collects and
# frees all of them one by one: one to five seconds after the run is marked successful on a busy
# 2-core machine (docs/benchmarks.md). Every command, task and database write of the run is
# Airflow's and the DAG's as with `airflow`; what becomes garbage after the freeze is reclaimed when
# the process ends. The interpreter is this one, which has Airflow (the `dbqueue` command's venv).
_DAGS_TEST = """
import atexit, gc, sys
sys.argv[0] = "airflow"
from airflow.__main__ import main
import airflow.cli.commands.dag_command
gc.freeze()
atexit.register(gc.freeze)
sys.exit(main())
"""


def dags_test_command(dag_id: str, conf: dict[str, Any]) -> list[str]:
    """The command line the demo runs ``airflow dags test <dag_id> -c <conf>`` with (see ``_DAGS_TEST``)."""
    return [sys.executable, "-c", _DAGS_TEST, "dags", "test", dag_id, "-c", json.dumps(conf)]


def _dags_folder() -> Path:
    folder = Path(__file__).resolve().parents[2] / "dags"
    if not (folder / f"{DAG_ID}.py").exists():
        raise SystemExit(f"dbqueue pipeline: the DAG {DAG_ID}.py is not in {folder}; run it from a checkout")
    return folder


def _conn_json(dsn: str, schema: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    return json.dumps(
        {
            "conn_type": "postgres",
            "host": info.get("host", "127.0.0.1"),
            "port": int(info.get("port") or 5432),
            "login": info.get("user"),
            "password": info.get("password"),
            "schema": info.get("dbname"),
            "extra": {"dbqueue_schema": schema},
        }
    )


class _Ticker:
    """Print '... still <what> (Ns)' every ``every`` seconds while a long step runs."""

    def __init__(self, what: str, every: float = 10.0) -> None:
        self.what, self.every = what, every
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            _say(f"   ... still {self.what} ({time.monotonic() - self._t0:.0f}s)")

    def __enter__(self) -> _Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


SPARK_PATHS = ("connect", "submit")


def airflow_env(dsn: str, schema: str, home: Path, connect_port: int | None = None) -> dict[str, str]:
    """The environment of the Airflow commands: their home, the DAGs, and the two connections (Spark:
    the local Connect server on ``connect_port``, else ``local[*]`` for spark-submit)."""
    here = str(Path(sys.executable).parent)
    spark = (
        {"conn_type": "spark_connect", "host": "sc://127.0.0.1", "port": connect_port}
        if connect_port is not None
        else {"conn_type": "spark", "host": "local[*]"}
    )
    return dict(
        os.environ,
        PATH=f"{here}{os.pathsep}{os.environ.get('PATH', '')}",
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGS_FOLDER=str(_dags_folder()),
        AIRFLOW__LOGGING__LOGGING_LEVEL="INFO",
        AIRFLOW_CONN_DBQUEUE_DEFAULT=_conn_json(dsn, schema),
        AIRFLOW_CONN_SPARK_DEFAULT=json.dumps(spark),
        DBQUEUE_RESULTS_SCHEMA=RESULTS_SCHEMA,
        SPARK_LOCAL_IP=os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"),
    )


def run(
    dsn: str,
    *,
    messages: int,
    batch: int,
    airflow_home: Path | None,
    spark: str = "connect",
    design: str = "table",
) -> int:
    """Run the demo; return the process exit code (0 when the results match what was pushed)."""
    if design not in ("table", "ring"):
        _say(f"dbqueue pipeline: --design must be table or ring, got {design!r}")
        return 2
    with DbQueue(dsn, schema=QUEUE_SCHEMA, pool_size=4) as dbq:
        return _run(
            dbq, messages=messages, batch=batch, airflow_home=airflow_home, spark=spark, design=design
        )


def ring_capacity(messages: int) -> int:
    """The demo ring's capacity: every order is pushed before the DAG runs, so it holds them all (a
    multiple of 4, as the rows layout, PostgreSQL's default ring, wants; it counts pushes there, and a
    push of many orders is one)."""
    return max(16_384, -(-messages // 4) * 4)


def _run(
    dbq: DbQueue, *, messages: int, batch: int, airflow_home: Path | None, spark: str, design: str = "table"
) -> int:
    t_start = time.monotonic()
    if messages < 1 or batch < 1:
        _say("dbqueue pipeline: --messages and --batch must be positive")
        return 2
    if spark not in SPARK_PATHS:
        _say(f"dbqueue pipeline: --spark must be one of {', '.join(SPARK_PATHS)}, got {spark!r}")
        return 2
    if find_jdbc_jar() is None:
        _say(f"dbqueue pipeline: {JDBC_HINT}")
        return 2
    home = airflow_home or default_data_dir().parent / "airflow-home"
    home.mkdir(parents=True, exist_ok=True)
    if spark == "submit":
        return _pipeline(
            dbq, messages=messages, batch=batch, home=home, warm=None, t_start=t_start, design=design
        )
    _say("0/4 starting a local Spark Connect server (local[2]), to warm up while the orders are pushed")
    warm = _WarmServer(LocalConnectServer(log_file=home / "spark-connect-server.log"), dbq.db.dsn, batch)
    try:
        return _pipeline(
            dbq, messages=messages, batch=batch, home=home, warm=warm, t_start=t_start, design=design
        )
    except ConnectServerError as exc:
        _say(f"dbqueue pipeline: {exc}")
        return 1
    finally:
        warm.server.stop()


class _WarmServer:
    """The Connect server, started at once in a thread that, once :meth:`results_ready` says the results
    tables exist, runs :data:`WARM_UP_ROUNDS` made-up batches of ``batch`` orders through the job."""

    def __init__(self, server: LocalConnectServer, dsn: str, batch: int) -> None:
        self.server, self.dsn, self.batch = server, dsn, batch
        self._results_ready = threading.Event()
        self._error: BaseException | None = None
        self.started_s: float | None = None
        self.rounds_s: list[float] = []
        self._thread = threading.Thread(target=self._run, name="dbqueue-connect-warm-up", daemon=True)
        self._t0 = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        try:
            self.server.start()
            self.started_s = time.monotonic() - self._t0
            self._results_ready.wait()
            from pyspark.sql import SparkSession

            session = SparkSession.builder.remote(self.server.url).create()
            try:
                with psycopg.connect(self.dsn) as conn:
                    self.rounds_s = OrderRollup(RESULTS_SCHEMA).warm_up(
                        session, jdbc_options(self.dsn), conn, rounds=WARM_UP_ROUNDS, size=self.batch
                    )
            finally:
                session.stop()
        except BaseException as exc:
            self._error = exc

    def results_ready(self) -> None:
        self._results_ready.set()

    def wait(self) -> None:
        """Wait for the warm-up to end; raise what stopped it."""
        self._results_ready.set()
        with _Ticker("warming up the Spark Connect server"):
            self._thread.join()
        if self._error is not None:
            if isinstance(self._error, ConnectServerError):
                raise self._error
            raise ConnectServerError(f"the Spark Connect server's warm-up failed: {self._error}")


def _pipeline(  # noqa: PLR0915
    dbq: DbQueue,
    *,
    messages: int,
    batch: int,
    home: Path,
    warm: _WarmServer | None,
    t_start: float,
    design: str = "table",
) -> int:
    """Run the pipeline demo's four stages (Airflow's database, the push, the DAG, the results) and
    return the exit status: 0 when every pushed order was counted exactly once.

    Long on purpose: its four numbered stages are what the user reads on screen, in that order, and share
    the timings and totals that the last one reports.
    """
    server = warm.server if warm is not None else None

    _say(f"1/4 Airflow metadata database (SQLite) in {home}")
    t0 = time.monotonic()
    env = airflow_env(dbq.db.dsn, dbq.schema, home, None)  # the Spark connection is not used here
    with _Ticker("migrating Airflow's database (the first run takes a minute)"):
        proc = subprocess.run(
            [_airflow(), "db", "migrate"], check=False, env=env, capture_output=True, text=True
        )
    if proc.returncode != 0:
        _say(proc.stdout[-3000:] + proc.stderr[-3000:])
        return 1
    _say(f"   ready in {time.monotonic() - t0:.1f}s")

    ring = design == "ring"
    shape = f"a ring of capacity {ring_capacity(messages):,}" if ring else "the table design"
    _say(f"2/4 pushing {messages:,} order events to queue {QUEUE!r} ({shape}, schema {dbq.schema!r})")
    t0 = time.monotonic()
    dbq.uninstall()  # a fresh demo schema each run, so the check below is about this run only
    dbq.install()
    shape_settings: dict[str, Any] = {"design": "ring", "capacity": ring_capacity(messages)} if ring else {}
    q = dbq.create_queue(QUEUE, **shape_settings)
    results = OrderRollup(RESULTS_SCHEMA)
    with psycopg.connect(dbq.db.dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{RESULTS_SCHEMA}" CASCADE')
        results.install(conn)  # the DAG's first task does it too; the warm-up writes to its staging
    if warm is not None:
        warm.results_ready()
    orders = list(sample_orders(messages))
    chunk = 5000
    for i in range(0, len(orders), chunk):
        q.push_batch(orders[i : i + chunk])
        _say(f"   pushed {min(i + chunk, len(orders)):>8,} / {len(orders):,}")
    push_s = time.monotonic() - t0
    _say(f"   {len(orders):,} pushed in {push_s:.1f}s ({len(orders) / push_s:,.0f} msg/s)")

    if warm is not None:
        warm.wait()
        _say(
            f"   Spark Connect server {warm.server.url} listening {warm.started_s:.1f}s after the start, "
            f"then warmed up on {len(warm.rounds_s)} made-up batch(es) of {batch:,}: "
            + ", ".join(f"{x:.1f}s" for x in warm.rounds_s)
            + f" (log: {warm.server.log_file})"
        )
    env = airflow_env(dbq.db.dsn, dbq.schema, home, server.port if server is not None else None)
    batches = -(-messages // batch)
    how = (
        f"Spark Connect at {server.url} ({batches} batch(es) of up to {batch:,}, in one session)"
        if server is not None
        else f"Spark local[*] on {batches} batch(es) of up to {batch:,} (one spark-submit each)"
    )
    _say(f"3/4 airflow dags test {DAG_ID}: sensor, then {how}")
    log = home / "last-pipeline-run.log"
    conf: dict[str, Any] = {"queue_name": QUEUE, "max_messages": batch, "max_batches": batches + 1}
    if ring:
        conf.update(design="ring", ring_capacity=ring_capacity(messages))
    t0 = time.monotonic()
    with log.open("w") as out, _Ticker("running the DAG", every=15):
        p = subprocess.Popen(
            dags_test_command(DAG_ID, conf),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert p.stdout is not None
        succeeded = False
        for line in p.stdout:
            out.write(line)
            succeeded = succeeded or "state=success" in line
            if _PROGRESS.search(line):
                m = _LOG_LINE.match(line.strip())
                _say(f"   [{time.monotonic() - t0:4.0f}s] {(m.group(1) if m else line.strip())[:160]}")
        rc = p.wait()
    dag_s = time.monotonic() - t0
    ok_run = rc == 0 and succeeded
    _say(f"   DAG run {'succeeded' if ok_run else 'FAILED'} in {dag_s:.1f}s (full log: {log})")

    _say("4/4 results")
    with psycopg.connect(dbq.db.dsn) as conn:
        totals = results.totals(conn) if ok_run else None
        top = results.top(conn, 5) if ok_run else []
    stats = q.stats()
    want_orders, want_qty, want_amount = expected_totals(orders)
    _say(
        f"   queue     ready={stats.ready} in_flight={stats.in_flight} failed={stats.failed} "
        f"finished={stats.finished}"
    )
    if totals is not None:
        _say(f"   batches   {totals.batches} published, {totals.messages:,} messages")
        _say(
            f"   results   {totals.orders:,} orders, {totals.quantity:,} units, EUR {totals.amount_eur:,.2f} "
            f"in {totals.groups:,} customer/product/hour groups"
        )
        _say(f"   expected  {want_orders:,} orders, {want_qty:,} units, EUR {want_amount:,.2f}")
        _say("   largest groups:")
        for g in top:
            _say(
                f"     {g['customer_id']}  {g['product_id']}  {g['window_start'][:16]}  "
                f"{g['orders']:>4} orders  EUR {Decimal(g['amount_eur']):>10,.2f}"
            )
    ok = (
        ok_run
        and totals is not None
        and (totals.messages, totals.orders, totals.quantity, totals.amount_eur)
        == (messages, want_orders, want_qty, want_amount)
        # a ring keeps no finished messages: drained is nothing ready, in flight or failed
        and (stats.ready, stats.in_flight, stats.failed, stats.finished) == (0, 0, 0, 0 if ring else messages)
    )
    _say(
        f"   check     {'OK' if ok else 'MISMATCH'}: every pushed order counted exactly once "
        "(count, units and EUR amount), queue drained"
    )
    total = time.monotonic() - t_start
    _say(
        f"   time      {total:.1f}s in total (push {push_s:.1f}s, DAG {dag_s:.1f}s); "
        f"{messages / dag_s:,.0f} orders/s through Spark"
    )
    return 0 if ok else 1
