"""``dbqueue demo`` and ``dbqueue pipeline``: a queue-driven pipeline on the engine alone, and the
Spark pipeline of the README (the command line itself is :mod:`airflow_dbqueue.cli`)."""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter, defaultdict
from typing import Any

from airflow_dbqueue.engine import DbQueue, Message


def say(msg: str) -> None:
    """Print a line of the command's output at once."""
    print(msg, flush=True)


PRODUCTS = {"espresso": 2.5, "latte": 3.8, "croissant": 2.9, "bagel": 3.1, "granola": 5.4, "tea": 2.2}


def _orders(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    products = list(PRODUCTS)
    out = []
    for i in range(n):
        product = rng.choice(products)
        qty = rng.randint(1, 4)
        out.append(
            {
                "order_id": f"o-{seed}-{i:06d}",
                "customer": f"c{rng.randint(1, 250):04d}",
                "product": product,
                "qty": qty,
                "amount_cents": round(PRODUCTS[product] * 100) * qty,
                "ts": 1_763_700_000 + i,
            }
        )
    return out


def cmd_demo(dbq: DbQueue, args: argparse.Namespace) -> int:  # noqa: PLR0915
    """Producers push order events; consumers lease batches, aggregate them and ack; poison messages
    are retried and end up failed; totals are checked against what was pushed.

    Long on purpose: the demo reads top to bottom as the story it prints (push, drain, report, check), and its
    closures share the counts.
    """
    t_start = time.monotonic()
    dbq.install()
    dbq.drop_queue("demo_orders", missing_ok=True)
    q = dbq.create_queue("demo_orders", max_attempts=3, retry_backoff=0.05, retry_backoff_max=0.2)
    n = args.messages
    producers, consumers, batch = 2, 2, 250
    orders = [_orders(n // producers + (1 if p < n % producers else 0), seed=p) for p in range(producers)]
    poison = {o["order_id"] for o in orders[0][:: max(1, n // 5)]}
    for o in orders[0]:
        if o["order_id"] in poison:
            o["poison"] = True
    pushed_cents = sum(o["amount_cents"] for part in orders for o in part)
    say(f"pushing {n} order events with {producers} producers in batches of {batch} ...")

    lock = threading.Lock()
    done_pushing = threading.Event()
    revenue: dict[str, int] = defaultdict(int)
    per_product: Counter[str] = Counter()
    processed: set[str] = set()
    batches = 0
    errors: list[BaseException] = []

    def produce(part: list[dict[str, Any]]) -> None:
        try:
            for i in range(0, len(part), batch):
                q.push_batch(part[i : i + batch])
        except BaseException as exc:
            errors.append(exc)

    def handle(msgs: list[Message]) -> None:
        nonlocal batches
        good = [m for m in msgs if not m.payload.get("poison")]
        bad = [m for m in msgs if m.payload.get("poison")]
        with lock:
            for m in good:
                if m.payload["order_id"] not in processed:  # at least once: drop redeliveries
                    processed.add(m.payload["order_id"])
                    revenue[m.payload["customer"]] += m.payload["amount_cents"]
                    per_product[m.payload["product"]] += m.payload["qty"]
            batches += 1
        if good:
            q.ack(good)
        if bad:
            q.nack(bad, error="poison order: validation failed")

    def consume() -> None:
        try:
            while True:
                msgs = q.pop(batch, semantics="at-least-once", wait=0.5, poll_interval=0.1)
                if msgs:
                    handle(msgs)
                elif done_pushing.is_set():
                    s = q.stats()
                    if s.ready == 0 and s.in_flight == 0 and s.delayed == 0:
                        return
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(part,)) for part in orders]
    threads += [threading.Thread(target=consume) for _ in range(consumers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads[:producers]:
        t.join()
    done_pushing.set()
    t_push = time.monotonic() - t0
    say(f"pushed {n} in {t_push:.2f}s ({n / t_push:,.0f} msg/s); consumers draining ...")
    last = time.monotonic()
    while any(t.is_alive() for t in threads[producers:]):
        time.sleep(0.2)
        if time.monotonic() - last > 2:
            last = time.monotonic()
            with lock:
                say(f"  ... processed {len(processed)} of {n - len(poison)}")
    t_all = time.monotonic() - t0
    if errors:
        raise errors[0]

    s = q.stats()
    failed = q.list_failed(limit=1000)
    processed_cents = sum(revenue.values())
    failed_cents = sum(f.payload["amount_cents"] for f in failed)
    say("")
    say(f"pushed      {n} messages ({pushed_cents / 100:,.2f} in orders)")
    say(f"processed   {len(processed)} messages in {batches} batches ({processed_cents / 100:,.2f})")
    say(f"failed      {len(failed)} poison messages after {q.settings.max_attempts} attempts each")
    say(f"throughput  {len(processed) / t_all:,.0f} msg/s end to end ({t_all:.2f}s)")
    say(f"queue stats {json.dumps(s.as_dict())}")
    say("top customers by revenue:")
    for cust, cents in sorted(revenue.items(), key=lambda kv: -kv[1])[:5]:
        say(f"  {cust}  {cents / 100:>10,.2f}")
    say("units by product: " + ", ".join(f"{p}={u}" for p, u in per_product.most_common()))
    ok = (
        len(processed) + len(failed) == n
        and processed_cents + failed_cents == pushed_cents
        and {f.payload["order_id"] for f in failed} == poison
        and s.ready == s.in_flight == 0
    )
    say(f"check       {'OK' if ok else 'MISMATCH'}: processed + failed == pushed (count and amount)")
    say(f"total time  {time.monotonic() - t_start:.1f}s")
    return 0 if ok else 1


def cmd_pipeline(dbq: DbQueue, args: argparse.Namespace) -> int:
    from pathlib import Path

    from airflow_dbqueue.spark import demo

    home = Path(args.airflow_home) if args.airflow_home else None
    return demo.run(
        dbq.db.dsn,
        messages=args.messages,
        batch=args.batch,
        airflow_home=home,
        spark=args.spark,
        design=args.design,
    )
