"""The local Spark Connect server from the pyspark wheel: it starts once per test session, and a session
on it reads a claimed batch from the queue database over JDBC."""

from __future__ import annotations

import json
import time

import psycopg.conninfo
import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.spark import find_jdbc_jar
from airflow_dbqueue.spark.connect_server import LocalConnectServer
from tests.helpers import checksum

pytestmark = pytest.mark.integration


def test_a_session_reads_a_queues_batch_over_jdbc(connect_server: LocalConnectServer, dbq: DbQueue) -> None:
    from pyspark.sql import SparkSession

    q = dbq.create_queue("jobs")
    sent = [{"job": i, "name": f"n{i}"} for i in range(300)]
    q.push_batch(sent)
    batch = q.claim_batch(300)
    assert batch is not None and batch.size == 300
    info = psycopg.conninfo.conninfo_to_dict(dbq.db.dsn)
    t0 = time.monotonic()
    spark = SparkSession.builder.remote(connect_server.url).create()
    try:
        assert time.monotonic() - t0 < 10  # the JVM is already up: a session is a gRPC call
        rows = (
            spark.read.format("jdbc")
            .option("url", f"jdbc:postgresql://{info['host']}:{info['port']}/{info['dbname']}")
            .option("user", info.get("user") or "")
            .option("driver", "org.postgresql.Driver")
            .option("dbtable", f"({q.batch_query(batch.batch_id)}) AS batch")
            .load()
            .selectExpr("ord", "CAST(payload AS STRING) AS payload")
            .collect()
        )
    finally:
        spark.stop()
    assert sorted(r["ord"] for r in rows) == list(range(1, 301))
    assert checksum(json.loads(r["payload"]) for r in rows) == checksum(sent)


def test_the_servers_command_line_binds_loopback_and_carries_the_jdbc_driver() -> None:
    cmd = LocalConnectServer().command(15002)
    assert cmd[cmd.index("--class") + 1] == "org.apache.spark.sql.connect.service.SparkConnectServer"
    assert cmd[cmd.index("--master") + 1] == "local[2]"
    assert cmd[cmd.index("--jars") + 1] == find_jdbc_jar()
    assert "spark.connect.grpc.binding.address=127.0.0.1" in cmd
    assert "spark.connect.grpc.binding.port=15002" in cmd
