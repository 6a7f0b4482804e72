"""The bottom layer of :mod:`cdsgd`: primitives every other layer may use.

:mod:`.checks`
    integer / number / choice validators whose errors name the bad value.
:mod:`.seeding`
    seeds derived from (seed, stream) and generators.
:mod:`.files`
    writes that survive a crash (``atomic_write``).
:mod:`.flat`
    flat parameter vectors (``flatten``, ``unflatten``, ``ParamLayout``).
:mod:`.comm`
    point-to-point messages and waits with timeouts, ``CommError``, ``free_port``.

Import from the modules; this package re-exports nothing.
"""

__all__: list[str] = []
