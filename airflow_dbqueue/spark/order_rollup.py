"""PySpark job: roll one batch of order events up per customer, product and time window.

One job definition, :func:`batch_job`, runs on both paths of ``DbQueueSparkSubmitOperator``: given a
classic session by this file's ``main`` under ``spark-submit``, or given a Spark Connect session by
the operator itself. It reads the batch straight from the queue database through JDBC, by batch id,
so no payload passes through Airflow; it validates every event, converts amounts to EUR with the
rates in ``<results>.fx_rates``, and writes its aggregates and a one-row summary into staging tables
keyed by batch id. Publishing them into the results (and acking the batch) is the operator's job, in
one database transaction, so a batch's results count exactly once whatever fails where.

The job imports only PySpark and the standard library, so any Spark cluster can run it as one file.

Arguments (the operator adds the ``--batch-*`` ones)::

    --batch-id UUID --batch-size N --batch-query SQL     which messages, and how to read them
    --results-schema NAME                                 where fx_rates and the staging tables are
    --window-minutes M                                    the tumbling window (default 60)
    --partitions P                                        parallel JDBC reads of the batch

JDBC connection: ``batch_job`` is handed its JDBC options (url, user, password, driver). Under
``spark-submit``, ``main`` takes them from ``DBQUEUE_JDBC_URL``, ``DBQUEUE_JDBC_USER`` and
``DBQUEUE_JDBC_PASSWORD`` in the environment, or instead of the password
``DBQUEUE_JDBC_PASSWORD_FILE``, a file holding it (cluster mode); never from the command line. On
Spark Connect the operator hands them from the queue's Airflow connection.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, NoReturn

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

ORDER_SCHEMA = T.StructType(
    [
        T.StructField("order_id", T.StringType()),
        T.StructField("customer_id", T.StringType()),
        T.StructField("product_id", T.StringType()),
        T.StructField("quantity", T.IntegerType()),
        T.StructField("unit_price", T.DecimalType(12, 2)),
        T.StructField("currency", T.StringType()),
        T.StructField("ordered_at", T.TimestampType()),
    ]
)
REQUIRED = ["order_id", "customer_id", "product_id", "quantity", "unit_price", "currency", "ordered_at"]
_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class BatchRejected(Exception):
    """The batch holds events this job must not roll up (the batch is released, not acked)."""


class JobArgumentError(Exception):
    """The job's arguments are wrong (under spark-submit: exit code 2)."""


class _Parser(argparse.ArgumentParser):
    # Raise instead of exiting: on Spark Connect the job runs inside the Airflow task's process.
    def error(self, message: str) -> NoReturn:
        raise JobArgumentError(f"{self.prog}: {message}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="order_rollup")
    p.add_argument("--batch-id", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--batch-query", required=True)
    p.add_argument("--results-schema", default="order_results")
    p.add_argument("--window-minutes", type=int, default=60)
    p.add_argument("--partitions", type=int, default=2)
    args = p.parse_args(argv)
    if not _IDENT.match(args.results_schema):
        p.error(f"--results-schema must be a plain lower-case identifier, got {args.results_schema!r}")
    if args.window_minutes < 1 or args.partitions < 1 or args.batch_size < 1:
        p.error("--window-minutes, --partitions and --batch-size must be positive")
    return args


def jdbc_options() -> dict[str, str]:
    """The JDBC options of a job run by spark-submit, from its environment."""
    try:
        url = os.environ["DBQUEUE_JDBC_URL"]
    except KeyError:
        raise SystemExit("order_rollup: DBQUEUE_JDBC_URL is not set") from None
    opts = {"url": url}
    if os.environ.get("DBQUEUE_JDBC_USER"):
        opts["user"] = os.environ["DBQUEUE_JDBC_USER"]
    if os.environ.get("DBQUEUE_JDBC_PASSWORD"):
        opts["password"] = os.environ["DBQUEUE_JDBC_PASSWORD"]
    elif os.environ.get("DBQUEUE_JDBC_PASSWORD_FILE"):  # cluster mode: a file where the driver runs
        path = os.environ["DBQUEUE_JDBC_PASSWORD_FILE"]
        why = "order_rollup: cannot read DBQUEUE_JDBC_PASSWORD_FILE"
        try:
            with open(path, encoding="utf-8") as f:
                opts["password"] = f.read().rstrip("\r\n")
        except OSError as exc:
            raise SystemExit(f"{why} {path!r}: {exc}") from None
    return opts


def read_batch(spark: SparkSession, jdbc: dict[str, str], args: argparse.Namespace) -> DataFrame:
    """The batch's messages, read in ``--partitions`` parallel JDBC queries split on ``ord``."""
    return (
        spark.read.format("jdbc")
        .options(**jdbc)
        .option("dbtable", f"({args.batch_query}) AS batch")
        .option("partitionColumn", "ord")
        .option("lowerBound", "1")
        .option("upperBound", str(args.batch_size + 1))
        .option("numPartitions", str(max(1, min(args.partitions, args.batch_size))))
        .option("fetchsize", "5000")
        .load()
    )


def validate(events: DataFrame, rates: DataFrame) -> DataFrame:
    """The events joined to their EUR rate, with ``problem``: what is wrong with each (null: nothing)."""
    missing = F.lit(False)
    for col in REQUIRED:
        missing = missing | F.col(col).isNull()
    return events.join(F.broadcast(rates), on="currency", how="left").withColumn(
        "problem",
        F.when(missing, F.lit("not an order event (missing or mistyped fields)"))
        .when(F.col("quantity") <= 0, F.lit("quantity must be positive"))
        .when(F.col("unit_price") < 0, F.lit("unit_price must not be negative"))
        .when(F.col("rate_to_eur").isNull(), F.concat(F.lit("no FX rate for currency "), F.col("currency"))),
    )


def rejection(checked: DataFrame, batch_id: str) -> BatchRejected:
    """The error naming the first bad messages of a batch (by id)."""
    bad = (
        checked.where(F.col("problem").isNotNull()).select("id", "problem").orderBy("id").limit(11).collect()
    )
    shown = "; ".join(f"message {r['id']}: {r['problem']}" for r in bad[:10])
    more = " (and more)" if len(bad) > 10 else ""
    return BatchRejected(f"batch {batch_id}: {shown}{more}")


def roll_up(checked: DataFrame, window_minutes: int, batch_id: str) -> DataFrame:
    """The batch's aggregates per customer, product and window, each with ``bad``: how many of its
    events have a problem (a batch with any is rejected before anything is written)."""
    amount = (F.col("quantity") * F.col("unit_price") * F.col("rate_to_eur")).cast(T.DecimalType(20, 4))
    return (
        checked.withColumn("amount_eur", amount)
        .groupBy("customer_id", "product_id", F.window("ordered_at", f"{window_minutes} minutes"))
        .agg(
            F.count("*").cast("long").alias("orders"),
            F.count("problem").cast("long").alias("bad"),
            F.sum("quantity").cast("long").alias("quantity"),
            F.sum("amount_eur").cast(T.DecimalType(20, 4)).alias("amount_eur"),
            F.min("ordered_at").alias("first_order_at"),
            F.max("ordered_at").alias("last_order_at"),
        )
        .select(
            F.lit(batch_id).alias("batch_id"),
            "customer_id",
            "product_id",
            F.col("window.start").alias("window_start"),
            "orders",
            "bad",
            "quantity",
            "amount_eur",
            "first_order_at",
            "last_order_at",
        )
    )


SUMMARY_SCHEMA = "batch_id string, messages long, orders long, amount_eur decimal(20,4), groups long"


def write(df: DataFrame, jdbc: dict[str, str], table: str) -> None:
    # stringtype=unspecified lets the batch id (a string here) land in a uuid column;
    # reWriteBatchedInserts sends each JDBC batch of rows as multi-row INSERTs, not one INSERT a row.
    params = "stringtype=unspecified&reWriteBatchedInserts=true"
    url = jdbc["url"] + ("&" if "?" in jdbc["url"] else "?") + params
    df.write.format("jdbc").options(**{**jdbc, "url": url}).option("dbtable", table).mode("append").save()


def batch_job(spark: SparkSession, argv: list[str], jdbc: dict[str, str]) -> dict[str, Any]:
    """Roll up the batch ``argv`` names, in ``spark`` (classic or Spark Connect), reading and writing
    the queue database with the JDBC options ``jdbc``; return the batch's totals.

    Raises :class:`BatchRejected` for a batch it must not roll up, :class:`JobArgumentError` for bad
    arguments."""
    args = parse_args(argv)
    # Windows and timestamps in UTC, whatever the session's default.
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    return run(spark, args, {**jdbc, "driver": "org.postgresql.Driver"})


def run(spark: SparkSession, args: argparse.Namespace, jdbc: dict[str, str]) -> dict[str, Any]:
    schema = args.results_schema
    raw = read_batch(spark, jdbc, args)
    events = raw.select("id", F.from_json(F.col("payload").cast("string"), ORDER_SCHEMA).alias("e"))
    flat = events.select("id", *[F.col(f"e.{c}").alias(c) for c in REQUIRED])
    rates = (
        spark.read.format("jdbc")
        .options(**jdbc)
        .option("dbtable", f"{schema}.fx_rates")
        .load()
        .select("currency", F.col("rate_to_eur").cast(T.DecimalType(18, 8)))
    )
    checked = validate(flat, rates)
    # Each Spark action costs a round of scheduling (and on Spark Connect a round trip), so the job
    # takes three, and reads the batch once: the rollup, which counts each group's bad events, is
    # cached; one pass over it counts the batch and its bad events, the next writes it to staging,
    # and the last writes the summary, a row of the totals the first pass returned. The rollup of a
    # batch is small (a row per customer, product and window at most), so it is one partition: one
    # task and one JDBC connection write it.
    rollup = roll_up(checked, args.window_minutes, args.batch_id).coalesce(1).cache()
    try:
        stats = rollup.agg(
            F.sum("orders").cast("long").alias("n"),
            F.sum("bad").cast("long").alias("bad"),
            F.count("*").cast("long").alias("groups"),
            F.sum("amount_eur").cast(T.DecimalType(20, 4)).alias("amount_eur"),
        ).first()
        assert stats is not None  # an aggregate without grouping has one row
        n = int(stats["n"] or 0)
        if stats["bad"]:
            raise rejection(checked, args.batch_id)
        if n != args.batch_size:
            raise BatchRejected(
                f"batch {args.batch_id}: read {n} messages, the batch holds {args.batch_size}"
            )
        write(rollup.drop("bad"), jdbc, f"{schema}.rollup_staging")
        # Every event of the batch is one order (a bad one rejects the batch), so orders = messages.
        summary = spark.createDataFrame(
            [(args.batch_id, n, n, stats["amount_eur"], int(stats["groups"]))], SUMMARY_SCHEMA
        )
        # Written last: the publisher takes a summary as proof that every aggregate row is there.
        write(summary, jdbc, f"{schema}.batch_staging")
    finally:
        # A Connect server outlives the batch: its cache must not keep every batch it ever rolled up.
        rollup.unpersist()
    return {"batch_id": args.batch_id, "messages": n}


def main(argv: list[str] | None = None) -> int:
    """spark-submit's entry: a classic session, the JDBC options from the environment, :func:`batch_job`."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        batch_id = parse_args(argv).batch_id
    except JobArgumentError as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2
    jdbc = jdbc_options()
    spark = SparkSession.builder.appName(f"order_rollup {batch_id}").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    try:
        result = batch_job(spark, argv, jdbc)
    except BatchRejected as exc:
        print(f"order_rollup: REJECTED {exc}", file=sys.stderr, flush=True)
        return 3
    finally:
        spark.stop()
    print(f"order_rollup: batch {batch_id} done: {result}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
