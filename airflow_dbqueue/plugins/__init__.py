"""The Queues page in the Airflow UI: a FastAPI app and a navigation entry, registered as an Airflow plugin.

Airflow finds :class:`DbQueuePlugin` through the package's ``airflow.plugins`` entry point. The app
(:mod:`airflow_dbqueue.plugins.queues`) is mounted by the API server under ``/dbqueue``; the UI shows
its page in the navigation's Browse menu.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from airflow_dbqueue.plugins.queues import URL_PREFIX, app


class DbQueuePlugin(AirflowPlugin):  # type: ignore[misc]
    """The Queues page: the JSON API and page of :mod:`airflow_dbqueue.plugins.queues`."""

    name = "dbqueue"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "DB Queue"}]
    # No leading slash: the UI resolves the page against its own base URL, and frames it.
    external_views = [
        {
            "name": "Queues",
            "href": URL_PREFIX.lstrip("/") + "/",
            "url_route": "dbqueue",
            "destination": "nav",
            "category": "browse",
        }
    ]


__all__ = ["DbQueuePlugin"]
