"""A Spark application (run by spark-submit's Python runner) that reports what it was given.

It writes, to the file ``$ARGS_OUT``: its arguments, whether ``$DBQUEUE_JDBC_PASSWORD`` reached it, and
the command lines of its ancestors (the driver's JVM, spark-submit, the task), so a test can check
that the templated arguments arrived as a list and that the password is on no command line.
"""

import json
import os
import sys


def ancestors(pid: int, depth: int = 6) -> list[str]:
    out = []
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, ValueError, IndexError):
            break
    return out


with open(os.environ["ARGS_OUT"], "w") as f:
    json.dump(
        {
            "argv": sys.argv[1:],
            "password": os.environ.get("DBQUEUE_JDBC_PASSWORD"),
            "ancestors": ancestors(os.getpid()),
        },
        f,
    )
print("args_job: done", flush=True)
