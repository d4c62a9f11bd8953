"""A Spark application (run by spark-submit's Python runner) that stages a batch without Spark work.

It writes ``<staging dir>/<batch id>`` (the batch's size: what a real job's staging rows stand for) and
ends. With ``--orphan`` first, it plays the job of a try that was killed: it goes on writing its
staging every 0.2 s until it is stopped. With ``--kill-task-once`` first, the first time it runs (no
``killed-once`` file beside the staging directory) it SIGKILLs the Airflow task process that started
it (the parent of spark-submit, whose Java process is this job's parent) and then goes on as such an
orphan; later runs stage normally. Arguments: the staging directory, [one of those], then the
operator's ``--batch-id ID --batch-size N --batch-query SQL``.
"""

import os
import signal
import sys
import time
from pathlib import Path


def parent_of(pid: int) -> int:
    """The parent process id of ``pid`` (Linux's /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


staging, rest = Path(sys.argv[1]), sys.argv[2:]
orphan = rest[:1] == ["--orphan"]
marker = staging.parent / "killed-once"
if rest[:1] == ["--kill-task-once"] and not marker.exists():
    task = parent_of(os.getppid())  # this job <- spark-submit (java) <- the task process
    cmdline = Path(f"/proc/{task}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    marker.write_text(f"{task} {cmdline}\n")
    print(f"staging_job: killing the task process {task}: {cmdline}", flush=True)
    os.kill(task, signal.SIGKILL)
    orphan = True
batch_id = rest[rest.index("--batch-id") + 1]
size = rest[rest.index("--batch-size") + 1]
print(f"staging_job: batch {batch_id} ({size} messages){' as an orphan' if orphan else ''}", flush=True)
while True:
    (staging / batch_id).write_text(f"{size}\n")
    if not orphan:
        break
    time.sleep(0.2)
