"""The executor's side of a simulated network (:mod:`cdsgd.network`): what each step tells the clock.

(The measured training time is :class:`cdsgd.executor.meters.StepTimer`'s.)

After every step the executor records, for each agent it holds, the
seconds its gradient took (the process's gradient time divided by the
agents it computed: each agent as if it had the process's hardware to
itself) and the bytes it sent. Each evaluation gathers the records of all
processes (one sum through the Reducer, so every process advances the same
clock) and advances the clock step by step; the row's ``sim_seconds`` is
the result. With ``drop`` or ``link_failure`` the step's mixer is wrapped
so that the lost messages are taken out of the mixing
(:class:`cdsgd.network.LossyMixer`), in the simulator only.
"""

from __future__ import annotations

import torch

from ..algorithms import ALGORITHMS, Algorithm
from ..mixers import LocalStepMixer, Mixer
from ..network import LossyMixer, NetworkClock, NetworkSpec

__all__ = ["ClockFeed", "check_network", "clock_traffic", "lossy_algorithms"]


def clock_traffic(algorithm: Algorithm) -> str:
    """How the clock charges ``algorithm``'s messages: gossip, a ring all-reduce, FedAvg's server, or none."""
    if algorithm.name == "fedavg":
        return "server"
    return algorithm.traffic


def lossy_algorithms() -> list[str]:
    """The algorithms that can run on a network that loses messages (gossip with a ``lost_message`` rule)."""
    return [name for name in ALGORITHMS.names() if ALGORITHMS.get(name).traffic == "neighbours"
            and ALGORITHMS.get(name).lost_message is not None]


def check_network(spec: NetworkSpec | None, algorithm: Algorithm, *, in_one_process: bool) -> None:
    """Refuse a network that loses messages (``drop``, ``link_failure``) for a rule or executor that cannot."""
    if spec is None or not spec.lossy:
        return
    what = f"network_params drop={spec.drop:g}, link_failure={spec.link_failure:g}"
    if algorithm.traffic != "neighbours" or algorithm.lost_message is None:
        why = ("does not gossip" if algorithm.traffic != "neighbours"
               else "keeps copies of its neighbours' models that a lost message would split")
        raise ValueError(f"{what}: algorithm {algorithm.name!r} cannot lose messages (it {why}); lost messages "
                         f"are simulated for {', '.join(lossy_algorithms())}")
    if not in_one_process:
        raise ValueError(f"{what}: lost messages are simulated with every agent in one process (executor=sim); "
                         "the runtime's messages are never lost")


class ClockFeed:
    """The clock of one executor and the records not yet given to it.

    Args:
        network: a :class:`~cdsgd.network.NetworkSpec` (the clock is built for the executor's
            graph and algorithm) or a ready :class:`~cdsgd.network.NetworkClock`.
        ex: the executor (its algorithm, mixer, agents, overlap and seed are read once).
    """

    def __init__(self, network: NetworkSpec | NetworkClock, ex) -> None:
        alg, n = ex.algorithm, ex.n_agents
        traffic = clock_traffic(alg)
        if isinstance(network, NetworkClock):
            clock = network
        elif isinstance(network, NetworkSpec):
            W = ex.mixer.matrix if traffic == "neighbours" else None
            if traffic == "neighbours" and W is None:
                raise ValueError("a simulated network needs the mixing matrix: this mixer does not say it (matrix "
                                 "is None); give a NetworkClock built with W")
            # a rule that mixes after the gradient (d2, choco, diloco's outer step, ...) cannot overlap it
            clock = NetworkClock(network, W, n_agents=n, traffic=traffic, overlap=ex.overlap and alg.mixes_params,
                                 seed=ex.seed,
                                 message_bytes=ex.layout.numel * ex.X.element_size())
        else:
            raise ValueError(f"network must be a NetworkSpec or a NetworkClock, got {type(network).__name__}")
        check_network(clock.spec, alg, in_one_process=len(ex.agents) == n)
        if clock.spec.lossy:
            alg.expect_losses()
        self.clock, self.mode, self.n_held = clock, alg.lost_message, len(ex.agents)
        self._compute: list[torch.Tensor] = []
        self._sent: list[torch.Tensor] = []
        self._delay: list[int] = []
        self._phase: list[int] = []
        self._ex = ex  # its membership (churn, :mod:`cdsgd.executor.membership`) learns when its changes took effect
        # each recorded step's online mask (None: all) and returning agents
        self._online: list[list[bool] | None] = []
        self._joins: list[list] = []

    def mixer(self, mixer: Mixer, k: int) -> Mixer:
        """The mixer of step k with that step's lost messages taken out (the mixer itself if none can be lost)."""
        if not self.clock.spec.lossy or isinstance(mixer, LocalStepMixer):  # a local step sends nothing to lose
            return mixer
        g = self.clock.graph(k)
        dropped, failed = self.clock.losses(k)
        return LossyMixer(mixer, g.recv, g.send, g.weight, dropped | failed, self.mode)

    def record(self, active: list[int], seconds: float, sent: torch.Tensor, delay: int = 0,
               phase: int | None = None, *, online=None, joins=()) -> None:
        """One step: the held agents in ``active`` computed for ``seconds`` together; ``sent``: bytes per held
        agent; ``delay``: the further steps those messages may take, ``phase``: the step of a schedule they went
        over, ``online`` and ``joins``: who took part and who came back (:meth:`NetworkClock.advance`)."""
        c = torch.zeros(self.n_held, dtype=torch.float64)
        if active:
            c[active] = seconds / len(active)
        self._compute.append(c)
        self._sent.append(sent.detach().double().cpu())
        self._delay.append(int(delay))
        self._phase.append(-1 if phase is None else int(phase))
        self._online.append(None if online is None else [bool(v) for v in online])
        self._joins.append([[int(j), int(d), float(b)] for j, d, b in joins])

    def flush(self, reducer) -> float:
        """Advance the clock over the recorded steps (gathered from every process); the simulated seconds."""
        if self._compute:
            per = torch.cat([torch.stack(self._compute, 1), torch.stack(self._sent, 1)], 1)
            every = reducer.agent_values(per).numpy()  # N × 2·steps, in agent order
            steps = len(self._compute)
            for s in range(steps):
                phase = None if self._phase[s] < 0 else self._phase[s]
                if self._ex.membership is not None:
                    self._ex.membership.timed(self.clock.k, self.clock.seconds)  # a change's time: when it took effect
                self.clock.advance(every[:, s], every[:, steps + s], delay=self._delay[s], phase=phase,
                                   online=self._online[s], joins=self._joins[s])
            for records in (self._compute, self._sent, self._delay, self._phase, self._online, self._joins):
                records.clear()
        return self.clock.seconds

    def state_dict(self) -> dict:
        """The clock's state and the records not yet given to it (a checkpoint between evaluations)."""
        return {"clock": self.clock.state_dict(), "compute": [t.clone() for t in self._compute],
                "sent": [t.clone() for t in self._sent], "delay": list(self._delay),
                "phase": list(self._phase), "online": list(self._online), "joins": list(self._joins)}

    def load_state_dict(self, state: dict) -> None:
        self.clock.load_state_dict(state["clock"])
        self._compute = [t.clone() for t in state["compute"]]
        self._sent = [t.clone() for t in state["sent"]]
        self._delay = list(state.get("delay", [0] * len(self._sent)))  # absent: written before delays existed
        self._phase = list(state.get("phase", [-1] * len(self._sent)))
        self._online = list(state.get("online", [None] * len(self._sent)))
        self._joins = list(state.get("joins", [[] for _ in self._sent]))

