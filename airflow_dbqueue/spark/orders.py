"""The order pipeline around the ``order_rollup`` Spark job: results tables, publishing, sample data.

Engine-level code (no Airflow imports). The Spark job writes a batch's aggregates into staging
tables; :meth:`OrderRollup.publish` moves them into the results inside the transaction that acks the
batch, so a batch's orders are counted once, and only when its messages leave the queue.
"""

from __future__ import annotations

import datetime as dt
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import psycopg
from psycopg import sql

from airflow_dbqueue.engine.errors import DbQueueError
from airflow_dbqueue.engine.models import Batch
from airflow_dbqueue.engine.names import validate_schema_name
from airflow_dbqueue.engine.sqlfile import load_queries

DEFAULT_RESULTS_SCHEMA = "order_results"

#: EUR per unit of each currency the sample data uses (fixed, for reproducible results).
SAMPLE_RATES = {"EUR": "1", "USD": "0.92", "GBP": "1.17", "SEK": "0.087", "CHF": "1.06"}


class PublishError(DbQueueError):
    """What the Spark job staged for a batch does not match the batch; nothing was published."""


@dataclass(frozen=True)
class Totals:
    """What the results hold, over every published batch."""

    batches: int
    messages: int
    orders: int
    quantity: int
    amount_eur: Decimal
    groups: int


class OrderRollup:
    """The results side of the order pipeline, in schema ``schema`` of the queue's database."""

    def __init__(self, schema: str = DEFAULT_RESULTS_SCHEMA) -> None:
        self.schema = validate_schema_name(schema)

    def _q(self, name: str) -> sql.Composed:
        body = load_queries(__package__ or "airflow_dbqueue.spark", "orders.sql")[name]
        return sql.SQL(body).format(schema=sql.Identifier(self.schema))

    def install(self, conn: psycopg.Connection[Any], rates: dict[str, str] | None = None) -> None:
        """Create the tables (idempotent) and set FX rates (the sample ones by default)."""
        conn.execute(self._q("install"))
        for currency, rate in (SAMPLE_RATES if rates is None else rates).items():
            self.set_rate(conn, currency, rate)

    def set_rate(self, conn: psycopg.Connection[Any], currency: str, rate: str | Decimal) -> None:
        conn.execute(self._q("set_rate"), {"currency": currency, "rate": Decimal(rate)})

    def publish(self, conn: psycopg.Connection[Any], batch: Batch) -> None:
        """Add the batch's staged aggregates to the results (call inside the ack's transaction).

        Raises :class:`PublishError` when the job's summary is missing or disagrees with the batch or
        with the staged rows, so a job that exited 0 without writing everything cannot ack a batch.
        """
        key = {"batch_id": batch.batch_id}
        summary = conn.execute(self._q("staged_summary"), key).fetchone()
        if summary is None:
            raise PublishError(f"batch {batch.batch_id}: the Spark job left no summary in {self.schema}")
        messages, orders, amount, groups = summary
        if messages != batch.size:
            raise PublishError(
                f"batch {batch.batch_id}: the Spark job summarised {messages} messages, the batch has "
                f"{batch.size}"
            )
        staged = conn.execute(self._q("staged_groups"), key).fetchone()
        if staged != (groups, orders, amount):
            raise PublishError(
                f"batch {batch.batch_id}: staged rows (groups, orders, amount) {staged} do not match the "
                f"job's summary {(groups, orders, amount)}"
            )
        conn.execute(self._q("publish_rollup"), key)
        conn.execute(self._q("record_batch"), key)
        conn.execute(self._q("discard_staged"), key)

    def discard(self, conn: psycopg.Connection[Any], batch: Batch) -> None:
        """Drop whatever the job staged for a batch that is being released."""
        conn.execute(self._q("discard_staged"), {"batch_id": batch.batch_id})

    def warm_up(
        self,
        spark: Any,
        jdbc: dict[str, str],
        conn: psycopg.Connection[Any],
        *,
        rounds: int = 3,
        size: int = 5000,
    ) -> list[float]:
        """Run the ``order_rollup`` job ``rounds`` times in ``spark`` on a batch of ``size`` orders made
        up in the database, and drop what it staged; return each round's seconds.

        A Spark server runs its first batches several times slower than later ones (class loading,
        the JDBC driver, code generation, the JVM compiling the hot paths): this pays for that
        before a real batch waits on it. The made-up batch is no queue's: nothing is claimed, and its
        staged rows, under a batch id of its own, are deleted after each round (they are never
        published). Needs the results tables (:meth:`install`) with at least one FX rate.
        """
        from airflow_dbqueue.spark import order_rollup  # PySpark: only where a session exists

        query = sql.SQL(load_queries(__package__ or "airflow_dbqueue.spark", "orders.sql")["warm_up_batch"])
        text = query.format(schema=sql.Identifier(self.schema), size=sql.Literal(int(size))).as_string(conn)
        seconds = []
        for _ in range(rounds):
            batch_id = str(uuid.uuid4())
            argv = ["--results-schema", self.schema, "--batch-id", batch_id, "--batch-size", str(size)]
            t0 = time.monotonic()
            try:
                order_rollup.batch_job(spark, [*argv, "--batch-query", text], jdbc)
            finally:
                with conn.transaction():
                    conn.execute(self._q("discard_staged"), {"batch_id": batch_id})
            seconds.append(time.monotonic() - t0)
        return seconds

    def totals(self, conn: psycopg.Connection[Any]) -> Totals:
        row = conn.execute(self._q("totals")).fetchone()
        assert row is not None
        return Totals(*row)

    def top(self, conn: psycopg.Connection[Any], n: int = 5) -> list[dict[str, Any]]:
        """The ``n`` largest groups by amount, as JSON-safe dicts."""
        cur = conn.execute(self._q("top_groups"), {"n": n})
        cols = [d.name for d in cur.description or []]
        return [
            {
                k: (v.isoformat() if isinstance(v, dt.datetime) else str(v) if isinstance(v, Decimal) else v)
                for k, v in zip(cols, row, strict=True)
            }
            for row in cur.fetchall()
        ]


def sample_orders(
    n: int,
    *,
    seed: int = 7,
    customers: int = 200,
    products: int = 40,
    start: dt.datetime | None = None,
    hours: float = 6.0,
    currencies: tuple[str, ...] = ("EUR", "EUR", "EUR", "USD", "GBP", "SEK"),
) -> Iterator[dict[str, Any]]:
    """Realistic order events: skewed customers and products, prices in several currencies."""
    rng = random.Random(seed)
    start = start or dt.datetime(2026, 11, 20, 8, 0, tzinfo=dt.UTC)
    prices = {p: Decimal(rng.randint(199, 19999)) / 100 for p in range(products)}
    span = hours * 3600
    for i in range(n):
        product = min(int(rng.paretovariate(1.2)) - 1, products - 1)
        customer = (
            min(int(rng.paretovariate(1.1)) - 1, customers - 1)
            if rng.random() < 0.5
            else rng.randrange(customers)
        )
        yield {
            "order_id": f"o-{seed}-{i:07d}",
            "customer_id": f"c-{customer:04d}",
            "product_id": f"p-{product:03d}",
            "quantity": rng.choice((1, 1, 1, 2, 2, 3, 5)),
            "unit_price": str(prices[product]),
            "currency": rng.choice(currencies),
            "ordered_at": (start + dt.timedelta(seconds=span * i / max(n, 1))).isoformat(),
            "channel": rng.choice(("web", "app", "store")),
        }


def expected_totals(
    orders: list[dict[str, Any]], rates: dict[str, str] | None = None
) -> tuple[int, int, Decimal]:
    """(orders, quantity, amount in EUR) that the results must hold for these events."""
    rates = SAMPLE_RATES if rates is None else rates
    cent = Decimal("0.0001")  # the job rounds each order's EUR amount to 4 places, half up
    amount = sum(
        (
            (o["quantity"] * Decimal(o["unit_price"]) * Decimal(rates[o["currency"]])).quantize(
                cent, ROUND_HALF_UP
            )
            for o in orders
        ),
        Decimal(0),
    )
    return len(orders), sum(o["quantity"] for o in orders), amount
