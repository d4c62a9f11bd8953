"""A job that only sleeps ``argv[1]`` seconds, on either Spark path.

The operator tests use it to hold a batch for a while without Spark work: the lease heartbeat, the
task timeout and the kill path are about the batch, not about what the job computes. Under
spark-submit (run as a file) the driver sleeps; on Spark Connect (``batch_job``) a Spark task on the
server sleeps (``java.lang.Thread.sleep`` through ``reflect``), so that stopping the job means
interrupting the server's work.
"""

import sys
import time
from typing import Any


def batch_job(spark: Any, argv: list[str], jdbc: dict[str, str]) -> str:
    millis = int(float(argv[0]) * 1000)
    print(f"sleepy_job: sleeping {argv[0]}s on the Connect server with {argv[1:3]}", flush=True)
    spark.sql(f"SELECT reflect('java.lang.Thread', 'sleep', CAST({millis} AS BIGINT))").collect()
    return "slept"


if __name__ == "__main__":
    print(f"sleepy_job: sleeping {sys.argv[1]}s with {sys.argv[2:4]}", flush=True)
    time.sleep(float(sys.argv[1]))
    print("sleepy_job: done", flush=True)
