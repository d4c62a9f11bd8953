"""A Spark application (run by spark-submit's Python runner) that stages a batch without Spark work.

It writes ``<staging dir>/<batch id>`` (the batch's size: what a real job's staging rows stand for) and
ends. With ``--orphan`` first, it plays the job of a try that was killed: it goes on writing its
staging every 0.2 s until it is stopped. Arguments: the staging directory, [``--orphan``], then the
operator's ``--batch-id ID --batch-size N --batch-query SQL``.
"""

import sys
import time
from pathlib import Path

staging, rest = Path(sys.argv[1]), sys.argv[2:]
orphan = rest[:1] == ["--orphan"]
batch_id = rest[rest.index("--batch-id") + 1]
size = rest[rest.index("--batch-size") + 1]
print(f"staging_job: batch {batch_id} ({size} messages){' as an orphan' if orphan else ''}", flush=True)
while True:
    (staging / batch_id).write_text(f"{size}\n")
    if not orphan:
        break
    time.sleep(0.2)
