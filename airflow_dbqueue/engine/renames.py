"""Arguments kept under an old name for one release: the old name still works and warns with a
:class:`DeprecationWarning` that names the new one (see "Names and defaults" in docs/concepts.md)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, ParamSpec, TypeVar

from airflow_dbqueue.engine.errors import ConflictingArgumentsError

_P = ParamSpec("_P")
_R = TypeVar("_R")

RENAMED_ATTRIBUTE = "__renamed_kwargs__"
"""The attribute of a function wrapped by :func:`renamed_kwargs` holding its ``{old: new}`` names."""


def warn_renamed(owner: str, old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``owner``'s argument ``old`` is deprecated in favour of ``new``."""
    warnings.warn(
        f"{owner}: {old} is deprecated and will be removed in the next release; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def take_renamed(
    owner: str, kwargs: MutableMapping[str, Any], renames: Mapping[str, str], *, stacklevel: int = 4
) -> dict[str, Any]:
    """Pop the old names of ``renames`` (``{old: new}``) out of ``kwargs``, warning for each; return
    their values under the new names.

    :raise ConflictingArgumentsError: (a ``TypeError`` too) when ``kwargs`` also holds the new name of
        an old one given.
    """
    out: dict[str, Any] = {}
    for old, new in renames.items():
        if old in kwargs:
            if new in kwargs:
                raise ConflictingArgumentsError(
                    f"{owner}: got both {old} (deprecated) and {new}; give only {new}"
                )
            warn_renamed(owner, f"{old}=", f"{new}=", stacklevel=stacklevel)
            out[new] = kwargs.pop(old)
    return out


def renamed_kwargs(**renames: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Let a function's keyword arguments be given by their old names too (``old="new"``), each with a
    :class:`DeprecationWarning` naming the new one. The wrapper's signature is the function's (its new
    names); the renames are kept in its ``__renamed_kwargs__``."""

    def wrap(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        owner = getattr(fn, "__qualname__", repr(fn))

        @functools.wraps(fn)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if kwargs:
                kwargs.update(take_renamed(owner, kwargs, renames))
            return fn(*args, **kwargs)

        setattr(wrapper, RENAMED_ATTRIBUTE, dict(renames))
        return wrapper

    return wrap
