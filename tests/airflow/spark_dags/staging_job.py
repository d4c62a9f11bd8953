"""A job that stages a batch without Spark work, on either Spark path.

It writes ``<staging dir>/<batch id>`` (the batch's size: what a real job's staging rows stand for) and
ends. Arguments: the staging directory, [one of the options below], then the operator's
``--batch-id ID --batch-size N --batch-query SQL``.

Under spark-submit (run as a file): with ``--orphan`` first, it plays the job of a try that was
killed: it goes on writing its staging every 0.2 s until it is stopped. With ``--kill-task-once``
first (or ``--kill-task-once=NAME``: a ``killed-once-NAME`` file, so that DAGs run side by side each
kill once), the first time it runs (no ``killed-once`` file beside the staging directory) it SIGKILLs the
Airflow task process that started it (the parent of spark-submit, whose Java process is this job's
parent) and then goes on as such an orphan; later runs stage normally.

On Spark Connect (``batch_job``) it runs one small query on the server, then stages. With
``--connect URL SESSION_ID TAG`` first (run as a file), it plays the Connect job of a killed try: a
client of that try's session (the id the operator derives from the try's consumer name) whose
operations carry the batch's tag (``batch_tag``, passed in: a task's children cannot import
Airflow, whose database the task hides from them), that writes its staging and runs a 60-second
Spark task on the server, over and over, until the session is interrupted or gone. With
``--kill-task-once`` first, the first time it runs (no ``killed-once-connect`` file beside the
staging directory) it starts such a client of its own session and batch, waits until that has
staged, and SIGKILLs the Airflow task process, which is the process ``batch_job`` runs in; later
runs stage normally.
"""

import os
import signal
import subprocess
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


def _kill_marker(staging: Path, rest: list[str], name: str) -> Path | None:
    """The marker file of ``--kill-task-once`` or ``--kill-task-once=NAME`` (``name-NAME``: DAGs that
    run side by side each kill their own task once), or None without the option."""
    opt, _, suffix = rest[0].partition("=") if rest else ("", "", "")
    if opt != "--kill-task-once":
        return None
    return staging.parent / (f"{name}-{suffix}" if suffix else name)


def batch_job(spark: Any, argv: list[str], jdbc: dict[str, str]) -> str:
    staging, rest = Path(argv[0]), argv[1:]
    batch_id, size = _arg(rest, "--batch-id"), _arg(rest, "--batch-size")
    marker = _kill_marker(staging, rest, "killed-once-connect")
    if marker is not None and not marker.exists():
        _kill_task_leaving_an_orphan(spark, staging, batch_id, size, marker)
    assert spark.range(int(size)).count() == int(size)
    (staging / batch_id).write_text(f"{size}\n")
    return f"staged {size}"


def _kill_task_leaving_an_orphan(spark: Any, staging: Path, batch_id: str, size: str, marker: Path) -> None:
    """SIGKILL this task process mid-batch, its job going on in its session on the server: a client of
    that session (a process of its own, in a session of its own) that runs the batch's tagged
    operations and writes its staging until the session is interrupted or gone."""
    from airflow_dbqueue.operators.spark import batch_tag

    url = f"sc://{spark.client._builder.endpoint}"
    job = [sys.executable, __file__, str(staging), "--connect", url, spark.session_id, batch_tag(batch_id)]
    with (staging.parent / f"orphan-{batch_id}.log").open("wb") as out:
        subprocess.Popen(
            [*job, "--batch-id", batch_id, "--batch-size", size, "--batch-query", "-"],
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 120
    while not (staging / batch_id).exists():  # the orphan has run the batch's job once
        assert time.monotonic() < deadline, "the orphan never started"
        time.sleep(0.2)
    task = os.getpid()
    cmdline = Path(f"/proc/{task}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    marker.write_text(f"{task} {cmdline}\n")
    print(f"staging_job: killing the task process {task}: {cmdline}", flush=True)
    os.kill(task, signal.SIGKILL)


def _connect_orphan(url: str, session_id: str, tag: str, staging: Path, rest: list[str]) -> None:
    from pyspark.sql import SparkSession

    batch_id, size = _arg(rest, "--batch-id"), _arg(rest, "--batch-size")
    spark = SparkSession.builder.remote(f"{url}/;session_id={session_id}").create()
    spark.addTag(tag)
    print(f"staging_job: batch {batch_id} ({size} messages) as a Connect orphan", flush=True)
    while True:
        (staging / batch_id).write_text(f"{size}\n")
        # one long operation: the retry's interrupt lands while it runs, not between two of them
        spark.sql("SELECT reflect('java.lang.Thread', 'sleep', CAST(60000 AS BIGINT))").collect()


def main() -> None:
    staging, rest = Path(sys.argv[1]), sys.argv[2:]
    if rest[:1] == ["--connect"]:
        _connect_orphan(rest[1], rest[2], rest[3], staging, rest[4:])
        return
    orphan = rest[:1] == ["--orphan"]
    marker = _kill_marker(staging, rest, "killed-once")
    if marker is not None and not marker.exists():
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
