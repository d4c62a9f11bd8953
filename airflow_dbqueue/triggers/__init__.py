"""Triggers of the airflow-dbqueue provider (deferrable sensor and event-driven scheduling)."""
