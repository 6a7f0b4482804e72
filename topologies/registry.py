"""Name registries with helpful errors.

Every choice in cdsgd (topology builder, weight rule, and later algorithm,
data set, model, ...) is a name in a :class:`Registry`, so that a sweep is a
list of overrides and a new option is one function plus one registry line.
An unknown name is refused with the allowed names and, where one is close,
a suggestion::

    >>> r = Registry("topology")
    >>> @r.register("ring")
    ... def ring(n): ...
    >>> r.get("rnig")
    Traceback (most recent call last):
    ...
    ValueError: topology 'rnig' is unknown; did you mean 'ring'? Known: ring

This module is plain Python: it is shared by ``topologies`` and ``cdsgd``.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterable, Iterator, TypeVar

__all__ = ["Registry", "unknown_name_error"]

T = TypeVar("T")


def unknown_name_error(kind: str, name: object, known: Iterable[str]) -> ValueError:
    """Return (not raise) the ValueError for an unknown ``name`` of ``kind``.

    The message names the bad value, suggests the closest known name when
    one is close enough, and lists all known names.
    """
    known = sorted(known)
    msg = f"{kind} {name!r} is unknown"
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
    if close:
        msg += f"; did you mean {close[0]!r}?"
    else:
        msg += ";"
    msg += " Known: " + ", ".join(known)
    return ValueError(msg)


class Registry(Generic[T]):
    """A mapping from names to objects of one kind (builders, rules, ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator adding the decorated object under ``name``."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        """The object registered as ``name``; ValueError with suggestions if none."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise unknown_name_error(self.kind, name, self._items) from None

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)
