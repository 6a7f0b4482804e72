r"""Churn: which agents are online at each step, drawn from a seed or read from a trace.

A membership trace is a set of offline intervals: agent j is offline at
steps ``leave ≤ k < return`` (``return`` None: it never comes back). Every
agent is online unless an interval says otherwise, so a run starts with
all of them unless a trace has an agent leave at step 0.

**Seeded churn** (``network_params.churn = c``, ``churn_down_steps = D``):
each agent alternates online and offline periods, starting online. Their
lengths in steps are geometric: offline periods of mean D, online periods
of mean U = D·(1 − c)/c, so that in the long run each agent is offline a
fraction D/(U + D) = c of the steps. Agent j's periods come from its own
stream (seed, "churn", j), so the trace of an agent does not depend on how
far the run goes or on the other agents.

**A trace file** (``network_params.churn_trace``): a CSV with the header
``agent,leave_step,return_step`` and one row per offline interval; an empty
``return_step`` (or ``never``) means the agent does not come back.

    >>> t = MembershipTrace(4, [(2, 3, 5), (0, 4, None)])
    >>> [t.online(k).astype(int).tolist() for k in (2, 3, 4, 5)]
    [[1, 1, 1, 1], [1, 1, 0, 1], [0, 1, 0, 1], [0, 1, 1, 1]]
    >>> MembershipTrace(4, [(4, 1, 2)])
    Traceback (most recent call last):
    ...
    ValueError: churn trace row 1 names agent 4; the agents are 0..3
    >>> t = random_churn(100, 0.3, 10, seed=0)
    >>> round(float(sum(t.online(k).mean() for k in range(2000, 4000)) / 2000), 2)   # about 1 − c
    0.7

Pure numpy: no torch.
"""

from __future__ import annotations

import bisect
import csv
import math
import os
from pathlib import Path

import numpy as np

from ..base.seeding import derive_seed

__all__ = ["MembershipTrace", "load_trace", "random_churn"]


class MembershipTrace:
    """Who is online at each step: ``online(k)``, a boolean N-vector.

    Args:
        n_agents: N.
        intervals: (agent, leave step, return step or None) rows: offline at leave ≤ k < return. One
            agent's intervals must not overlap; ValueError naming the bad row (1-based) otherwise.
        draw: for seeded churn, ``draw(j, upto)`` extends agent j's intervals to cover step ``upto``
            (:func:`random_churn`); None for a fixed trace.
    """

    def __init__(self, n_agents: int, intervals=(), *, draw=None) -> None:
        self.n_agents = int(n_agents)
        self._intervals: list[list[tuple[int, float]]] = [[] for _ in range(self.n_agents)]
        for row, interval in enumerate(intervals, 1):
            self._intervals_add(row, *interval)
        self._draw, self._covered = draw, -1
        self._sorted = [0] * self.n_agents  # how many of agent j's intervals are known to be in order

    def _intervals_add(self, row: int, agent, leave, ret) -> None:
        where = f"churn trace row {row}"
        if isinstance(agent, bool) or not isinstance(agent, (int, np.integer)) or not 0 <= agent < self.n_agents:
            raise ValueError(f"{where} names agent {agent}; the agents are 0..{self.n_agents - 1}")
        if isinstance(leave, bool) or not isinstance(leave, (int, np.integer)) or leave < 0:
            raise ValueError(f"{where}: leave_step must be a step >= 0, got {leave!r}")
        end = math.inf if ret is None else ret
        if ret is not None and (isinstance(ret, bool) or not isinstance(ret, (int, np.integer)) or ret <= leave):
            raise ValueError(f"{where}: agent {agent} returns at step {ret!r}, not after it left (step {leave}); "
                             "return_step must be greater than leave_step, or empty for never")
        for other_leave, other_end in self._intervals[agent]:
            if leave < other_end and other_leave < end:
                raise ValueError(f"{where}: agent {agent}'s interval [{leave}, {ret if ret is not None else 'never'}) "
                                 f"overlaps its interval from step {other_leave}")
        self._intervals[agent].append((int(leave), end))

    def add(self, agent: int, leave: int, ret: int | None = None) -> None:
        """Agent ``agent`` is offline from step ``leave`` until ``ret`` (None: for good); a loss the
        runtime observed (:meth:`cdsgd.executor.membership.Membership.lose`)."""
        self._intervals_add(sum(map(len, self._intervals)) + 1, agent, leave, ret)

    def readmit(self, agent: int, k: int) -> None:
        """Agent ``agent``, offline for good since an earlier step, is back at step k (a replacement joined)."""
        for i, (leave, end) in enumerate(self._intervals[agent]):
            if end == math.inf and leave < k:
                self._intervals[agent][i] = (leave, int(k))
                return
        raise ValueError(f"agent {agent} is not offline for good before step {k}: it cannot be readmitted")

    def online(self, k: int) -> np.ndarray:
        """The boolean N-vector of the agents online at step k."""
        if self._draw is not None and k > self._covered:
            upto = max(k, 2 * self._covered + 64)  # draw ahead, so that asking step by step stays cheap
            for j in range(self.n_agents):
                self._draw(j, upto)
            self._covered = upto
        mask = np.ones(self.n_agents, dtype=bool)
        for j, intervals in enumerate(self._intervals):
            if not intervals:
                continue
            if self._sorted[j] != len(intervals):  # kept sorted by leave step (a trace's rows come in any order)
                intervals.sort()
                self._sorted[j] = len(intervals)
            i = bisect.bisect_right(intervals, (k, math.inf)) - 1  # the last interval left at or before k
            mask[j] = not (i >= 0 and k < intervals[i][1])
        return mask

    def intervals(self, j: int) -> list[tuple[int, int | None]]:
        """Agent j's offline intervals drawn or given so far, (leave, return or None), in order."""
        return sorted((leave, None if end == math.inf else int(end)) for leave, end in self._intervals[j])


def random_churn(n_agents: int, rate: float, down_steps: float, seed: int) -> MembershipTrace:
    """Seeded churn (module docstring): offline a fraction ``rate`` of the steps, offline periods of mean
    ``down_steps``. ``rate`` 0 gives a trace where every agent is always online."""
    if not 0 <= rate < 1:
        raise ValueError(f"network_params.churn = {rate!r} is out of range: the fraction of steps an agent is "
                         "offline, in [0, 1)")
    if not (math.isfinite(down_steps) and down_steps >= 1):
        raise ValueError(f"network_params.churn_down_steps = {down_steps!r} is out of range: the mean offline "
                         "period in steps, >= 1")
    if rate == 0:
        return MembershipTrace(n_agents)
    up = down_steps * (1 - rate) / rate
    rngs = [np.random.default_rng(derive_seed(seed, "churn", j)) for j in range(n_agents)]
    reached = [0] * n_agents  # the step at which agent j's next online period starts

    def draw(j: int, upto: int) -> None:
        while reached[j] <= upto:
            leave = reached[j] + int(rngs[j].geometric(min(1.0, 1.0 / up)))
            back = leave + int(rngs[j].geometric(min(1.0, 1.0 / down_steps)))
            trace._intervals[j].append((leave, back))
            reached[j] = back

    trace = MembershipTrace(n_agents, draw=draw)
    return trace


def load_trace(path: str | os.PathLike, n_agents: int) -> MembershipTrace:
    """The trace in a CSV file (header ``agent,leave_step,return_step``; module docstring); ValueError
    naming the file and row on a bad one."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"network_params.churn_trace {str(path)!r} is not a file (a CSV with header "
                         "agent,leave_step,return_step)")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        want = ["agent", "leave_step", "return_step"]
        if [h.strip() for h in (reader.fieldnames or [])] != want:
            raise ValueError(f"churn trace {str(path)!r} has the header {reader.fieldnames}; it must be "
                             f"{','.join(want)}")
        rows = []
        for i, r in enumerate(reader, 1):
            try:
                ret = (r["return_step"] or "").strip()
                rows.append((int(r["agent"]), int(r["leave_step"]), None if ret in ("", "never") else int(ret)))
            except (TypeError, ValueError):
                raise ValueError(f"churn trace {str(path)!r} row {i}: {dict(r)} is not whole numbers "
                                 "(return_step may be empty or 'never')") from None
    try:
        return MembershipTrace(n_agents, rows)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
