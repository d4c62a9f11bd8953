"""SQL Server connection strings: an ``mssql://`` URL or an ODBC connection string read into ODBC
attributes (and described without credentials), the ODBC driver to name, and the string pyodbc opens."""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from urllib.parse import parse_qsl, unquote, urlsplit

from airflow_dbqueue.engine.errors import ConfigurationError

DEFAULT_DRIVER = "ODBC Driver 18 for SQL Server"


def bundled_driver() -> str | None:
    """Return the path of the ODBC Driver 18 shipped by the ``mssql-python-odbc`` wheel, if installed."""
    try:
        import mssql_python_odbc  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    libs = mssql_python_odbc.get_libs_dir()
    arch = os.uname().machine
    arch = {"aarch64": "arm64"}.get(arch, arch)
    for distro in ("debian_ubuntu", "rhel", "suse", "alpine"):
        found = sorted(glob.glob(os.path.join(libs, "linux", distro, arch, "lib", "libmsodbcsql-*.so*")))
        if found:
            return found[-1]
    return None


def default_driver() -> str:
    """The ODBC driver to name when a DSN names none: Driver 18 if registered, else the bundled one.

    Without pyodbc nothing can connect (:meth:`MssqlDatabase.connect` says what to install), but a
    connection string can still be built: it names the bundled driver, or Driver 18.
    """
    try:
        import pyodbc
    except ImportError:
        return bundled_driver() or DEFAULT_DRIVER
    if DEFAULT_DRIVER in pyodbc.drivers():
        return DEFAULT_DRIVER
    return bundled_driver() or DEFAULT_DRIVER


def parse_dsn(dsn: str) -> tuple[dict[str, str], str]:
    """Return ``(odbc_attributes, where)`` of an ``mssql://`` URL or an ODBC connection string.

    ``where`` is ``host:port/database`` without credentials, for error messages. A URL's query
    parameters pass through as ODBC attributes (``?Encrypt=no&TrustServerCertificate=yes``).
    """
    text = dsn.strip().removeprefix("odbc:")
    attrs: dict[str, str] = {}
    if "://" in text:
        url = urlsplit(text)
        try:
            url_port = url.port
        except ValueError:
            raise ConfigurationError(
                "the SQL Server connection URL is not valid: its port is not a port number (1..65535)"
            ) from None
        attrs["SERVER"] = f"tcp:{url.hostname or 'localhost'},{url_port or 1433}"
        if url.path.strip("/"):
            attrs["DATABASE"] = unquote(url.path.strip("/"))
        if url.username:
            attrs["UID"] = unquote(url.username)
        if url.password:
            attrs["PWD"] = unquote(url.password)
        for k, v in parse_qsl(url.query):
            attrs[k.upper() if k.lower() in ("driver", "encrypt") else k] = v
    else:
        for part in _split_odbc(text):
            key, _, value = part.partition("=")
            if key.strip():
                attrs[key.strip().upper()] = value.strip()
    server = attrs.get("SERVER", "localhost").removeprefix("tcp:")
    host, _, port = server.partition(",")
    where = f"{host or 'localhost'}:{port or 1433}/{attrs.get('DATABASE', '')}"
    return attrs, where


def _split_odbc(text: str) -> list[str]:
    """Split an ODBC connection string on ``;`` outside ``{...}`` values."""
    parts, cur, depth = [], "", 0
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth = max(0, depth - 1)
        if ch == ";" and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def odbc_connection_string(attrs: Mapping[str, str], connect_timeout: float) -> str:
    """Return an ODBC connection string for ``attrs`` (driver defaulted, values braced when needed)."""
    out = dict(attrs)
    out.setdefault("DRIVER", default_driver())
    out.setdefault("LoginTimeout", str(max(1, int(connect_timeout))))
    out.setdefault("APP", "airflow-dbqueue")

    def value(v: str) -> str:
        if v.startswith("{") or not any(c in v for c in ";{}= "):
            return v
        return "{" + v.replace("}", "}}") + "}"

    return ";".join(f"{k}={value(str(v))}" for k, v in out.items())
