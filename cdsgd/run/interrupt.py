"""Ctrl-C and SIGTERM held until the step in progress is done, so that a run can checkpoint where it stopped.

A signal's own handler raises at once (``KeyboardInterrupt``; the CLI's
SIGTERM handler :class:`~cdsgd.runtime.Terminated`), often in the middle of
a step, with the parameters half updated: a run stopped that way could only
resume from its last periodic checkpoint (stopped at step 2066, resumed from
2061). Inside ``with StopBetweenSteps() as stop`` the first SIGINT or
SIGTERM is only noted; the run asks :attr:`StopBetweenSteps.requested`
after each step, writes a checkpoint of that step, and calls
:meth:`StopBetweenSteps.deliver`, which raises what the signal's own
handler raises. A second signal stops at once (a step that hangs can still
be stopped). Left alone: signals whose handler is not a Python function
(``SIG_DFL``, ``SIG_IGN``) and threads other than the main one.

    >>> import signal
    >>> with StopBetweenSteps() as stop:
    ...     signal.raise_signal(signal.SIGINT)  # the step goes on
    ...     held = stop.requested
    ...     try:
    ...         stop.deliver()
    ...     except KeyboardInterrupt:
    ...         raised = True
    >>> held, raised, signal.getsignal(signal.SIGINT) is signal.default_int_handler
    (True, True, True)
"""

from __future__ import annotations

import signal
import threading

__all__ = ["HELD_SIGNALS", "StopBetweenSteps"]

#: the signals a run holds until the end of its step
HELD_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM") if hasattr(signal, name))


class StopBetweenSteps:
    """Hold SIGINT and SIGTERM until the caller is between steps (see the module docstring).

    Args:
        enabled: False leaves every handler as it is (``requested`` stays False), e.g. in a run of
            several processes, whose ranks could not agree on one step to stop at.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        #: the signal held (its number), or None
        self.pending: int | None = None
        self._handlers: dict[int, object] = {}

    def __enter__(self) -> "StopBetweenSteps":
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in HELD_SIGNALS:
                handler = signal.getsignal(sig)
                if callable(handler):
                    self._handlers[sig] = handler
                    signal.signal(sig, self._hold)
        return self

    def _hold(self, signum: int, frame) -> None:
        if self.pending is not None:  # the second signal: at once
            self.pending = signum
            self.deliver(frame)
        self.pending = signum

    @property
    def requested(self) -> bool:
        """A signal arrived since the block began (and was not delivered yet)."""
        return self.pending is not None

    def deliver(self, frame=None) -> None:
        """Put the handlers back and call the held signal's own handler (which raises, as a rule)."""
        signum, self.pending = self.pending, None
        handlers = dict(self._handlers)
        self._restore()
        if signum is not None:
            handlers[signum](signum, frame)

    def _restore(self) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers.clear()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self.pending is not None:
            self.deliver()  # a signal during the last evaluation: not lost
        self._restore()
