"""Sensors of the airflow-dbqueue provider."""
