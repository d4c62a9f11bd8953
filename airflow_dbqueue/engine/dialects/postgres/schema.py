"""The PostgreSQL dialect's schema: ``schema.sql`` and its migrations, and installing, migrating and
dropping them in one schema with what the engine owns there recorded (``owned_objects``).

:class:`PostgresSchema` is a part of :class:`PostgresDatabase`; the engine calls it through the
:class:`~airflow_dbqueue.engine.dialects.base.Database` protocol only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from contextlib import AbstractContextManager
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
import psycopg.errors

from airflow_dbqueue.engine.dialects.base import (
    SchemaObject,
    describe_objects,
    engine_objects,
    ownership,
    refuse_foreign_objects,
    refuse_newer_schema,
)
from airflow_dbqueue.engine.dialects.postgres.errors import primary
from airflow_dbqueue.engine.errors import DatabaseError, ForeignObjectsError, SchemaError
from airflow_dbqueue.engine.sqlfile import parse_named_queries, read_text

log = logging.getLogger(__name__)

_PKG = __package__ or "airflow_dbqueue.engine.dialects.postgres"
_MIGRATION_FILE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


def migrations() -> list[tuple[int, str]]:
    """Return ``[(version, sql)]`` of every migration file, in order."""
    found = []
    for entry in resources.files(_PKG).joinpath("migrations").iterdir():
        m = _MIGRATION_FILE.match(entry.name)
        if m:
            found.append((int(m.group(1)), parse_named_queries(entry.read_text(encoding="utf-8"))["migrate"]))
    found.sort()
    versions = [v for v, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise SchemaError(f"migration files are not numbered 1..n without gaps: {versions}")
    return found


def schema_sql() -> tuple[int, str]:
    """Return ``(version, sql)`` of the current full schema."""
    text = read_text(_PKG, "schema.sql")
    m = re.search(r"SCHEMA_VERSION:\s*(\d+)", text)
    if not m:
        raise SchemaError("schema.sql does not declare its SCHEMA_VERSION")
    return int(m.group(1)), parse_named_queries(text)["schema"]


def _engine_names() -> frozenset[tuple[str, str]]:
    """The tables, sequences and functions that the schema file and the migrations create."""
    texts = [read_text(_PKG, "schema.sql")]
    texts += [
        e.read_text(encoding="utf-8")
        for e in resources.files(_PKG).joinpath("migrations").iterdir()
        if _MIGRATION_FILE.match(e.name)
    ]
    return frozenset().union(*(engine_objects(t) for t in texts))


class _Connections(Protocol):
    """What the schema's part takes from the rest of :class:`PostgresDatabase`."""

    schema: str
    where: str

    def transaction(
        self, conn: psycopg.Connection[Any] | None = None
    ) -> AbstractContextManager[psycopg.Connection[Any]]: ...

    def query(self, name: str, identifiers: Mapping[str, str] | None = None) -> bytes: ...

    def compose(self, body: str, identifiers: Mapping[str, str] | None = None) -> bytes: ...


if TYPE_CHECKING:  # the dialect's class supplies them
    _Base = _Connections
else:
    _Base = object


class PostgresSchema(_Base):
    """The schema part of :class:`PostgresDatabase` (see the module's docstring)."""

    def install(self) -> int:
        """Create or migrate the schema, idempotently and safely when run concurrently.

        A schema that does not exist is created (and recorded as the engine's); an existing one that
        holds no install must be empty, or :class:`ForeignObjectsError` names what it holds and
        nothing is done. Everything the install creates is recorded in ``owned_objects``.

        :return: the schema version now installed.
        """
        latest, full = schema_sql()
        steps = migrations()
        if steps[-1][0] != latest:
            raise SchemaError(
                f"schema.sql declares version {latest} but the last migration is {steps[-1][0]}"
            )
        with self.transaction() as c:
            c.execute(self.query("install_lock"), {"schema": self.schema})
            current = self._installed_version(c)
            refuse_newer_schema(self.schema, self.where, current, latest)
            if current == latest:
                return latest
            before = self._objects(c)
            created_schema = False
            if current == 0:
                if self._fetch_one(c, "schema_exists"):
                    refuse_foreign_objects(self.schema, self.where, before)
                else:
                    c.execute(self.query("create_schema"))
                    created_schema = True
                c.execute(self.compose(full))
                c.execute(self.query("record_version"), {"version": latest})
                log.info("installed dbqueue schema %s at version %s", self.schema, latest)
            else:
                for version, body in steps:
                    if version > current:
                        c.execute(self.compose(body))
                        c.execute(self.query("record_version"), {"version": version})
                        log.info("migrated dbqueue schema %s to version %s", self.schema, version)
            rings = [r[0] for r in c.execute(self.query("owned_ring_sequences"), {"schema": self.schema})]
            own, schema_is_ours = ownership(
                before,
                self._objects(c),
                fresh=current == 0,
                created_schema=created_schema,
                engine_names=_engine_names(),
                ring_sequences=rings,
            )
            if schema_is_ours:
                own.add(("schema", self.schema))
            kinds, names = [k for k, _ in sorted(own)], [n for _, n in sorted(own)]
            c.execute(self.query("record_owned"), {"kinds": kinds, "names": names})
        return latest

    def _fetch_one(self, c: psycopg.Connection[Any], name: str) -> Any:
        row = c.execute(self.query(name), {"schema": self.schema}).fetchone()
        return row[0] if row else None

    def _installed_version(self, c: psycopg.Connection[Any]) -> int:
        """The version of the install in the schema (0: none), read in ``c``'s transaction."""
        if not self._fetch_one(c, "schema_installed"):
            return 0
        row = c.execute(self.query("schema_version")).fetchone()
        return int(row[0]) if row else 0

    def _objects(self, c: psycopg.Connection[Any]) -> list[SchemaObject]:
        rows = c.execute(self.query("schema_objects"), {"schema": self.schema}).fetchall()
        return [SchemaObject(kind, name, identity) for kind, name, identity in rows]

    def migrate_to(self, version: int) -> None:
        """Apply migrations 1..version to a schema that does not exist yet (for tests and upgrades)."""
        with self.transaction() as c:
            c.execute(self.query("install_lock"), {"schema": self.schema})
            for v, body in migrations():
                if v <= version:
                    c.execute(self.compose(body))
                    c.execute(self.query("record_version"), {"version": v})

    def drop_schema(self) -> None:
        """Drop what the engine created in the schema, and the schema when it is the engine's and empty.

        What is dropped is what ``owned_objects`` lists (and the rings' sequences, which ``rings``
        lists); an install of an older version is migrated first, which records it. Objects that are
        not the engine's stay, and so does the schema that holds them. When an object that is not the
        engine's depends on one of its objects (a view over ``meta``), :class:`ForeignObjectsError`
        names it and nothing is dropped. A schema without an install is left alone.
        """
        with self.transaction() as c:
            c.execute(self.query("install_lock"), {"schema": self.schema})
            current = self._installed_version(c) if self._fetch_one(c, "schema_exists") else 0
        if current == 0:
            log.info(
                "dbqueue schema %s holds no install at %s: nothing to uninstall", self.schema, self.where
            )
            return
        latest = schema_sql()[0]
        if current < latest:
            self.install()  # records what the engine owns, as it does for any older install
        try:
            with self.transaction() as c:
                c.execute(self.query("install_lock"), {"schema": self.schema})
                refuse_newer_schema(self.schema, self.where, self._installed_version(c), latest)
                owned = {(k, n) for k, n in c.execute(self.query("owned_objects"))}
                for name in [
                    r[0] for r in c.execute(self.query("owned_ring_sequences"), {"schema": self.schema})
                ]:
                    c.execute(self.query("drop_owned_sequence", {"sequence": name}))
                present = [o for o in self._objects(c) if o.key in owned]
                for kind, query, ident in (
                    ("function", "drop_owned_routine", "routine"),
                    ("table", "drop_owned_table", "table"),
                    ("sequence", "drop_owned_sequence", "sequence"),
                ):
                    for o in present:
                        if o.kind == kind:
                            c.execute(self.query(query, {ident: o.name}))
                left = self._objects(c)
                if ("schema", self.schema) in owned and not left:
                    c.execute(self.query("drop_owned_schema"))
                    log.info("uninstalled dbqueue schema %s at %s", self.schema, self.where)
                else:
                    log.info(
                        "uninstalled dbqueue from schema %s at %s; the schema stays (%s)",
                        self.schema,
                        self.where,
                        f"it holds {describe_objects(left)}" if left else "the engine did not create it",
                    )
        except DatabaseError as exc:
            cause = exc.__cause__
            if isinstance(cause, psycopg.errors.DependentObjectsStillExist):
                found = (cause.diag.message_detail or primary(cause)).splitlines()
                raise ForeignObjectsError(
                    f"uninstall of schema {self.schema!r} at {self.where} refused: objects that are not "
                    f"the engine's depend on its own ({'; '.join(found)}). Nothing was dropped: drop "
                    "or move them first",
                    found,
                ) from exc
            raise
