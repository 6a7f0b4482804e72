r"""Sequence bucketing: padding, epoch time and validation loss, side by side in one run.

Run::

    python benchmarks/bucketing.py [--datasets plaid synthetic_seq] [--epochs 8] [--hidden 32]

For each data set (PLAID from sktime's files, and ``synthetic_seq``) and an
LSTM classifier trained by the simulator on one agent (``msgd``, batch 32),
it prints, for n_buckets in {1, 2, 4, 8, 16} and the boundary rules
``optimal``, ``quantile`` and ``uniform``:

* ``padded``: the fraction of padded elements over one epoch's batches, each
  batch padded to its own longest sequence (``padded_fraction``);
* ``epoch s``: wall-clock seconds of one training epoch, and ``speedup``, the
  unbucketed epoch's time over this one (measured in the same run);
* for the ``optimal`` rule, ``val loss`` / ``val acc`` after ``--epochs``
  epochs from the same initialisation and seed: bucketing changes which
  sequences share a batch, so the losses differ by run-to-run noise only.

A second table times one epoch with the packed (``packed=true``, padded
steps skipped) and the padded (all steps of the cut batch computed) LSTM,
without bucketing and with 8 optimal buckets.

The goal (the issue's): with 8 optimal buckets on PLAID, a padded fraction
at most a quarter of the unbucketed one and an epoch at least 2× faster.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cdsgd.data import load_dataset, sequence_lengths  # noqa: E402
from cdsgd.data.bucketing import (  # noqa: E402
    BucketBatchSampler, BucketStream, bucket_boundaries, padded_fraction,
)
from cdsgd.models import build_model  # noqa: E402
from cdsgd.simulator import Simulator  # noqa: E402

BATCH = 32
BUCKETS = (1, 2, 4, 8, 16)
RULES = ("optimal", "quantile", "uniform")


def simulator(ds, lengths, n_buckets, rule, hidden, packed, seed=0):
    x, y = ds.train
    bounds = bucket_boundaries(lengths, n_buckets, rule)
    probe = BucketStream(lengths, BATCH, bounds, torch.Generator().manual_seed(0))
    return Simulator(
        lambda: build_model("lstm", ds.input_shape, ds.n_classes, hidden=hidden, packed=packed), [(x, y)],
        None, "msgd", lr=0.05, momentum=0.9, batch_size=BATCH, seed=seed, test_set=ds.test,
        batch_stream=lambda j, gen: BucketStream(lengths, BATCH, bounds, gen),
        steps_per_epoch=probe.batches_per_epoch,
    )


def epoch_seconds(sim) -> float:
    t0 = time.perf_counter()
    for _ in range(sim.steps_per_epoch):
        sim.step()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["plaid", "synthetic_seq"])
    parser.add_argument("--epochs", type=int, default=8, help="training epochs for the validation loss")
    parser.add_argument("--hidden", type=int, default=32, help="LSTM hidden size (default 32)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"# benchmarks/bucketing.py  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}  LSTM hidden {args.hidden}, batch {BATCH}, "
          f"{args.epochs} epochs for the validation columns")
    for name in args.datasets:
        ds = load_dataset(name, "data")
        lengths = sequence_lengths(ds.train[0]).numpy()
        print(f"\n## {name}: {len(lengths)} training sequences, lengths {lengths.min()}..{lengths.max()} "
              f"(mean {lengths.mean():.0f}), {ds.n_classes} classes, {ds.input_shape[1] - 1} channel(s)\n")
        print("| buckets | rule | boundaries | padded | epoch s | speedup | val loss | val acc |")
        print("|---|---|---|---|---|---|---|---|")
        base = None
        for k in BUCKETS:
            for rule in RULES if k > 1 else ("optimal",):
                bounds = bucket_boundaries(lengths, k, rule)
                batches = list(BucketBatchSampler(lengths, BATCH, bounds, seed=0))
                pad = padded_fraction(lengths, batches)
                sim = simulator(ds, lengths, k, rule, args.hidden, packed=True)
                secs = epoch_seconds(sim)
                base = secs if base is None else base
                if rule == "optimal":
                    sim = simulator(ds, lengths, k, rule, args.hidden, packed=True)
                    row = sim.run(epochs=args.epochs, eval_every=args.epochs * sim.steps_per_epoch)[-1]
                    val = f"{row['test_loss']:.3f} | {row['test_accuracy']:.3f}"
                else:
                    val = "| "
                shown = ",".join(map(str, bounds)) if len(bounds) <= 8 else f"{len(bounds)} bounds"
                print(f"| {k} | {rule} | {shown} | {pad:.3f} | {secs:.2f} | {base / secs:.2f}x | {val} |",
                      flush=True)
        print("\n| LSTM | buckets | epoch s | packed/padded time |")
        print("|---|---|---|---|")
        for k in (1, 8):
            t = {p: epoch_seconds(simulator(ds, lengths, k, "optimal", args.hidden, packed=p)) for p in (True, False)}
            print(f"| packed | {k} | {t[True]:.2f} | {t[True] / t[False]:.2f} |")
            print(f"| padded | {k} | {t[False]:.2f} | 1 |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
