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
            "Durable message queues inside the PostgreSQL database you already run: a meta/data table "
            "design with priorities, delayed messages, retries, a failed state, and at-most-once / "
            "at-least-once / exactly-once delivery."
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
