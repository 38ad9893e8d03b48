"""A real PostgreSQL server for the tests of the results store: Debian's postgresql
(initdb and the server as the `postgres` user where the suite runs as root, which initdb
refuses), in a temporary folder, on a free port, for the whole session. The server is the
pytest process's own child, which the kernel stops when that process dies, however it
dies: pg_ctl's server, detached into a session of its own, outlived a SIGKILL'd suite."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from autotune.trials.reaper import PR_SET_PDEATHSIG

# Set in CI (.ci/run): a machine without PostgreSQL fails these tests instead of skipping.
REQUIRED = "AUTOTUNE_REQUIRE_POSTGRES"
USER = "autotune"
# A role that must give its password (SCRAM): what a team's server asks of a URL such as
# postgresql://tuner:secret@db.internal/autotune. Every other role is trusted.
PASSWORD_USER, PASSWORD = "tuner", "Pw52-never-printed"
PREFIX = "autotune-pg-"
OWNER = "owner.pid"  # in a server's folder: the pid of the process whose server it is


def binaries() -> Path | None:
    """The folder of initdb and postgres: $AUTOTUNE_PG_BIN, Debian's newest, or the PATH's."""
    said = os.environ.get("AUTOTUNE_PG_BIN")
    candidates = [said] if said else sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                                            key=lambda p: int(Path(p).parent.name)
                                            if Path(p).parent.name.isdigit() else 0,
                                            reverse=True)
    on_path = shutil.which("initdb")
    candidates += [str(Path(on_path).parent)] if on_path else []
    return next((Path(c) for c in candidates if c and (Path(c) / "postgres").exists()), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """initdb, start, stop; `url(db)` for a database on it."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix=PREFIX))
        self.data = self.root / "data"
        self.port = _free_port()
        self.as_user: list[str] = []
        self.proc: subprocess.Popen | None = None
        if os.geteuid() == 0:  # initdb refuses root: the server runs as postgres
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]
        (self.root / OWNER).write_text(str(os.getpid()))

    def _run(self, *args: str) -> None:
        subprocess.run([*self.as_user, *args], check=True, capture_output=True, text=True,
                       timeout=120)

    def start(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", USER,
                  "-A", "trust", "--no-sync", "-E", "UTF8")
        hba = self.data / "pg_hba.conf"  # the first line that matches is the one used
        hba.write_text(f"host all {PASSWORD_USER} 127.0.0.1/32 scram-sha-256\n"
                       + hba.read_text())
        owner = pwd.getpwnam("postgres") if self.as_user else None
        with open(self.root / "log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.bindir / "postgres"), "-D", str(self.data), "-p", str(self.port),
                 "-k", str(self.root), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                 "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                user=owner.pw_uid if owner else None, group=owner.pw_gid if owner else None,
                extra_groups=[] if owner else None, preexec_fn=_die_with(os.getpid()),
                # Out of the terminal's group, as pg_ctl's was: a Ctrl-C reaches pytest,
                # whose teardown stops the server once the tests' connections are closed.
                start_new_session=True)
        self._wait_ready(60.0)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"PostgreSQL exited ({self.proc.returncode}) as it started: "
                                   + (self.root / "log").read_text()[-2000:])
            # Its own socket, not the port: another server may hold a port taken meanwhile.
            ready = subprocess.run([str(self.bindir / "pg_isready"), "-q", "-h", str(self.root),
                                    "-p", str(self.port)], check=False, timeout=30)
            if ready.returncode == 0 and self.proc.poll() is None:
                return
            time.sleep(0.1)
        raise RuntimeError(f"PostgreSQL did not accept connections in {timeout_s:.0f} s: "
                           + (self.root / "log").read_text()[-2000:])

    def stop(self) -> None:
        """Fast shutdown (SIGINT: clients disconnected, the server gone when this returns)."""
        try:
            if self.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=30)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def new_database(self, *, password: bool = False) -> str:
        """A fresh empty database (one per test), its URL; with `password`, owned by
        PASSWORD_USER and its URL theirs, password and all."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={USER} dbname=postgres",
                             autocommit=True) as conn:
            if not password:
                conn.execute(f'CREATE DATABASE "{name}"')
                return self.url(name)
            if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s",
                                (PASSWORD_USER,)).fetchone():
                conn.execute(f"CREATE ROLE {PASSWORD_USER} LOGIN PASSWORD '{PASSWORD}'")
            conn.execute(f'CREATE DATABASE "{name}" OWNER {PASSWORD_USER}')
        return f"postgresql://{PASSWORD_USER}:{PASSWORD}@127.0.0.1:{self.port}/{name}"


def session_server() -> Iterator[Server | None]:
    """The server for the session, or None where PostgreSQL is not installed (and not
    required)."""
    bindir = binaries()
    if bindir is None:
        if os.environ.get(REQUIRED):
            raise RuntimeError(f"{REQUIRED} is set but no PostgreSQL binaries were found "
                               "(install postgresql, or set AUTOTUNE_PG_BIN)")
        yield None
        return
    remove_stale()
    server = Server(bindir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _die_with(parent: int) -> Callable[[], None]:
    """In the server's process, before its exec (and after its change of user, which
    clears it): SIGINT, PostgreSQL's fast shutdown, when `parent` dies. Strictly when the
    thread that started it ends: the session's fixtures run on pytest's main thread."""
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGINT, 0, 0, 0) != 0:
            os._exit(2)  # not armed: better no server than one that outlives the suite
        if os.getppid() != parent:  # it died before the signal was armed
            os._exit(1)

    return arm


def remove_stale() -> None:
    """The folders of servers whose pytest process is gone (SIGKILL'd: its server stopped
    with it, but nothing removed the folder). A folder without its owner's pid yet is a
    server another suite is starting."""
    for root in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        with contextlib.suppress(OSError, ValueError):
            pid = int((root / OWNER).read_text())
            if not alive(pid):
                shutil.rmtree(root, ignore_errors=True)


def alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (a killed suite no init has reaped yet) does not."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False
