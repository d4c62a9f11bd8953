"""The table design's ready index fills its leaf pages (schema.sql, meta_ready_idx): every claim passes,
page by page, the entries of the messages popped since the last VACUUM, so the fewer pages they take,
the less a pop at depth reads. Storage is checked here, never a timing: messages pushed in claim order
leave the index's parts about full, and a queue filled that way still pops every message once, in
claim order."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import psycopg
import pytest

from tests.helpers import checksum

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue

pytestmark = pytest.mark.integration

GENERATIONS = 8
ENTRY_BYTES = 36
"""A ready entry on a leaf page: an 8-byte index tuple header, the key (queue_id, priority, process_at,
id: 4 + 2, aligned to 8, + 8 + 8 = 24 bytes) and a 4-byte line pointer."""
USABLE_BYTES = 8192 - 24 - 16
"""A leaf page less its header and the B-tree's special space."""


@pytest.fixture(autouse=True)
def no_recycling_pass(dbq: DbQueue) -> Iterator[None]:
    """No partition recycling while a test reads the index sizes (it would find nothing to empty, but
    keeps the test to the statements it sends)."""
    assert dbq.recycler is not None
    with dbq.recycler.suspended():
        yield


def test_ready_index_parts_fill_their_pages_and_pops_stay_in_order(dbq: DbQueue, pg_dsn: str) -> None:
    q = dbq.create_queue("dense")
    sent = [{"n": i, "pad": "x" * (i % 17)} for i in range(20_000)]
    ids: list[int] = []
    for at in range(0, len(sent), 500):
        ids += q.push_batch(sent[at : at + 500])
    assert ids == sorted(ids) and len(set(ids)) == len(sent)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CHECKPOINT; ANALYZE "{dbq.schema}".meta')
        parts = c.execute(
            """
            SELECT i.relname, pg_relation_size(i.oid) / current_setting('block_size')::integer,
                   i.reloptions, (SELECT count(*) FROM {schema}.meta m
                                  WHERE m.gen = right(i.relname, 1)::integer AND m.state = 0)
            FROM pg_class i JOIN pg_namespace n ON n.oid = i.relnamespace
            WHERE n.nspname = %s AND i.relname ~ '^meta_ready_idx_[0-7]$'
            ORDER BY i.relname""".replace("{schema}", f'"{dbq.schema}"'),
            (dbq.schema,),
        ).fetchall()
    assert [p[0] for p in parts] == [f"meta_ready_idx_{g}" for g in range(GENERATIONS)]
    assert sum(p[3] for p in parts) == len(sent)
    for name, pages, options, entries in parts:
        # full leaves, and no deduplication pass before a split (every entry is distinct: schema.sql)
        assert sorted(options) == ["deduplicate_items=off", "fillfactor=100"], (name, options)
        # a metapage, a root and the leaves, each leaf full but the last: a part of 16,384 entries (one
        # generation) takes 73 leaves, where the default fillfactor (90) left 81
        leaves = pages - 2
        assert leaves <= math.ceil(entries * ENTRY_BYTES / USABLE_BYTES) + 1, (name, pages, entries)
    assert max(p[3] for p in parts) > 16_000  # a whole generation, where the check above tells 90 from 100
    popped = []
    while batch := q.pop(1000):
        popped += batch
    assert [m.id for m in popped] == ids
    assert checksum(m.payload for m in popped) == checksum(sent)
    assert q.stats().ready == 0
