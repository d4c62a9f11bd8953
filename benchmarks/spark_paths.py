"""The two Spark paths of the pipeline side by side: a batch on Spark Connect, a batch with spark-submit.

For each path it pushes ``--messages`` sample orders into a queue of its own, then takes batches of up
to ``--batch`` one after the other exactly as ``DbQueueSparkSubmitOperator`` does, without Airflow
around it: claim the batch, run the ``order_rollup`` job on it (``batch_job`` in a new session of a
local Spark Connect server whose id is the batch id, or ``spark-submit`` of ``order_rollup.py`` in
``local[*]``), then publish the staged rollup and ack the batch in one transaction (release it on any
failure). It measures each batch from claim to ack, and checks at the end that the results hold every
pushed order exactly once (orders, units and EUR amount) and the queue is drained.

    .venv/bin/python benchmarks/spark_paths.py                        # 20,000 orders, batches of 5,000
    .venv/bin/python benchmarks/spark_paths.py --messages 200000 --batch 20000 --paths connect
    .venv/bin/python benchmarks/spark_paths.py --json

The Connect server is started once per run (its start is reported apart, not in any batch) with
``local[2]`` and 1 GiB, as ``scripts/demo`` starts it; the first batch on it warms it up, and the
``warm p50`` leaves that batch out. Exit status: 0 when every path's check passed, 1 when one did not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.embedded import EmbeddedPostgres
from airflow_dbqueue.spark import ORDER_ROLLUP_JOB, find_jdbc_jar, jdbc_options
from airflow_dbqueue.spark.connect_server import LocalConnectServer, spark_submit
from airflow_dbqueue.spark.orders import OrderRollup, expected_totals, sample_orders

PATHS = ("connect", "submit")


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

    def warm_up(self, results: OrderRollup, dsn: str, rounds: int, size: int) -> list[float]:
        """The server's warm-up: ``rounds`` made-up batches of ``size`` through the job."""
        session = self.session()
        try:
            with psycopg.connect(dsn) as conn:
                return results.warm_up(session, self.jdbc, conn, rounds=rounds, size=size)
        finally:
            session.stop()


def run_path(  # noqa: PLR0915
    path: str, dsn: str, messages: int, batch: int, connect_url: str | None, *, warm_up: int = 0
) -> dict[str, Any]:
    """Push, then claim, run and publish-and-ack batch after batch; return what was measured.

    Long on purpose: one path measured in order (set up, push, batches, check), sharing its timings.
    """
    schema, results = f"bench_spark_{path}", OrderRollup(f"bench_results_{path}")
    orders = list(sample_orders(messages, seed=17))
    jdbc = jdbc_options(dsn)
    runner: _Connect | _Submit = _Connect(connect_url, jdbc) if connect_url is not None else _Submit(jdbc)
    with DbQueue(dsn, schema=schema, pool_size=2) as dbq:
        dbq.uninstall()
        dbq.install()
        q = dbq.create_queue("orders")
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
        failed = 0
        t_first = time.monotonic()
        while True:
            t0 = time.monotonic()
            b = q.claim_batch(batch, visibility_timeout=600, consumer=f"bench.{path}")
            if b is None:
                break
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
            _say(f"{path}: batch {len(per_batch)} ({b.size:,}) claim to ack {per_batch[-1]:.2f}s")
        all_s = time.monotonic() - t_first
        if isinstance(runner, _Connect):
            runner.close()
        with psycopg.connect(dsn) as c:
            totals = results.totals(c)
        st = q.stats()
        want = expected_totals(orders)
        ok = (
            failed == 0
            and (totals.messages, totals.orders, totals.quantity, totals.amount_eur) == (messages, *want)
            and (st.ready, st.in_flight, st.failed, st.finished) == (0, 0, 0, messages)
        )
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{results.schema}" CASCADE')
        dbq.uninstall()
    warm = per_batch[1:] or per_batch
    return {
        "path": path,
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
        "exactly_once": ok,
    }


def _secs(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs) + " s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spark_paths", description=__doc__.split("\n", 1)[0])
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=5_000)
    p.add_argument("--paths", default="connect,submit", help="comma-separated: connect, submit")
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
    p.add_argument("--json", action="store_true", help="one JSON object per path on stdout")
    args = p.parse_args(argv)
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if args.messages < 1 or args.batch < 1 or not paths or set(paths) - set(PATHS):
        p.error(f"--messages and --batch must be positive, --paths a list of {', '.join(PATHS)}")
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
            row = run_path(path, dsn, args.messages, args.batch, url, warm_up=args.warm_up)
            row["server_start_s"] = start_s
            row["load"] = round(os.getloadavg()[0], 1)
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
    return 0 if all(r["exactly_once"] for r in rows) else 1


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
    head = (
        "| | "
        + " | ".join("Spark Connect" if r["path"] == "connect" else "spark-submit" for r in rows)
        + " |"
    )
    lines = [head, "| --- |" + " --- |" * len(rows)]
    lines += ["| " + name + " | " + " | ".join(f(r) for r in rows) + " |" for name, f in fields]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
