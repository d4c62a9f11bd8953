"""Hooks of the airflow-dbqueue provider."""
