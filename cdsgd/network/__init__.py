"""The simulated network: a clock of simulated seconds over a modelled network (docs/network.md).

``network_spec(name, params)`` resolves ``network`` / ``network_params``;
:class:`NetworkClock` turns each step's computation times and message sizes
into simulated seconds; :class:`LossyMixer` takes lost messages out of a
step's mixing. Pure model: a run with a clock is bit-identical to the same
run without one, except where the network changes what arrives (drops,
failed links, asynchrony, churn).
"""

from .churn import MembershipTrace, load_trace, random_churn
from .clock import NetworkClock, stragglers
from .lossy import LOSS_MODES, LossyMixer
from .spec import DEFAULTS, NETWORK_KEYS, PRESETS, NetworkSpec, network_spec

__all__ = ["DEFAULTS", "LOSS_MODES", "LossyMixer", "MembershipTrace", "NETWORK_KEYS", "NetworkClock", "NetworkSpec",
           "PRESETS", "load_trace", "network_spec", "random_churn", "stragglers"]
