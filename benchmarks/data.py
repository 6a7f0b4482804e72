r"""Drawing training batches: in-memory tensor indexing vs a DataLoader worker pool.

Run::

    python benchmarks/data.py [--batches 300]

The simulator keeps every agent's shard as tensors in memory and draws each
batch by indexing with the agent's permutation (``cdsgd.executor.BatchStream``).
This script times, side by side in one run, the cost of drawing one batch of
32 Fashion-MNIST-shaped samples (1×28×28 float32) that way and through
``torch.utils.data.DataLoader`` over a ``TensorDataset`` with 0 and 2
worker processes (shuffled, batch 32). The figure of merit is microseconds per
batch; the ratio column is each variant over in-memory indexing. A worker
pool only pays when producing a sample is expensive (decoding, augmentation
in Python); here the samples already are tensors.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import _common  # noqa: F401,E402 - the repository on sys.path first

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from cdsgd.executor import BatchStream  # noqa: E402

N_SAMPLES, BATCH = 12000, 32


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=300, help="batches per timed run (default 300)")
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (N_SAMPLES,), generator=g)

    def indexing():
        stream = BatchStream(N_SAMPLES, BATCH, torch.Generator().manual_seed(1))
        for _ in range(args.batches):
            idx = stream.next()
            xb, yb = x[idx], y[idx]
        return xb, yb

    def loader(workers):
        def run():
            dl = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, num_workers=workers,
                            generator=torch.Generator().manual_seed(1), persistent_workers=False)
            it = iter(dl)
            for _ in range(args.batches):
                xb, yb = next(it)
            return xb, yb
        return run

    variants = {"tensor indexing (cdsgd)": indexing, "DataLoader, 0 workers": loader(0),
                "DataLoader, 2 workers": loader(2)}
    times = {k: [] for k in variants}
    for k, f in variants.items():  # warm-up
        f()
    for r in range(3):
        for k, f in variants.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) / args.batches * 1e6)
    base = statistics.median(times["tensor indexing (cdsgd)"])
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.batches} batches of {BATCH} x (1, 28, 28), median of 3 runs "
          "(the DataLoader rows include starting their workers)")
    print("| variant | µs per batch | ratio to indexing |")
    print("| :--- | ---: | ---: |")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"| {k} | {m:.0f} | {m / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
