"""The Airflow examples of docs/*.md: DAG files that parse, and one that runs with ``airflow dags test``.

``parse`` examples (they need a Spark cluster, a triggerer or tables of their own to run) are executed
as DAG files and must define a DAG with tasks. ``dag`` examples run with ``airflow dags test`` against
a real PostgreSQL, and the queue and the XComs are checked afterwards. See tests/docs_examples.py.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from airflow_dbqueue.engine import DbQueue
from tests.airflow.conftest import dags_test, migrated_airflow_env
from tests.airflow.test_dags import xcom
from tests.docs_examples import Example, all_examples
from tests.helpers import checksum

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("example", all_examples("parse"), ids=str)
def test_dag_example_parses(example: Example, tmp_path: Path) -> None:
    from airflow.dag_processing.dagbag import DagBag

    (tmp_path / "example_dag.py").write_text(example.code)
    bag = DagBag(dag_folder=str(tmp_path))
    assert not bag.import_errors, f"{example.where}: {bag.import_errors}"
    assert len(bag.dags) == 1, f"{example.where}: expected one DAG, got {list(bag.dags)}"
    [dag] = bag.dags.values()
    assert dag.task_ids, f"{example.where}: the DAG has no tasks"


@pytest.mark.parametrize("example", all_examples("dag"), ids=str)
def test_dag_example_runs(example: Example, tmp_path: Path, pg_dsn: str, dbq: DbQueue) -> None:
    dag_id, queue = example.options["dag_id"], example.options["queue"]
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / f"{dag_id}.py").write_text(example.code)
    env = migrated_airflow_env(tmp_path / "home", dags)
    ok, out = dags_test(env, pg_dsn, dbq.schema, dag_id)
    assert ok, f"{example.where}:\n{out[-4000:]}"
    stats = dbq.queue(queue).stats()
    finished = int(example.options["finished"])
    assert (stats.ready, stats.delayed, stats.in_flight, stats.failed) == (0, 0, 0, 0)
    assert stats.finished == finished
    for task_id, expected in example.options.get("xcom", {}).items():
        assert xcom(env, dag_id, task_id) == expected, f"{example.where}: XCom of {task_id}"
    if "payloads" in example.options:  # what was finished is exactly what the DAG's producer made
        pushed = runpy.run_path(str(dags / f"{dag_id}.py"))[example.options["payloads"]](None)
        with psycopg.connect(pg_dsn) as c:
            rows = c.execute(
                sql.SQL(
                    "SELECT coalesce(f.payload, d.payload) FROM {s}.done f LEFT JOIN {s}.data d USING (id) "
                    "WHERE f.queue_id = %s AND f.outcome = 1"
                ).format(s=sql.Identifier(dbq.schema)),
                (dbq.queue(queue).settings.queue_id,),
            ).fetchall()
        done = [json.loads(bytes(r[0])) for r in rows]
        assert len(done) == len(pushed) == finished
        assert checksum(done) == checksum(pushed)
