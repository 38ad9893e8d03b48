"""A real PostgreSQL server for the tests of the results store: Debian's postgresql
(initdb and pg_ctl as the `postgres` user where the suite runs as root, which initdb
refuses), in a temporary folder, on a free port, for the whole session."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

# Set in CI (.ci/run): a machine without PostgreSQL fails these tests instead of skipping.
REQUIRED = "AUTOTUNE_REQUIRE_POSTGRES"
USER = "autotune"
# A role that must give its password (SCRAM): what a team's server asks of a URL such as
# postgresql://tuner:secret@db.internal/autotune. Every other role is trusted.
PASSWORD_USER, PASSWORD = "tuner", "Pw52-never-printed"


def binaries() -> Path | None:
    """The folder of initdb and pg_ctl: $AUTOTUNE_PG_BIN, Debian's newest, or the PATH's."""
    said = os.environ.get("AUTOTUNE_PG_BIN")
    candidates = [said] if said else sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                                            key=lambda p: int(Path(p).parent.name)
                                            if Path(p).parent.name.isdigit() else 0,
                                            reverse=True)
    on_path = shutil.which("initdb")
    candidates += [str(Path(on_path).parent)] if on_path else []
    return next((Path(c) for c in candidates if c and (Path(c) / "pg_ctl").exists()), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """initdb, start, stop; `url(db)` for a database on it."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root: the server runs as postgres
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]

    def _run(self, *args: str) -> None:
        subprocess.run([*self.as_user, *args], check=True, capture_output=True, text=True,
                       timeout=120)

    def start(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", USER,
                  "-A", "trust", "--no-sync", "-E", "UTF8")
        hba = self.data / "pg_hba.conf"  # the first line that matches is the one used
        hba.write_text(f"host all {PASSWORD_USER} 127.0.0.1/32 scram-sha-256\n"
                       + hba.read_text())
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-o", options,
                  "-l", str(self.root / "log"), "-w", "-t", "60", "start")

    def stop(self) -> None:
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast",
                      "-w", "stop")
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
    server = Server(bindir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
