"""The neighbour exchange and the optimizers in a process subgroup, in four real gloo processes.

A subgroup's ranks are not the global ones (global ranks 1, 2, 3 are group
ranks 0, 1, 2). ``rank`` and W's indices are group ranks; a mixer that
addressed global ranks would exchange with the wrong process, or with the
one outside the group, and these values would not come out. The expected
values are computed here in numpy from hand-written matrices.

torch orders a group's ranks by their global ranks whatever order
``new_group`` is given them in (``new_group([3, 0, 1])`` makes global 0, 1, 3
group ranks 0, 1, 2), so "a reordered group" is a group with a gap: the
second case checks that and runs in it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_harness import run_ranks

T = 20.0  # comm_timeout: a wrong peer would show as a CommError after this, long before the harness' deadline
STEPS, LR, P = 3, 0.1, 5
#: the path 0 - 1 - 2 with Metropolis weights, written out (rows and columns sum to 1)
W3 = np.array([[2 / 3, 1 / 3, 0.0], [1 / 3, 1 / 3, 1 / 3], [0.0, 1 / 3, 2 / 3]])
#: the ring of 6 with weight 1/3 on each edge and the diagonal (two agents per group rank)
W6 = np.array([[1 / 3 if (i - j) % 6 in (0, 1, 5) else 0.0 for j in range(6)] for i in range(6)])
X0 = np.random.default_rng(0).standard_normal((6, P))  # rows 0..2: the three agents of W3; all 6: W6's
C = np.random.default_rng(1).standard_normal((3, P))   # f_j(x) = ½‖x − c_j‖², so g_j(x) = x − c_j


def _in_subgroup(rank, world, members):
    import torch.distributed as dist

    from cdsgd.algorithms import CDSGD, DecentralizedOptimizer
    from cdsgd.runtime import BlockMixer, NeighbourMixer

    group = dist.new_group(members)
    try:
        if dist.get_rank(group) < 0:  # outside the group: its own thing, which includes being refused its mixer
            with pytest.raises(ValueError, match=rf"global rank {rank}\) is not a member of the given group"):
                NeighbourMixer(W3, 0, group=group, timeout=T)
            return "outside"
        g = dist.get_rank(group)
        refusals = []
        with pytest.raises(ValueError) as e:  # a rank not this process's (as its global rank would be)
            NeighbourMixer(W3, (g + 1) % 3, group=group, timeout=T)
        refusals.append(str(e.value))
        with pytest.raises(ValueError) as e:  # a matrix for another number of ranks
            NeighbourMixer(W6, g, group=group, timeout=T)
        refusals.append(str(e.value))

        mixer = NeighbourMixer(W3, g, group=group, timeout=T)
        x, mixes = torch.tensor(X0[g]), []
        for _ in range(STEPS):
            x = mixer.mix(x).clone()
            mixes.append(x)
        block = BlockMixer(W6, g, 3, group=group, timeout=T)
        Xb = torch.tensor(X0[block.agents])
        block_mixes = [block.mix(Xb).clone(), block.mix(2 * Xb).clone()]  # buffers reused: a second mix too

        c = torch.tensor(C[g])
        finals = {}
        for name in ("dsgt", "cdsgd"):
            p = torch.nn.Parameter(torch.tensor(X0[g]))
            mix = NeighbourMixer(W3, g, group=group, timeout=T)
            opt = (DecentralizedOptimizer([p], mix, "dsgt", lr=LR, momentum=0.0) if name == "dsgt"
                   else CDSGD([p], mix, lr=LR))
            for _ in range(STEPS):
                p.grad = p.detach() - c  # the gradient at the current x
                opt.post()
                opt.step()
            finals[name] = p.detach().clone()
        return {"group rank": g, "refusals": refusals, "mixes": mixes, "block": block_mixes, **finals}
    finally:
        dist.barrier()  # everyone, members or not, stays until all are done (global rank 0 holds the store)


def _expected():
    mixes, X = [], X0[:3]
    for _ in range(STEPS):
        X = W3 @ X
        mixes.append(X)
    X, Y, G_prev = X0[:3].copy(), np.zeros((3, P)), np.zeros((3, P))
    for _ in range(STEPS):  # gradient tracking: y ← W y + g(x) − g_prev;  x ← W x − lr y
        G = X - C
        Y = W3 @ Y + G - G_prev
        G_prev = G
        X = W3 @ X - LR * Y
    dsgt = X
    X = X0[:3].copy()
    for _ in range(STEPS):  # CDSGD: x ← W x − lr g(x)
        X = W3 @ X - LR * (X - C)
    return mixes, dsgt, X


@pytest.mark.parametrize("members", [[1, 2, 3], [3, 0, 1]], ids=["ranks-1-2-3", "ranks-3-0-1"])
def test_mixing_and_optimizers_in_a_subgroup(members):
    results = run_ranks(_in_subgroup, 4, members, timeout=180, pg_timeout=60)
    mixes, dsgt, cdsgd = _expected()
    order = sorted(members)  # torch's group ranks follow the global order
    for rank in range(4):
        if rank not in members:
            assert results[rank] == "outside"
            continue
        r = results[rank]
        g = r["group rank"]
        assert g == order.index(rank)
        assert (f"rank {(g + 1) % 3} was given, but this process is rank {g} of the group (global rank {rank})"
                in r["refusals"][0])
        assert "places its 6 agents on 6 ranks, but the group has 3" in r["refusals"][-1]
        for k in range(STEPS):
            np.testing.assert_allclose(r["mixes"][k].numpy(), mixes[k][g], rtol=0, atol=1e-14)
        rows = [2 * g, 2 * g + 1]
        np.testing.assert_allclose(r["block"][0].numpy(), (W6 @ X0)[rows], rtol=0, atol=1e-14)
        np.testing.assert_allclose(r["block"][1].numpy(), (W6 @ (2 * X0))[rows], rtol=0, atol=1e-14)
        np.testing.assert_allclose(r["dsgt"].numpy(), dsgt[g], rtol=0, atol=1e-13)
        np.testing.assert_allclose(r["cdsgd"].numpy(), cdsgd[g], rtol=0, atol=1e-13)
