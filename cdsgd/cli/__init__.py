"""The ``cdsgd`` command line: :func:`main` (the console script) and its parser.

:mod:`.commands`
    ``cdsgd run | launch | sweep | plot | data`` and the parser.
:mod:`.topo`, :mod:`.export`
    ``cdsgd topo`` and ``cdsgd export``.
:mod:`.launch`
    how ``cdsgd launch`` drives torchrun.
"""

from .commands import build_parser, main

__all__ = ["build_parser", "main"]

