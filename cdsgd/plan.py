"""The validation door: one Config in, one typed :class:`Plan` out, before any data is loaded.

:func:`validate_config` checks every key against what :class:`~cdsgd.config.Config`
declares about it (type, choices or registry, bounds), then builds what can
be built without data, once: the graph, its mixing matrix and spectral gap,
the algorithm with its hyperparameters, and a probe of the model with its
options. A bad name, value, graph file or model option fails here, before an
output folder exists. :func:`prepare` then loads and partitions the data and
returns the :class:`Parts` the executor consumes.

    >>> from cdsgd.config import load_config
    >>> plan = validate_config(load_config(overrides=["topology=torus", "n_agents=9", "algorithm=cdsgd"]))
    >>> plan.W.shape, type(plan.algorithm).__name__, round(plan.spectral_gap.gap, 4)
    ((9, 9), 'CDSGDAlgorithm', 0.6)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable

import networkx as nx
import numpy as np
import torch

import topologies

from .algorithms import ALGORITHMS, Algorithm, algorithm_params, make_algorithm
from .config import Config, check_ranges, key_info
from .data import DATASETS, PARTITIONS, Dataset, load_dataset, partition, sequence_lengths
from .data.bucketing import BUCKET_RULES, BucketBatchSampler, BucketStream, bucket_boundaries
from .mixing import DENSE_UP_TO
from .models import MODELS, build_model, check_model_options
from .seeding import generator

__all__ = ["Parts", "Plan", "REGISTRIES", "hyperparameters", "prepare", "validate_config"]

#: the registries that hold the allowed names of config keys declared with ``registry=``
REGISTRIES = {"algorithm": ALGORITHMS, "mixing": topologies.RULES, "dataset": DATASETS, "partition": PARTITIONS,
              "model": MODELS, "bucket_rule": BUCKET_RULES}


@dataclass
class Plan:
    """What a valid config builds without data: graph, mixing matrix, spectral gap, algorithm."""

    cfg: Config
    graph: nx.Graph
    #: dense up to DENSE_UP_TO agents, a scipy.sparse CSR matrix beyond (O(edges) memory)
    W: "np.ndarray | object"
    spectral_gap: topologies.SpectralGap
    algorithm: Algorithm


@dataclass
class Parts:
    """Everything a run needs: the plan, the data split among agents, the model factory, batch streams."""

    plan: Plan
    dataset: Dataset
    shards: list[tuple[torch.Tensor, torch.Tensor]]
    test_set: tuple[torch.Tensor, torch.Tensor]
    model_fn: Callable[[], torch.nn.Module]
    batch_stream: Callable | None = None
    steps_per_epoch: int | None = None
    bucket_boundaries: list | None = None

    @property
    def graph(self) -> nx.Graph:
        return self.plan.graph

    @property
    def W(self):
        return self.plan.W

    @property
    def spectral_gap(self) -> topologies.SpectralGap:
        return self.plan.spectral_gap

    def __getitem__(self, name: str):
        """``parts["shards"]``: the dict-style access of earlier releases."""
        if name not in {f.name for f in fields(self)} | {"graph", "W", "spectral_gap"}:
            raise KeyError(name)
        return getattr(self, name)


def hyperparameters(cfg: Config) -> dict:
    """The algorithm's own hyperparameters out of the config (as declared: ``unset``, ``overridden_by``)."""
    hyper = {}
    for name in algorithm_params(cfg.algorithm):
        if name not in Config.__dataclass_fields__:
            continue
        info, value = key_info(name), getattr(cfg, name)
        if info["unset"] is not None and value == info["unset"]:
            continue  # e.g. local_steps=0: not given
        other = info["overridden_by"]
        if other and getattr(cfg, other) != key_info(other)["unset"]:
            continue  # e.g. local_epochs when local_steps is given
        hyper[name] = value
    return hyper


def validate_config(cfg: Config) -> Plan:
    """Refuse bad names and values before any data is loaded; build the graph, W and the algorithm once."""
    for name in Config.__dataclass_fields__:
        tag = key_info(name)["registry"]
        if tag:
            REGISTRIES[tag].get(getattr(cfg, name))
    check_ranges(cfg)
    if cfg.checkpoint_unit == "steps" and cfg.checkpoint_every != int(cfg.checkpoint_every):
        raise ValueError(f"checkpoint_every must be a whole number of steps with checkpoint_unit='steps', "
                         f"got {cfg.checkpoint_every}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device; use device=cpu")
    algorithm = make_algorithm(cfg.algorithm, **hyperparameters(cfg))  # lr, momentum, ... checked by the rule
    check_model_options(cfg.model, cfg.model_params)
    # the graph and its mixing matrix (cheap): a bad graph file fails here, before an output folder exists
    if cfg.topology in topologies.SCHEDULES:  # time-varying: W_k of the schedule at step k (its own weights)
        if cfg.mixing != key_info("mixing")["default"]:
            raise ValueError(f"topology {cfg.topology!r} is a time-varying schedule with its own weights; "
                             f"mixing={cfg.mixing!r} does not apply to it (leave mixing unset)")
        W = topologies.schedule(cfg.topology, cfg.n_agents, **cfg.topology_params)
        G = W.union_graph()
    else:
        G = topologies.resolve(cfg.topology, cfg.n_agents, **cfg.topology_params)
        W = topologies.mixing_matrix(G, cfg.mixing, sparse=G.number_of_nodes() > DENSE_UP_TO)  # no N×N at scale
    algorithm.check_mixing(W)  # e.g. D² needs λₙ(W) > −1/3
    return Plan(cfg=cfg, graph=G, W=W, spectral_gap=topologies.spectral_gap(W), algorithm=algorithm)


def _subset(x: torch.Tensor, y: torch.Tensor, k: int, seed: int, what: str):
    if not k or k >= len(y):
        return x, y
    keep = torch.randperm(len(y), generator=generator(seed, what))[:k].sort().values
    return x[keep], y[keep]


def prepare(cfg: Config, plan: Plan | None = None) -> Parts:
    """The data of a run, loaded and split among the agents, with the model factory (validating first if no plan)."""
    plan = plan if plan is not None else validate_config(cfg)
    ds = load_dataset(cfg.dataset, cfg.data_dir, download=cfg.download)
    train_x, train_y = _subset(*ds.train, cfg.train_subset, cfg.seed, "train_subset")
    test_x, test_y = _subset(*ds.test, cfg.test_subset, cfg.seed, "test_subset")
    idx = partition(train_y.numpy(), cfg.n_agents, cfg.partition, seed=cfg.seed, alpha=cfg.dirichlet_alpha,
                    min_size=cfg.min_shard_size)
    shards = [(train_x[torch.from_numpy(i)], train_y[torch.from_numpy(i)]) for i in idx]

    def model_fn():
        return build_model(cfg.model, ds.input_shape, ds.n_classes, **cfg.model_params)

    model_fn()  # options that depend on the data's shape fail here
    return Parts(plan=plan, dataset=ds, shards=shards, test_set=(test_x, test_y), model_fn=model_fn,
                 **_bucketed_streams(cfg, ds, shards))


def _bucketed_streams(cfg: Config, ds, shards) -> dict:
    """With ``bucketing`` > 1: each agent's batches come from length buckets of its own shard.

    Returns ``batch_stream`` (agent j's BucketStream over its shard's lengths
    and its own boundaries, by ``bucket_rule``), ``steps_per_epoch`` (the
    mean over agents of the batches one pass over a shard takes: the last
    batch of every bucket may be short), and the boundaries per agent; ``{}``
    without bucketing.
    """
    if cfg.bucketing <= 1:
        return {}
    if len(ds.input_shape) != 2:
        raise ValueError(f"bucketing={cfg.bucketing} needs a sequence data set (plaid, japanese_vowels, "
                         f"synthetic_seq), not {cfg.dataset!r} with inputs of shape {ds.input_shape}")
    lengths = [sequence_lengths(x).numpy() for x, _ in shards]
    bounds = [bucket_boundaries(ln, cfg.bucketing, cfg.bucket_rule) for ln in lengths]
    per_pass = [len(BucketBatchSampler(ln, cfg.batch_size, b)) for ln, b in zip(lengths, bounds)]
    return {
        "batch_stream": lambda j, gen: BucketStream(lengths[j], cfg.batch_size, bounds[j], gen),
        "steps_per_epoch": max(1, math.ceil(sum(per_pass) / len(per_pass))),
        "bucket_boundaries": bounds,
    }
