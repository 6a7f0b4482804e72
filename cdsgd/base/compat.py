"""Every old name of earlier releases, in one place; each warns on use.

The code moved into layer packages (``cdsgd.base``, ``cdsgd.run``,
``cdsgd.report``, ``cdsgd.cli``) and a few names were renamed. Old import
paths and names keep working, resolved from the tables below, and each use
raises a :class:`DeprecationWarning` that names the new home:

:data:`MOVED_MODULES`
    old module path → the module(s) whose names it now forwards;
    ``import cdsgd.simulator`` gives a module that forwards to
    :mod:`cdsgd.executor` (and ``ParamLayout`` to :mod:`cdsgd.base.flat`).
:data:`MOVED_NAMES`
    ``(module, old name)`` → ``"new.module:new_name"``, served by the
    module's ``__getattr__`` (:func:`module_getattr`).
:data:`RENAMED_ATTRIBUTES`
    ``(class name, old attribute)`` → new attribute, served by
    :class:`renamed_attribute`.

Example::

    >>> import warnings
    >>> import cdsgd.algorithms, cdsgd.base.checks
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     old = cdsgd.algorithms.check_lr
    >>> old is cdsgd.base.checks.check_lr, caught[0].category.__name__
    (True, 'DeprecationWarning')
    >>> print(caught[0].message)
    cdsgd.algorithms.check_lr is an old name: use cdsgd.base.checks.check_lr

This module imports only the standard library: everything is named by
string and imported when an old name is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "RENAMED_ATTRIBUTES", "RENAMED_KEYWORDS", "install", "module_getattr",
           "renamed_attribute", "renamed_keyword", "item_as_attribute"]

#: old module path → new module path(s); a name is looked up in them in order
MOVED_MODULES: dict[str, tuple[str, ...]] = {
    "cdsgd.simulator": ("cdsgd.executor", "cdsgd.base.flat"),
    "cdsgd.mixing": ("cdsgd.mixers",),
    "cdsgd.checks": ("cdsgd.base.checks",),
    "cdsgd.seeding": ("cdsgd.base.seeding",),
    "cdsgd.files": ("cdsgd.base.files",),
    "cdsgd.flat": ("cdsgd.base.flat",),
    "cdsgd.comm": ("cdsgd.base.comm",),
    "cdsgd.plan": ("cdsgd.run.plan",),
    "cdsgd.experiment": ("cdsgd.run.experiment",),
    "cdsgd.checkpoint": ("cdsgd.run.checkpoint",),
    "cdsgd.logger": ("cdsgd.run.logger",),
    "cdsgd.progress": ("cdsgd.run.progress",),
    "cdsgd.sweep": ("cdsgd.run.sweep",),
    "cdsgd.plotting": ("cdsgd.report.plotting",),
    "cdsgd.topology_drawing": ("cdsgd.report.topology_drawing",),
    "cdsgd.export": ("cdsgd.report.export",),
    "cdsgd.cli_topo": ("cdsgd.cli.topo",),
    "cdsgd.cli_export": ("cdsgd.cli.export",),
    "cdsgd.launch": ("cdsgd.cli.launch",),
}

#: (module, old name) → "new.module:new_name"
MOVED_NAMES: dict[tuple[str, str], str] = {
    ("cdsgd.config", "_toml_value"): "cdsgd.config:toml_value",
    **{("cdsgd.algorithms", n): f"cdsgd.base.checks:{n}"
       for n in ("check_int", "check_lr", "check_momentum", "check_weight_decay")},
    ("cdsgd.cli", "free_port"): "cdsgd.base.comm:free_port",
    ("cdsgd.cli", "launch_argv"): "cdsgd.cli.launch:launch_argv",
    ("cdsgd.cli", "describe_launch_failure"): "cdsgd.cli.launch:describe_launch_failure",
}

#: (class name, old attribute) → new attribute
RENAMED_ATTRIBUTES: dict[tuple[str, str], str] = {
    ("Mixer", "rows"): "agents",
}

#: (function, old keyword) → new keyword (``eval_every`` of the config counts epochs; these count steps)
RENAMED_KEYWORDS: dict[tuple[str, str], str] = {
    ("Executor.run", "eval_every"): "eval_every_steps",
    ("simulate", "eval_every"): "eval_every_steps",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is an old name: use {new}", DeprecationWarning, stacklevel=3)


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def module_getattr(module: str):
    """A module-level ``__getattr__`` for ``module`` that serves its old names from :data:`MOVED_NAMES`."""

    def __getattr__(name: str):
        target = MOVED_NAMES.get((module, name))
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        _warn(f"{module}.{name}", target.replace(":", "."))
        return _resolve(target)

    return __getattr__


class renamed_attribute:
    """A class attribute kept under its old name (``rows = renamed_attribute()`` in ``class Mixer``)."""

    def __set_name__(self, owner, name: str) -> None:
        self.old = name
        self.new = RENAMED_ATTRIBUTES[(owner.__name__, name)]
        self.owner = owner.__name__

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        _warn(f"{self.owner}.{self.old}", f"{self.owner}.{self.new}")
        return getattr(obj, self.new)


def item_as_attribute(self, name: str):
    """``obj["name"]`` as ``obj.name``: the dict-style access of earlier releases (as ``__getitem__``)."""
    cls = type(self).__name__
    if not isinstance(name, str) or name.startswith("_") or not hasattr(self, name):
        raise KeyError(name)
    _warn(f"{cls}[{name!r}]", f"{cls}.{name}")
    return getattr(self, name)


def renamed_keyword(function: str, kwargs: dict, new: str, value, *, rest: bool = False):
    """The value of keyword ``new`` of ``function``, also when given under its old name (popped from ``kwargs``).

    ``rest=True``: ``kwargs`` holds nothing else (any other keyword is a TypeError, as Python would say).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     renamed_keyword("simulate", {"eval_every": 5}, "eval_every_steps", None)
    5
    >>> print(caught[0].message)
    simulate(eval_every=...) is an old name: use simulate(eval_every_steps=...)
    """
    for (fn, old), to in RENAMED_KEYWORDS.items():
        if fn == function and to == new and old in kwargs:
            if value is not None:
                raise TypeError(f"{function}() got both {new}= and its old name {old}=; give {new}= only")
            _warn(f"{function}({old}=...)", f"{function}({new}=...)")
            value = kwargs.pop(old)
    if rest and kwargs:
        raise TypeError(f"{function}() got an unexpected keyword argument {next(iter(kwargs))!r}")
    return value


class _Forward(types.ModuleType):
    """An old module path: every name comes from the new module(s)."""

    _targets: tuple[str, ...] = ()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        for target in self._targets:
            module = importlib.import_module(target)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} (now {', '.join(self._targets)}) has no attribute {name!r}")


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module paths of :data:`MOVED_MODULES`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        module = _Forward(spec.name)
        module._targets = MOVED_MODULES[spec.name]
        return module

    def exec_module(self, module) -> None:
        names: list[str] = []
        for target in module._targets:
            names += getattr(importlib.import_module(target), "__all__", [])
        module.__all__ = list(dict.fromkeys(names))
        warnings.warn(f"module {module.__name__} is an old path: use {' / '.join(module._targets)}",
                      DeprecationWarning, stacklevel=2)


def install() -> None:
    """Let the old module paths import (idempotent; ``cdsgd/__init__.py`` calls it)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
