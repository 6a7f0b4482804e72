r"""The processes a run lives in, as one object: :class:`LocalGroup` (one process) or :class:`DistGroup`.

A run asks its group for everything that depends on where the agents live:

``rank``, ``world``, ``attempt``
    who this process is, how many there are, and how many times the run has
    been (re)started (0: first start; any rank's restart makes every rank resume);
``agree(value) -> list``
    every process's value, in rank order (an all-gather);
``decide(fn) -> value``
    rank 0 computes ``fn()`` and every process gets its result, or its
    ValueError (used to prepare the output folder once);
``check(facts)``
    every process holds the same facts (mixing matrix, config, ...);
``agents``
    the agents this process holds (None: all of them);
``mixer(W, exact)``, ``reducer(device)``
    the Mixer and Reducer the executor uses;
``diagnose(error) -> Failure``
    the failure as one line, naming the rank that was lost when it can be
    known, and whether the run was being stopped on purpose;
``close()``
    leave together (a barrier) and release the process group;
``writer``
    whether this process writes the output folder;
``elastic``, ``view``, ``regroup(live, tag)``
    under elastic membership (``cdsgd launch ... membership=elastic``), who
    is still alive and how the survivors form a new process group
    (:mod:`cdsgd.runtime.elastic`).

:func:`join` starts a :class:`DistGroup` inside a torchrun launch; a
:class:`LocalGroup` needs nothing. No module-level state: the rendezvous
store lives on the group.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from dataclasses import dataclass, field

import torch

from ..base.comm import CommError
from ..executor.reducer import Reducer
from ..mixers import Mixer, make_mixer
from .elastic import ELASTIC_ENV, JOIN_ENV, View

__all__ = ["DistGroup", "Failure", "Group", "LocalGroup", "Terminated", "describe", "join"]

#: seconds a failing rank waits to learn which rank was lost (the others report within milliseconds)
LOST_PATIENCE = 2.0


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (the CLI turns it into this): the run stops as on Ctrl-C, its files complete."""


def describe(e: BaseException) -> str:
    """One line for summary.json's ``error``."""
    if isinstance(e, Terminated):
        return "SIGTERM"
    if isinstance(e, KeyboardInterrupt):
        return "SIGINT (Ctrl-C)"
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


@dataclass(frozen=True)
class Failure:
    """What a failed or stopped run reports: ``message`` (one line), the ``lost`` ranks, ``stopped`` on purpose."""

    message: str
    lost: list[int] = field(default_factory=list)
    stopped: bool = False

    def status(self, e: BaseException) -> str:
        """``failed`` or ``interrupted``, for summary.json.

        Ctrl-C/SIGTERM is an interruption, unless a rank was lost (torchrun's
        SIGTERM after a rank died); any other error is a failure, unless the
        run was being stopped (a neighbour left because the launcher stopped it).
        """
        if isinstance(e, KeyboardInterrupt):
            return "failed" if self.lost else "interrupted"
        return "interrupted" if self.stopped else "failed"


class Group:
    """The interface; see the module docstring."""

    rank: int = 0
    world: int = 1
    attempt: int = 0
    #: the agents this process holds (None: every agent)
    agents: list[int] | None = None
    #: whether a lost process leaves the run rather than stopping it (:mod:`cdsgd.runtime.elastic`)
    elastic: bool = False
    #: whether this process replaces a lost one in a running elastic run
    joining: bool = False

    @property
    def writer(self) -> bool:
        """Whether this process writes the output folder (rank 0; under elastic membership the lowest live rank)."""
        return self.rank == 0

    def agree(self, value) -> list:
        raise NotImplementedError

    def decide(self, fn):
        raise NotImplementedError

    def check(self, facts: dict) -> None:
        raise NotImplementedError

    def mixer(self, W, *, exact: bool, n_agents: int) -> Mixer:
        """The mixer of this process's agents for W (a matrix, a Schedule, or None: all-reduce):
        :func:`cdsgd.mixers.make_mixer`."""
        raise NotImplementedError

    def reducer(self, device: torch.device) -> Reducer:
        raise NotImplementedError

    def diagnose(self, e: BaseException) -> Failure:
        raise NotImplementedError

    def close(self) -> None:
        """Leave the group after a completed run: together."""

    def release(self) -> None:
        """Leave the group after a failure, without waiting for the others."""


class LocalGroup(Group):
    """Every agent in this one process: nothing to agree on, nobody to lose."""

    def agree(self, value) -> list:
        return [value]

    def decide(self, fn):
        return fn()

    def check(self, facts: dict) -> None:
        pass

    def mixer(self, W, *, exact: bool, n_agents: int) -> Mixer:
        return make_mixer(W, n_agents=n_agents, exact=exact, validated=True)  # W comes validated from the plan

    def reducer(self, device: torch.device) -> Reducer:
        return Reducer()

    def diagnose(self, e: BaseException) -> Failure:
        return Failure(describe(e))


def join(*, device: str, comm_timeout: float, n_agents: int) -> "DistGroup":
    """Join the torchrun launch this process belongs to (a block of n_agents/world agents per rank).

    A ValueError outside a launch, or when the world size does not divide n_agents
    (:func:`cdsgd.runtime.exchange.agents_per_process`).
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(
            f"executor='torch' runs the agents in torchrun processes and must be launched by torchrun "
            f"(missing {', '.join(missing)}): use  cdsgd launch --nproc-per-node R [CONFIG] "
            "[key=value ...]  (R dividing n_agents)  or  torchrun --nproc-per-node R -m cdsgd run ... executor=torch"
        )
    from .exchange import agents_per_process

    # under a plain torchrun no cdsgd launch has checked the process count
    agents_per_process(n_agents, int(os.environ["WORLD_SIZE"]))
    return DistGroup(device=device, comm_timeout=comm_timeout, n_agents=n_agents)


class DistGroup(Group):
    """torch.distributed ranks (gloo on CPU, nccl on CUDA), each holding a contiguous block of agents.

    Rank r holds agents r·N/R … (r+1)·N/R − 1 (:func:`cdsgd.runtime.exchange.agent_block`);
    ``n_agents=None`` means one agent per rank.
    """

    def __init__(self, *, device: str, comm_timeout: float, n_agents: int | None = None) -> None:
        import torch.distributed as dist
        # Before joining: torch.distributed.nn binds group.WORLD as a default argument when imported (the first
        # optimizer imports it through torch._dynamo); imported after the join, it would keep the group alive
        # past destroy_process_group, and gloo's threads could abort the process at exit (exit -6).
        import torch.distributed.nn  # noqa: F401

        self.dist, self.timeout = dist, float(comm_timeout)
        self.elastic = os.environ.get(ELASTIC_ENV) == "1"
        #: a replacement of a lost rank, joining a running elastic run (:func:`cdsgd.runtime.elastic.join_run`)
        self.joining = self.elastic and os.environ.get(JOIN_ENV) == "1"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.backend, self.device = "nccl", torch.device(f"cuda:{torch.cuda.current_device()}")
        else:
            self.backend, self.device = "gloo", torch.device("cpu")
        _die_with_parent()
        self.store, attempt = self._init()
        self.rank, self.world = ((dist.get_rank(), dist.get_world_size()) if dist.is_initialized()
                                 else (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])))  # a joiner
        self.view = View(self.world) if self.elastic else None
        self.n_agents = self.world if n_agents is None else int(n_agents)
        self._failures: list[tuple[BaseException, Failure]] = []
        try:
            # only the restarted node's agent may count restarts: ask everyone
            self.attempt = attempt if self.joining else max(self.agree(attempt))
            if self.store is not None:  # who runs where: lets a failing rank tell a dead local process from a slow one
                self.store.set(f"cdsgd/proc/rank{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        except BaseException:
            self.release()
            raise

    def _init(self):
        """Join the process group; return (the rendezvous store or None, this process's attempt number).

        Under torchrun the workers use the agent's TCPStore, which outlives a
        restart: the keys of the failed attempt are still in it, and joining the
        group again under the same names hangs (pytorch issue 135712). So each
        start counts itself in the store and joins under a prefix of its own
        attempt. TORCHELASTIC_RESTART_COUNT counts restarts too, but only on the
        node whose agent restarted (so every rank is asked).
        """
        dist = self.dist
        timeout = datetime.timedelta(seconds=self.timeout)
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if self.elastic:  # cdsgd launch's own store, which outlives every worker (cdsgd.cli.supervise)
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            self.store_root = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                            is_master=False, timeout=timeout)
            if self.joining:  # no process group until the survivors admit it
                return self.store_root, 0
            prefixed = dist.PrefixStore("cdsgd/pg/start", self.store_root)
            dist.init_process_group(self.backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
            return self.store_root, 0
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                  is_master=False, timeout=timeout)
            attempt = store.add(f"cdsgd/starts/rank{rank}", 1) - 1
            prefixed = dist.PrefixStore(f"cdsgd/attempt{attempt}", store)
            dist.init_process_group(self.backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
            return prefixed, max(attempt, restarts)
        dist.init_process_group(self.backend, timeout=timeout)
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            return _get_default_store(), restarts
        except Exception:  # noqa: BLE001 - naming a lost rank is a courtesy, not a requirement
            return None, restarts

    # ------------------------------------------------------------ agreement

    def agree(self, value) -> list:
        got: list = [None] * self.world
        self.dist.all_gather_object(got, value)
        return got

    def decide(self, fn):
        decided: list = [None]
        if self.rank == 0:
            try:
                decided[0] = ("ok", fn())
            except ValueError as e:
                decided[0] = ("error", str(e))
        self.dist.broadcast_object_list(decided, src=0)
        status, value = decided[0]
        if status == "error":
            raise ValueError(value)
        return value

    def check(self, facts: dict) -> None:
        from .reduce import check_agreement

        if not self.joining:  # a replacement runs the launch's command line: the survivors checked it at start
            check_agreement(facts)

    @property
    def agents(self) -> list[int]:
        return self.agents_of(self.rank)

    def agents_of(self, rank: int) -> list[int]:
        """The agents rank ``rank`` of the launch holds."""
        from .exchange import agent_block

        return agent_block(self.n_agents, self.world, rank)

    @property
    def writer(self) -> bool:
        return self.rank == (0 if self.view is None else self.view.writer)

    def regroup(self, live: list[int], tag: str) -> None:
        """The survivors ``live`` (ranks of the launch) form a new process group, under the store prefix
        ``tag`` (every survivor calls this with the same arguments)."""
        dist = self.dist
        if dist.is_initialized():
            dist.destroy_process_group()
        prefixed = dist.PrefixStore(f"cdsgd/pg/{tag}", self.store_root)
        dist.init_process_group(self.backend, store=prefixed, rank=live.index(self.rank), world_size=len(live),
                                timeout=datetime.timedelta(seconds=self.timeout))
        self.view.set(live)

    def mixer(self, W, *, exact: bool, n_agents: int) -> Mixer:
        from .exchange import BlockMixer

        def block(Wk, *, exact: bool, validate: bool, n_agents: int | None = None) -> Mixer:
            return BlockMixer(Wk, self.rank, self.world, timeout=self.timeout, exact=exact, validate=validate,
                              n_agents=n_agents, view=self.view)

        return make_mixer(W, n_agents=n_agents, exact=exact, per_matrix=block, validated=True)  # as LocalGroup

    def reducer(self, device: torch.device) -> Reducer:
        from .reduce import DistReducer

        return DistReducer(device=self.device, timeout=self.timeout, view=self.view)

    def close(self) -> None:
        """Leave together (a rank tearing its connections down while a peer still reads from them
        would fail that peer's last collective), then release the group."""
        try:
            if self.backend == "gloo":
                self.dist.monitored_barrier(timeout=datetime.timedelta(seconds=self.timeout))
            else:
                self.dist.barrier()
        finally:
            self.release()

    def release(self) -> None:
        """Release the process group without waiting for the others (after a failure)."""
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    # ------------------------------------------------------------ failures

    def diagnose(self, e: BaseException) -> Failure:
        """The failure as one line naming the lost rank when it can be known (asked once per error)."""
        for seen, failure in self._failures:
            if seen is e:
                return failure
        try:
            lost, seen_by, stopped = _lost_ranks(self.store, e, self.rank, self.world)
        except Exception:  # noqa: BLE001 - the store may be gone with the node that held it
            peer = getattr(e, "peer", None)
            lost, seen_by, stopped = ([peer] if peer is not None else []), self.rank, False
        rank = self.rank
        msg = describe(e) if isinstance(e, KeyboardInterrupt) else str(e)
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
        failure = Failure(named, lost, stopped)
        self._failures.append((e, failure))
        return failure


def _lost_ranks(store, e: BaseException, rank: int, world: int) -> tuple[list[int], int, bool]:
    """(the ranks this failure lost, the rank that saw it, whether the run was being stopped on purpose).

    Through the rendezvous store: every rank registers its host and pid at
    start (``cdsgd/proc/rankR``); every rank that fails says so before it
    exits (``cdsgd/down/rankR``), and a rank stopped by SIGTERM says that
    first (``cdsgd/stopping/rankR``); a rank that died (SIGKILL, a lost node)
    says nothing. A rank that saw a neighbour's connection close knows the
    peer: if that peer was stopping, the run is being stopped and nothing was
    lost; if it had said it was going down, it left after a failure of its
    own (a knock-on) and this rank waits for the record like the others; else
    it records the peer (the first report wins: later ones may be knock-on
    failures too). Any other failing rank (a collective failed, or
    torchrun's SIGTERM) waits up to :data:`LOST_PATIENCE` seconds for that
    record, naming at once any rank on its own host whose process is gone
    without a word; at the end, ranks on other hosts that never said they
    were going down are named, unless the run was being stopped.
    """
    peer = e.peer if isinstance(e, CommError) else None
    if store is None:
        return ([peer] if peer is not None else []), rank, False
    if isinstance(e, Terminated):
        store.set(f"cdsgd/stopping/rank{rank}", "1")
    store.set(f"cdsgd/down/rank{rank}", "1")
    if peer is not None:
        if store.check([f"cdsgd/stopping/rank{peer}"]):
            return [], rank, True
        # a peer that said it was going down left after a failure of its own: a knock-on, not the loss
        if not store.check([f"cdsgd/down/rank{peer}"]) and store.add("cdsgd/lost/ticket", 1) == 1:
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

    deadline = time.monotonic() + LOST_PATIENCE
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


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the launcher dies, so that a killed launcher leaves no worker behind."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get(ELASTIC_ENV) == "1"
    if not sys.platform.startswith("linux") or not launched:
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
