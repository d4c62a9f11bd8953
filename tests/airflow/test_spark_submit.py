"""DbQueueSparkSubmitOperator's spark-submit command lines, credentials and templating, run as Airflow runs
them (``airflow dags test``: real task code, real rendering, the Spark provider's real SparkSubmitHook).

- Templating: ``application_args`` as an XComArg and as a Jinja string reach a real local
  ``spark-submit`` as argument lists, and the JDBC password reaches the job in its environment while
  no command line of the job's ancestors (the JVM, spark-submit) holds it.
- Masters: no Spark cluster runs here, so for the standalone, YARN and Kubernetes masters a recording
  stand-in for ``spark-submit`` sits first on PATH. It records the exact command line and
  environment the operator gives it and prints what the real one prints for the provider to follow
  (a YARN application id, a Kubernetes driver pod and exit code, a standalone driver id); the
  standalone cluster driver's status comes from a stand-in of the master's REST API on 127.0.0.1.
  What the clusters then do with the command line is not tested here.
"""

from __future__ import annotations

import http.server
import json
import os
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_dbqueue.engine import ConfigurationError, DbQueue
from airflow_dbqueue.spark import find_jdbc_jar
from tests.airflow.conftest import CONN_ID, conn_json, dags_test, migrated_airflow_env, spark_env
from tests.dialects import run_sql
from tests.helpers import checksum

pytestmark = pytest.mark.integration

DAGS = Path(__file__).with_name("spark_dags")
PASSWORD = "pw-Zq7-never-on-argv"
PASSWORD_FILE = "/etc/dbqueue/jdbc-password"


@pytest.fixture(scope="module")
def submit_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return spark_env(migrated_airflow_env(tmp_path_factory.mktemp("airflow-home-submit"), DAGS))


def with_password(pg_dsn: str, schema: str) -> dict[str, str]:
    """``dbqueue_default`` with a password (the test server trusts local connections and ignores it)."""
    conn = json.loads(conn_json(pg_dsn, schema))
    return {f"AIRFLOW_CONN_{CONN_ID.upper()}": json.dumps({**conn, "password": PASSWORD})}


def batches(dbq: DbQueue) -> list[tuple[str, int, int]]:
    """(batch id, state, size) by claim time; state 1 is acked, 2 released."""
    rows = run_sql(dbq, "SELECT batch_id, state, cardinality(ids) FROM {schema}.batches ORDER BY claimed_at")
    return [(str(b), s, n) for b, s, n in rows]


def finished_payloads(dbq: DbQueue) -> list[Any]:
    """Payloads of the finished messages: in their done rows (small ones) or in data (large ones)."""
    rows = run_sql(
        dbq,
        "SELECT coalesce(f.payload, d.payload) FROM {schema}.done f LEFT JOIN {schema}.data d ON d.id = f.id",
    )
    return [json.loads(bytes(r[0])) for r in rows]


@pytest.mark.usefixtures("spark_system")  # a real spark-submit: Java, and the jar it is handed
def test_templated_arguments_and_the_password_reach_a_real_local_spark_submit(
    submit_env: dict[str, str], pg_dsn: str, dbq: DbQueue, tmp_path: Path
) -> None:
    q = dbq.create_queue("jobs")
    sent = [{"job": i} for i in range(20)]
    q.push_batch(sent)
    ok, out = dags_test(
        submit_env,
        pg_dsn,
        dbq.schema,
        "dbqueue_test_spark_templating",
        {"out": str(tmp_path)},
        **with_password(pg_dsn, dbq.schema),
    )
    assert ok, out[-5000:]
    runs = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("from_xcom", "from_jinja")}
    acked = batches(dbq)
    assert [(s, n) for _, s, n in acked] == [(1, 10), (1, 10)]
    for (batch_id, _, _), (name, args) in zip(
        acked,
        [
            ("from_xcom", ["--label", "from xcom", "--n", "3"]),
            ("from_jinja", ["--label", 'it\'s "quoted"', "--n", "7"]),
        ],
        strict=True,
    ):
        run = runs[name]
        assert run["argv"] == [
            *args,
            "--batch-id",
            batch_id,
            "--batch-size",
            "10",
            "--batch-query",
            q.batch_query(batch_id),
        ], name
        assert run["password"] == PASSWORD, name  # in the job's environment
        assert any("org.apache.spark.deploy.SparkSubmit" in c for c in run["ancestors"]), run["ancestors"]
        assert not [c for c in run["ancestors"] if PASSWORD in c], name  # on no command line
    assert checksum(finished_payloads(dbq)) == checksum(sent)
    assert (q.stats().ready, q.stats().in_flight, q.stats().finished) == (0, 0, 20)


FAKE_SPARK_SUBMIT = """#!{python}
# A stand-in for spark-submit: records its command line and environment, and prints what the real
# one prints for SparkSubmitHook to follow in each mode.
import json, os, sys, uuid
args = sys.argv[1:]
env = {{k: v for k, v in os.environ.items() if k.startswith("DBQUEUE_")}}
with open(os.path.join({record!r}, uuid.uuid4().hex + ".json"), "w") as f:
    json.dump({{"argv": args, "env": env}}, f)
master = args[args.index("--master") + 1]
cluster = "--deploy-mode" in args and args[args.index("--deploy-mode") + 1] == "cluster"
mode = args[args.index("--mode") + 1] if "--mode" in args else "?"
print("stand-in spark-submit for", mode, flush=True)
if master.startswith("yarn") and cluster:
    print("INFO Client: Submitted application application_1700000000000_0042", flush=True)
elif master.startswith("k8s") and cluster:
    print("INFO LoggingPodStatusWatcherImpl: pod name: dbqueue-jobs-1a2b3c-driver", flush=True)
    print("INFO LoggingPodStatusWatcherImpl: Exit code: 0", flush=True)
elif master.startswith("spark") and cluster:
    n = "0099" if "fails.jar" in " ".join(args) else "0001"
    print(f"INFO Client: Submitted driver driver-20260101000000-{{n}}", flush=True)
"""


class _StandaloneMaster(http.server.BaseHTTPRequestHandler):
    """The REST status API of a Spark standalone master: driver ...-0099 fails, others finish after a
    first RUNNING answer (so the provider polls more than once)."""

    asked: dict[str, int] = {}

    def do_GET(self) -> None:
        driver = self.path.rsplit("/", 1)[-1]
        n = self.asked[driver] = self.asked.get(driver, 0) + 1
        state = "RUNNING" if n == 1 else ("FAILED" if driver.endswith("0099") else "FINISHED")
        body = {"action": "SubmissionStatusResponse", "driverState": state, "submissionId": driver}
        data = json.dumps(body, indent=2, separators=(",", " : ")).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def standalone_master() -> Iterator[int]:
    _StandaloneMaster.asked = {}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandaloneMaster)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def spark_connections(rest_port: int) -> dict[str, str]:
    def conn(host: str, **extra: Any) -> str:
        return json.dumps({"conn_type": "spark", "host": host, "extra": extra})

    standalone = "spark://127.0.0.1:7077"
    k8s = "k8s://https://127.0.0.1:6443"
    conns = {
        "local": conn("local[2]"),
        "standalone_client": conn(standalone, **{"deploy-mode": "client"}),
        "standalone_cluster": conn(standalone, **{"deploy-mode": "cluster", "rest-port": str(rest_port)}),
        "standalone_cluster_fails": conn(
            standalone, **{"deploy-mode": "cluster", "rest-port": str(rest_port)}
        ),
        "yarn_client": conn("yarn", **{"deploy-mode": "client"}),
        "yarn_cluster": conn("yarn", **{"deploy-mode": "cluster"}),
        "k8s_client": conn(k8s, **{"deploy-mode": "client", "namespace": "jobs"}),
        "k8s_cluster": conn(k8s, **{"deploy-mode": "cluster", "namespace": "jobs"}),
    }
    return {f"AIRFLOW_CONN_SPARK_{mode.upper()}": c for mode, c in conns.items()}


@pytest.mark.usefixtures("jdbc_driver")  # the stand-in needs no Java; the operator hands on the jar
def test_command_lines_of_every_master_hold_no_secret_with_a_stand_in_spark_submit_no_cluster(
    submit_env: dict[str, str], pg_dsn: str, dbq: DbQueue, tmp_path: Path, standalone_master: int
) -> None:
    q = dbq.create_queue("jobs")
    sent = [{"job": i} for i in range(40)]
    q.push_batch(sent)
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    fake = bin_dir / "spark-submit"
    fake.write_text(FAKE_SPARK_SUBMIT.format(python=sys.executable, record=str(record)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(submit_env, PATH=f"{bin_dir}{os.pathsep}{submit_env['PATH']}")
    ok, out = dags_test(
        env,
        pg_dsn,
        dbq.schema,
        "dbqueue_test_spark_masters",
        **with_password(pg_dsn, dbq.schema),
        **spark_connections(standalone_master),
    )
    assert not ok, out[-5000:]  # the failing standalone driver fails its task, and so the run

    calls = [json.loads(p.read_text()) for p in record.iterdir()]
    by_mode = {c["argv"][c["argv"].index("--mode") + 1]: c for c in calls}
    assert len(calls) == len(by_mode) == 8, sorted(by_mode)
    by_batch = {b: (s, n) for b, s, n in batches(dbq)}
    jar = find_jdbc_jar()
    assert jar is not None
    url = f"jdbc:postgresql://{_host_port_db(pg_dsn)}"

    def expected(mode: str, master: str, options: list[str], application: str) -> list[str]:
        argv = by_mode[mode]["argv"]
        batch_id = argv[argv.index("--batch-id") + 1]
        return [
            "--master",
            master,
            "--conf",
            "spark.ui.enabled=false",
            *options,
            "--name",
            f"dbqueue-jobs-{batch_id[:8]}",
            *(["--class", "org.example.Rollup"] if application.endswith(".jar") else []),
            *_deploy_mode(mode),
            application,
            "--mode",
            mode,
            "--batch-id",
            batch_id,
            "--batch-size",
            "5",
            "--batch-query",
            q.batch_query(batch_id),
        ]

    def driver_env_confs(prefix: str) -> list[str]:
        return [
            "--conf",
            f"{prefix}.DBQUEUE_JDBC_URL={url}",
            "--conf",
            f"{prefix}.DBQUEUE_JDBC_PASSWORD_FILE={PASSWORD_FILE}",
            "--conf",
            f"{prefix}.DBQUEUE_JDBC_USER={_user(pg_dsn)}",
        ]

    jars = ["--jars", jar]
    k8s_ns = ["--conf", "spark.kubernetes.namespace=jobs"]
    want = {
        "local": expected("local", "local[2]", jars, "job.py"),
        "standalone_client": expected("standalone_client", "spark://127.0.0.1:7077", jars, "job.py"),
        "standalone_cluster": expected(
            "standalone_cluster", "spark://127.0.0.1:7077", jars, "hdfs:///jobs/rollup.jar"
        ),
        "standalone_cluster_fails": expected(
            "standalone_cluster_fails", "spark://127.0.0.1:7077", jars, "hdfs:///jobs/fails.jar"
        ),
        "yarn_client": expected("yarn_client", "yarn", jars, "job.py"),
        "yarn_cluster": expected(
            "yarn_cluster", "yarn", [*driver_env_confs("spark.yarn.appMasterEnv"), *jars], "job.py"
        ),
        "k8s_client": expected("k8s_client", "k8s://https://127.0.0.1:6443", [*k8s_ns, *jars], "job.py"),
        "k8s_cluster": expected(
            "k8s_cluster",
            "k8s://https://127.0.0.1:6443",
            [*driver_env_confs("spark.kubernetes.driverEnv"), *k8s_ns, *jars],
            "local:///opt/jobs/job.py",
        ),
    }
    for mode, call in by_mode.items():
        assert _sorted_confs(call["argv"]) == _sorted_confs(want[mode]), mode
        assert PASSWORD not in " ".join(call["argv"]), mode
        cluster = mode.endswith(("_cluster", "_cluster_fails"))
        assert call["env"].get("DBQUEUE_JDBC_PASSWORD") == (None if cluster else PASSWORD), mode
        assert call["env"].get("DBQUEUE_JDBC_PASSWORD_FILE") == (PASSWORD_FILE if cluster else None), mode
        assert call["env"]["DBQUEUE_JDBC_URL"] == url, mode
        argv = call["argv"]
        state, size = by_batch[argv[argv.index("--batch-id") + 1]]
        assert (state, size) == ((2, 5) if mode == "standalone_cluster_fails" else (1, 5)), mode
    # the standalone drivers were followed to their end through the master's status API
    assert _StandaloneMaster.asked == {"driver-20260101000000-0001": 2, "driver-20260101000000-0099": 2}
    assert "ended in state FAILED" in out
    # cluster mode with a password but no jdbc_password_file: refused before anything was claimed
    assert "set jdbc_password_file to a file holding it" in out
    assert len(by_batch) == 8
    st = q.stats()
    assert (st.ready, st.in_flight, st.finished) == (5, 0, 35)  # the failed driver's batch is back
    assert checksum(finished_payloads(dbq) + [m.payload for m in q.peek(10)]) == checksum(sent)


def _deploy_mode(mode: str) -> list[str]:
    if mode == "local":
        return []
    return ["--deploy-mode", "cluster" if "cluster" in mode else "client"]


def _sorted_confs(argv: list[str]) -> list[str]:
    """``argv`` with its ``--conf`` pairs in a fixed order (the operator builds them from mappings)."""
    confs = sorted(argv[i + 1] for i, a in enumerate(argv) if a == "--conf")
    rest = [a for i, a in enumerate(argv) if a != "--conf" and (i == 0 or argv[i - 1] != "--conf")]
    return [*rest, *confs]


def _host_port_db(pg_dsn: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    return f"{info.get('host', '127.0.0.1')}:{info.get('port', 5432)}/{info.get('dbname')}"


def _user(pg_dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(pg_dsn).get("user"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spark_submit_kwargs": {"track_driver_via_k8s_api": True}}, "track_driver_via_k8s_api=True"),
        ({"spark_submit_kwargs": {"yarn_track_via_rm_api": True}}, "yarn_track_via_rm_api=True"),
        (
            {"spark_conf": {"spark.yarn.submit.waitAppCompletion": "false"}},
            "spark.yarn.submit.waitAppCompletion=false",
        ),
        (
            {"spark_conf": {"spark.kubernetes.submission.waitAppCompletion": "False"}},
            "spark.kubernetes.submission.waitAppCompletion=false",
        ),
        ({"spark_submit_kwargs": {"env_vars": {"A": "1"}}}, "use the operator's env_vars="),
    ],
)
def test_settings_that_return_before_the_job_ends_are_refused(kwargs: dict[str, Any], match: str) -> None:
    from airflow_dbqueue.operators.spark import DbQueueSparkSubmitOperator

    with pytest.raises(ConfigurationError, match=match):
        DbQueueSparkSubmitOperator(task_id="t", queue_name="q", application="job.py", **kwargs)
