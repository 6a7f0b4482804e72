"""One Config → one run → the output folder of the run-output contract.

``run_experiment(cfg)`` builds the graph and mixing matrix, loads and
partitions the data, builds the model, runs the executor and writes, into
``cfg.out``:

``config.toml``
    the fully resolved config that produced the run;
``metrics.csv``
    one row per evaluation (every ``eval_every`` epochs and at the end) with
    the columns ``epoch, step, train_loss, test_loss, test_accuracy,
    test_accuracy_avg_model, consensus_distance, bytes_sent_per_agent,
    wall_seconds``; each row is flushed to disk as soon as it exists;
``summary.json``
    the final row, ``best_test_accuracy``, the config identity (algorithm,
    topology, n_agents, mixing, dataset, partition, model, seed), the
    spectral gap and lambda2, ``status`` (``completed`` or ``interrupted``),
    and the versions of torch and cdsgd.

On Ctrl-C the rows of the evaluations done stay complete, summary.json is
written with ``status = "interrupted"``, and KeyboardInterrupt propagates.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import topologies

from . import __version__
from . import checkpoint as ckpt
from .algorithms import ALGORITHMS, algorithm_params, make_algorithm
from .config import Config, dump_config, load_config, short_value
from .data import DATASETS, PARTITIONS, load_dataset, partition, random_crop_flip, sequence_lengths
from .data.bucketing import BUCKET_RULES, BucketBatchSampler, BucketStream, bucket_boundaries
from .models import MODELS, build_model
from .seeding import generator
from .simulator import METRIC_COLUMNS, STRATEGIES, INITS, Simulator

__all__ = ["run_experiment", "prepare", "EXECUTORS", "CHECKPOINT_UNITS", "Terminated", "default_out"]

#: executors ``cdsgd run`` knows (the distributed runtime adds "torch")
EXECUTORS = ("sim", "torch")
#: units of ``checkpoint_every``
CHECKPOINT_UNITS = ("epochs", "steps")


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (the CLI turns it into this): the run stops as on Ctrl-C, its files complete."""


def _choice(key: str, value: str, allowed) -> None:
    if value not in allowed:
        raise topologies.unknown_name_error(key, value, allowed)


def validate_config(cfg: Config) -> tuple:
    """Refuse bad names and values before any data is loaded.

    Returns the graph and its mixing matrix ``(G, W)``, built to check them
    (so that :func:`prepare` need not build them again).
    """
    ALGORITHMS.get(cfg.algorithm)
    _choice("executor", cfg.executor, EXECUTORS)
    topologies.RULES.get(cfg.mixing)
    DATASETS.get(cfg.dataset)
    PARTITIONS.get(cfg.partition)
    MODELS.get(cfg.model)
    _choice("strategy", cfg.strategy, STRATEGIES)
    _choice("init", cfg.init, INITS)
    if cfg.n_agents < 1:
        raise ValueError(f"n_agents must be >= 1, got {cfg.n_agents}")
    if not cfg.epochs > 0:
        raise ValueError(f"epochs must be > 0, got {cfg.epochs}")
    for key in ("batch_size", "eval_every", "eval_batch_size", "local_epochs", "min_shard_size"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(cfg, key)}")
    for key in ("train_subset", "test_subset", "eval_agents", "eval_samples", "local_steps", "seed", "bucketing"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"{key} must be >= 0 (0 means all/off), got {getattr(cfg, key)}")
    if not cfg.dirichlet_alpha > 0:
        raise ValueError(f"dirichlet_alpha must be > 0, got {cfg.dirichlet_alpha}")
    if not cfg.comm_timeout > 0:
        raise ValueError(f"comm_timeout must be > 0 seconds, got {cfg.comm_timeout}")
    BUCKET_RULES.get(cfg.bucket_rule)
    make_algorithm(cfg.algorithm, **hyperparameters(cfg))  # lr, momentum, schedule... checked by the rule itself
    # the graph and its mixing matrix (cheap): a bad graph file fails here, before an output folder exists
    G = topologies.resolve(cfg.topology, cfg.n_agents, **cfg.topology_params)
    W = topologies.mixing_matrix(G, cfg.mixing)
    _choice("checkpoint_unit", cfg.checkpoint_unit, CHECKPOINT_UNITS)
    if cfg.checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0 (0: no checkpoints), got {cfg.checkpoint_every}")
    if cfg.checkpoint_unit == "steps" and cfg.checkpoint_every != int(cfg.checkpoint_every):
        raise ValueError(f"checkpoint_every must be a whole number of steps with checkpoint_unit='steps', "
                         f"got {cfg.checkpoint_every}")
    _choice("device", cfg.device, ("cpu", "cuda"))
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device; use device=cpu")
    return G, W


def hyperparameters(cfg: Config) -> dict:
    """The algorithm's own hyperparameters out of the config."""
    allowed = set(algorithm_params(cfg.algorithm))
    hyper = {k: getattr(cfg, k) for k in ("lr", "lr_schedule", "lr_tau", "lr_power", "weight_decay",
                                            "momentum", "nesterov") if k in allowed}
    if cfg.algorithm == "fedavg":
        hyper["fedavg_fraction"] = cfg.fedavg_fraction
        if cfg.local_steps:
            hyper["local_steps"] = cfg.local_steps
        else:
            hyper["local_epochs"] = cfg.local_epochs
    return hyper


def _subset(x: torch.Tensor, y: torch.Tensor, k: int, seed: int, what: str):
    if not k or k >= len(y):
        return x, y
    keep = torch.randperm(len(y), generator=generator(seed, what))[:k].sort().values
    return x[keep], y[keep]


def prepare(cfg: Config) -> dict:
    """Everything a run needs, built from the config: graph, W, data, shards, model factory."""
    G, W = validate_config(cfg)
    gap = topologies.spectral_gap(W)
    ds = load_dataset(cfg.dataset, cfg.data_dir, download=cfg.download)
    train_x, train_y = _subset(*ds.train, cfg.train_subset, cfg.seed, "train_subset")
    test_x, test_y = _subset(*ds.test, cfg.test_subset, cfg.seed, "test_subset")
    idx = partition(train_y.numpy(), cfg.n_agents, cfg.partition, seed=cfg.seed, alpha=cfg.dirichlet_alpha,
                    min_size=cfg.min_shard_size)
    shards = [(train_x[torch.from_numpy(i)], train_y[torch.from_numpy(i)]) for i in idx]
    build_model(cfg.model, ds.input_shape, ds.n_classes, **cfg.model_params)  # bad model options fail here
    return {
        "graph": G, "W": W, "spectral_gap": gap, "dataset": ds, "shards": shards,
        "test_set": (test_x, test_y),
        "model_fn": lambda: build_model(cfg.model, ds.input_shape, ds.n_classes, **cfg.model_params),
        **_bucketed_streams(cfg, ds, shards),
    }


def _bucketed_streams(cfg: Config, ds, shards) -> dict:
    """With ``bucketing`` > 1: each agent's batches come from length buckets of its own shard.

    Returns the Simulator options ``batch_stream`` (agent j's BucketStream over
    its shard's lengths and its own boundaries, by ``bucket_rule``) and
    ``steps_per_epoch`` (the mean over agents of the batches one pass over a
    shard takes: the last batch of every bucket may be short), and the
    boundaries per agent; ``{}`` without bucketing.
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


def default_out(cfg: Config) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    topo = short_value(cfg.topology)
    return os.path.join("runs", f"{cfg.algorithm}-{topo}-{cfg.dataset}-{stamp}")


def _prepare_out(cfg: Config, *, resume: bool = False) -> Path:
    """The output folder, made. Resuming, it may hold files, but only of a run with the same config."""
    out = Path(cfg.out or default_out(cfg))
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {str(out)!r} exists and is not a folder")
    if resume and (out / "config.toml").is_file():
        try:
            there = load_config(out / "config.toml")
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot resume into {str(out)!r}: its config.toml does not load ({e})") from None
        diff = ckpt.config_mismatch(ckpt.config_for_checkpoint(there.__dict__),
                                    ckpt.config_for_checkpoint(cfg.__dict__))
        if diff:
            raise ValueError(f"cannot resume into {str(out)!r}: it holds a run with another config ({diff})")
    elif out.is_dir() and any(out.iterdir()) and not cfg.overwrite and not resume:
        raise ValueError(f"output folder {str(out)!r} is not empty; choose another out=, set overwrite=true, "
                         "or resume=true to continue the run there")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _checkpoint_steps(cfg: Config, steps_per_epoch: int) -> int:
    """Steps between checkpoints (0: none)."""
    if not cfg.checkpoint_every:
        return 0
    if cfg.checkpoint_unit == "steps":
        return int(cfg.checkpoint_every)
    return max(1, round(cfg.checkpoint_every * steps_per_epoch))


def _find_checkpoint(cfg: Config, out: Path, *, rank: int = 0, world: int = 1, agree=None,
                     log: Callable[[str], None]) -> dict | None:
    """The payload of the latest checkpoint every rank holds, loaded and checked; None if there is none.

    ``agree(mine) -> list`` exchanges a value between ranks (the runtime's
    all-gather); the simulator is one rank on its own.
    """
    agree = agree or (lambda mine: [mine])
    steps = agree(ckpt.steps_on_disk(out, rank))
    common = set(steps[0]).intersection(*map(set, steps[1:]))
    if not common:
        held = {r: s[-1] for r, s in enumerate(steps) if s}
        log(f"resume: no checkpoint held by all {world} rank(s) in {out / 'checkpoints'}"
            + (f" (latest per rank: {held})" if held else "") + "; starting from step 0")
        return None
    step = max(common)
    path = ckpt.checkpoint_path(out, step, rank)
    try:
        payload, problem = ckpt.load(path, config=ckpt.config_for_checkpoint(cfg.__dict__), world=world,
                                     rank=rank), None
    except ValueError as e:
        payload, problem = None, str(e)
    problems = [p for p in agree(problem) if p]
    if problems:  # every rank stops, with the first problem found
        raise ValueError(problems[0])
    log(f"resume: continuing from the checkpoint of step {step} ({path.parent})")
    return payload


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_number(v):
    return None if isinstance(v, float) and math.isnan(v) else v


def _make_executor(cfg: Config, parts: dict, **where) -> Simulator:
    return Simulator(
        parts["model_fn"], parts["shards"], where.pop("mixer", parts["W"]), cfg.algorithm,
        batch_size=cfg.batch_size, seed=cfg.seed, init=cfg.init, strategy=cfg.strategy,
        test_set=parts["test_set"], eval_batch_size=cfg.eval_batch_size,
        eval_agents=cfg.eval_agents or None, eval_samples=cfg.eval_samples or None, exact=cfg.exact,
        augment=random_crop_flip if cfg.augment else None, overlap=cfg.overlap, device=cfg.device,
        batch_stream=parts.get("batch_stream"), steps_per_epoch=parts.get("steps_per_epoch"),
        **where, **hyperparameters(cfg),
    )


def _default_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_experiment(cfg: Config, *, progress: bool | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Run one experiment and write its output folder. Returns the summary dict.

    ``executor="sim"`` runs all agents in this process. ``executor="torch"``
    must run in every rank of a torchrun launch (``cdsgd launch``): rank j is
    agent j, rank 0 writes the output folder, the others write nothing there.

    ``progress``: a tqdm bar (default: when stderr is a terminal); otherwise
    one log line per evaluation through ``log`` (default: print to stderr).
    """
    log = log or _default_log
    if progress is None:
        progress = sys.stderr.isatty()
    validate_config(cfg)
    if cfg.executor == "torch":
        return _run_distributed(cfg, progress=progress, log=log)
    out = _prepare_out(cfg, resume=cfg.resume)
    cfg = Config(**{**cfg.__dict__, "out": str(out)})
    if cfg.exact:
        torch.set_num_threads(1)  # as each torchrun worker: identical rounding in both executors
    parts = prepare(cfg)
    sim = _make_executor(cfg, parts)
    if cfg.resume:
        payload = _find_checkpoint(cfg, out, log=log)
    else:
        payload = None
        ckpt.remove_all(out)  # an earlier run's checkpoints (overwrite=true) must never be resumed into this one
    return _drive(cfg, sim, parts, out, writer=True, progress=progress, log=log, resume=payload)


def _run_distributed(cfg: Config, *, progress: bool, log: Callable[[str], None]) -> dict:
    import torch.distributed as dist

    from .runtime import CommError, DistReducer, NeighbourMixer, check_agreement

    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(
            f"executor='torch' runs one process per agent and must be launched by torchrun "
            f"(missing {', '.join(missing)}): use  cdsgd launch --nproc-per-node {cfg.n_agents} [CONFIG] "
            "[key=value ...]  or  torchrun --nproc-per-node N -m cdsgd run ... executor=torch"
        )
    world = int(os.environ["WORLD_SIZE"])
    if world != cfg.n_agents:
        raise ValueError(f"world size {world} must equal n_agents={cfg.n_agents}: one rank per agent")
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    else:
        backend = "gloo"
    if cfg.exact:
        torch.set_num_threads(1)
    _die_with_parent()
    attempt = _init_group(backend, cfg.comm_timeout)
    rank = dist.get_rank()
    try:
        if rank != 0:
            log = lambda msg: None  # noqa: E731 - only rank 0 talks
            progress = False
        attempts: list = [None] * world
        dist.all_gather_object(attempts, attempt)
        restarted = max(attempts) > 0  # only the restarted node's agent may count restarts: ask everyone
        resume = cfg.resume or restarted
        if restarted:
            log(f"cdsgd run: attempt {max(attempts) + 1} after a restart: resuming from the latest complete "
                "checkpoint" + ("" if cfg.checkpoint_every else " (checkpoint_every=0: none, so from step 0)"))
        decided: list = [None]
        if rank == 0:
            try:
                decided[0] = ("ok", str(_prepare_out(cfg, resume=resume)))
            except ValueError as e:
                decided[0] = ("error", str(e))
        dist.broadcast_object_list(decided, src=0)
        status, value = decided[0]
        if status == "error":
            raise ValueError(value)
        out = Path(value)
        cfg = Config(**{**cfg.__dict__, "out": str(out)})
        parts = prepare(cfg)
        device = torch.device(f"cuda:{torch.cuda.current_device()}") if cfg.device == "cuda" else torch.device("cpu")
        mixer = NeighbourMixer(parts["W"], rank, timeout=cfg.comm_timeout, exact=cfg.exact)
        reducer = DistReducer(device=device, timeout=cfg.comm_timeout)
        sim = _make_executor(cfg, parts, mixer=mixer, agents=[rank], reducer=reducer)
        if _STORE is not None:  # who runs where: lets a failing rank tell a dead local process from a slow one
            import socket

            _STORE.set(f"cdsgd/proc/rank{rank}", f"{socket.gethostname()} {os.getpid()}")
        if not resume:
            ckpt.remove_all(out)  # before the agreement below: no rank has written a checkpoint of this run yet
        # "resume" differs between a first attempt and a restart: compare the config without it
        check_agreement({"mixing matrix": parts["W"], "n_agents": cfg.n_agents, "world size": world,
                         "parameter count": sim.layout.numel,
                         "config": dump_config(Config(**{**cfg.__dict__, "resume": False}))})

        def everyone(mine):
            got: list = [None] * world
            dist.all_gather_object(got, mine)
            return got

        payload = _find_checkpoint(cfg, out, rank=rank, world=world, agree=everyone, log=log) if resume else None
        summary = _drive(cfg, sim, parts, out, writer=rank == 0, progress=progress, log=log, resume=payload,
                         rank=rank, world=world, explain=lambda e: _name_the_lost(e, rank))
        # leave together: a rank tearing its connections down while a peer still reads
        # from them would fail that peer's last collective
        if backend == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=cfg.comm_timeout))
        else:
            dist.barrier()
        return summary
    except CommError as e:
        raise CommError(_name_the_lost(e, rank), e.peer) from None
    except Terminated as e:
        raise Terminated(_name_the_lost(e, rank)) from None
    finally:
        dist.destroy_process_group()


_STORE = None  # this process's rendezvous store (the runtime reports lost ranks through it)


def _init_group(backend: str, comm_timeout: float) -> int:
    """Join the process group; return this process's attempt number (0 on the first start).

    Under torchrun the workers use the agent's TCPStore, which outlives a
    restart: the keys of the failed attempt are still in it, and joining the
    group again under the same names hangs (pytorch issue 135712). So each
    start counts itself in the store and joins under a prefix of its own
    attempt. TORCHELASTIC_RESTART_COUNT counts restarts too, but only on the
    node whose agent restarted (the caller asks every rank).
    """
    global _STORE
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=comm_timeout)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)
        attempt = store.add(f"cdsgd/starts/rank{rank}", 1) - 1
        _STORE = dist.PrefixStore(f"cdsgd/attempt{attempt}", store)
        dist.init_process_group(backend, store=_STORE, rank=rank, world_size=world, timeout=timeout)
        return max(attempt, restarts)
    dist.init_process_group(backend, timeout=timeout)
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        _STORE = _get_default_store()
    except Exception:  # noqa: BLE001 - naming a lost rank is a courtesy, not a requirement
        _STORE = None
    return restarts


def _lost_ranks(e: BaseException, rank: int, world: int) -> tuple[list[int], int, bool]:
    """(the ranks this failure lost, the rank that saw it, whether the run was being stopped on purpose).

    Through the rendezvous store: every rank registers its host and pid at
    start (``cdsgd/proc/rankR``); every rank that fails says so before it
    exits (``cdsgd/down/rankR``), and a rank stopped by SIGTERM says that
    first (``cdsgd/stopping/rankR``); a rank that died (SIGKILL, a lost node)
    says nothing. A rank that saw a neighbour's connection close knows the
    peer: if that peer was stopping, the run is being stopped and nothing was
    lost; else it records the peer (the first report wins: later ones may be
    knock-on failures). Any other failing rank (a collective failed, or
    torchrun's SIGTERM) waits up to ``_LOST_PATIENCE`` seconds for that
    record, naming at once any rank on its own host whose process is gone
    without a word; at the end, ranks on other hosts that never said they
    were going down are named, unless the run was being stopped.
    """
    import socket

    store, peer = _STORE, getattr(e, "peer", None)
    if store is None:
        return ([peer] if peer is not None else []), rank, False
    if isinstance(e, Terminated):
        store.set(f"cdsgd/stopping/rank{rank}", "1")
    store.set(f"cdsgd/down/rank{rank}", "1")
    if peer is not None:
        if store.check([f"cdsgd/stopping/rank{peer}"]):
            return [], rank, True
        if store.add("cdsgd/lost/ticket", 1) == 1:
            store.set("cdsgd/lost/rank", f"{peer} {rank}")
            return [peer], rank, False
    host = socket.gethostname()
    others = [r for r in range(world) if r != rank]
    procs = {}
    for r in others:
        if store.check([f"cdsgd/proc/rank{r}"]):
            h, pid = store.get(f"cdsgd/proc/rank{r}").decode().rsplit(" ", 1)
            procs[r] = (h, int(pid))

    def quiet(r):
        return not store.check([f"cdsgd/down/rank{r}"])

    def gone(r):  # a process on this host that no longer exists
        if r not in procs or procs[r][0] != host:
            return False
        try:
            os.kill(procs[r][1], 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    deadline = time.monotonic() + _LOST_PATIENCE
    while True:
        if store.check(["cdsgd/lost/rank"]):
            lost, seen_by = map(int, store.get("cdsgd/lost/rank").decode().split())
            return [lost], seen_by, False
        dead = [r for r in others if quiet(r) and gone(r)]
        if dead:
            return dead, rank, False
        if time.monotonic() > deadline:
            if isinstance(e, Terminated) or any(store.check([f"cdsgd/stopping/rank{r}"]) for r in others):
                return [], rank, True
            remote_silent = [r for r in others if quiet(r) and procs.get(r, ("?",))[0] != host]
            return (remote_silent if len(remote_silent) < len(others) else []), rank, False
        time.sleep(0.05)


#: seconds a failing rank waits to learn which rank was lost (the others report within milliseconds)
_LOST_PATIENCE = 2.0


def _name_the_lost(e: BaseException, rank: int) -> str:
    """The failure as one line that names the rank that was lost, when it can be known.

    Called twice for one failure (for summary.json, and for the error the
    rank exits with): the answer is kept on the exception, with
    ``_cdsgd_lost`` (the lost ranks) and ``_cdsgd_stopped`` (the run was
    being stopped on purpose: SIGTERM to the launcher) for the run's status.
    """
    cached = getattr(e, "_cdsgd_named", None)
    if cached is not None:
        return cached
    try:
        lost, seen_by, stopped = _lost_ranks(e, rank, int(os.environ.get("WORLD_SIZE", "1")))
    except Exception:  # noqa: BLE001 - the store may be gone with the node that held it
        lost, seen_by, stopped = ([e.peer] if getattr(e, "peer", None) is not None else []), rank, False
    msg = _explain(e) if isinstance(e, KeyboardInterrupt) else str(e)
    if msg.startswith(f"rank {rank}: "):
        msg = msg[len(f"rank {rank}: "):]
    if lost:
        ranks = f"rank {lost[0]}" if len(lost) == 1 else f"ranks {lost}"
        how = "" if seen_by == rank else f" (reported by rank {seen_by})"
        named = f"rank {rank}: lost {ranks}{how}: {msg}"
    elif stopped and not isinstance(e, Terminated):
        named = f"rank {rank}: stopped with the run (SIGTERM): {msg}"
    else:
        named = f"rank {rank}: {msg}"
    try:
        e._cdsgd_named, e._cdsgd_lost, e._cdsgd_stopped = named, lost, stopped
    except AttributeError:
        pass
    return named


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the launcher dies, so that a killed launcher leaves no worker behind."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() == 1:  # the launcher died before prctl: nobody will stop this worker
            raise Terminated()
    except (OSError, AttributeError):
        pass


def _explain(e: BaseException) -> str:
    """One line for summary.json's "error"."""
    if isinstance(e, Terminated):
        return "SIGTERM"
    if isinstance(e, KeyboardInterrupt):
        return "SIGINT (Ctrl-C)"
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _csv_row(row: dict) -> dict:
    return {k: repr(v) if isinstance(v, float) else v for k, v in row.items()}


def _drive(cfg: Config, sim: Simulator, parts: dict, out: Path, *, writer: bool, progress: bool,
           log: Callable[[str], None], resume: dict | None = None, rank: int = 0, world: int = 1,
           explain: Callable[[BaseException], str] | None = None) -> dict:
    """Run the executor; the writer writes config.toml, metrics.csv, summary.json (and params.pt).

    Every process writes its own checkpoints (``checkpoint_every``).
    ``resume``: a checkpoint payload to continue from; its metrics rows are
    written again, and the run goes on from its step.
    """
    explain = explain or _explain
    total = max(1, round(cfg.epochs * sim.steps_per_epoch))
    every = _checkpoint_steps(cfg, sim.steps_per_epoch)
    gap = parts["spectral_gap"]
    summary = {
        "status": "running",
        "out": str(out),
        **cfg.identity(),
        "executor": cfg.executor,
        "spectral_gap": gap.gap,
        "lambda2": gap.lambda2,
        "n_parameters": sim.layout.numel,
        "steps_per_epoch": sim.steps_per_epoch,
        "strategy": sim.strategy,
        "torch_version": torch.__version__,
        "cdsgd_version": __version__,
    }
    rows: list[dict] = []
    if resume is not None:
        sim.load_state_dict(resume["simulator"])
        if sim.k > total:
            raise ValueError(f"the checkpoint is of step {sim.k}, beyond this run's {total} steps")
        rows = [dict(r) for r in resume["rows"]]
        if resume.get("diverged_at_step"):
            summary["diverged_at_step"] = resume["diverged_at_step"]
        summary["resumed_from_step"] = sim.k
    if writer:
        _atomic_write(out / "config.toml", dump_config(cfg))
    log(f"cdsgd run: {cfg.algorithm} on {cfg.topology} (n={cfg.n_agents}, spectral gap {gap.gap:.4f}), "
        f"{cfg.dataset}/{cfg.partition}, model {cfg.model} ({sim.layout.numel} parameters), "
        f"{total} steps, executor {cfg.executor}, output {out}"
        + (f", checkpoint every {every} steps" if every else ""))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=sim.k, unit="step", file=sys.stderr, dynamic_ncols=True)
    f = open(out / "metrics.csv", "w", newline="") if writer else None
    try:
        csv_writer = None
        if f is not None:
            csv_writer = csv.DictWriter(f, fieldnames=list(METRIC_COLUMNS))
            csv_writer.writeheader()
            csv_writer.writerows(_csv_row(r) for r in rows)  # a resumed run's rows up to its checkpoint
            f.flush()
            os.fsync(f.fileno())

        def on_row(row: dict) -> None:
            rows.append(row)
            if not math.isfinite(row["train_loss"]) and not summary.get("diverged_at_step"):
                summary["diverged_at_step"] = row["step"]
                log(f"warning: the training loss is {row['train_loss']} at step {row['step']}: the run diverged "
                    f"(lower lr={cfg.lr} or momentum={cfg.momentum})")
            if csv_writer is not None:
                csv_writer.writerow(_csv_row(row))
                f.flush()
                os.fsync(f.fileno())
            if bar is not None:
                bar.set_postfix_str(f"acc {row['test_accuracy']:.3f}")
            else:
                log(f"epoch {row['epoch']:.2f}  train_loss {row['train_loss']:.4f}  "
                    f"test_acc {row['test_accuracy']:.4f}  avg_model_acc {row['test_accuracy_avg_model']:.4f}  "
                    f"consensus {row['consensus_distance']:.3g}")

        def after_step(k: int) -> None:
            if not every or k % every:
                return
            state = {"config": ckpt.config_for_checkpoint(cfg.__dict__), "world": world,
                     "simulator": sim.state_dict(), "rows": rows,
                     "diverged_at_step": summary.get("diverged_at_step")}
            ckpt.save(out, k, rank, state)
            sim.reducer.barrier(f"checkpoint of step {k} (waiting for every rank to write its file)")
            ckpt.prune(out, rank, keep=k)  # step k is complete on every rank: older ones are not needed

        try:
            if total > sim.k:
                sim.run(steps=total - sim.k, eval_every=cfg.eval_every * sim.steps_per_epoch, callback=on_row,
                        progress=(lambda k: bar.update(1)) if bar is not None else None, after_step=after_step)
            if cfg.save_params:
                params = sim.reducer.gather(sim.X)
                if writer:
                    tmp = out / "params.pt.tmp"
                    torch.save(params.cpu(), tmp)
                    os.replace(tmp, out / "params.pt")
            summary["status"] = "completed"
        except KeyboardInterrupt as e:
            summary["error"] = explain(e)
            # torchrun's SIGTERM after a rank died is a failure of the run, not a user's stop
            summary["status"] = "failed" if getattr(e, "_cdsgd_lost", None) else "interrupted"
            raise
        except Exception as e:
            summary["error"] = explain(e)
            # a neighbour that left because the launcher stopped the run: the run was interrupted
            summary["status"] = "interrupted" if getattr(e, "_cdsgd_stopped", False) else "failed"
            raise
        finally:
            if bar is not None:
                bar.close()
            final = rows[-1] if rows else {}
            accs = [r["test_accuracy"] for r in rows if not math.isnan(r["test_accuracy"])]
            summary.update({k: _json_number(v) for k, v in final.items()})
            summary["best_test_accuracy"] = max(accs) if accs else None
            summary["evaluations"] = len(rows)
            summary["eval_bytes_per_agent"] = sim.reducer.bytes
            if writer:
                _atomic_write(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    finally:
        if f is not None:
            f.close()
    return summary
