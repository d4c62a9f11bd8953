"""A real PgBouncer (Debian's ``pgbouncer``) in front of the test server, started and stopped by the tests.

One process serves three pooled databases, all of them the test server's database:

- the server database's own name: ``pool_mode = transaction`` (each transaction on whichever server
  connection is free);
- ``session``: ``pool_mode = session`` (one server connection a client connection, ``DISCARD ALL``
  between clients);
- ``narrow``: transaction mode with two server connections only, so that many client connections take
  turns on the same few server connections (what the tests of statements that must not be confused need);
- any other name: the server's database of that name, in transaction mode.

Clients are not authenticated (``auth_type = any``): PgBouncer logs in to the server as the test DSN's
user. PgBouncer refuses to run as root; as root it runs as the embedded server's system user.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import psycopg.conninfo

from airflow_dbqueue.engine.embedded import free_port


def find_pgbouncer() -> str | None:
    """The path of the ``pgbouncer`` binary, or None."""
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None
    )


class PgBouncer:
    """A PgBouncer process in front of the server of ``server_dsn``; :meth:`dsn` names a pooled
    database. :meth:`kill` and :meth:`start` take it down and bring it back on the same port."""

    def __init__(self, server_dsn: str, binary: str) -> None:
        self.binary = binary
        self.server = psycopg.conninfo.conninfo_to_dict(server_dsn)
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="dbqueue-pgbouncer-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self._user: str | None = None
        if os.geteuid() == 0:
            from airflow_dbqueue.engine.embedded import RUN_AS_USER, _ensure_user

            entry = _ensure_user()
            self._user = RUN_AS_USER
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
            os.chmod(self.dir, 0o755)
        self._write_config()

    def _write_config(self) -> None:
        s = self.server
        target = " ".join(
            f"{k}={v}"
            for k, v in (
                ("host", s.get("host") or "127.0.0.1"),
                ("port", s.get("port") or 5432),
                ("dbname", s.get("dbname") or "postgres"),
                ("user", s.get("user") or "postgres"),
                ("password", s.get("password")),
            )
            if v
        )
        any_database = " ".join(p for p in target.split() if not p.startswith("dbname="))
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"{self.dbname} = {target} pool_mode=transaction\n"
            f"session = {target} pool_mode=session\n"
            f"narrow = {target} pool_mode=transaction pool_size=2\n"
            # Any other database name: that database of the server, in transaction mode.
            f"* = {any_database} pool_mode=transaction\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = any\n"
            "pool_mode = transaction\n"
            "default_pool_size = 20\n"
            "max_client_conn = 1000\n"
            # The JDBC driver sends it at startup; PgBouncer refuses parameters it does not know.
            "ignore_startup_parameters = extra_float_digits\n"
            # Server connections idle in PgBouncer's pool keep the name of their last client; with the
            # client's address added they are never taken for a client's own (a test that counts the
            # sessions an application left open counts its own only).
            "application_name_add_host = 1\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
            f"pidfile = {self.dir / 'pgbouncer.pid'}\n"
        )
        if self._user is not None:
            from airflow_dbqueue.engine.embedded import _ensure_user

            entry = _ensure_user()
            os.chown(self.dir / "pgbouncer.ini", entry.pw_uid, entry.pw_gid)

    @property
    def dbname(self) -> str:
        """The server's database: the transaction-mode pool bears its name, so that a listen DSN that
        differs from the pooler's only in host and port (an Airflow connection's listen host and port)
        reaches the same database on the server."""
        return str(self.server.get("dbname") or "postgres")

    def dsn(self, mode: str, dbname: str | None = None) -> str:
        """A DSN of the pooled database for ``mode`` (``transaction``, ``session`` or ``narrow``), or of
        the server's database ``dbname`` in transaction mode."""
        name = dbname or (self.dbname if mode == "transaction" else mode)
        return f"host=127.0.0.1 port={self.port} dbname={name} user={self.server.get('user') or 'postgres'}"

    def start(self, timeout: float = 15.0) -> None:
        """Start PgBouncer and wait until it answers on its port."""
        cmd = [self.binary] + (["-u", self._user] if self._user else []) + [str(self.dir / "pgbouncer.ini")]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self.proc.returncode}: {self.log()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.5):
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"pgbouncer did not listen on {self.port} within {timeout:g}s: {self.log()[-2000:]}"
        )

    def kill(self) -> None:
        """SIGKILL the process (clients see their connections drop) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "pgbouncer.pid").unlink()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "pgbouncer.log").read_text(errors="replace")
        return ""
