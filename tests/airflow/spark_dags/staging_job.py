"""A job that stages a batch without Spark work, on either Spark path.

It writes ``<staging dir>/<batch id>`` (the batch's size: what a real job's staging rows stand for) and
ends. Arguments: the staging directory, [one of the options below], then the operator's
``--batch-id ID --batch-size N --batch-query SQL``.

Under spark-submit (run as a file): with ``--orphan`` first, it plays the job of a try that was
killed: it goes on writing its staging every 0.2 s until it is stopped. With ``--kill-task-once``
first, the first time it runs (no ``killed-once`` file beside the staging directory) it SIGKILLs the
Airflow task process that started it (the parent of spark-submit, whose Java process is this job's
parent) and then goes on as such an orphan; later runs stage normally.

On Spark Connect (``batch_job``) it runs one small query on the server, then stages. With
``--connect URL SESSION_ID`` first (run as a file), it plays the Connect job of a killed try: a
client of that try's session (the id the operator derives from the try's consumer name) whose
operations carry the batch's tag, that writes its staging and runs a one-second Spark task on the
server, over and over, until the session is interrupted or gone.
"""

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


def parent_of(pid: int) -> int:
    """The parent process id of ``pid`` (Linux's /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _arg(rest: list[str], name: str) -> str:
    return rest[rest.index(name) + 1]


def batch_job(spark: Any, argv: list[str], jdbc: dict[str, str]) -> str:
    staging, rest = Path(argv[0]), argv[1:]
    batch_id, size = _arg(rest, "--batch-id"), _arg(rest, "--batch-size")
    assert spark.range(int(size)).count() == int(size)
    (staging / batch_id).write_text(f"{size}\n")
    return f"staged {size}"


def _connect_orphan(url: str, session_id: str, staging: Path, rest: list[str]) -> None:
    from pyspark.sql import SparkSession

    from airflow_dbqueue.operators.spark import batch_tag

    batch_id, size = _arg(rest, "--batch-id"), _arg(rest, "--batch-size")
    spark = SparkSession.builder.remote(f"{url}/;session_id={session_id}").create()
    spark.addTag(batch_tag(batch_id))
    print(f"staging_job: batch {batch_id} ({size} messages) as a Connect orphan", flush=True)
    while True:
        (staging / batch_id).write_text(f"{size}\n")
        spark.sql("SELECT reflect('java.lang.Thread', 'sleep', CAST(1000 AS BIGINT))").collect()


def main() -> None:
    staging, rest = Path(sys.argv[1]), sys.argv[2:]
    if rest[:1] == ["--connect"]:
        _connect_orphan(rest[1], rest[2], staging, rest[3:])
        return
    orphan = rest[:1] == ["--orphan"]
    marker = staging.parent / "killed-once"
    if rest[:1] == ["--kill-task-once"] and not marker.exists():
        task = parent_of(os.getppid())  # this job <- spark-submit (java) <- the task process
        cmdline = Path(f"/proc/{task}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        marker.write_text(f"{task} {cmdline}\n")
        print(f"staging_job: killing the task process {task}: {cmdline}", flush=True)
        os.kill(task, signal.SIGKILL)
        orphan = True
    batch_id, size = _arg(rest, "--batch-id"), _arg(rest, "--batch-size")
    print(f"staging_job: batch {batch_id} ({size} messages){' as an orphan' if orphan else ''}", flush=True)
    while True:
        (staging / batch_id).write_text(f"{size}\n")
        if not orphan:
            break
        time.sleep(0.2)


if __name__ == "__main__":
    main()
