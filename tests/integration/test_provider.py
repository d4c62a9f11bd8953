"""Airflow discovers the provider through its entry point and accepts its provider info."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_dbqueue.get_provider_info import get_provider_info

pytestmark = pytest.mark.integration


def test_provider_info_shape() -> None:
    info = get_provider_info()
    assert info["package-name"] == "airflow-dbqueue"  # must equal the distribution name
    assert info["name"] and info["description"]


def test_airflow_providers_list_shows_it(tmp_path: Path) -> None:
    env = dict(os.environ, AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__LOAD_EXAMPLES="False")
    airflow = Path(sys.executable).with_name("airflow")
    out = subprocess.run(
        [str(airflow), "providers", "list", "--output", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    providers = {p["package_name"]: p for p in json.loads(out.stdout)}
    assert "airflow-dbqueue" in providers, out.stderr[-2000:]
    assert providers["airflow-dbqueue"]["version"] == get_provider_info()["versions"][0]
