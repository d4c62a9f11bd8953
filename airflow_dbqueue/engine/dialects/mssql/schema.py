"""The SQL Server dialect's schema: ``schema.sql``'s versioned steps, and installing, migrating and
dropping them in one schema with what the engine owns there recorded (``owned_objects``).

:class:`MssqlSchema` is a part of :class:`MssqlDatabase`; the engine calls it through the
:class:`~airflow_dbqueue.engine.dialects.base.Database` protocol only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from airflow_dbqueue.engine.dialects.mssql.params import to_positional
from airflow_dbqueue.engine.dialects.ownership import (
    SchemaObject,
    describe_objects,
    engine_objects,
    ownership,
    refuse_foreign_objects,
    refuse_newer_schema,
)
from airflow_dbqueue.engine.errors import SchemaError
from airflow_dbqueue.engine.sqlfile import parse_named_queries, read_text

log = logging.getLogger(__name__)

_PKG = __package__ or "airflow_dbqueue.engine.dialects.mssql"
_STEP_BLOCK = re.compile(r"v([0-9]+)_[a-z0-9_]+")


def schema_steps() -> tuple[int, list[tuple[int, list[str]]]]:
    """Return ``(latest, [(version, [batch, ...])])`` of ``schema.sql``, versions 1..latest in order.

    Block ``schema`` is version 1; a block named ``vN_<what>`` belongs to version N (one batch each: a
    CREATE PROCEDURE must be alone in its batch). A fresh install runs every step; an install at version
    k runs the steps after k. Both run the same text, so a migrated schema is the fresh one.
    """
    text = read_text(_PKG, "schema.sql")
    m = re.search(r"SCHEMA_VERSION:\s*(\d+)", text)
    if not m:
        raise SchemaError("schema.sql does not declare its SCHEMA_VERSION")
    latest = int(m.group(1))
    steps: dict[int, list[str]] = {}
    for name, body in parse_named_queries(text).items():
        step = _STEP_BLOCK.fullmatch(name)
        if name == "schema":
            steps.setdefault(1, []).append(body)
        elif step:
            steps.setdefault(int(step.group(1)), []).append(body)
        else:
            raise SchemaError(f"schema.sql block {name!r} is neither 'schema' nor named vN_<what>")
    if sorted(steps) != list(range(1, latest + 1)):
        raise SchemaError(f"schema.sql has steps {sorted(steps)}, not 1..{latest} (its SCHEMA_VERSION)")
    return latest, sorted(steps.items())


def schema_sql() -> tuple[int, str]:
    """Return ``(latest version, sql)`` with the first version's tables (block ``schema``).

    The later versions' blocks are in :func:`schema_steps`."""
    latest, steps = schema_steps()
    return latest, steps[0][1][0]


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
        """Create or migrate the schema (idempotent; concurrent installs serialize on an app lock).

        A schema that does not exist is created (and recorded as the engine's); an existing one that
        holds no install must be empty, or :class:`ForeignObjectsError` names what it holds and nothing
        is done. Everything the install creates is recorded in ``owned_objects``.

        :return: the schema version now installed.
        """
        latest, steps = schema_steps()
        with self.transaction() as c:
            cur = c.cursor()
            try:
                cur.execute(*to_positional(self.query("install_lock"), {"schema": self.schema}))
                current = self._installed_version(cur)
                refuse_newer_schema(self.schema, self.where, current, latest)
                if current == latest:
                    return latest
                before = self._objects(cur)
                created_schema = False
                if current == 0:
                    if self._scalar(cur, "schema_exists"):
                        refuse_foreign_objects(self.schema, self.where, before)
                    else:
                        cur.execute(self.query("create_schema"))
                        created_schema = True
                for version, batches in steps:
                    if version <= current:
                        continue
                    for batch in batches:
                        cur.execute(self.compose(batch))
                    cur.execute(*to_positional(self.query("record_version"), {"version": version}))
                rings = [
                    r[0]
                    for r in cur.execute(
                        *to_positional(self.query("owned_ring_sequences"), {"schema": self.schema})
                    ).fetchall()
                ]
                own, schema_is_ours = ownership(
                    before,
                    self._objects(cur),
                    fresh=current == 0,
                    created_schema=created_schema,
                    engine_names=engine_objects(read_text(_PKG, "schema.sql")),
                    ring_sequences=rings,
                )
                if schema_is_ours:
                    own.add(("schema", self.schema))
                params = {"kinds": [k for k, _ in sorted(own)], "names": [n for _, n in sorted(own)]}
                cur.execute(*to_positional(self.query("record_owned"), params))
            finally:
                cur.close()
            log.info(
                "%s dbqueue schema %s at version %s on SQL Server",
                "installed" if current == 0 else f"migrated from version {current}:",
                self.schema,
                latest,
            )
        return latest

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
        lists); an install of an older version is migrated first, which records it. Objects that are
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
        latest = schema_steps()[0]
        if current < latest:
            self.install()  # records what the engine owns, as it does for any older install
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
