"""What a database role may do to a queue: the actions :meth:`DbQueue.grant` hands out, and the check a
queue handle makes before it sends anything (the database refuses the rest anyway: on PostgreSQL with
row-level security, ``dialects/postgres/grants.py``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from airflow_dbqueue.engine.errors import ConfigurationError

ACTIONS = ("push", "pop", "read", "admin")
"""``push``; ``pop`` (pop, ack, nack, claims and batches; implies ``read``); ``read`` (stats, peek,
counts, failed messages); ``admin`` (create and drop queues, requeue and delete failed messages,
consumer groups, maintenance; implies ``pop`` and ``read``)."""

NEEDED_BY: dict[str, str] = {
    "push": "push",
    "push_batch": "push",
    "pop": "pop",
    "pop_payloads": "pop",
    "ack": "pop",
    "nack": "pop",
    "ack_receipts": "pop",
    "nack_receipts": "pop",
    "leased": "pop",
    "reclaim_expired": "pop",
    "claim_batch": "pop",
    "batch_query": "pop",
    "ack_batch": "pop",
    "release_batch": "pop",
    "extend_batch": "pop",
    "get_batch": "read",
    "open_batches": "read",
    "peek": "read",
    "count_ready": "read",
    "readiness": "read",
    "stats": "read",
    "list_failed": "read",
    "groups": "read",
    "requeue_failed": "admin",
    "delete_failed": "admin",
    "add_group": "admin",
    "drop_group": "admin",
    "maintain": "admin",
    "recover_gaps": "admin",
}
"""The action each method of a queue handle needs."""


def check_actions(actions: Iterable[str] | str) -> list[str]:
    """The actions asked for (a list, or one string of them separated by commas), checked:
    :class:`ConfigurationError` names one that is not an action."""
    if isinstance(actions, str):
        actions = [a.strip() for a in actions.split(",")]
    out: list[str] = []
    for a in actions:
        if a not in ACTIONS:
            raise ConfigurationError(f"{a!r} is not an action; the actions are {', '.join(ACTIONS)}")
        if a not in out:
            out.append(a)
    if not out:
        raise ConfigurationError(f"no action given; the actions are {', '.join(ACTIONS)}")
    return out


_F = TypeVar("_F", bound=Callable[..., Any])


def guarded(fn: _F, action: str) -> _F:
    """``fn``, a method of a queue handle, refusing with :class:`PermissionDeniedError` unless the
    handle's role may take ``action`` (``handle.require``)."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._may is not None:
            self.require(action)
        return fn(self, *args, **kwargs)

    call.__dbqueue_action__ = action  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


def guard_methods(cls: type) -> None:
    """Wrap the methods ``cls`` itself defines that :data:`NEEDED_BY` names."""
    for name, action in NEEDED_BY.items():
        fn = cls.__dict__.get(name)
        if callable(fn) and not hasattr(fn, "__dbqueue_action__"):
            setattr(cls, name, guarded(fn, action))
