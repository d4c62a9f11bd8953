"""PySpark jobs launched by ``spark-submit``, and the pipeline code around them (no Airflow imports).

:data:`ORDER_ROLLUP_JOB` is the path of the order-rollup job, the application a DAG hands to
``DbQueueSparkSubmitOperator``. Jobs read batches from the queue database with Spark's JDBC source,
so they need PostgreSQL's JDBC driver: :func:`find_jdbc_jar` says where it is.
"""

from __future__ import annotations

import os
from pathlib import Path

ORDER_ROLLUP_JOB = str(Path(__file__).with_name("order_rollup.py"))

JDBC_JAR_ENV = "DBQUEUE_JDBC_JAR"
#: Where Debian's libpostgresql-jdbc-java puts the PostgreSQL JDBC driver.
DEBIAN_JDBC_JAR = "/usr/share/java/postgresql.jar"
JDBC_HINT = (
    f"no PostgreSQL JDBC driver for the Spark job: install Debian's libpostgresql-jdbc-java "
    f"({DEBIAN_JDBC_JAR}) or set ${JDBC_JAR_ENV} to the driver's jar"
)


def jdbc_options(dsn: str) -> dict[str, str]:
    """Spark JDBC options (url, user, password) for the PostgreSQL database of a libpq ``dsn``."""
    from airflow_dbqueue.engine.dialects.factory import jdbc_options as postgres_jdbc_options

    return postgres_jdbc_options(dsn)


def find_jdbc_jar() -> str | None:
    """``$DBQUEUE_JDBC_JAR``, else Debian's PostgreSQL JDBC driver when installed, else None."""
    jar = os.environ.get(JDBC_JAR_ENV)
    if jar:
        return jar
    return DEBIAN_JDBC_JAR if Path(DEBIAN_JDBC_JAR).is_file() else None


__all__ = [
    "DEBIAN_JDBC_JAR",
    "JDBC_HINT",
    "JDBC_JAR_ENV",
    "ORDER_ROLLUP_JOB",
    "find_jdbc_jar",
    "jdbc_options",
]
