"""Provider metadata, read by Airflow's ProvidersManager (``apache_airflow_provider`` entry point)."""

from __future__ import annotations

from typing import Any

from airflow_dbqueue import __version__

INTEGRATION = "DB Queue"


def get_provider_info() -> dict[str, Any]:
    """Return the provider description Airflow validates against its provider_info schema.

    The connection type ``dbqueue`` is the provider's own: its form (declared here, so the API server
    builds it without importing the hook) names the dialect and the queue schema, and its Test button
    runs :meth:`DbQueueHook.test_connection`. The hook also reads connections of the existing types
    ``postgres``, ``mssql`` and ``odbc``, which belong to their own providers.
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
    info["connection-types"] = _connection_types()
    return info


def _connection_types() -> list[dict[str, Any]]:
    """The provider's own connection type, ``dbqueue``, with its form."""
    return [
        {
            "connection-type": "dbqueue",
            "hook-class-name": "airflow_dbqueue.hooks.dbqueue.DbQueueHook",
            "hook-name": "DB Queue",
            "ui-field-behaviour": {
                "hidden-fields": [],
                "relabeling": {"schema": "Database"},
                "placeholders": {
                    "host": "the database server",
                    "port": "5432 (PostgreSQL) or 1433 (SQL Server)",
                    "schema": "the database that holds the queue schema",
                    "extra": '{"sslmode": "require"} (libpq settings, or ODBC attributes for SQL Server)',
                },
            },
            "conn-fields": {
                "dialect": {
                    "label": "Dialect",
                    "description": "postgresql, or mssql for SQL Server (written, not yet run against one)",
                    "schema": {"type": "string", "enum": ["postgresql", "mssql"], "default": "postgresql"},
                },
                "dbqueue_schema": {
                    "label": "Queue schema",
                    "description": "The schema of the queue tables in that database",
                    "schema": {"type": ["string", "null"], "default": "dbqueue"},
                },
                "dbqueue_pooler": {
                    "label": "Pooler",
                    "description": "transaction when the host is a pooler in transaction mode (PgBouncer's "
                    "pool_mode = transaction, RDS Proxy, Supavisor, pgcat); none or session otherwise",
                    "schema": {
                        "type": "string",
                        "enum": ["none", "session", "transaction"],
                        "default": "none",
                    },
                },
                "dbqueue_listen_host": {
                    "label": "Listen host",
                    "description": "Behind a transaction pooler: the host that reaches the database with a "
                    "session of its own (the server, or a pooler in session mode), with the same login, for "
                    "LISTEN and maintenance. Empty: waits poll and maintenance is refused",
                    "schema": {"type": ["string", "null"]},
                },
                "dbqueue_listen_port": {
                    "label": "Listen port",
                    "description": "The listen host's port (empty: the connection's port)",
                    "schema": {"type": ["integer", "null"]},
                },
            },
        }
    ]
