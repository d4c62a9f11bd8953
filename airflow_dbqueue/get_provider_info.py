"""Provider metadata, read by Airflow's ProvidersManager (``apache_airflow_provider`` entry point)."""

from __future__ import annotations

from typing import Any

from airflow_dbqueue import __version__


def get_provider_info() -> dict[str, Any]:
    """Return the provider description Airflow validates against its provider_info schema."""
    return {
        "package-name": "airflow-dbqueue",
        "name": "DB Queue",
        "description": (
            "Durable message queues inside PostgreSQL (and SQL Server): ring-buffer and meta/data "
            "table designs, at-most-once / at-least-once / exactly-once delivery, maintenance and Spark."
        ),
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "DB Queue",
                "external-doc-url": "https://github.com/airflow-dbqueue/airflow-dbqueue",
                "tags": ["software"],
            }
        ],
    }
