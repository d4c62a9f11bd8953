"""The SQL Server dialect's schema: ``schema.sql`` (tables, indexes and sequences), ``functions.sql``
(every procedure and function, re-applied whenever it changes) and ``migrations/<release>.sql``, and
installing, upgrading and dropping them in one schema with what the engine owns there recorded
(``owned_objects``), as the PostgreSQL dialect does.

:class:`MssqlSchema` is a part of :class:`MssqlDatabase`; the engine calls it through the
:class:`~airflow_dbqueue.engine.dialects.base.Database` protocol only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from airflow_dbqueue.engine.dialects.mssql.params import to_positional
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
from airflow_dbqueue.engine.sqlfile import parse_named_queries, read_text

log = logging.getLogger(__name__)

_PKG = __package__ or "airflow_dbqueue.engine.dialects.mssql"
_ROUTINES = ("procedure", "function")


def schema_sql() -> tuple[int, str]:
    """Return ``(version, sql)`` of the tables, indexes and sequences of a fresh install (one batch)."""
    text = read_text(_PKG, "schema.sql")
    return declared_version(text, "schema.sql"), parse_named_queries(text)["schema"]


def schema_tables() -> frozenset[str]:
    """The tables ``schema.sql`` creates in the schema."""
    return frozenset(n for k, n in engine_objects(read_text(_PKG, "schema.sql")) if k == "table")


def functions_sql() -> tuple[list[str], str, frozenset[str]]:
    """Return ``(batches, sha256, names)`` of ``functions.sql``: every procedure and function, one
    ``CREATE OR ALTER`` batch each, in the order they are applied."""
    text = read_text(_PKG, "functions.sql")
    names = frozenset(n for k, n in engine_objects(text) if k in _ROUTINES)
    return list(parse_named_queries(text).values()), digest(text), names


def migrations() -> list[tuple[int, list[str]]]:
    """Return ``[(version, [batch, ...])]`` of ``migrations/<release>.sql``, in release order."""
    return release_migrations(_PKG)


class _Connections(Protocol):
    """What the schema's part takes from the rest of :class:`MssqlDatabase`."""

    schema: str
    where: str

    def transaction(self, conn: Any | None = None) -> AbstractContextManager[Any]: ...

    def query(self, name: str, identifiers: Mapping[str, str] | None = None) -> str: ...

    def compose(self, body: str, identifiers: Mapping[str, str] | None = None) -> str: ...


if TYPE_CHECKING:  # the dialect's class supplies them
    _Base = _Connections
else:
    _Base = object


class MssqlSchema(_Base):
    """The schema part of :class:`MssqlDatabase` (see the module's docstring)."""

    def install(self) -> int:
        """Create or upgrade the schema (idempotent; concurrent installs serialize on an app lock).

        A schema that does not exist is created (and recorded as the engine's); an existing one that
        holds no install must be empty, or :class:`ForeignObjectsError` names what it holds and nothing
        is done. An install of an earlier release runs the migrations after it. Then, when
        ``functions.sql`` is not the one last applied (its SHA-256 in ``owned_objects``), every
        procedure and function is altered, and an engine's routine that the file no longer defines is
        dropped: all in one transaction. Everything the install creates is recorded in
        ``owned_objects``. An install newer than this code, or made by a development version before the
        first release, or one at this code's version that lacks a table this code creates (another
        build's), raises :class:`SchemaError` and is left alone.

        :return: the schema version now installed.
        """
        latest, tables = schema_sql()
        routines, sha, defined = functions_sql()
        with self.transaction() as c:
            cur = c.cursor()
            try:
                cur.execute(*to_positional(self.query("install_lock"), {"schema": self.schema}))
                current = self._installed_version(cur)
                refuse_newer_schema(self.schema, self.where, current, latest)
                refuse_older_schema(self.schema, self.where, current)
                before = self._objects(cur)
                if current == latest:
                    present = {o.name for o in before if o.kind == "table"}
                    refuse_incomplete_schema(self.schema, self.where, current, schema_tables() - present)
                applied = self._scalar(cur, "functions_applied") if current else None
                if current == latest and applied == sha:
                    return latest
                created_schema = False
                if current == 0:
                    if self._scalar(cur, "schema_exists"):
                        refuse_foreign_objects(self.schema, self.where, before)
                    else:
                        cur.execute(self.query("create_schema"))
                        created_schema = True
                    cur.execute(self.compose(tables))
                    cur.execute(*to_positional(self.query("record_version"), {"version": latest}))
                    log.info("installed dbqueue schema %s at version %s on SQL Server", self.schema, latest)
                for version, batches in migrations():
                    if 0 < current < version <= latest:
                        for batch in batches:
                            cur.execute(self.compose(batch))
                        cur.execute(*to_positional(self.query("record_version"), {"version": version}))
                        log.info("upgraded dbqueue schema %s to version %s", self.schema, version)
                self._apply_functions(cur, routines, defined)
                before_keys = {o.key for o in before}
                own = {o.key for o in self._objects(cur) if o.key not in before_keys}
                if created_schema:
                    own.add(("schema", self.schema))
                if applied is not None:
                    cur.execute(
                        *to_positional(self.query("forget_owned"), {"kind": FUNCTIONS_KIND, "name": applied})
                    )
                own.add((FUNCTIONS_KIND, sha))
                params = {"kinds": [k for k, _ in sorted(own)], "names": [n for _, n in sorted(own)]}
                cur.execute(*to_positional(self.query("record_owned"), params))
                if current:
                    log.info("applied the routines of dbqueue schema %s (%s)", self.schema, sha[:12])
            finally:
                cur.close()
        return latest

    def _apply_functions(self, cur: Any, routines: list[str], defined: frozenset[str]) -> None:
        """Apply ``functions.sql``, a batch a routine, and drop an engine's procedure or function that
        the file no longer defines."""
        for batch in routines:
            cur.execute(self.compose(batch))
        owned = {(str(k), str(n)) for k, n in cur.execute(self.query("owned_objects")).fetchall()}
        for o in self._objects(cur):
            if o.kind in _ROUTINES and o.key in owned and o.name not in defined:
                cur.execute(self.query("drop_owned_routine", {"routine": o.name}))
                cur.execute(*to_positional(self.query("forget_owned"), {"kind": o.kind, "name": o.name}))

    def _scalar(self, cur: Any, name: str) -> Any:
        row = cur.execute(*to_positional(self.query(name), {"schema": self.schema})).fetchone()
        return row[0] if row else None

    def _installed_version(self, cur: Any) -> int:
        """The version of the install in the schema (0: none), read on ``cur``'s transaction."""
        if not self._scalar(cur, "schema_installed"):
            return 0
        got = cur.execute(self.query("schema_version")).fetchone()
        return int(got[0]) if got else 0

    def _objects(self, cur: Any) -> list[SchemaObject]:
        rows = cur.execute(*to_positional(self.query("schema_objects"), {"schema": self.schema})).fetchall()
        return [SchemaObject(str(kind), str(name), str(identity)) for kind, name, identity in rows]

    def drop_schema(self) -> None:
        """Drop what the engine created in the schema, and the schema when it is the engine's and empty.

        What is dropped is what ``owned_objects`` lists (and the rings' sequences, which ``rings``
        lists); an install of an earlier release is upgraded first. Objects that are
        not the engine's stay, and so does the schema that holds them. When an object that is not the
        engine's refers to one of its tables (a view, a foreign key), :class:`ForeignObjectsError` names
        it and nothing is dropped. A schema without an install is left alone.
        """
        with self.transaction() as c:
            cur = c.cursor()
            try:
                cur.execute(*to_positional(self.query("install_lock"), {"schema": self.schema}))
                current = self._installed_version(cur) if self._scalar(cur, "schema_exists") else 0
            finally:
                cur.close()
        if current == 0:
            log.info(
                "dbqueue schema %s holds no install at %s: nothing to uninstall", self.schema, self.where
            )
            return
        refuse_older_schema(self.schema, self.where, current)
        latest = schema_sql()[0]
        if current < latest:
            self.install()
        with self.transaction() as c:
            cur = c.cursor()
            try:
                cur.execute(*to_positional(self.query("install_lock"), {"schema": self.schema}))
                refuse_newer_schema(self.schema, self.where, self._installed_version(cur), latest)
                owned = {(str(k), str(n)) for k, n in cur.execute(self.query("owned_objects")).fetchall()}
                rings = cur.execute(
                    *to_positional(self.query("owned_ring_sequences"), {"schema": self.schema})
                ).fetchall()
                for (name,) in rings:
                    cur.execute(self.query("drop_owned_sequence", {"sequence": str(name)}))
                present = [o for o in self._objects(cur) if o.key in owned]
                for kind, query, ident in (
                    ("procedure", "drop_owned_routine", "routine"),
                    ("function", "drop_owned_routine", "routine"),  # they refer to tables: before them
                    ("table", "drop_owned_table", "table"),
                    ("sequence", "drop_owned_sequence", "sequence"),
                ):
                    for o in present:
                        if o.kind == kind and o.name != "owned_objects":
                            cur.execute(self.query(query, {ident: o.name}))
                if ("table", "owned_objects") in {o.key for o in present}:
                    cur.execute(self.query("drop_owned_table", {"table": "owned_objects"}))
                left = self._objects(cur)
                if ("schema", self.schema) in owned and not left:
                    cur.execute(self.query("drop_owned_schema"))
                    log.info("uninstalled dbqueue schema %s at %s", self.schema, self.where)
                else:
                    log.info(
                        "uninstalled dbqueue from schema %s at %s; the schema stays (%s)",
                        self.schema,
                        self.where,
                        f"it holds {describe_objects(left)}" if left else "the engine did not create it",
                    )
            finally:
                cur.close()
