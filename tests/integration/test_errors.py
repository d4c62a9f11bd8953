"""Clear errors for an unreachable database and a missing schema, with the queue data left intact."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from airflow_dbqueue.engine import DatabaseUnavailableError, DbQueue, SchemaError
from airflow_dbqueue.engine.embedded import free_port

if TYPE_CHECKING:
    from airflow_dbqueue.engine.embedded import EmbeddedPostgres

pytestmark = pytest.mark.integration


def test_unreachable_database_is_named() -> None:
    port = free_port()  # nothing listens there
    dbq = DbQueue(f"host=127.0.0.1 port={port} user=postgres dbname=app password=secret", connect_timeout=2)
    t0 = time.monotonic()
    with pytest.raises(DatabaseUnavailableError) as err:
        dbq.install()
    assert time.monotonic() - t0 < 30  # bounded by connect_timeout, not hanging
    msg = str(err.value)
    assert f"127.0.0.1:{port}/app" in msg
    assert "secret" not in msg
    dbq.close()


def test_missing_schema_says_install(pg_dsn: str) -> None:
    dbq = DbQueue(pg_dsn, schema="never_installed_here")
    with pytest.raises(SchemaError, match="not installed"):
        dbq.queue("orders")
    dbq.close()


def test_server_restart_is_survived_by_the_pool(embedded_server: EmbeddedPostgres) -> None:
    with DbQueue(embedded_server.dsn, pool_size=4, connect_timeout=5) as dbq:
        dbq.install()
        q = dbq.create_queue("orders")
        ids = q.push_batch(list(range(10)))
        embedded_server.stop(mode="fast")
        with pytest.raises(DatabaseUnavailableError):
            q.push(99)
        embedded_server.start()
        # the failed call made the pool drop its dead connections: the next call just works
        assert q.stats().ready == 10
        assert [m.id for m in q.pop(20)] == ids
