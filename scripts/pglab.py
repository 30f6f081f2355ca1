#!/usr/bin/env python3
"""A throwaway PostgreSQL server for tests and local runs, with no server installed beforehand.

`with pglab.server() as pg: url = pg.url()` gives the SQLAlchemy async URL (`postgresql+asyncpg://...`) of an
empty scratch database; `await pg.reset_schema()` empties it again between tests.

`cluster()` runs initdb into a temporary directory, starts postgres with pg_ctl on a unix socket inside that
directory (no TCP port to collide with, unless tcp=True), and on exit stops the server and deletes the directory,
also after a failure. As root it runs the server as the `postgres` OS user, because postgres refuses to run as
root. The cluster trades durability for speed (fsync off): it is for tests only.

`server()` honours GPUSWARM_TEST_POSTGRES_URL (a SQLAlchemy URL of an existing server whose user may create
databases: the scratch database is created there and dropped on exit) and otherwise starts a cluster. Missing
server binaries or a missing asyncpg raise PostgresUnavailable with the reason; a server that fails to start
raises RuntimeError with the tail of its log.

Run alone it starts a cluster and prints its URL until Ctrl-C: `python scripts/pglab.py`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_URL = "GPUSWARM_TEST_POSTGRES_URL"
SERVER_BINARIES = ("initdb", "pg_ctl", "postgres")
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresUnavailable(RuntimeError):
    """PostgreSQL cannot be used here at all (no server binaries, no driver); the message says what to install."""


@dataclass
class PostgresServer:
    """A reachable server, the user that may create databases on it, and `database`, an empty scratch database.
    `admin_database` is where that user connects to create and drop databases."""

    user: str
    host: str  # a directory (unix socket) or an address
    port: int
    admin_database: str
    database: str
    password: str | None = None
    query: dict[str, str] = field(default_factory=dict)  # extra URL query items of an external server (ssl, ...)

    def url(self, database: str | None = None) -> str:
        """The SQLAlchemy async URL of `database` (default: the scratch database) on this server."""
        from sqlalchemy.engine import URL

        database = database or self.database
        if self.host.startswith("/"):  # a unix socket directory goes in the query, as asyncpg's host
            return URL.create("postgresql+asyncpg", username=self.user, password=self.password, database=database,
                              query={**self.query, "host": self.host, "port": str(self.port)}).render_as_string(
                                  hide_password=False)
        return URL.create("postgresql+asyncpg", username=self.user, password=self.password, host=self.host,
                          port=self.port, database=database, query=self.query).render_as_string(hide_password=False)

    async def _connect(self, database: str):  # noqa: ANN202 - an asyncpg.Connection
        import asyncpg

        return await asyncpg.connect(user=self.user, password=self.password, host=self.host, port=self.port,
                                     database=database)

    async def _admin(self):  # noqa: ANN202 - an asyncpg.Connection
        return await self._connect(self.admin_database)

    async def reset_schema(self, database: str | None = None) -> None:
        """Empty a database: drop its public schema with everything in it and create it again. Sessions still
        connected to it are ended first, so a leaked connection cannot make this wait for its locks. Measured
        here: about half the time of creating a fresh database (which copies a template)."""
        conn = await self._connect(database or self.database)
        try:
            await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                               "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            await conn.execute("DROP SCHEMA IF EXISTS public CASCADE; CREATE SCHEMA public")
        finally:
            await conn.close()

    async def create_database(self, name: str, template: str = "template0") -> str:
        """Create an empty database (from `template`) and return its URL."""
        _check_name(name)
        _check_name(template)
        conn = await self._admin()
        try:
            await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        finally:
            await conn.close()
        return self.url(name)

    async def drop_database(self, name: str) -> None:
        """Drop a database, ending any session still connected to it (PostgreSQL 13+)."""
        _check_name(name)
        conn = await self._admin()
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


def run_coroutine(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine to its end from synchronous code, also where an event loop exists (a worker thread)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(f"not a plain database name: {name!r}")


def _require_asyncpg() -> None:
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        raise PostgresUnavailable("the asyncpg driver is not installed: pip install 'gpuswarm[postgres]' "
                                  "(the dev extra includes it)") from None


def find_bindir() -> Path:
    """The directory holding initdb, pg_ctl and postgres: `pg_config --bindir`, else the newest
    /usr/lib/postgresql/*/bin (Debian keeps them off PATH), else PATH."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True)
            candidates.append(Path(out.stdout.strip()))
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += [Path(p) for p in sorted(versions, key=lambda p: int(re.sub(r"\D", "", p) or 0), reverse=True)]
    if shutil.which("initdb"):
        candidates.append(Path(shutil.which("initdb")).parent)
    for bindir in candidates:
        if all((bindir / name).is_file() and os.access(bindir / name, os.X_OK) for name in SERVER_BINARIES):
            return bindir
    raise PostgresUnavailable(
        "no PostgreSQL server binaries (initdb, pg_ctl, postgres) found via pg_config, /usr/lib/postgresql/*/bin "
        f"or PATH: install them (apt-get install postgresql) or set {ENV_URL} to an existing server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cluster(database: str = "gpuswarm", *, tcp: bool = False, start_timeout: int = 60) -> Iterator[PostgresServer]:
    """Start a throwaway cluster with one empty database `database`; yield it as a PostgresServer."""
    _require_asyncpg()
    bindir = find_bindir()
    run_as: dict[str, Any] = {}
    if os.geteuid() == 0:
        try:
            account = pwd.getpwnam("postgres")
        except KeyError:
            raise PostgresUnavailable("running as root, and there is no `postgres` OS user to run the server as "
                                      "(postgres refuses to run as root)") from None
        run_as = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    root = Path(tempfile.mkdtemp(prefix="pglab-"))  # short: a unix socket path must fit in 107 bytes
    data, log = root / "data", root / "postgres.log"
    if run_as:
        os.chown(root, run_as["user"], run_as["group"])
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "TZ": "UTC"}
    env.pop("PGDATA", None)

    def pg(*args: str, timeout: float = start_timeout + 30) -> None:
        result = subprocess.run([str(bindir / args[0]), *args[1:]], cwd=root, env=env, capture_output=True,
                                text=True, timeout=timeout, **run_as)
        if result.returncode != 0:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({result.returncode}): {result.stderr.strip()}"
                               f"{chr(10) + 'server log: ' + tail if tail else ''}")

    port = _free_port() if tcp else 5432  # on a socket alone the port only names the socket file
    options = [f"-p {port}", f"-k {root}", "-c listen_addresses=" + ("127.0.0.1" if tcp else "''"),
               "-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off", "-c max_connections=200"]
    started = False
    try:
        pg("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync")
        pg("pg_ctl", "start", "-w", "-t", str(start_timeout), "-D", str(data), "-l", str(log), "-o", " ".join(options))
        started = True
        server = PostgresServer(user="postgres", host="127.0.0.1" if tcp else str(root), port=port,
                                admin_database="postgres", database=database)
        pg("createdb", "-h", server.host, "-p", str(port), "-U", "postgres", database)
        yield server
    finally:
        try:
            if started:
                pg("pg_ctl", "stop", "-w", "-m", "immediate", "-D", str(data), timeout=60)
        finally:
            shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def external(url: str) -> Iterator[PostgresServer]:
    """An existing server named by a SQLAlchemy URL. Its database is where a scratch database is created (and
    dropped on exit), so the user needs CREATEDB."""
    _require_asyncpg()
    from sqlalchemy import make_url

    parsed = make_url(url)
    query = {k: v for k, v in parsed.query.items() if isinstance(v, str)}
    host = query.pop("host", None) or parsed.host or "localhost"
    port = int(query.pop("port", None) or parsed.port or 5432)
    server = PostgresServer(user=parsed.username or "postgres", password=parsed.password, host=host, port=port,
                            admin_database=parsed.database or "postgres",
                            database=f"gpuswarm_test_{uuid.uuid4().hex[:12]}", query=query)
    run_coroutine(server.create_database(server.database))
    try:
        yield server
    finally:
        run_coroutine(server.drop_database(server.database))


@contextlib.contextmanager
def server() -> Iterator[PostgresServer]:
    """GPUSWARM_TEST_POSTGRES_URL's server when set, else a throwaway cluster."""
    url = os.environ.get(ENV_URL)
    with external(url) if url else cluster() as found:
        yield found


if __name__ == "__main__":
    import time

    with cluster() as pg:
        print(f"PostgreSQL running: DATABASE_URL={pg.url()}  (Ctrl-C stops and deletes it)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
