"""Provider metadata, read by Airflow's ProvidersManager (``apache_airflow_provider`` entry point)."""

from __future__ import annotations

import importlib.util
from typing import Any

from airflow_dbqueue import __version__

INTEGRATION = "DB Queue"


def _postgres_provider_installed() -> bool:
    try:
        return importlib.util.find_spec("airflow.providers.postgres") is not None
    except (ImportError, ValueError):
        return False


def get_provider_info() -> dict[str, Any]:
    """Return the provider description Airflow validates against its provider_info schema.

    DbQueueHook works on connections of the existing ``postgres`` type. That type belongs to the
    postgres provider when it is installed, and two providers claiming one connection type make
    Airflow pick one of them by discovery order; so the hook is registered as the ``postgres``
    connection type (which gives the UI a form for it, and lists the hook in ``airflow providers
    hooks``) only when the postgres provider is absent. Either way the hook reads any ``postgres``
    connection.
    """
    info: dict[str, Any] = {
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
                "integration-name": INTEGRATION,
                "external-doc-url": "https://github.com/airflow-dbqueue/airflow-dbqueue",
                "tags": ["software"],
            }
        ],
        "hooks": [{"integration-name": INTEGRATION, "python-modules": ["airflow_dbqueue.hooks.dbqueue"]}],
        "operators": [
            {
                "integration-name": INTEGRATION,
                "python-modules": ["airflow_dbqueue.operators.dbqueue", "airflow_dbqueue.operators.spark"],
            }
        ],
        "sensors": [{"integration-name": INTEGRATION, "python-modules": ["airflow_dbqueue.sensors.dbqueue"]}],
        "triggers": [
            {"integration-name": INTEGRATION, "python-modules": ["airflow_dbqueue.triggers.dbqueue"]}
        ],
        "queues": ["airflow_dbqueue.queues.dbqueue.DbQueueMessageQueueProvider"],
    }
    if not _postgres_provider_installed():
        info["connection-types"] = [
            {
                "connection-type": "postgres",
                "hook-class-name": "airflow_dbqueue.hooks.dbqueue.DbQueueHook",
                "hook-name": "DB Queue (PostgreSQL)",
            }
        ]
    return info
