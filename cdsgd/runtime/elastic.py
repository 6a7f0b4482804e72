r"""Elastic membership across processes: a rank that dies is left behind, the survivors train on.

Under ``membership = "elastic"`` ``cdsgd launch`` starts the workers itself
(:mod:`cdsgd.cli.supervise`) and hosts a key-value store (torch's TCPStore)
that outlives any worker; it writes ``cdsgd/el/dead/R`` the moment worker R
exits. Every step k of the runtime is then a small round of agreement
through that store (:class:`ElasticStep`), attempt a = 0, 1, …:

1. **ready**: each live rank reports that it reached step k; it waits
   until every rank of the current view has reported, is marked dead, or
   ``comm_timeout`` has passed. The first rank to finish waiting proposes
   the ranks that reported; the store keeps the first proposal
   (compare-and-set), and every rank adopts it: one decision, whoever
   waited longest. A rank left out of it stops (:class:`Excluded`).
2. If the view changed (or a retry follows a failure), the process group
   is built again over the survivors (``destroy_process_group``, then a
   fresh group under its own store prefix: gloo's connections to a dead
   rank do not recover), and the agents of the lost ranks leave the run's
   :class:`~cdsgd.executor.membership.Membership` at step k, exactly as a
   churn trace ``agent, k,`` makes them leave in the simulator: the
   survivors mix over the surviving subgraph with the run's weight rule.
3. The step runs from a copy of the executor's state taken before it; the
   simulated clock's records of the step are gathered with it (a lost
   rank's share of the clock cannot be asked for afterwards).
4. **done**: each rank reports whether its step went through; decided as
   in 1. If every rank of the view reported success, step k is committed.
   Otherwise (a neighbour died inside the exchange: a :class:`CommError`
   within ``comm_timeout``), every rank puts its state back and step k is
   tried again (attempt a + 1) without the lost ranks.

A replacement of a lost rank (``cdsgd launch --max-restarts``) asks to join
(``JOIN``); the next step's ready round admits it, the lowest live rank
leaves it the run's state in the store, and its agents come back at that
step (:func:`join_run`): parameters and rule state from their donors, data
streams and random draws as its predecessor left them (``LOCAL``, written
by every rank at every step).

So every wait is bounded by ``comm_timeout``, the survivors agree on one
step at which a rank left, and the run equals the simulator's given the
churn trace of those departures (bit for bit in exact mode).

:class:`View` maps the ranks a run was launched with (the agents' layout
never changes: rank r always holds :func:`~cdsgd.runtime.exchange.agent_block`
(N, R, r)) onto the current process group, and spreads what the survivors
gather into the launch's agent order (the lost ranks' rows filled in).

``CDSGD_FAULT="die:RANK:STEP[:WHERE]"`` makes rank RANK kill itself
(SIGKILL) at step STEP: ``WHERE`` = ``step`` (default: before it reports
ready), ``exchange`` (after it reported ready: the others meet a closed
connection inside the step) or ``checkpoint`` (while writing the
checkpoint of step STEP). Several faults: separate them with commas. It is
how the tests kill a rank at a known point (docs/reliability.md).
"""

from __future__ import annotations

import copy
import datetime
import gc
import io
import json
import os
import signal
import time

import torch

from ..base.comm import CommError

__all__ = ["ADMIT", "DEAD", "ELASTIC_ENV", "ElasticStep", "Excluded", "FAULT_ENV", "JOIN", "JOIN_ENV", "LOCAL", "Quorum",
           "View", "adopt", "check_launched", "fault", "join_run", "lost_now", "resume_point", "streams_state"]

#: set to "1" by ``cdsgd launch`` for the workers of an elastic run (membership = "elastic")
ELASTIC_ENV = "CDSGD_ELASTIC"
#: the store key the launcher writes when worker R exits (``DEAD.format(R)``)
DEAD = "cdsgd/el/dead/{}"
#: a replacement rank is started (``JOIN.format(R)`` = "starting", by the launcher) and asks to join
#: ("ready"), and is told where it is admitted (``ADMIT``)
JOIN, ADMIT = "cdsgd/el/join/{}", "cdsgd/el/admit/{}"
#: rank R's agents' data streams and random draws at the start of step K (``LOCAL.format(R, K)``)
LOCAL = "cdsgd/el/local/{}/{}"
#: set to "1" by ``cdsgd launch`` for a replacement of a lost rank
JOIN_ENV = "CDSGD_JOIN"
#: the environment variable of fault injection (tests)
FAULT_ENV = "CDSGD_FAULT"
_WHERE = ("step", "exchange", "checkpoint", "join")


class Excluded(RuntimeError):
    """This rank was left out of the survivors' decision (it answered after ``comm_timeout``): it stops."""


def check_launched(executor: str, membership: str) -> None:
    """Refuse an elastic runtime run that ``cdsgd launch`` did not start (torchrun stops every rank at the
    first loss, and nobody would mark the dead)."""
    if executor == "torch" and membership == "elastic" and os.environ.get(ELASTIC_ENV) != "1":
        raise ValueError("membership = 'elastic' with executor = 'torch' runs under cdsgd launch, which starts and "
                         "watches its workers (torchrun stops every rank at the first loss): use  cdsgd launch "
                         "--nproc-per-node R [CONFIG] membership=elastic ...")


def fault(where: str, rank: int, k: int) -> None:
    """Kill this process (SIGKILL, as a lost machine) when ``CDSGD_FAULT`` names (rank, step k, where)."""
    spec = os.environ.get(FAULT_ENV, "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if parts[0] != "die" or len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] not in _WHERE):
            raise ValueError(f"{FAULT_ENV}={spec!r}: each fault is die:RANK:STEP[:WHERE], WHERE one of "
                             f"{', '.join(_WHERE)}")
        if int(parts[1]) == rank and parts[2] in ("*", str(k)) and (parts[3] if len(parts) == 4 else "step") == where:
            os.kill(os.getpid(), signal.SIGKILL)


class View:
    """The live ranks (ranks of the launch, ascending) and each one's rank in the current process group.

    >>> v = View(4); v.set([0, 2, 3]); v.peer(2), v.writer
    (1, 0)
    >>> v.spread([torch.ones(1, 2), 3 * torch.ones(1, 2), 4 * torch.ones(1, 2)], 0.0).squeeze(1).tolist()
    [[1.0, 1.0], [0.0, 0.0], [3.0, 3.0], [4.0, 4.0]]
    """

    def __init__(self, world: int) -> None:
        self.world = int(world)
        self.set(range(self.world))

    def set(self, live) -> None:
        self.live = sorted(int(r) for r in live)
        self._index = {r: i for i, r in enumerate(self.live)}

    def peer(self, rank: int) -> int:
        """Rank ``rank`` of the launch as a rank of the current process group."""
        try:
            return self._index[rank]
        except KeyError:
            raise CommError(f"rank {rank} has left the run (live ranks: {self.live})", rank) from None

    @property
    def writer(self) -> int:
        """The lowest live rank: it writes the output folder."""
        return self.live[0]

    def spread(self, blocks: list[torch.Tensor], fill: float) -> torch.Tensor:
        """The live ranks' equal blocks (in group order) as the launch's ``world`` blocks, stacked; a lost
        rank's block is ``fill``."""
        if len(blocks) == self.world:
            return torch.cat(blocks)
        out = [torch.full_like(blocks[0], fill) for _ in range(self.world)]
        for r, b in zip(self.live, blocks):
            out[r] = b
        return torch.cat(out)


class Quorum:
    """Decisions through the store: every member reports a value, the first to finish waiting proposes what
    it saw, the store keeps the first proposal (compare-and-set), and everyone adopts it.

    A member is dead once the launcher has counted more deaths of its rank (``DEAD``) than the run has
    admitted replacements of it (``incarnation``).
    """

    def __init__(self, store, rank: int, timeout: float, world: int) -> None:
        self.store, self.rank, self.timeout = store, int(rank), float(timeout)
        self.incarnation = {r: 0 for r in range(world)}

    def deaths(self, rank: int) -> int:
        return int(self.store.add(DEAD.format(rank), 0))

    def decide(self, tag: str, members: list[int], value: str = "1", *, joiners=(), want: int = 0) -> dict[int, str]:
        """{member: value} of those that reported ``tag`` before the others were dead or ``timeout`` passed;
        with ``joiners`` (ranks not in ``members``), each that asked to join (``JOIN``) as {rank: "join"},
        waiting up to ``timeout`` more for them while fewer than ``want`` would be live."""
        key = f"cdsgd/el/{tag}/"
        self.store.set(key + str(self.rank), value)
        deadline, pause = time.monotonic() + self.timeout, 0.0005
        waiting = set(members)
        seen: dict[int, str] = {}
        while True:
            ranks = sorted(waiting)
            keys = [key + str(q) for q in ranks]
            if self.store.check(keys):  # the usual case: everyone has reported (two round trips in all)
                seen.update({q: v.decode() for q, v in zip(ranks, self.store.multi_get(keys))})
                break
            for q in ranks:
                if self.store.check([key + str(q)]):
                    seen[q] = self.store.get(key + str(q)).decode()
                    waiting.discard(q)
                elif self.deaths(q) > self.incarnation[q]:
                    waiting.discard(q)
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
        deadline = time.monotonic() + self.timeout
        while joiners:  # a replacement the launcher started says "starting", then "ready" once built
            asked = {q: self.store.get(JOIN.format(q)).decode() for q in joiners if self.store.check([JOIN.format(q)])}
            seen.update({q: "join" for q, v in asked.items() if v == "ready"})
            if len(seen) >= want or "starting" not in asked.values() or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        proposal = json.dumps(sorted(seen.items()))
        decided = self.store.compare_set(key + "decision", "", proposal).decode()
        return {int(q): v for q, v in json.loads(decided)}


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)  # written by this run's own ranks


def streams_state(ex) -> dict:
    """What no other rank can give back of this rank's agents: their data streams and random draws."""
    return {"data": ex.data.state_dict(), "rng": [r.cpu() for r in ex.stack.rng.state_dict()]}  # as the stack's


class ElasticStep:
    """The executor's step under elastic membership: agreed, taken from a copy, committed or tried again.

    Args:
        group: the run's :class:`~cdsgd.runtime.group.DistGroup` (its view, store and ``regroup``).
        ex: the executor (its ``membership`` loses the agents of lost ranks, and takes back those of
            replacements).

    ``min_ranks``: while fewer ranks would be live, a step waits up to ``comm_timeout`` for replacements.
    ``rows``: the run's metrics rows so far (the run loop sets it), handed to a replacement that joins.
    Each rank also leaves in the store, at each step, its agents' data streams and random draws at the start
    of the next one (``LOCAL``): what a replacement of it continues from.
    """

    def __init__(self, group, ex, *, min_ranks: int = 0) -> None:
        self.group, self.ex, self.min_ranks = group, ex, int(min_ranks)
        self.quorum = Quorum(group.store_root, group.rank, group.timeout, group.world)
        self.rows: list[dict] = []
        #: set by :func:`join_run` in a replacement: the attempt of the step it was admitted at
        self.admitted: int | None = None
        self._published = -1

    def _publish(self, k: int) -> None:
        if self._published != k:
            self.group.store_root.set(LOCAL.format(self.group.rank, k), _dumps(streams_state(self.ex)))
            self._published = k

    def _change(self, before: list[int], decided: dict[int, str], k: int, tag: str, attempt: int) -> None:
        """Step k's view differs from ``before`` (or follows a failure): lost ranks' agents leave, admitted
        replacements' agents come back (the lowest live rank hands them the run's state), and the survivors
        and the replacements form a new process group."""
        group, ex, quorum = self.group, self.ex, self.quorum
        live = sorted(decided)
        lost = [r for r in before if r not in live]
        joined = [q for q, v in decided.items() if v == "join"]
        if lost:
            ex.membership.lose([j for r in lost for j in group.agents_of(r)], k)
        if joined:
            ex.membership.rejoin([j for q in joined for j in group.agents_of(q)], k)
            quorum.incarnation.update({q: quorum.deaths(q) for q in joined})
            if group.writer:
                store = group.store_root
                store.set(f"cdsgd/el/{tag}/state", _dumps({"simulator": ex.state_dict(), "rows": self.rows,
                                                           "incarnation": quorum.incarnation}))
                for q in joined:
                    store.set(ADMIT.format(q), json.dumps({"step": k, "attempt": attempt, "tag": tag, "live": live}))
                    store.delete_key(JOIN.format(q))
        group.regroup(live, tag)

    def __call__(self) -> float:
        group, ex, k = self.group, self.ex, self.ex.k
        self._publish(k)
        first, decided = (0, None) if self.admitted is None else (self.admitted, {})  # {}: decided at the join
        self.admitted = None
        for attempt in range(first, first + group.world + 1):
            tag = f"s{k}.{attempt}"
            if decided is None:
                fault("step", group.rank, k)
                before = list(group.view.live)
                decided = self.quorum.decide(f"{tag}/ready", before, want=self.min_ranks,
                                             joiners=[r for r in range(group.world) if r not in before])
                if group.rank not in decided:
                    raise Excluded(f"rank {group.rank} was left out at step {k} (it answered after "
                                   f"comm_timeout={group.timeout:g} s); the run goes on without it")
                if sorted(decided) != before or attempt > 0 or "join" in decided.values():
                    self._change(before, decided, k, tag, attempt)
            if "join" in decided.values():
                fault("join", group.rank, k)
            live, decided = list(group.view.live), None
            saved = copy.deepcopy(ex.state_dict())
            fault("exchange", group.rank, k)
            error = None
            try:
                loss = ex.step()
                if ex.meters.clock is not None:  # each step's records gathered while every rank of it is alive
                    ex.meters.clock.flush(ex.reducer)
            except CommError as e:
                error = str(e)
            if error is not None:  # close this rank's connections (once the error's frames, which hold the
                gc.collect()  # posted works and hence the group, are gone): a peer still waiting on it fails
                group.release()  # now, not at its timeout
            self._publish(k + 1)  # this attempt's state; a later attempt's overwrites it
            done = self.quorum.decide(f"{tag}/done", live, "0" if error else "1")
            if sorted(done) == live and all(v == "1" for v in done.values()):
                group.store_root.delete_key(LOCAL.format(group.rank, k))
                return loss
            ex.load_state_dict(saved)
        raise CommError(f"rank {group.rank}: step {k} failed {group.world + 1} times", None)


def join_run(group, ex) -> dict:
    """A replacement rank joins the running elastic run: it asks (``JOIN``), waits at most ``comm_timeout``
    for the survivors to admit it at the next step, joins their new process group, and returns the payload
    to continue from (the lowest live rank's state and metrics rows, with its own agents' data streams and
    random draws as its lost predecessor left them); its agents' parameters and rule state come from their
    donors in the step itself (:meth:`~cdsgd.executor.membership.Membership.begin`)."""
    store, rank = group.store_root, group.rank
    store.set(JOIN.format(rank), "ready")
    key = ADMIT.format(rank)
    try:
        store.wait([key], datetime.timedelta(seconds=group.timeout))
    except Exception:  # noqa: BLE001 - the store's timeout error: say it in one line
        raise CommError(f"rank {rank}: not admitted into the elastic run within comm_timeout="
                        f"{group.timeout:g} s (is it still running?)", None) from None
    admit = json.loads(store.get(key).decode())
    store.delete_key(key)
    payload = _loads(store.get(f"cdsgd/el/{admit['tag']}/state"))
    group.regroup(admit["live"], admit["tag"])
    state = payload["simulator"]  # the run's state (step, clock, membership, ...)
    leave = max(k for j, k in state["membership"]["lost"] if j in ex.agents)
    state = adopt(ex, state, _loads(store.get(LOCAL.format(rank, leave))))
    stepper = ex.stepper
    stepper.quorum.incarnation = {int(q): int(v) for q, v in payload["incarnation"].items()}
    stepper.admitted = int(admit["attempt"])
    return {"simulator": state, "rows": payload["rows"], "joined": True}


def adopt(ex, state: dict, own: dict | None = None) -> dict:
    """Another rank's executor ``state`` made this rank's: the run's step, clock, membership and the rule's
    shared state from it; this rank's own agents, their parameters and per-agent rule state (a donor gives
    them in the step they come back at, if ever), counters and, from ``own`` (:func:`streams_state`; None:
    as they are here), their data streams and random draws."""
    mine, held = ex.state_dict(), len(ex.agents)
    own = own if own is not None else {"data": mine["data"], "rng": mine["stack"]["rng"]}
    return {**state, "agents": mine["agents"], "stack": {"X": mine["stack"]["X"], "rng": own["rng"]},
            "data": own["data"], "mixer": mine["mixer"],
            "rule": {n: (mine["rule"][n] if t.dim() and t.shape[0] == held else t) for n, t in state["rule"].items()},
            "meters": {**state["meters"], "loss": mine["meters"]["loss"], "nonfinite": mine["meters"]["nonfinite"]}}


def lost_now(membership: dict) -> set[int]:
    """The agents a membership state (``Membership.state_dict``) records as lost and not back."""
    count: dict[int, int] = {}
    for j, _ in membership.get("lost", []):
        count[int(j)] = count.get(int(j), 0) + 1
    for j, _ in membership.get("back", []):
        count[int(j)] -= 1
    return {j for j, c in count.items() if c > 0}


def resume_point(steps: list[list[int]], group, path) -> tuple[int, int] | None:
    """The checkpoint an elastic run resumes from: (step, the lowest rank holding it), the latest step whose
    file every rank holds but the ranks that run had lost for good by then (read from that lowest rank's
    file, ``path(step, rank)``); None if there is none. Those ranks take that rank's state (:func:`adopt`);
    their agents stay lost. ``steps``: the steps each rank holds a checkpoint of."""
    for step in sorted(set().union(*map(set, steps)), reverse=True):
        holders = [r for r, s in enumerate(steps) if step in s]
        missing = [r for r in range(group.world) if r not in holders]
        if missing:
            try:
                payload = torch.load(path(step, holders[0]), map_location="cpu", weights_only=True)
                lost = lost_now(payload["simulator"].get("membership", {}))
            except Exception:  # noqa: BLE001 - a damaged file: an older checkpoint may do
                continue
            if not all(set(group.agents_of(r)) <= lost for r in missing):
                continue
        return step, holders[0]
    return None
