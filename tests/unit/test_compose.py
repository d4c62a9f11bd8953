"""docker-compose.yml: valid by the compose specification, and consistent with itself and the repository.

No Docker engine runs on the build machines, so these checks and review are what keep the stack honest:
the schema (check-jsonschema's vendored compose-spec), then what a schema cannot see — services that
depend on each other exist and are healthy or finished as the conditions say, the Dockerfile and its
targets exist, the DAGs and the Spark driver settings are mounted from this repository, the Airflow
connections point at the services that exist, the image versions agree with pyproject.toml, and no
secret is written down except as an overridable local default that .env.example documents.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE_DIR = ROOT / "docker"
ENV_EXAMPLE = ROOT / ".env.example"

# ${VAR}, ${VAR:-default}, ${VAR-default}; "$$" is a literal dollar for the container's shell.
_INTERP = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")
_SECRETISH = re.compile(r"PASSWORD|SECRET|FERNET|_KEY$|SQL_ALCHEMY_CONN|^AIRFLOW_CONN_|_DSN$")
AIRFLOW_SERVICES = (
    "airflow-init",
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
)


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _services() -> dict[str, dict[str, Any]]:
    services = _compose()["services"]
    assert isinstance(services, dict)
    return services


def _resolve(value: str) -> str:
    """``value`` with every ``${VAR:-default}`` replaced by its default (what runs without a .env)."""
    return _INTERP.sub(lambda m: m.group(2) or "", value)


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "environment is written as a mapping throughout"
    return {k: str(v) for k, v in env.items()}


def _depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def _dockerfile_stages(path: Path) -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", path.read_text(), re.MULTILINE | re.IGNORECASE))


def _dockerfile_arg_default(path: Path, name: str) -> str:
    m = re.search(rf"^ARG\s+{name}=(\S+)\s*$", path.read_text(), re.MULTILINE)
    assert m, f"{path.name} declares ARG {name} with a default"
    return m.group(1)


def _env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def _volume_sources(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path (resolved) of the service's bind mounts."""
    out = {}
    for vol in service.get("volumes") or []:
        assert isinstance(vol, str), "volumes are written in the short syntax throughout"
        source, target = vol.split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = str((ROOT / source).resolve())
    return out


# -- the compose specification -------------------------------------------------------------------


def _check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("check-jsonschema")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "check_jsonschema"]
    return subprocess.run(
        [*cmd, "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ, NO_COLOR="1"),
    )


def test_compose_file_validates_against_the_compose_specification() -> None:
    proc = _check_jsonschema(COMPOSE)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_schema_check_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        "services:\n"
        "  app:\n"
        "    image: busybox\n"
        "    depends_on:\n"
        "      db:\n"
        "        condition: service_ready\n"  # not a condition the specification knows
        "    healthcheck:\n"
        "      test: [CMD, 'true']\n"
        "      retry: 3\n"  # not a healthcheck field
    )
    proc = _check_jsonschema(broken)
    assert proc.returncode != 0, proc.stdout + proc.stderr


# -- the services and their order ----------------------------------------------------------------


def test_every_dependency_is_a_service_and_its_condition_can_be_met() -> None:
    services = _services()
    for name, svc in services.items():
        for dep, condition in _depends_on(svc).items():
            assert dep in services, f"{name} depends on {dep!r}, which is not a service"
            assert dep != name, f"{name} depends on itself"
            target = services[dep]
            assert not target.get("profiles"), f"{name} depends on {dep}, which only runs under a profile"
            if condition == "service_healthy":
                assert target.get("healthcheck", {}).get("test"), f"{name} waits for {dep} to be healthy"
            elif condition == "service_completed_successfully":
                assert target.get("restart", "no") == "no", f"{dep} is one-shot, so it must not restart"
                assert "healthcheck" not in target, f"{dep} exits, so it has no healthcheck"
            else:
                raise AssertionError(
                    f"{name} -> {dep}: want service_healthy or service_completed_successfully"
                )


def test_dependencies_have_no_cycle() -> None:
    services = _services()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"dependency cycle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for dep in _depends_on(services[name]):
            visit(dep, (*path, name))
        done.add(name)

    for name in services:
        visit(name, ())


def test_every_long_running_service_has_a_healthcheck() -> None:
    for name, svc in _services().items():
        if svc.get("restart") == "no":
            continue  # one-shot
        test = svc.get("healthcheck", {}).get("test")
        assert test and test != ["NONE"], f"{name} has no healthcheck"


def test_the_stack_starts_in_order() -> None:
    services = _services()
    init = _depends_on(services["airflow-init"])
    assert init == {"postgres": "service_healthy"}
    for name in AIRFLOW_SERVICES[1:]:
        deps = _depends_on(services[name])
        assert deps.get("postgres") == "service_healthy", name
        assert deps.get("airflow-init") == "service_completed_successfully", name
    # The scheduler runs the tasks (LocalExecutor), so it starts once Spark and the API are there.
    sched = _depends_on(services["airflow-scheduler"])
    assert sched.get("spark-worker") == "service_healthy"
    assert sched.get("airflow-apiserver") == "service_healthy"
    assert _depends_on(services["spark-worker"]) == {"spark-master": "service_healthy"}


# -- images ----------------------------------------------------------------------------------------


def test_builds_use_a_dockerfile_and_target_that_exist() -> None:
    built = {name: svc["build"] for name, svc in _services().items() if "build" in svc}
    assert set(AIRFLOW_SERVICES) | {"spark-worker"} <= set(built)
    for name, build in built.items():
        context = (ROOT / build["context"]).resolve()
        assert context == ROOT, f"{name} builds from the repository root"
        dockerfile = context / build["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
        assert build["target"] in _dockerfile_stages(dockerfile), f"{name}: no stage {build['target']!r}"
    assert {b["target"] for n, b in built.items() if n in AIRFLOW_SERVICES} == {"airflow"}
    assert built["spark-worker"]["target"] == "spark"


def test_the_airflow_image_copies_only_what_exists_and_the_context_leaves_out_the_venv() -> None:
    dockerfile = (DOCKERFILE_DIR / "Dockerfile").read_text()
    for line in re.findall(r"^COPY\s+(?!--from)(.*)$", dockerfile, re.MULTILINE):
        *sources, _dest = [w for w in line.split() if not w.startswith("--")]
        for src in sources:
            assert (ROOT / src).exists(), f"the Dockerfile copies {src}, which is not in the repository"
    assert '"/opt/dbqueue/src[spark]"' in dockerfile, "the package is installed with its spark extra"
    assert "libpostgresql-jdbc-java" in dockerfile
    assert "ENV DBQUEUE_JDBC_JAR=/usr/share/java/postgresql.jar" in dockerfile
    assert "default-jre-headless" in dockerfile  # spark-submit needs Java in the Airflow container
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git", ".env"} <= ignored


def test_image_versions_agree_with_pyproject_and_each_other() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = {
        re.split(r"[=<>!~\[ ]", dep, maxsplit=1)[0]: dep
        for dep in pyproject["project"]["optional-dependencies"]["spark"]
        + pyproject["project"]["dependencies"]
    }
    pyspark = re.fullmatch(r"pyspark==(\S+)", pins["pyspark"])
    assert pyspark, "pyspark is pinned to one version"
    services = _services()
    dockerfile = DOCKERFILE_DIR / "Dockerfile"
    env_example = _env_example()

    spark_images = {
        _resolve(services["spark-master"]["image"]),
        _resolve(services["spark-worker"]["build"]["args"]["SPARK_IMAGE"]),
        _resolve(services["spark-connect"]["build"]["args"]["SPARK_IMAGE"]),
        *(_resolve(services[n]["build"]["args"]["SPARK_IMAGE"]) for n in AIRFLOW_SERVICES),
        _dockerfile_arg_default(dockerfile, "SPARK_IMAGE"),
        env_example["SPARK_IMAGE"],
    }
    assert len(spark_images) == 1, spark_images
    (spark_image,) = spark_images
    repo, tag = spark_image.split(":")
    assert repo == "apache/spark"
    assert tag.split("-")[0] == pyspark.group(1), "the cluster's Spark version is the driver's (pyspark)"

    bases = {
        _resolve(services["spark-worker"]["build"]["args"]["AIRFLOW_BASE_IMAGE"]),
        *(_resolve(services[n]["build"]["args"]["AIRFLOW_BASE_IMAGE"]) for n in AIRFLOW_SERVICES),
        _dockerfile_arg_default(dockerfile, "AIRFLOW_BASE_IMAGE"),
        env_example["AIRFLOW_BASE_IMAGE"],
    }
    assert len(bases) == 1, f"driver and executors must share one base image (one Python): {bases}"
    (base,) = bases
    m = re.fullmatch(r"apache/airflow:(\d+)\.(\d+)\.(\d+)-python(\d+)\.(\d+)", base)
    assert m, base
    assert (int(m[1]), int(m[2])) == (3, 3), "Airflow 3.3.x, as pyproject.toml requires"
    assert "apache-airflow>=3.3,<3.4" in pins["apache-airflow"]
    low = re.fullmatch(r">=(\d+)\.(\d+)", pyproject["project"]["requires-python"])
    assert low and (int(m[4]), int(m[5])) >= (int(low[1]), int(low[2])), "the image's Python fits the package"


# -- Airflow, its connections, and Spark ------------------------------------------------------------


def test_airflow_services_mount_the_repositorys_dags_and_use_the_local_executor() -> None:
    services = _services()
    for name in AIRFLOW_SERVICES:
        svc = services[name]
        mounts = _volume_sources(svc)
        assert mounts.get("/opt/airflow/dags") == str(ROOT / "dags"), f"{name} mounts the repository's dags/"
        env = _env(svc)
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
        assert _resolve(env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"]).startswith(
            "http://airflow-apiserver:"
        )
        assert (
            env["AIRFLOW__API_AUTH__JWT_SECRET"]
            == _env(services["airflow-apiserver"])["AIRFLOW__API_AUTH__JWT_SECRET"]
        ), "every Airflow component shares one JWT secret"
    commands = {name: services[name].get("command") for name in AIRFLOW_SERVICES[1:]}
    assert commands == {
        "airflow-apiserver": "api-server",
        "airflow-scheduler": "scheduler",
        "airflow-dag-processor": "dag-processor",
        "airflow-triggerer": "triggerer",
    }
    init = "\n".join(services["airflow-init"]["command"])
    assert "airflow db migrate" in init and "airflow users create --role Admin" in init


def _spark_daemon_address(service: dict[str, Any]) -> tuple[str, str]:
    cmd = [str(c) for c in service["command"]]
    host = cmd[cmd.index("--host") + 1]
    port = cmd[cmd.index("--port") + 1] if "--port" in cmd else ""
    return host, port


def test_the_spark_connection_targets_the_master_service() -> None:
    services = _services()
    env = _env(services["airflow-scheduler"])
    conn = json.loads(_resolve(env["AIRFLOW_CONN_SPARK_DEFAULT"]))
    assert conn["conn_type"] == "spark"
    m = re.fullmatch(r"spark://([a-z0-9-]+):(\d+)", conn["host"])
    assert m, conn["host"]
    master = services[m[1]]
    assert "org.apache.spark.deploy.master.Master" in master["command"]
    assert _spark_daemon_address(master) == (m[1], m[2]), "the master listens on the connection's host:port"
    assert conn.get("extra", {}).get("deploy-mode", "client") == "client"
    worker = services["spark-worker"]
    assert conn["host"] in worker["command"], "the worker registers with the same master"
    worker_host, _ = _spark_daemon_address(worker)
    assert worker_host == "spark-worker", "the worker advertises a name the driver can resolve"


def test_the_spark_connect_connection_targets_a_connect_server_on_the_cluster() -> None:
    """The pipeline DAG's Spark connection (``$DBQUEUE_SPARK_CONN_ID``) is a ``spark_connect`` one whose
    host and port are those of the spark-connect service, a Connect server that runs on the master's
    cluster with PostgreSQL's JDBC driver (installed in its image) and a driver name the executors
    resolve; the scheduler, which runs the tasks, starts once it is healthy."""
    services = _services()
    env = _env(services["airflow-scheduler"])
    conn_id = env["DBQUEUE_SPARK_CONN_ID"]
    conn = json.loads(_resolve(env[f"AIRFLOW_CONN_{conn_id.upper()}"]))
    assert conn["conn_type"] == "spark_connect"
    m = re.fullmatch(r"sc://([a-z0-9-]+)", conn["host"])
    assert m, conn["host"]
    server = services[m[1]]
    cmd = [str(c) for c in server["command"]]
    assert cmd[cmd.index("--class") + 1] == "org.apache.spark.sql.connect.service.SparkConnectServer"
    confs = dict(cmd[i + 1].split("=", 1) for i, c in enumerate(cmd) if c == "--conf")
    assert confs["spark.connect.grpc.binding.port"] == str(conn["port"])
    assert confs["spark.driver.host"] == m[1], "the executors reach the server's driver by its service name"
    master_conn = json.loads(_resolve(env["AIRFLOW_CONN_SPARK_DEFAULT"]))
    assert cmd[cmd.index("--master") + 1] == master_conn["host"], "it runs on the same cluster"
    assert cmd[cmd.index("--jars") + 1] == "/usr/share/java/postgresql.jar"
    assert server["build"]["target"] == "spark"
    spark_stage = (DOCKERFILE_DIR / "Dockerfile").read_text().split("AS spark\n", 1)[1].split("\nFROM ", 1)[0]
    assert "libpostgresql-jdbc-java" in spark_stage, "the jar is in the server's image"
    assert str(conn["port"]) in str(server["healthcheck"]["test"])
    assert _depends_on(services["airflow-scheduler"]).get(m[1]) == "service_healthy"
    assert not [c for c in cmd if re.search(r"PASSWORD|password", c)], "the server holds no credential"


def test_the_spark_driver_advertises_the_service_that_runs_the_tasks() -> None:
    services = _services()
    sched = services["airflow-scheduler"]
    conf_dir = _env(sched)["SPARK_CONF_DIR"]
    assert _volume_sources(sched).get(conf_dir) == str(DOCKERFILE_DIR / "spark-conf")
    conf = dict(
        line.split(None, 1)
        for line in (DOCKERFILE_DIR / "spark-conf" / "spark-defaults.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    # With the LocalExecutor the scheduler runs the tasks, hence spark-submit and the driver.
    assert conf["spark.driver.host"].strip() == "airflow-scheduler"
    assert conf["spark.driver.bindAddress"].strip() == "0.0.0.0"


def _init_sql() -> str:
    init = DOCKERFILE_DIR / "postgres-init" / "10-airflow-database.sh"
    assert os.access(init, os.X_OK)
    return init.read_text()


def test_the_queue_connection_points_at_the_postgres_service() -> None:
    services = _services()
    pg = services["postgres"]
    pg_env = _env(pg)
    for name in AIRFLOW_SERVICES:
        env = _env(services[name])
        conn = json.loads(_resolve(env["AIRFLOW_CONN_DBQUEUE_DEFAULT"]))
        assert conn["conn_type"] == "dbqueue", "the provider's own type, whose Test button runs our hook"
        assert conn["extra"] == {"dialect": "postgresql", "dbqueue_schema": "dbqueue"}
        assert conn["host"] in services and services[conn["host"]]["image"].startswith("postgres:")
        assert conn["port"] == 5432
        assert (conn["login"], conn["schema"]) == ("dbqueue", "dbqueue")
        assert conn["password"] == _resolve(pg_env["DBQUEUE_DB_PASSWORD"])
        dsn = dict(kv.split("=", 1) for kv in _resolve(env["DBQUEUE_DSN"]).split())
        assert dsn == {
            "host": "postgres",
            "port": "5432",
            "user": "dbqueue",
            "password": conn["password"],
            "dbname": "dbqueue",
        }
    init = DOCKERFILE_DIR / "postgres-init"
    assert _volume_sources(pg).get("/docker-entrypoint-initdb.d") == str(init)
    sql = _init_sql()
    assert "CREATE DATABASE dbqueue OWNER dbqueue" in sql
    assert "CREATE DATABASE airflow OWNER airflow" in sql


def test_the_metadata_database_uses_psycopg_3_sync_and_async() -> None:
    services = _services()
    password = _resolve(_env(services["postgres"])["AIRFLOW_DB_PASSWORD"])
    for name in AIRFLOW_SERVICES:
        env = {k: _resolve(v) for k, v in _env(services[name]).items()}
        # psycopg2 is not installed: psycopg 3 needs its own driver names, and an async URL as well.
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == (
            f"postgresql+psycopg://airflow:{password}@postgres:5432/airflow"
        )
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC"] == (
            f"postgresql+psycopg_async://airflow:{password}@postgres:5432/airflow"
        )
        assert env["AIRFLOW__CORE__TEST_CONNECTION"] == "Enabled", "the Test button is off by default"
        if "fab" in env.get("AIRFLOW__CORE__AUTH_MANAGER", ""):
            assert "apache-airflow-providers-fab" in (DOCKERFILE_DIR / "Dockerfile").read_text(), (
                "the FAB auth manager comes from the FAB provider, which the image must install"
            )
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(d.startswith("psycopg[") for d in pyproject["project"]["dependencies"])


def test_no_service_logs_in_as_the_superuser_and_the_databases_are_apart() -> None:
    services = _services()
    pg_env = _env(services["postgres"])
    superuser = pg_env["POSTGRES_USER"]
    assert superuser == "postgres" and pg_env["POSTGRES_DB"] == "postgres"
    sql = _init_sql()
    for role in ("dbqueue", "airflow"):
        assert re.search(rf"CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE", sql), role
        assert f"GRANT CONNECT, TEMPORARY ON DATABASE {role} TO {role};" in sql
        assert f"REVOKE CONNECT, TEMPORARY ON DATABASE {role} FROM PUBLIC;" in sql
    for name in AIRFLOW_SERVICES:
        env = {k: _resolve(v) for k, v in _env(services[name]).items()}
        assert json.loads(env["AIRFLOW_CONN_DBQUEUE_DEFAULT"])["login"] != superuser
        assert f"://{superuser}:" not in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        assert f"user={superuser} " not in env["DBQUEUE_DSN"]


def test_default_passwords_are_no_word_that_logs_hold() -> None:
    """Airflow masks a connection's password wherever it appears in task logs: a default such as
    "dbqueue" or "airflow" would blank out every mention of the package or of Airflow."""
    words = set(re.findall(r"[A-Za-z0-9_]+", COMPOSE.read_text())) | {"airflow_dbqueue", "order_results"}
    defaults = {var: default for var, default in _INTERP.findall(COMPOSE.read_text()) if "PASSWORD" in var}
    assert {"DBQUEUE_DB_PASSWORD", "AIRFLOW_DB_PASSWORD", "POSTGRES_SUPERUSER_PASSWORD"} <= set(defaults)
    for var, default in defaults.items():
        if var == "AIRFLOW_ADMIN_PASSWORD":
            continue  # the UI login, not a connection's password
        assert len(default) >= 12, var
        assert not [w for w in words if default.lower() in w.lower()], f"{var}'s default {default!r}"


def test_sql_server_is_optional_and_unused() -> None:
    services = _services()
    mssql = services["sqlserver"]
    assert mssql["profiles"] == ["sqlserver"]
    assert mssql["image"] == "mcr.microsoft.com/mssql/server:2022-latest"
    assert _env(mssql)["ACCEPT_EULA"] == "Y"
    for name, svc in services.items():
        assert "sqlserver" not in _depends_on(svc), f"{name} must not need the optional SQL Server"


# -- secrets and settings ----------------------------------------------------------------------------


def test_no_secret_is_hard_coded_and_local_defaults_are_marked() -> None:
    for name, svc in _services().items():
        for key, value in _env(svc).items():
            if re.search(r"PASSWORD|SECRET|_KEY$", key):
                assert _INTERP.fullmatch(value), f"{name}: {key} must be ${{VAR:-local default}}, from .env"
            if re.search(r"SQL_ALCHEMY_CONN|^AIRFLOW_CONN_DBQUEUE|_DSN$", key):
                assert re.search(r"\$\{\w*PASSWORD:-", value), f"{name}: {key} takes its password from .env"
    # Every default of a password or secret sits on a line that says it is a local default.
    for number, line in enumerate(COMPOSE.read_text().splitlines(), 1):
        if re.search(r"(?<!\$)\$\{\w*(?:PASSWORD|SECRET)\w*:-[^}]+\}", line):
            assert "# local default" in line, f"docker-compose.yml:{number}: mark the local default"


def _strings(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return [node] if isinstance(node, str) else []


def test_every_variable_is_documented_in_env_example() -> None:
    used = {m for s in _strings(_compose()) for m in _INTERP.findall(s)}
    documented = _env_example()
    missing = sorted({var for var, _ in used} - set(documented))
    assert not missing, f"document these in .env.example: {missing}"
    for var, default in used:
        if var in documented and default:
            assert documented[var] == default, f".env.example shows {var}'s default as in docker-compose.yml"
    assert ".env" in (ROOT / ".gitignore").read_text().split(), "a real .env is never committed"
    tracked = subprocess.run(
        ["git", "ls-files", "--", ".env"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert tracked == "", "a .env is committed (git ls-files): it would hold real passwords"


@pytest.mark.parametrize("port", ["POSTGRES_PORT", "AIRFLOW_PORT", "SPARK_MASTER_UI_PORT", "MSSQL_PORT"])
def test_published_ports_are_on_loopback_only(port: str) -> None:
    published = [p for svc in _services().values() for p in svc.get("ports") or [] if port in p]
    assert published, port
    assert all(p.startswith("127.0.0.1:") for p in published)
