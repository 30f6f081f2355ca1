"""The coordinator suite runs on both databases: `database_url` is parametrized over SQLite and PostgreSQL.

One throwaway PostgreSQL cluster (scripts/pglab.py) serves the whole run, or the server GPUSWARM_TEST_POSTGRES_URL
names. Each test starts from an empty database, which the app migrates itself, as it does in production: one
scratch database whose schema is dropped and created again before each test (measured: about twice as fast as a
new database per test, which PostgreSQL copies from a template).

The postgres tests skip, with the reason, only where the server binaries or the driver are missing and
GPUSWARM_REQUIRE_POSTGRES is not set; CI sets it, so there they fail instead of silently not running.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pglab
import pytest

REQUIRE_ENV = "GPUSWARM_REQUIRE_POSTGRES"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[pglab.PostgresServer]:
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(pglab.server())
        except pglab.PostgresUnavailable as e:
            if os.environ.get(REQUIRE_ENV):
                pytest.fail(f"{REQUIRE_ENV} is set, but PostgreSQL is unavailable: {e}", pytrace=False)
            pytest.skip(f"PostgreSQL unavailable ({e}); set {REQUIRE_ENV}=1 to make this an error")
        yield server


@pytest.fixture
async def postgres_url(postgres_server: pglab.PostgresServer) -> str:
    """The URL of an empty PostgreSQL database (emptied before the test, so a failed test leaves no trace)."""
    await postgres_server.reset_schema()
    return postgres_server.url()


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str | None:
    """The CoordinatorConfig.database_url of a test's app: None is the default (SQLite in the data dir)."""
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def signature_process() -> bool:
    """CoordinatorConfig.signature_process of test_api's app: node signatures checked in the event loop, unless a
    test parametrizes it (test_api.BOTH_CHECKERS)."""
    return False
