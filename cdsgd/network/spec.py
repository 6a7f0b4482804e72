"""What a simulated network is: presets, their parameters, and the one check of a user's values.

A network is an uplink bandwidth per agent, a one-way latency, a computation
time per step, stragglers, two kinds of loss, and churn (agents that go
offline and come back: :mod:`cdsgd.network.churn`). ``network = "none"`` (the
default) turns the simulated clock off; a preset name turns it on with the
preset's values; ``network_params`` overrides any of them, and given alone
defines a custom network whose other keys take :data:`DEFAULTS`::

    >>> network_spec("edge").bandwidth_mbps, network_spec("edge").latency_ms
    (10.0, 25.0)
    >>> network_spec("none", {"bandwidth_mbps": 100, "latency_ms": 5, "compute_ms": 0})
    NetworkSpec(name='custom', bandwidth_mbps=100.0, latency_ms=5.0, compute_ms=0.0, stragglers=0.0, straggler_slowdown=4.0, drop=0.0, link_failure=0.0, agents_per_host=1, churn=0.0, churn_down_steps=20.0, churn_trace=None)
    >>> network_spec("none") is None
    True
    >>> network_spec("lna")
    Traceback (most recent call last):
    ...
    ValueError: network 'lna' is unknown; did you mean 'lan'? Known: datacenter, edge, lan, none, wan

The presets (one-way latency; the uplink is what one agent can send per second):

============  ==============  ===========  ===================================================
preset        bandwidth       latency      source
============  ==============  ===========  ===================================================
datacenter    10 Gbit/s       0.05 ms      10 Gigabit Ethernet (IEEE 802.3ae); round trips of
                                           about 100 µs inside a datacenter (Alizadeh et al.,
                                           "Data Center TCP", SIGCOMM 2010)
lan           1 Gbit/s        0.5 ms       Gigabit Ethernet (IEEE 802.3ab); a switched office
                                           network's round trip of about 1 ms
wan           100 Mbit/s      30 ms        a site-to-site link between regions of one
                                           continent (round trips of 50–70 ms, e.g. the
                                           published inter-region latencies of cloud providers)
edge          10 Mbit/s       25 ms        mobile and home uplinks (Ookla Speedtest Global
                                           Index: median mobile upload about 10 Mbit/s,
                                           latency of tens of ms)
============  ==============  ===========  ===================================================

Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from topologies import unknown_name_error

__all__ = ["DEFAULTS", "NETWORK_KEYS", "PRESETS", "NetworkSpec", "network_spec"]

#: the values a custom network takes for the keys ``network_params`` leaves out
DEFAULTS = {
    "bandwidth_mbps": 1000.0,
    "latency_ms": 0.0,
    "compute_ms": None,  # measured: the run's own forward/backward time per agent
    "stragglers": 0.0,
    "straggler_slowdown": 4.0,
    "drop": 0.0,
    "link_failure": 0.0,
    "agents_per_host": 1,
    "churn": 0.0,
    "churn_down_steps": 20.0,
    "churn_trace": None,
}

#: the keys of ``network_params`` and what each means (docs and errors)
NETWORK_KEYS = {
    "bandwidth_mbps": "each agent's uplink in Mbit/s (> 0)",
    "latency_ms": "one-way latency of every message in ms (>= 0)",
    "compute_ms": "computation time per step and agent in ms (>= 0); absent: measured from the run",
    "stragglers": "fraction of agents, chosen by the seed, that compute straggler_slowdown times slower ([0, 1])",
    "straggler_slowdown": "how many times slower a straggler computes (>= 1)",
    "drop": "probability that one message is lost ([0, 1))",
    "link_failure": "probability that an edge is down for one step, both directions ([0, 1))",
    "agents_per_host": "agents 0..h-1, h..2h-1, ... share one host's uplink; messages within a host cost nothing "
                       "(an integer >= 1)",
    "churn": "fraction of steps each agent is offline, seeded (needs membership = \"elastic\"; [0, 1))",
    "churn_down_steps": "mean length in steps of an agent's offline periods under churn (>= 1)",
    "churn_trace": "a CSV of offline intervals (agent,leave_step,return_step) instead of seeded churn",
}

#: the named networks (docs: the table in this module's docstring and docs/network.md)
PRESETS = {
    "datacenter": {"bandwidth_mbps": 10_000.0, "latency_ms": 0.05},
    "lan": {"bandwidth_mbps": 1_000.0, "latency_ms": 0.5},
    "wan": {"bandwidth_mbps": 100.0, "latency_ms": 30.0},
    "edge": {"bandwidth_mbps": 10.0, "latency_ms": 25.0},
}


@dataclass(frozen=True)
class NetworkSpec:
    """A resolved network: every key of :data:`NETWORK_KEYS` with its value (``compute_ms`` None: measured)."""

    name: str
    bandwidth_mbps: float
    latency_ms: float
    compute_ms: float | None
    stragglers: float
    straggler_slowdown: float
    drop: float
    link_failure: float
    agents_per_host: int = 1
    churn: float = 0.0
    churn_down_steps: float = 20.0
    churn_trace: str | None = None

    @property
    def churning(self) -> bool:
        """Whether agents go offline and come back (``churn`` > 0 or a ``churn_trace``)."""
        return self.churn > 0 or self.churn_trace is not None

    @property
    def lossy(self) -> bool:
        """Whether messages can be lost (``drop`` or ``link_failure`` > 0): the arithmetic of the run changes."""
        return self.drop > 0 or self.link_failure > 0

    def transfer_seconds(self, n_bytes: float) -> float:
        """Seconds one message of ``n_bytes`` occupies the sender's uplink: n_bytes · 8 / bandwidth."""
        return float(n_bytes) * 8.0 / (self.bandwidth_mbps * 1e6)

    @property
    def latency(self) -> float:
        """The one-way latency in seconds."""
        return self.latency_ms / 1e3

    def params(self) -> dict:
        """The values as ``network_params`` would give them (for summary.json)."""
        return {k: getattr(self, k) for k in NETWORK_KEYS}


def _check_value(key: str, value) -> float | int | None:
    if key in ("compute_ms", "churn_trace") and value is None:
        return None
    if key == "churn_trace":
        if not isinstance(value, str) or not value:
            raise ValueError(f"network_params.{key} must be a path to a CSV file, got {value!r} ({NETWORK_KEYS[key]})")
        return value
    if key == "agents_per_host":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"network_params.{key} must be an integer >= 1, got {value!r} ({NETWORK_KEYS[key]})")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"network_params.{key} must be a number, got {value!r} ({NETWORK_KEYS[key]})")
    v = float(value)
    ok = {"bandwidth_mbps": 0 < v < math.inf, "latency_ms": 0 <= v < math.inf, "compute_ms": 0 <= v < math.inf,
          "stragglers": 0 <= v <= 1, "straggler_slowdown": 1 <= v < math.inf, "drop": 0 <= v < 1,
          "link_failure": 0 <= v < 1, "churn": 0 <= v < 1, "churn_down_steps": 1 <= v < math.inf}[key]
    if not ok:
        raise ValueError(f"network_params.{key} = {value!r} is out of range: {NETWORK_KEYS[key]}")
    return v


def network_spec(name: str = "none", params: dict | None = None) -> NetworkSpec | None:
    """The network of ``network = name`` with ``network_params = params``; None when the clock is off.

    ``name`` is ``"none"`` or a key of :data:`PRESETS`; ``params`` overrides
    the preset's values (or, with ``"none"``, defines a custom network over
    :data:`DEFAULTS`). A bad name, key or value is a one-line ValueError naming it.
    """
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise ValueError(f"network_params must be a table of {', '.join(NETWORK_KEYS)}, got {params!r}")
    if name != "none" and name not in PRESETS:
        raise unknown_name_error("network", name, ["none", *PRESETS])
    for k in params:
        if k not in NETWORK_KEYS:
            raise unknown_name_error("network_params key", k, NETWORK_KEYS)
    if name == "none" and not params:
        return None
    values = {**DEFAULTS, **PRESETS.get(name, {}), **params}
    checked = {k: _check_value(k, values[k]) for k in NETWORK_KEYS}
    if checked["churn"] and checked["churn_trace"] is not None:
        raise ValueError(f"network_params gives churn = {checked['churn']:g} and churn_trace = "
                         f"{checked['churn_trace']!r}: give one (seeded churn, or the trace of who is offline when)")
    return NetworkSpec(name="custom" if name == "none" else name, **checked)

