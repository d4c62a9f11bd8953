"""Operators of the airflow-dbqueue provider: push and pop batches."""
