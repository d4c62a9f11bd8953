"""What the engine owns in a schema, and refusing what it does not: the objects a dialect's SQL files
create, the catalogue (``owned_objects``) that records them, and the checks an install makes before it
writes anything (a schema that holds someone else's objects, an install too new or too old for this
code). Each dialect's ``schema.py`` calls these; nothing here runs a statement."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable
from importlib import resources

from airflow_dbqueue.engine.errors import ForeignObjectsError, SchemaError
from airflow_dbqueue.engine.sqlfile import parse_named_queries


@dataclasses.dataclass(frozen=True, slots=True)
class SchemaObject:
    """One object of a schema as the database's catalog lists it; ``kind`` and ``name`` are its key."""

    kind: str
    """``table``, ``sequence``, ``function``, ``procedure``, ``view`` ... as the dialect names it."""
    name: str
    identity: str = dataclasses.field(default="", compare=False)
    """How the database describes it (schema-qualified, with a function's arguments), for messages."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.name)


_CREATES = re.compile(
    r"^\s*CREATE\s+(?:OR\s+(?:REPLACE|ALTER)\s+)?(TABLE|SEQUENCE|FUNCTION|PROCEDURE)\s+\{schema\}\.(\w+)",
    re.IGNORECASE | re.MULTILINE,
)


def engine_objects(sql_text: str) -> frozenset[tuple[str, str]]:
    """Return the ``(kind, name)`` of every table, sequence, function and procedure that a SQL file of
    the dialect creates in ``{schema}``."""
    return frozenset((kind.lower(), name) for kind, name in _CREATES.findall(sql_text))


def describe_objects(objects: Iterable[SchemaObject], limit: int = 20) -> str:
    """One line naming up to ``limit`` objects (``kind identity``), for an error message."""
    items = [f"{o.kind} {o.identity or o.name}" for o in objects]
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def refuse_foreign_objects(schema: str, where: str, found: list[SchemaObject]) -> None:
    """Raise :class:`ForeignObjectsError` when a schema that holds no dbqueue install holds anything:
    a fresh install goes only into a schema of its own, or an empty one."""
    if found:
        raise ForeignObjectsError(
            f"schema {schema!r} at {where} already holds {len(found)} object(s) that are not the "
            f"engine's: {describe_objects(found)}. Nothing was installed: give the queues a schema of "
            "their own (one that does not exist yet, or an empty one)",
            [f"{o.kind} {o.identity or o.name}" for o in found],
        )


FIRST_RELEASE = "1.0"
"""The release whose schema is each dialect's baseline: the oldest install that this code upgrades."""
FUNCTIONS_KIND = "functions"
"""The kind of the ``owned_objects`` row whose name is the SHA-256 of the routines file last applied."""

_RELEASE = re.compile(r"([0-9]+)\.([0-9]{1,2})")
_DECLARED = re.compile(r"SCHEMA_VERSION:\s*(\S+)")
_MIGRATION_FILE = re.compile(r"([0-9]+\.[0-9]{1,2})\.sql")


def release_version(release: str) -> int:
    """The schema version a release records in ``schema_version``: ``major * 100 + minor``
    (``"1.0"`` is 100, ``"1.1"`` 101)."""
    m = _RELEASE.fullmatch(release)
    if not m:
        raise SchemaError(f"{release!r} is not a release name (major.minor, as 1.0 or 1.12)")
    return int(m.group(1)) * 100 + int(m.group(2))


def declared_version(text: str, filename: str) -> int:
    """The version a schema file declares in its ``SCHEMA_VERSION: <release>`` line."""
    m = _DECLARED.search(text)
    if not m:
        raise SchemaError(f"{filename} does not declare its SCHEMA_VERSION")
    return release_version(m.group(1))


def release_migrations(package: str) -> list[tuple[int, list[str]]]:
    """Return ``[(version, [block, ...])]`` of the package's ``migrations/<release>.sql`` files in
    release order: one a release that changed a table, each upgrading an install of the release
    before it. A file's named blocks run in file order, each as one statement batch."""
    folder = resources.files(package).joinpath("migrations")
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        m = _MIGRATION_FILE.fullmatch(entry.name)
        if not m:
            raise SchemaError(f"migration file {entry.name!r} is not named for its release (1.1.sql)")
        found.append(
            (release_version(m.group(1)), list(parse_named_queries(entry.read_text("utf-8")).values()))
        )
    return sorted(found)


def digest(text: str) -> str:
    """The SHA-256 of a routines file, as ``owned_objects`` records it."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def refuse_older_schema(schema: str, where: str, current: int) -> None:
    """Raise :class:`SchemaError` when a schema holds an install made by a development version before
    the first release (a schema version below :data:`FIRST_RELEASE`'s): this code does not upgrade it."""
    if 0 < current < release_version(FIRST_RELEASE):
        raise SchemaError(
            f"schema {schema!r} at {where} holds an install of a development version of airflow-dbqueue "
            f"made before release {FIRST_RELEASE} (schema version {current}), which this version cannot "
            "upgrade or uninstall. Reinstall: uninstall it with the version that made it "
            "(DbQueue.uninstall()), or drop the schema with everything in it (DROP SCHEMA ... CASCADE), "
            "then install again"
        )


def refuse_incomplete_schema(schema: str, where: str, version: int, missing: Iterable[str]) -> None:
    """Raise :class:`SchemaError` when an install recorded at this code's schema version lacks tables
    this code's ``schema.sql`` creates: it was made by another build of the same version (a
    development tree), and this code would fail at the first statement that reads a missing table."""
    names = sorted(missing)
    if names:
        raise SchemaError(
            f"schema {schema!r} at {where} holds an install at schema version {version} without the "
            f"table(s) {', '.join(names)} that this build of airflow-dbqueue creates at that version: it "
            "was installed by another build (a development tree). Nothing was changed. Reinstall: "
            "uninstall it with the build that made it (DbQueue.uninstall()), or drop the schema with "
            "everything in it (DROP SCHEMA ... CASCADE), then install again"
        )


def refuse_newer_schema(schema: str, where: str, current: int, latest: int) -> None:
    """Raise :class:`SchemaError` when an installed schema is newer than this code knows (installs
    and migrations never downgrade or touch it)."""
    if current > latest:
        raise SchemaError(
            f"schema {schema!r} at {where} is at version {current}, newer than this code's {latest}; "
            "upgrade airflow-dbqueue"
        )
