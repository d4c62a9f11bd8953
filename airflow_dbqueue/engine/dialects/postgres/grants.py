"""Least-privilege roles on PostgreSQL: who may do what to which queue (``DbQueue.grant``), enforced by
the database.

The schema's tables have row-level security (``schema.sql``'s block ``policies``): a role other than
the owner sees and changes only the rows of the queues it holds an action on, as the ``grants`` table
says, whatever it runs. A grant records the role's actions there and gives the role the table
privileges the policies then narrow: ``USAGE`` on the schema, ``SELECT, INSERT, UPDATE, DELETE`` on the
queue tables, ``SELECT`` on the version and the catalogue, the sequences its actions use (a ring's own,
for the roles of that ring), ``CREATE`` on the schema for a role that may administer every queue (a
ring's sequences are made when it is created), and ``MAINTAIN`` on the tables where the server has it
(PostgreSQL 17 and later) for a role that administers every queue, so that its maintenance may VACUUM
and REINDEX. Only the schema's owner grants and revokes.

A ring of the rows layout keeps its messages in tables of its own (segments, position logs, leases, done
rows, retry log, batch ledger, sequences; its consumer groups' copies too), which row-level security
cannot narrow: a role gets privileges on those objects of the rings it holds an action on, and no other
ring's, each action what its statements need (:func:`rows_ring_statements`). They are set again whenever
the role's grants change, and given when a ring or a group of it is made (:meth:`grant_new_ring`), so a
segment emptied and reused keeps them (``TRUNCATE`` keeps a table's privileges).

:class:`PostgresGrants` is a part of :class:`PostgresDatabase`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from psycopg import sql

from airflow_dbqueue.engine.errors import ConfigurationError

_TABLE_ONLY_READ = ("schema_version", "owned_objects")
_NEVER_GRANTED = ("grants",)

# The own objects of a ring of the rows layout (functions.sql, ring_rows_template), by their name past
# the prefix of the ring or group (ring_<queue_id>_r, ring_g<gid>_r).
_ROWS_SEGMENT = re.compile(r"(q|emptied)[0-3]?")  # the segments and their emptied ones' totals, and views
_ROWS_LOG = re.compile(r"(pos|l|d|r)[0-3]?")  # positions, leases, done rows, retry log, and their views
_ROWS_LEDGER = re.compile(r"bs?")  # the batch ledger
_ROWS_PUSH_SEQ = re.compile(r"gen[0-3]|rows")  # row numbers and the segments' generation labels
_ROWS_POP_SEQ = re.compile(r"posgen|retrygen")  # the newest segments the logs were written in
_ROWS_KEYS = "keys"  # the deduplication keys
_ALL_TABLE = frozenset(("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE"))
_ALL_SEQUENCE = frozenset(("USAGE", "SELECT", "UPDATE"))


def _rows_privileges(what: str, kind: str, actions: frozenset[str]) -> frozenset[str]:
    """The privileges a role holding ``actions`` on a ring of the rows layout gets on its object
    ``what`` (of kind ``'r'`` table, ``'v'`` view, ``'S'`` sequence). Any action reads everything. A push
    inserts a row into a segment, and rotates one in: it empties a segment with its logs (those of every
    group) and the table of the emptied segments' total beside it under ``LOCK TABLE`` and ``TRUNCATE``,
    writes that total again there, and labels it (``setval``); a push with deduplication keys inserts,
    updates and (when a rotation comes first) deletes its keys in the ring's key table. A pop, ack,
    nack, reclaim or batch only inserts into its group's logs and the ledger (a claim locks its ledger
    row). admin: everything (maintenance, failed messages)."""
    if not actions:
        return frozenset()
    if "admin" in actions:
        return _ALL_SEQUENCE if kind == "S" else _ALL_TABLE
    got = {"SELECT"}
    push, pop = "push" in actions, "pop" in actions
    if kind == "S":
        if (push and _ROWS_PUSH_SEQ.fullmatch(what)) or (pop and _ROWS_POP_SEQ.fullmatch(what)):
            got |= {"USAGE", "UPDATE"}
        return frozenset(got)
    if kind == "v":
        return frozenset(got)
    if push and what == _ROWS_KEYS:
        got |= {"INSERT", "UPDATE", "DELETE"}
    if push and _ROWS_SEGMENT.fullmatch(what):
        got |= {"INSERT", "TRUNCATE"}
    if push and _ROWS_LOG.fullmatch(what):
        got.add("TRUNCATE")
    if pop and _ROWS_LOG.fullmatch(what):
        got.add("INSERT")
    if pop and _ROWS_LEDGER.fullmatch(what):
        got |= {"INSERT", "UPDATE", "DELETE"}
    return frozenset(got)


def rows_ring_statements(
    schema: str,
    objects: Iterable[tuple[Any, ...]],
    actions_of: Mapping[tuple[str, int], Iterable[str]],
) -> list[sql.Composed]:
    """The statements that set each role's privileges on the own objects of rings of the rows layout:
    ``objects`` as the query ``ring_rows_objects_of`` returns them, ``actions_of[(role, queue_id)]`` the
    actions the role now holds on that ring. Everything is revoked first, then what the actions need is
    granted (one statement a set of privileges)."""
    by_queue: dict[int, list[tuple[str, str, str]]] = {}
    for queue_id, name, kind, what in objects:
        by_queue.setdefault(int(queue_id), []).append((str(name), str(kind), str(what)))
    out: list[sql.Composed] = []
    for (role, queue_id), held in sorted(actions_of.items()):
        owned = by_queue.get(queue_id)
        if not owned:
            continue
        r = sql.Identifier(role)
        actions = frozenset(held)
        for keyword, kinds in (("TABLE", ("r", "v")), ("SEQUENCE", ("S",))):
            names = [n for n, k, _ in owned if k in kinds]
            if not names:
                continue
            out.append(
                sql.SQL("REVOKE ALL ON " + keyword + " {} FROM {}").format(
                    sql.SQL(", ").join(sql.Identifier(schema, n) for n in names), r
                )
            )
            groups: dict[frozenset[str], list[str]] = {}
            for n, k, what in owned:
                if k in kinds:
                    privileges = _rows_privileges(what, k, actions)
                    if privileges:
                        groups.setdefault(privileges, []).append(n)
            for privileges, granted in sorted(groups.items(), key=lambda kv: sorted(kv[0])):
                out.append(
                    sql.SQL("GRANT " + ", ".join(sorted(privileges)) + " ON " + keyword + " {} TO {}").format(
                        sql.SQL(", ").join(sql.Identifier(schema, n) for n in granted), r
                    )
                )
    return out


class _Connections(Protocol):
    schema: str

    def transaction(self, conn: Any = None) -> AbstractContextManager[psycopg.Connection[Any]]: ...

    def fetchall(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: psycopg.Connection[Any] | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> list[tuple[Any, ...]]: ...

    def fetchone(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: psycopg.Connection[Any] | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> tuple[Any, ...] | None: ...


if TYPE_CHECKING:
    _Base = _Connections
else:
    _Base = object


class PostgresGrants(_Base):
    """The grants part of :class:`PostgresDatabase` (see the module's docstring)."""

    def grant(self, role: str, queue_id: int | None, actions: Sequence[str]) -> list[str]:
        """Let ``role`` take ``actions`` on queue ``queue_id`` (None: every queue, present and future);
        return the actions it did not hold before. One transaction."""
        with self.transaction() as c:
            self._check_role(role, c)
            added = [
                r[0]
                for r in self.fetchall(
                    "grants_add", {"role": role, "queue_id": queue_id, "actions": list(actions)}, c
                )
            ]
            self._table_privileges(c, role)
            rings = (
                [int(r[0]) for r in self.fetchall("list_ring_ids", None, c)]
                if queue_id is None
                else [queue_id]
            )
            self._ring_privileges(c, [role], rings)
            self._rows_ring_privileges(c, [role], None if queue_id is None else [queue_id])
            if queue_id is None and "admin" in actions:
                c.execute(
                    sql.SQL("GRANT CREATE ON SCHEMA {} TO {}").format(
                        sql.Identifier(self.schema), sql.Identifier(role)
                    )
                )
                self._maintain_privilege(c, role, grant=True)
        return added

    def revoke(self, role: str, queue_id: int | None, actions: Sequence[str]) -> list[str]:
        """Take ``actions`` on ``queue_id`` (None: the grant on every queue) from ``role``; return the
        actions it held. A role left with no grant loses the privileges the grants gave it."""
        with self.transaction() as c:
            removed = [
                r[0]
                for r in self.fetchall(
                    "grants_remove", {"role": role, "queue_id": queue_id, "actions": list(actions)}, c
                )
            ]
            if queue_id is None and "admin" in actions and self._exists(role, c):
                c.execute(
                    sql.SQL("REVOKE CREATE ON SCHEMA {} FROM {}").format(
                        sql.Identifier(self.schema), sql.Identifier(role)
                    )
                )
                self._maintain_privilege(c, role, grant=False)
            if self._exists(role, c):
                self._rows_ring_privileges(c, [role], None if queue_id is None else [queue_id])
            row = self.fetchone("grants_of_role", {"role": role}, c)
            if row is not None and row[0] == 0 and self._exists(role, c):
                self._revoke_all(c, role)
        return removed

    def list_grants(self) -> list[tuple[str, str | None, str]]:
        """Every grant: ``(role, queue name or None for every queue, action)``."""
        return [(r[0], r[1], r[2]) for r in self.fetchall("grants_list")]

    def actions_on(self, queue_id: int | None) -> frozenset[str]:
        """What the session's role may do to queue ``queue_id`` (None: to every queue)."""
        row = self.fetchone("actions_on", {"queue_id": queue_id})
        return frozenset(row[0] if row and row[0] else ())

    def sees_all_activity(self) -> bool:
        """Whether the session's role sees every session's transaction in pg_stat_activity."""
        row = self.fetchone("sees_all_activity")
        return bool(row and row[0])

    def grant_new_ring(self, conn: psycopg.Connection[Any], queue_id: int) -> None:
        """Give a ring's own objects, just made in ``conn``'s transaction (a ring's sequences; a ring of
        the rows layout's tables, or those of a consumer group just added to it), to the roles that hold
        an action on it or on every queue."""
        roles = [r[0] for r in self.fetchall("grants_roles_of_queue", {"queue_id": queue_id}, conn)]
        if roles:
            self._ring_privileges(conn, roles, [queue_id])
            self._rows_ring_privileges(conn, roles, [queue_id])

    # -- privileges ------------------------------------------------------------------------------

    def _exists(self, role: str, c: psycopg.Connection[Any]) -> bool:
        return self.fetchone("role_exists", {"role": role}, c) is not None

    def _check_role(self, role: str, c: psycopg.Connection[Any]) -> None:
        if not isinstance(role, str) or not role or not self._exists(role, c):
            raise ConfigurationError(
                f"role {role!r} does not exist on the server; create it first (CREATE ROLE)"
            )

    def _tables(self, c: psycopg.Connection[Any]) -> list[str]:
        return [r[0] for r in self.fetchall("owned_tables", None, c)]

    def _table_privileges(self, c: psycopg.Connection[Any], role: str) -> None:
        s, r = sql.Identifier(self.schema), sql.Identifier(role)
        c.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
        for t in self._tables(c):
            if t in _NEVER_GRANTED:
                continue
            what = "SELECT" if t in _TABLE_ONLY_READ else "SELECT, INSERT, UPDATE, DELETE"
            c.execute(sql.SQL("GRANT " + what + " ON TABLE {}.{} TO {}").format(s, sql.Identifier(t), r))
        for seq in ("message_id_seq", "group_gids"):
            c.execute(
                sql.SQL("GRANT USAGE, SELECT, UPDATE ON SEQUENCE {}.{} TO {}").format(
                    s, sql.Identifier(seq), r
                )
            )

    def _ring_privileges(self, c: psycopg.Connection[Any], roles: list[str], queue_ids: list[int]) -> None:
        for (seq,) in self.fetchall("ring_sequences_of", {"queue_ids": queue_ids}, c):
            for role in roles:
                c.execute(
                    sql.SQL("GRANT USAGE, SELECT, UPDATE ON SEQUENCE {} TO {}").format(
                        sql.Identifier(self.schema, seq), sql.Identifier(role)
                    )
                )

    def _rows_ring_privileges(
        self, c: psycopg.Connection[Any], roles: list[str], queue_ids: list[int] | None
    ) -> None:
        """Set ``roles``' privileges on the own objects of the rings of the rows layout among ``queue_ids``
        (None: every one) to what their actions on each ring need now."""
        objects = self.fetchall("ring_rows_objects_of", {"schema": self.schema, "queue_ids": queue_ids}, c)
        rings = sorted({int(o[0]) for o in objects})
        if not rings:
            return
        actions_of: dict[tuple[str, int], Iterable[str]] = {}
        for role in roles:
            for queue_id, held in self.fetchall("role_actions_on", {"role": role, "queue_ids": rings}, c):
                actions_of[(role, int(queue_id))] = held or ()
        for statement in rows_ring_statements(self.schema, objects, actions_of):
            c.execute(statement)

    def _maintain_privilege(self, c: psycopg.Connection[Any], role: str, *, grant: bool) -> None:
        """``MAINTAIN`` (VACUUM, ANALYZE, REINDEX) on the tables, where the server has it (17+)."""
        row = self.fetchone("server_version_num", None, c)
        if row is None or row[0] < 170000:
            return
        s, r = sql.Identifier(self.schema), sql.Identifier(role)
        verb = "GRANT MAINTAIN ON TABLE {}.{} TO {}" if grant else "REVOKE MAINTAIN ON TABLE {}.{} FROM {}"
        for t in self._tables(c):
            c.execute(sql.SQL(verb).format(s, sql.Identifier(t), r))

    def _revoke_all(self, c: psycopg.Connection[Any], role: str) -> None:
        s, r = sql.Identifier(self.schema), sql.Identifier(role)
        for t in self._tables(c):
            c.execute(sql.SQL("REVOKE ALL ON TABLE {}.{} FROM {}").format(s, sql.Identifier(t), r))
        for seq in ("message_id_seq", "group_gids"):
            c.execute(sql.SQL("REVOKE ALL ON SEQUENCE {}.{} FROM {}").format(s, sql.Identifier(seq), r))
        rings = [r_[0] for r_ in self.fetchall("list_ring_ids", None, c)]
        for (seq,) in self.fetchall("ring_sequences_of", {"queue_ids": rings}, c):
            c.execute(
                sql.SQL("REVOKE ALL ON SEQUENCE {} FROM {}").format(sql.Identifier(self.schema, seq), r)
            )
        c.execute(sql.SQL("REVOKE ALL ON SCHEMA {} FROM {}").format(s, r))
