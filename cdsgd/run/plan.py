"""The validation door: one Config in, one typed :class:`Plan` out, before any data is loaded.

:func:`validate_config` checks every key against what :class:`~cdsgd.config.Config`
declares about it (type, choices or registry, bounds), then builds what can
be built without data, once: the graph, its mixing matrix and spectral gap,
the algorithm with its hyperparameters, and a probe of the model with its
options. A bad name, value, graph file or model option fails here, before an
output folder exists. The centralized baselines (an algorithm whose
``traffic`` is not ``"neighbours"``: ``sgd``, ``msgd``, ``fedavg``
all-reduce, ``local`` never communicates) need no graph: none is built,
whatever ``topology`` says, and W is None (:func:`uses_graph`,
:func:`baseline_gap`). :func:`prepare` then loads and partitions the data and
returns the :class:`Parts` the executor consumes.

A ``model`` or ``dataset`` of the form ``"package.module:callable"`` is the
user's own: it is imported instead of looked up in the registry, and
because its inputs and outputs are unknown until it runs, the door loads the
data set once (kept in :attr:`Plan.data` for :func:`prepare`), checks what
the loader returned and runs the model on two training inputs. See
:func:`load_config_dataset` and :func:`cdsgd.models.build_model`.

    >>> from cdsgd.config import load_config
    >>> plan = validate_config(load_config(overrides=["topology=torus", "n_agents=9", "algorithm=cdsgd"]))
    >>> plan.W.shape, type(plan.algorithm).__name__, round(plan.spectral_gap.gap, 4)
    ((9, 9), 'CDSGDAlgorithm', 0.6)
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import networkx as nx
import numpy as np
import torch

import topologies

from ..algorithms import ALGORITHMS, Algorithm, algorithm_params, make_algorithm
from ..algorithms.compression import COMPRESSORS
from ..base.seeding import generator
from ..config import Config, check_ranges, key_info
from ..data import (DATASETS, PARTITIONS, Dataset, bigram_loss, load_dataset, partition, random_crop_flip,
                    sequence_lengths)
from ..network import NetworkSpec, network_spec
from ..data.bucketing import BUCKET_RULES, BucketBatchSampler, BucketStream, bucket_boundaries
from ..executor import AgentStack, DataFeed, Evaluator, Executor
from ..executor.asynchronous import check_asynchronous, executor_class
from ..executor.evaluation import default_eval_agents
from ..executor.timing import check_network
from ..executor.membership import build_membership, check_membership
from ..models import MODELS, SequenceClassifier, build_model, check_model_options, import_callable, is_import_path
from .graphs import baseline_gap, own_graph, plan_topology, uses_graph
from .logger import check_logger

__all__ = ["IMPORTABLE", "Parts", "Plan", "REGISTRIES", "baseline_gap", "build_executor", "hyperparameters",
           "load_config_dataset",
           "prepare", "uses_graph", "validate_config"]

#: the registries that hold the allowed names of config keys declared with ``registry=``
#: (a ``model`` or ``dataset`` holding a ':' is imported instead: :data:`IMPORTABLE`)
REGISTRIES = {"algorithm": ALGORITHMS, "mixing": topologies.RULES, "dataset": DATASETS, "partition": PARTITIONS,
              "model": MODELS, "bucket_rule": BUCKET_RULES, "compression": COMPRESSORS}
#: registries whose names may also be ``"package.module:callable"`` (the user's own model or data set)
IMPORTABLE = ("model", "dataset")


@dataclass
class Plan:
    """What a valid config builds without data: graph, mixing matrix, spectral gap, algorithm.

    For an algorithm that needs no graph (:func:`uses_graph` false: ``sgd``,
    ``msgd``, ``fedavg``, ``local``) ``graph`` and ``W`` are None (None is
    the all-reduce mean to a Mixer; ``local`` never mixes) and
    ``spectral_gap`` is that of the averaging the rule does
    (:func:`baseline_gap`).
    """

    cfg: Config
    #: None when the algorithm needs no graph
    graph: nx.Graph | None
    #: dense up to topologies.DENSE_UP_TO agents, a scipy.sparse CSR matrix beyond (O(edges) memory);
    #: a topologies.Schedule for a time-varying topology; None when the algorithm needs no graph
    W: "np.ndarray | object | None"
    spectral_gap: topologies.SpectralGap
    algorithm: Algorithm
    #: warnings about the config (settings that have no effect, weights that are ignored); a run logs them
    notes: list = field(default_factory=list)
    #: the data set, when the door had to load it (the user's own model or data set); else None
    data: Dataset | None = field(default=None, repr=False)
    #: the simulated network (``network``, ``network_params``), or None: no clock
    network: NetworkSpec | None = None

    @property
    def uses_graph(self) -> bool:
        """The algorithm mixes with neighbours over ``graph`` and ``W`` (false for the centralized baselines)."""
        return uses_graph(self.algorithm)

    def effective_neighbours(self) -> float:
        """:func:`topologies.effective_neighbours` of W (NaN beyond its size limit); without a graph, that of
        the averaging the rule does: n_agents for the all-reduce mean 11ᵀ/n, 1 for ``local``'s Π = I."""
        if self.uses_graph:
            return topologies.effective_neighbours(self.W)
        return float(self.cfg.n_agents) if self.algorithm.traffic == "allreduce" else 1.0


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
    bigram_loss: float | None = None  # text: the closed-form bigram model's test loss (cdsgd.data.bigram_loss)

    @property
    def graph(self) -> nx.Graph:
        return self.plan.graph

    @property
    def W(self):
        return self.plan.W

    @property
    def spectral_gap(self) -> topologies.SpectralGap:
        return self.plan.spectral_gap


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
        if tag and not (tag in IMPORTABLE and is_import_path(getattr(cfg, name))):
            REGISTRIES[tag].get(getattr(cfg, name))
    check_ranges(cfg)
    check_logger(cfg.logger)  # logger="tensorboard" without the package fails here, not after the run
    if cfg.checkpoint_unit == "steps" and cfg.checkpoint_every != int(cfg.checkpoint_every):
        raise ValueError(f"checkpoint_every must be a whole number of steps with checkpoint_unit='steps', "
                         f"got {cfg.checkpoint_every}")
    if cfg.bucket_sync and cfg.bucket_fill:
        raise ValueError("bucket_fill=true needs bucket_sync=false: with bucket_sync every agent takes its batch "
                         "from the bucket of the step, which a filled batch would straddle")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device; use device=cpu")
    _check_compression(cfg)
    algorithm = make_algorithm(cfg.algorithm, **hyperparameters(cfg))  # lr, momentum, ... checked by the rule
    network = network_spec(cfg.network, cfg.network_params)
    check_asynchronous(network, algorithm, in_one_process=cfg.executor == "sim")  # adpsgd: sim, compute_ms given
    check_network(network, algorithm, in_one_process=cfg.executor == "sim")
    if cfg.min_ranks and cfg.membership != "elastic":
        raise ValueError(f"min_ranks = {cfg.min_ranks} waits for replacements, which join under membership = "
                         f"'elastic' only (membership = {cfg.membership!r}): set membership = \"elastic\" or min_ranks = 0")
    check_membership(cfg.membership, network, algorithm, n_agents=cfg.n_agents, executor=cfg.executor,
                     mixing=cfg.mixing, schedule=cfg.topology in topologies.SCHEDULES.names())
    check_model_options(cfg.model, cfg.model_params)  # names only for the user's own model: shapes come below
    if uses_graph(algorithm):
        # the graph and its mixing matrix (cheap): a bad graph file fails here, before an output folder exists
        G, W = own_graph(cfg, algorithm) or plan_topology(cfg)
        if getattr(algorithm, "needs_tree", False):  # relaysum: a spanning tree of the topology
            if isinstance(W, topologies.Schedule):
                raise ValueError(f"algorithm {cfg.algorithm!r} relays along one fixed spanning tree; topology "
                                 f"{cfg.topology!r} is time-varying: give a graph (a chain is topology=path)")
            G = topologies.spanning_tree(G)
            W = topologies.mixing_matrix(G, "metropolis", sparse=G.number_of_nodes() > topologies.DENSE_UP_TO)
        algorithm.check_mixing(W)  # e.g. D² needs λₙ(W) > −1/3
        gap = topologies.spectral_gap(W)
    else:  # all-reduce or no communication: topology, topology_params and mixing are not used
        G, W, gap = None, None, baseline_gap(algorithm, cfg.n_agents)
    data = None
    if is_import_path(cfg.dataset) or is_import_path(cfg.model):  # the user's code: run it before any folder exists
        data = load_config_dataset(cfg)
        check_model_options(cfg.model, cfg.model_params, input_shape=data.input_shape, n_classes=data.n_classes,
                            sample=data.train[0][:2])
    return Plan(cfg=cfg, graph=G, W=W, spectral_gap=gap, algorithm=algorithm, data=data,
                notes=_notes(cfg, G, algorithm, W, gap), network=network)


def _check_compression(cfg: Config) -> None:
    """Refuse a compressor (or its options) given to an algorithm that sends full vectors."""
    takes = "compression" in algorithm_params(cfg.algorithm)
    given = [k for k in ("compression", "compression_params") if getattr(cfg, k) != key_info(k)["default"]]
    if given and not takes:
        users = ", ".join(a for a in ALGORITHMS if "compression" in algorithm_params(a))
        raise ValueError(f"{given[0]}={getattr(cfg, given[0])!r} needs an algorithm that sends compressed "
                         f"messages ({users}); algorithm={cfg.algorithm!r} sends full vectors")


def _notes(cfg: Config, G: nx.Graph | None, algorithm: Algorithm, W=None,
           gap: topologies.SpectralGap | None = None) -> list[str]:
    """Settings of ``cfg`` that have no effect, and a mixing matrix ``W`` that never reaches consensus
    (:func:`topologies.mixing_warnings`: periodic, or spectral gap 0), said before the run rather than
    found out after it."""
    notes = [] if G is None else topologies.mixing_warnings(W, gap)
    unused = [k for k in ("topology", "topology_params", "mixing") if getattr(cfg, k) != key_info(k)["default"]]
    if G is None and unused:
        how = "averages over all agents (all-reduce)" if algorithm.traffic == "allreduce" else "never communicates"
        notes.append(f"{', '.join(f'{k}={getattr(cfg, k)!r}' for k in unused)} "
                     f"{'has' if len(unused) == 1 else 'have'} no effect with algorithm={cfg.algorithm!r}: "
                     f"it {how} and builds no graph")
    if G is not None and topologies.is_graph_file(cfg.topology) and cfg.mixing != "weight":
        carried = [what for what, found in (
            ("edge weights", any("weight" in d for _, _, d in G.edges(data=True))),
            ("self weights", any(v is not None for _, v in G.nodes(data="self_weight")))) if found]
        if carried:
            notes.append(f"graph file {cfg.topology!r} carries {' and '.join(carried)}, which mixing={cfg.mixing!r} "
                         "ignores (it computes its own); set mixing=weight to mix with the file's weights")
    if (getattr(algorithm, "needs_groups", False) or getattr(algorithm, "needs_complete", False)) and unused:
        what = ("random groups of group_size" if getattr(algorithm, "needs_groups", False)
                else "the complete graph (a compressed all-gather)")
        notes.append(f"{', '.join(f'{k}={getattr(cfg, k)!r}' for k in unused)} "
                     f"{'has' if len(unused) == 1 else 'have'} no effect with algorithm={cfg.algorithm!r}: it mixes "
                     f"over {what}")
    if getattr(algorithm, "needs_tree", False) and cfg.mixing != key_info("mixing")["default"]:
        notes.append(f"mixing={cfg.mixing!r} has no effect with algorithm={cfg.algorithm!r}: it averages over all "
                     "agents along a spanning tree, every agent weighted 1/N")
    for name in ("bucket_sync", "bucket_fill"):
        if getattr(cfg, name) and cfg.bucketing <= 1:
            notes.append(f"{name}=true has no effect with bucketing={cfg.bucketing} (it needs bucketing > 1)")
    for name in ("momentum", "nesterov", "consensus_step"):
        if name not in algorithm_params(cfg.algorithm) and getattr(cfg, name) != key_info(name)["default"]:
            users = ", ".join(a for a in ALGORITHMS if name in algorithm_params(a))
            notes.append(f"{name}={getattr(cfg, name)!r} has no effect with algorithm={cfg.algorithm!r} "
                         f"(it is used by {users})")
    return notes


def load_config_dataset(cfg: Config) -> Dataset:
    """The data set of a config: ``load_dataset(cfg.dataset, cfg.data_dir, download=cfg.download,
    **cfg.dataset_params)``, or the user's.

    ``dataset = "package.module:loader"`` imports ``loader`` and calls
    ``loader(pathlib.Path(cfg.data_dir), **cfg.dataset_params)``. It may return a
    :class:`~cdsgd.data.Dataset`, or ``((train_x, train_y), (test_x,
    test_y))`` of tensors or numpy arrays: inputs floating-point of shape
    (n, *input_shape), used as they are (normalise them yourself), labels
    integers 0..K−1 with K = the largest label + 1 (at least 2). Anything
    else is a ValueError naming the data set and what is expected.

    >>> from cdsgd.config import load_config
    >>> load_config_dataset(load_config(overrides=["dataset=synthetic"])).n_classes
    4
    """
    if not is_import_path(cfg.dataset):
        return load_dataset(cfg.dataset, cfg.data_dir, download=cfg.download, **cfg.dataset_params)
    loader = import_callable(cfg.dataset, "data set")
    try:
        inspect.signature(loader).bind(Path(cfg.data_dir), **cfg.dataset_params)
    except TypeError as e:
        raise ValueError(f"data set {cfg.dataset!r}: the loader cannot take dataset_params "
                         f"{cfg.dataset_params} ({e})") from e
    except ValueError:  # no signature to check against (a C function): the call will tell
        pass
    return _as_dataset(cfg.dataset, loader(Path(cfg.data_dir), **cfg.dataset_params))


_EXPECTED = "a cdsgd.data.Dataset or ((train_x, train_y), (test_x, test_y)) of tensors or numpy arrays"


def _as_dataset(name: str, result) -> Dataset:
    if isinstance(result, Dataset):
        return result
    if not (isinstance(result, (tuple, list)) and len(result) == 2
            and all(isinstance(s, (tuple, list)) and len(s) == 2 for s in result)):
        raise ValueError(f"data set {name!r}: the loader returned {_describe(result)}; expected {_EXPECTED}")
    splits = []
    for split, (x, y) in zip(("train", "test"), result):
        if not all(isinstance(a, (torch.Tensor, np.ndarray)) for a in (x, y)):
            raise ValueError(f"data set {name!r}: the loader's {split} split holds {_describe(x)} and "
                             f"{_describe(y)}; expected (inputs, labels) as tensors or numpy arrays")
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        if not x.is_floating_point() or x.dim() < 2:
            raise ValueError(f"data set {name!r}: {split} inputs are {x.dtype} of shape {tuple(x.shape)}; "
                             "expected floating-point inputs of shape (n, *input_shape)")
        if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool or y.dim() != 1:
            raise ValueError(f"data set {name!r}: {split} labels are {y.dtype} of shape {tuple(y.shape)}; "
                             "expected integer class labels of shape (n,)")
        splits.append((x.float().contiguous(), y.long().contiguous()))
    labels = torch.cat([splits[0][1], splits[1][1]])
    n_classes = int(labels.max()) + 1 if labels.numel() else 0
    if n_classes < 2:
        raise ValueError(f"data set {name!r}: the labels span {n_classes} class(es); "
                         "expected labels 0..K-1 with K >= 2")
    return Dataset(name, splits[0], splits[1], n_classes, tuple(splits[0][0].shape[1:]))


def _describe(value) -> str:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"a {type(value).__name__} of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _subset(k: int, seed: int, what: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same ``k`` rows (a seeded choice, kept in order) of each tensor; all of them when k is 0 or ≥ n."""
    n = len(tensors[0])
    if not k or k >= n:
        return tensors
    keep = torch.randperm(n, generator=generator(seed, what))[:k].sort().values
    return tuple(t[keep] for t in tensors)


def prepare(cfg: Config, plan: Plan | None = None) -> Parts:
    """The data of a run, loaded and split among the agents, with the model factory (validating first if no plan)."""
    plan = plan if plan is not None else validate_config(cfg)
    ds = plan.data if plan.data is not None else load_config_dataset(cfg)
    train_x, train_y, by = _subset(cfg.train_subset, cfg.seed, "train_subset", *ds.train, ds.partition_labels)
    test_x, test_y = _subset(cfg.test_subset, cfg.seed, "test_subset", *ds.test)
    idx = partition(by.numpy(), cfg.n_agents, cfg.partition, seed=cfg.seed, alpha=cfg.dirichlet_alpha,
                    min_size=cfg.min_shard_size)
    shards = [(train_x[torch.from_numpy(i)], train_y[torch.from_numpy(i)]) for i in idx]

    def model_fn():
        return build_model(cfg.model, ds.input_shape, ds.n_classes, **cfg.model_params)

    model = model_fn()  # options that depend on the data's shape fail here (and fragments the model cannot make)
    plan.algorithm.bind(n_agents=cfg.n_agents, steps_per_epoch=1, seed=cfg.seed,
                        tensor_sizes=[p.numel() for p in model.parameters()])
    if len(ds.input_shape) == 2 and not is_import_path(cfg.model) and not isinstance(model, SequenceClassifier):
        note = (f"model {cfg.model!r} reads each padded sequence of {cfg.dataset!r} as one flat vector (lengths "
                f"and order are lost); the sequence models are lstm, gru and pgru")
        if note not in plan.notes:
            plan.notes.append(note)
    bigram = None if ds.bytes_per_token is None else bigram_loss(
        dataclasses.replace(ds, train=(train_x, train_y), test=(test_x, test_y), groups=by))  # the run's own text
    return Parts(plan=plan, dataset=ds, shards=shards, test_set=(test_x, test_y), model_fn=model_fn,
                 bigram_loss=bigram, **_bucketed_streams(cfg, ds, shards))


def build_executor(cfg: Config, parts: Parts, group) -> Executor:
    """The executor of this process, its parts built from the config: every agent (one process) or the
    block of agents its rank holds (``group``: a :class:`cdsgd.runtime.Group`, which gives the held
    agents, the mixer reaching the others and the reducer). This is the one place where config keys
    become the executor's parts.
    """
    alg, n = parts.plan.algorithm, cfg.n_agents
    stack = AgentStack(parts.model_fn, n, seed=cfg.seed, ids=group.agents, init=cfg.init, same_init=alg.same_init,
                       strategy=cfg.strategy, exact=cfg.exact, device=cfg.device, grad_clip=cfg.grad_clip)
    data = DataFeed(parts.shards, stack.ids, batch_size=cfg.batch_size, seed=cfg.seed, device=stack.device,
                    augment=random_crop_flip if cfg.augment else None, batch_stream=parts.batch_stream,
                    steps_per_epoch=parts.steps_per_epoch)
    evaluator = Evaluator(parts.test_set, n, eval_agents=cfg.eval_agents or default_eval_agents(n),
                          eval_samples=cfg.eval_samples or None, eval_batch_size=cfg.eval_batch_size, seed=cfg.seed,
                          device=stack.device, bytes_per_token=parts.dataset.bytes_per_token)
    mixer = group.mixer(parts.W, exact=cfg.exact, n_agents=n)
    ex = executor_class(alg)(stack, data, mixer, alg, group.reducer(torch.device(cfg.device)), evaluator,
                             parts.plan.network, overlap=cfg.overlap)  # AsyncExecutor for adpsgd
    if getattr(ex, "membership", None) is not None or getattr(group, "elastic", False):  # churn or lost ranks
        ex.membership = build_membership(parts.plan.network, mixer, seed=cfg.seed, graph=parts.graph, rule=cfg.mixing,
                                         make=lambda W: group.mixer(W, exact=cfg.exact, n_agents=n))
    if getattr(group, "elastic", False):  # a rank that dies leaves the run (cdsgd.runtime.elastic)
        from ..runtime.elastic import ElasticStep

        ex.stepper = ElasticStep(group, ex, min_ranks=cfg.min_ranks)
    return ex


def _bucketed_streams(cfg: Config, ds, shards) -> dict:
    """With ``bucketing`` > 1: each agent's batches come from length buckets.

    Returns ``batch_stream`` (agent j's stream of index batches),
    ``steps_per_epoch`` and ``bucket_boundaries`` (one list per agent); ``{}``
    without bucketing.

    - ``bucket_sync`` false: agent j's BucketStream over its shard's lengths
      and its own boundaries (by ``bucket_rule``); an epoch is the mean over
      agents of the batches one pass over a shard takes (the last batch of
      every bucket may be short; with ``bucket_fill`` only a pass's last).
    - ``bucket_sync`` true: one set of boundaries for all agents, by
      ``bucket_rule`` over the lengths of all shards together, and agent j's
      SyncBucketStream walking the bucket sequence shared by every agent
      (seeded by ``cfg.seed``); an epoch is one pass of that sequence,
      Σ_i ⌈N_i / (n_agents · batch_size)⌉ steps with N_i the sequences of
      bucket i over all shards.
    """
    if cfg.bucketing <= 1:
        return {}
    if len(ds.input_shape) != 2:
        raise ValueError(f"bucketing={cfg.bucketing} needs a sequence data set (plaid, japanese_vowels, "
                         f"synthetic_seq), not {cfg.dataset!r} with inputs of shape {ds.input_shape}")
    lengths = [sequence_lengths(x).numpy() for x, _ in shards]
    if cfg.bucket_sync:
        from ..data.bucketing import SyncBucketStream, bucket_part_sizes, sync_steps_per_bucket

        common = bucket_boundaries(np.concatenate(lengths), cfg.bucketing, cfg.bucket_rule)
        steps = sync_steps_per_bucket(bucket_part_sizes(lengths, common), cfg.batch_size)
        return {
            "batch_stream": lambda j, gen: SyncBucketStream(lengths[j], cfg.batch_size, common, gen,
                                                            steps_per_bucket=steps, seed=cfg.seed),
            "steps_per_epoch": sum(steps),
            "bucket_boundaries": [list(common) for _ in shards],
        }
    bounds = [bucket_boundaries(ln, cfg.bucketing, cfg.bucket_rule) for ln in lengths]
    per_pass = [len(BucketBatchSampler(ln, cfg.batch_size, b, fill=cfg.bucket_fill)) for ln, b in zip(lengths, bounds)]
    return {
        "batch_stream": lambda j, gen: BucketStream(lengths[j], cfg.batch_size, bounds[j], gen, fill=cfg.bucket_fill),
        "steps_per_epoch": max(1, math.ceil(sum(per_pass) / len(per_pass))),
        "bucket_boundaries": bounds,
    }
