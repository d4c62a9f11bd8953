"""Test DAGs for DbQueueSparkSubmitOperator's command lines and templating (see test_spark_submit.py).

``dbqueue_test_spark_templating`` runs a real ``spark-submit`` (the ``spark_default`` connection,
local). ``dbqueue_test_spark_masters`` runs one task per master and deploy mode, each with its own Spark
connection (``spark_<mode>``); the test puts a recording stand-in for ``spark-submit`` first on PATH,
since no cluster runs here.
"""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import DAG, task

from airflow_dbqueue.operators.spark import DbQueueSparkSubmitOperator

HERE = Path(__file__).parent
ARGS_JOB = str(HERE / "args_job.py")
PASSWORD_FILE = "/etc/dbqueue/jdbc-password"

with DAG(
    dag_id="dbqueue_test_spark_templating",
    schedule=None,
    catchup=False,
    params={"args": ["--label", 'it\'s "quoted"', "--n", 7], "out": "/tmp"},
):

    @task
    def make_args() -> list[object]:
        return ["--label", "from xcom", "--n", 3]

    from_xcom = DbQueueSparkSubmitOperator(
        task_id="from_xcom",
        queue_name="jobs",
        application=ARGS_JOB,
        application_args=make_args(),
        env_vars={"ARGS_OUT": "{{ params.out }}/from_xcom.json"},
        max_messages=10,
    )
    from_jinja = DbQueueSparkSubmitOperator(
        task_id="from_jinja",
        queue_name="jobs",
        application=ARGS_JOB,
        application_args="{{ params.args }}",
        env_vars={"ARGS_OUT": "{{ params.out }}/from_jinja.json"},
        max_messages=10,
    )
    from_xcom >> from_jinja

# mode -> (application, cluster mode); each task uses the Spark connection spark_<mode>.
MODES = {
    "local": ("job.py", False),
    "standalone_client": ("job.py", False),
    "standalone_cluster": ("hdfs:///jobs/rollup.jar", True),
    "standalone_cluster_fails": ("hdfs:///jobs/fails.jar", True),
    "yarn_client": ("job.py", False),
    "yarn_cluster": ("job.py", True),
    "k8s_client": ("job.py", False),
    "k8s_cluster": ("local:///opt/jobs/job.py", True),
}

with DAG(dag_id="dbqueue_test_spark_masters", schedule=None, catchup=False):
    for mode, (application, cluster) in MODES.items():
        DbQueueSparkSubmitOperator(
            task_id=mode,
            queue_name="jobs",
            application=application,
            application_args=["--mode", mode],
            spark_conn_id=f"spark_{mode}",
            spark_conf={"spark.ui.enabled": "false"},
            spark_submit_kwargs={"java_class": "org.example.Rollup"} if application.endswith(".jar") else {},
            jdbc_password_file=PASSWORD_FILE if cluster else None,
            max_messages=5,
            retries=0,
        )
    # Cluster mode, a connection with a password, and no jdbc_password_file: refused before a claim.
    DbQueueSparkSubmitOperator(
        task_id="yarn_cluster_no_password_file",
        queue_name="jobs",
        application="job.py",
        spark_conn_id="spark_yarn_cluster",
        max_messages=5,
        retries=0,
    )
