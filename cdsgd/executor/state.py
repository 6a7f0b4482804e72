"""An executor's state for checkpoints: everything that decides the rest of the run.

Every function takes the executor ``ex`` (cdsgd.executor.Executor) whose agents it saves or restores.
"""

from __future__ import annotations

import torch

__all__ = ["load_state_dict", "state_dict"]


def state_dict(ex) -> dict:
    """Everything that decides the rest of the run, for the agents held here.

    Parameters, the algorithm's state (momentum), the step counter, the
    train-loss window, the wall clock (training, warm-up, timed steps), each agent's data order (permutation,
    position, generator), augmentation and dropout streams, and the bytes
    counted so far. Only tensors, numbers, strings, lists and dicts: it
    loads with ``torch.load(weights_only=True)``. Restoring it into a
    Simulator built with the same arguments (:meth:`load_state_dict`)
    continues bit for bit as if it had never stopped.
    """
    return {
        "k": ex.k,
        "agents": list(ex.agents),
        "n_agents": ex.n_agents,
        "numel": ex.layout.numel,
        "X": ex.X.detach().cpu().clone(),
        "algorithm": ex.algorithm.name,
        "algorithm_state": {name: t.detach().cpu().clone() for name, t in ex.state.items()},
        "loss_sums": ex._loss_sums.clone(),
        "loss_counts": ex._loss_counts.clone(),
        "wall": ex._wall,
        "warmup_seconds": ex.warmup_seconds,
        "timed_steps": ex.timed_steps,
        "eval_seconds": ex.eval_seconds,
        "nonfinite": ex._nonfinite.clone(),
        "streams": [s.state_dict() for s in ex.streams],
        "augment": [g.get_state() for g in ex._augment_gens] if ex._augment_gens else [],
        "rng": [s.cpu() for s in ex.rng.state_dict()],
        "bytes_sent": ex.mixer.bytes_sent.clone(),
        "bytes_across": float(ex.mixer.bytes_across),
        "eval_bytes": float(ex.reducer.bytes),
        "network": None if ex.clock is None else ex.clock.state_dict(),
    }


def load_state_dict(ex, state: dict) -> None:
    """Continue from :meth:`state_dict` of an executor built the same way; mismatches are ValueErrors."""
    expect = {"agents": list(ex.agents), "n_agents": ex.n_agents, "numel": ex.layout.numel,
              "algorithm": ex.algorithm.name}
    for key, want in expect.items():
        if state.get(key) != want:
            raise ValueError(f"checkpoint state has {key} = {state.get(key)!r}, this run has {want!r}")
    if tuple(state["X"].shape) != tuple(ex.X.shape):
        raise ValueError(f"checkpoint parameters have shape {tuple(state['X'].shape)}, "
                         f"this run {tuple(ex.X.shape)}")
    if sorted(state["algorithm_state"]) != sorted(ex.state):
        raise ValueError(f"checkpoint algorithm state holds {sorted(state['algorithm_state'])}, "
                         f"this run {sorted(ex.state)}")
    with torch.no_grad():
        ex.X.copy_(state["X"])  # in place: the loop strategy's modules are views of X
        for name, t in state["algorithm_state"].items():
            ex.state[name].copy_(t)
    for stream, s in zip(ex.streams, state["streams"], strict=True):
        stream.load_state_dict(s)
    for g, s in zip(ex._augment_gens or [], state["augment"], strict=True):
        g.set_state(s)
    ex.rng.load_state_dict([s.to(ex.rng.states[0].device) for s in state["rng"]])
    ex.mixer.bytes_sent.copy_(state["bytes_sent"])
    ex.mixer.bytes_across = float(state["bytes_across"])
    ex.reducer.bytes = float(state["eval_bytes"])
    ex.k = int(state["k"])
    ex._loss_sums.copy_(state["loss_sums"])
    ex._loss_counts.copy_(state["loss_counts"])
    ex._wall = float(state["wall"])
    ex.warmup_seconds = float(state.get("warmup_seconds", 0.0))  # older checkpoints: every step was timed
    ex.timed_steps = int(state.get("timed_steps", ex.k))  # (this process's first step is warm-up again)
    ex.eval_seconds = float(state.get("eval_seconds", 0.0))
    if "nonfinite" in state:
        ex._nonfinite.copy_(state["nonfinite"])
    if (state.get("network") is None) != (ex.clock is None):
        raise ValueError("checkpoint and this run differ in their simulated network (one has a clock, the other "
                         "none); resume with the network of the checkpoint's run")
    if ex.clock is not None:
        ex.clock.load_state_dict(state["network"])
