"""airflow-dbqueue: message queues inside the relational database you already run.

The engine (:mod:`airflow_dbqueue.engine`) never imports Airflow; the Airflow face (hooks, operators,
sensors, triggers) is a thin layer on top of it.
"""

from __future__ import annotations

__version__ = "0.1.0"
