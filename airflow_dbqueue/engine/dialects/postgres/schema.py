"""The PostgreSQL dialect's schema: ``schema.sql`` (tables, indexes and sequences), ``functions.sql``
(every function, re-applied whenever it changes) and ``migrations/<release>.sql``, and installing,
upgrading and dropping them in one schema with what the engine owns there recorded (``owned_objects``).

:class:`PostgresSchema` is a part of :class:`PostgresDatabase`; the engine calls it through the
:class:`~airflow_dbqueue.engine.dialects.base.Database` protocol only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
import psycopg.errors

from airflow_dbqueue.engine.dialects.ownership import (
    FUNCTIONS_KIND,
    SchemaObject,
    declared_version,
    describe_objects,
    digest,
    engine_objects,
    refuse_foreign_objects,
    refuse_incomplete_schema,
    refuse_newer_schema,
    refuse_older_schema,
    release_migrations,
)
from airflow_dbqueue.engine.dialects.postgres.errors import primary
from airflow_dbqueue.engine.errors import DatabaseError, ForeignObjectsError
from airflow_dbqueue.engine.sqlfile import parse_named_queries, read_text

log = logging.getLogger(__name__)

_PKG = __package__ or "airflow_dbqueue.engine.dialects.postgres"


def schema_sql() -> tuple[int, str]:
    """Return ``(version, sql)`` of the tables, indexes and sequences of a fresh install."""
    text = read_text(_PKG, "schema.sql")
    return declared_version(text, "schema.sql"), parse_named_queries(text)["schema"]


def schema_tables() -> frozenset[str]:
    """The tables ``schema.sql`` creates in the schema (the partitions its functions add are not)."""
    return frozenset(n for k, n in engine_objects(read_text(_PKG, "schema.sql")) if k == "table")


def policies_sql() -> str:
    """The row-level security of a fresh install (``schema.sql``'s block ``policies``): applied after
    ``functions.sql``, whose functions its policies call."""
    return parse_named_queries(read_text(_PKG, "schema.sql"))["policies"]


def functions_sql() -> tuple[str, str, frozenset[str]]:
    """Return ``(sql, sha256, names)`` of ``functions.sql``: every function, ``CREATE OR REPLACE``."""
    text = read_text(_PKG, "functions.sql")
    names = frozenset(n for k, n in engine_objects(text) if k == "function")
    return parse_named_queries(text)["functions"], digest(text), names


def migrations() -> list[tuple[int, list[str]]]:
    """Return ``[(version, [statements, ...])]`` of ``migrations/<release>.sql``, in release order."""
    return release_migrations(_PKG)


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
        """Create or upgrade the schema, idempotently and safely when run concurrently.

        A schema that does not exist is created (and recorded as the engine's); an existing one that
        holds no install must be empty, or :class:`ForeignObjectsError` names what it holds and
        nothing is done. An install of an earlier release runs the migrations after it. Then, when
        ``functions.sql`` is not the one last applied (its SHA-256 in ``owned_objects``), every function
        is replaced, and an engine's function that the file no longer defines is dropped: all in one
        transaction, which pushes and pops may run beside. Everything the install creates is recorded
        in ``owned_objects``. An install newer than this code, or made by a development version before
        the first release, raises :class:`SchemaError` and is left alone.

        :return: the schema version now installed.
        """
        latest, tables = schema_sql()
        functions, sha, defined = functions_sql()
        with self.transaction() as c:
            c.execute(self.query("install_lock"), {"schema": self.schema})
            current = self._installed_version(c)
            refuse_newer_schema(self.schema, self.where, current, latest)
            refuse_older_schema(self.schema, self.where, current)
            before = self._objects(c)
            if current == latest:
                present = {o.name for o in before if o.kind == "table"}
                refuse_incomplete_schema(self.schema, self.where, current, schema_tables() - present)
            applied = self._fetch_one(c, "functions_applied") if current else None
            if current == latest and applied == sha:
                return latest
            created_schema = False
            if current == 0:
                if self._fetch_one(c, "schema_exists"):
                    refuse_foreign_objects(self.schema, self.where, before)
                else:
                    c.execute(self.query("create_schema"))
                    created_schema = True
                c.execute(self.compose(tables))
                c.execute(self.query("record_version"), {"version": latest})
                log.info("installed dbqueue schema %s at version %s", self.schema, latest)
            for version, statements in migrations():
                if 0 < current < version <= latest:
                    for statement in statements:
                        c.execute(self.compose(statement))
                    c.execute(self.query("record_version"), {"version": version})
                    log.info("upgraded dbqueue schema %s to version %s", self.schema, version)
            self._apply_functions(c, functions, defined, fresh=current == 0)
            before_keys = {o.key for o in before}
            own = {o.key for o in self._objects(c) if o.key not in before_keys}
            if created_schema:
                own.add(("schema", self.schema))
            if applied is not None:
                c.execute(self.query("forget_owned"), {"kind": FUNCTIONS_KIND, "name": applied})
            own.add((FUNCTIONS_KIND, sha))
            kinds, names = [k for k, _ in sorted(own)], [n for _, n in sorted(own)]
            c.execute(self.query("record_owned"), {"kinds": kinds, "names": names})
            if current:
                log.info("applied the functions of dbqueue schema %s (%s)", self.schema, sha[:12])
        return latest

    def _apply_functions(
        self, c: psycopg.Connection[Any], functions: str, defined: frozenset[str], *, fresh: bool
    ) -> None:
        """Apply ``functions.sql`` (and on a fresh install the row-level security policies, which call
        its functions), and drop an engine's function that the file no longer defines."""
        c.execute(self.compose(functions))
        if fresh:
            c.execute(self.compose(policies_sql()))
        owned = {(k, n) for k, n in c.execute(self.query("owned_objects"))}
        for o in self._objects(c):
            if o.kind == "function" and o.key in owned and o.name not in defined:
                c.execute(self.query("drop_owned_routine", {"routine": o.name}))
                c.execute(self.query("forget_owned"), {"kind": o.kind, "name": o.name})

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

    def drop_schema(self) -> None:
        """Drop what the engine created in the schema, and the schema when it is the engine's and empty.

        What is dropped is what ``owned_objects`` lists (and the rings' sequences, which ``rings``
        lists); an install of an earlier release is upgraded first. Objects that are not the engine's
        stay, and so does the schema that holds them. When an object that is not the
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
        refuse_older_schema(self.schema, self.where, current)
        latest = schema_sql()[0]
        if current < latest:
            self.install()
        try:
            with self.transaction() as c:
                c.execute(self.query("install_lock"), {"schema": self.schema})
                refuse_newer_schema(self.schema, self.where, self._installed_version(c), latest)
                owned = {(k, n) for k, n in c.execute(self.query("owned_objects"))}
                c.execute(self.query("ring_rows_drop_all"))  # rows-layout rings' own tables and functions
                for name in [
                    r[0] for r in c.execute(self.query("owned_ring_sequences"), {"schema": self.schema})
                ]:
                    c.execute(self.query("drop_owned_sequence", {"sequence": name}))
                present = [o for o in self._objects(c) if o.key in owned]
                for kind, query, ident in (
                    # tables first: their row-level security policies call the functions
                    ("table", "drop_owned_table", "table"),
                    ("function", "drop_owned_routine", "routine"),
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
