"""Your own training loop with cdsgd's CDMSGD optimizer, one process per agent.

Run on one machine with 4 agents on a ring:

    torchrun --nproc-per-node 4 experiments/launch/own_loop.py --epochs 5

Each rank is one agent: it trains its own copy of the model on its own
shard of scikit-learn's digits and, every step, averages its parameters with
its ring neighbours only (CDMSGD). Nothing here is specific to the data or
the model: swap in yours. After each epoch rank 0 prints one line per agent:
its own test accuracy and the distance of its parameters from rank 0's
(gathered from every rank, so the ranks' lines never run into each other).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 - before init_process_group: see the note at the end of main
import torch.nn.functional as F
from torch import nn

import topologies
from cdsgd import CDMSGD
from cdsgd.data import load_dataset, partition
from cdsgd.runtime import NeighbourMixer, check_agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--topology", default="ring")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank

    W = topologies.mixing_matrix(topologies.build(args.topology, world))
    check_agreement({"mixing matrix": W, "args": vars(args)})  # all ranks hold the same graph and settings
    mixer = NeighbourMixer(W, rank, timeout=60)

    data = load_dataset("digits")
    shard = partition(data.train[1].numpy(), world, "iid", seed=0)[rank]
    x, y = data.train[0][shard], data.train[1][shard]

    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = CDMSGD(model.parameters(), mixer, lr=args.lr, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for epoch in range(args.epochs):
        for idx in torch.randperm(len(y), generator=g).split(32):
            if len(idx) < 32:
                continue  # every rank takes the same number of steps
            opt.post()  # send x_j to the neighbours while computing the gradient at x_j
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()  # x_j <- sum_l pi_jl x_l + mu m_j - lr g_j
        with torch.no_grad():
            acc = (model(data.test[0]).argmax(1) == data.test[1]).float().mean()
            flat = torch.cat([p.reshape(-1) for p in model.parameters()])
            ref = flat.clone()
            dist.broadcast(ref, src=0)  # evaluation only: how far from rank 0?
            mine = torch.stack([acc, (flat - ref).norm()])
            every = [torch.zeros(2) for _ in range(world)]
            dist.all_gather(every, mine)  # rank 0 prints for all: one write, whole lines
        if rank == 0:
            sys.stdout.write("".join(f"rank {r} epoch {epoch + 1}: test accuracy {a:.3f}, |x_j - x_0| = {d:.4f}\n"
                                     for r, (a, d) in enumerate(t.tolist() for t in every)))
            sys.stdout.flush()
    dist.barrier()  # leave together: no rank closes its connections while a peer still reads from them
    # Tear gloo down here, while Python is fully alive. This works only if nothing else still holds the
    # process group. torch.distributed.nn binds group.WORLD as a default argument when it is imported,
    # and the first optimizer imports it (through torch._dynamo). If that import happened after
    # init_process_group, the group would outlive destroy_process_group. Its gloo threads would then
    # still be running at interpreter shutdown and could abort the process ("terminate called without
    # an active exception", exit -6) after all the work was done. That is why it is imported at the top.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
