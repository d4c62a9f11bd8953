"""A Spark application (run by spark-submit's Python runner) that only sleeps ``argv[1]`` seconds.

The operator tests use it to hold a batch for a while without Spark work: the lease heartbeat, the
task timeout and the kill path are about the batch, not about what the job computes.
"""

import sys
import time

print(f"sleepy_job: sleeping {sys.argv[1]}s with {sys.argv[2:4]}", flush=True)
time.sleep(float(sys.argv[1]))
print("sleepy_job: done", flush=True)
