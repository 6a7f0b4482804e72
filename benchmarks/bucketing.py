r"""Sequence bucketing: padding, epoch time and validation loss, side by side in one run.

Run::

    python benchmarks/bucketing.py [--datasets plaid synthetic_seq] [--epochs 8] [--hidden 32] [--cost-model]
    OMP_NUM_THREADS=1 python benchmarks/bucketing.py --time-to-loss --epochs 30   # ~11 min
    python benchmarks/bucketing.py --from-sweep runs/plaid_buckets   # the same table from the study's sweep

For each data set (PLAID from sktime's files, and ``synthetic_seq``) and an
LSTM classifier trained by the simulator on one agent (``msgd``, batch 32),
it prints, for n_buckets in {1, 2, 4, 8, 16} and the boundary rules
``optimal``, ``quantile`` and ``uniform``:

* ``padded``: the fraction of padded elements over one epoch's batches, each
  batch padded to its own longest sequence (``padded_fraction``);
* ``epoch s``: wall-clock seconds of one training epoch, and its speedup over
  the two unbucketed baselines measured in the same run: ``fixed`` (every
  batch padded to the data set's longest sequence, the classic fixed-shape
  batch; ``trim=false``) and ``trimmed`` (random batches, each cut to its own
  longest sequence: the model's default);
* ``epoch s`` is the fastest of 3 consecutive epochs;
* for the ``optimal`` rule, ``val loss`` / ``val acc`` after ``--epochs``
  epochs, mean ± sd over 3 seeds: bucketing changes which sequences share a
  batch, which must not change the result beyond the seed-to-seed spread.

A second table times one epoch with the packed (``packed=true``, padded
steps skipped) and the padded (all steps of the cut batch computed) LSTM,
without bucketing and with 8 optimal buckets.

The goal (the issue's): with 8 optimal buckets on PLAID, a padded fraction
at most a quarter of the unbucketed one and an epoch at least 2× faster.

``--time-to-loss`` judges bucketing as Khomenko et al. (2016) do: by the
time to reach a validation loss, not by the time of an epoch. It runs the
settings that learn PLAID (docs/sequences.md, "Settings that learn": CDMSGD
on a ring of 4 agents, LSTM hidden 64, ``batch_size=16 lr=0.5 momentum=0.9
grad_clip=1``) through ``run_experiment`` with an evaluation every epoch, for
each bucket count and rule and 3 seeds, and prints mean ± sd over the seeds of

* ``epoch s``: training seconds per epoch (``wall_seconds`` of the last
  evaluation / epochs; evaluation time excluded); ``train s``: all of them;
* ``classes/batch``: the mean number of distinct classes in a full batch of
  the runs' own streams (each agent's shard, 20 passes; :func:`classes_per_batch`),
  beside the share of the length's variance that the class explains (η²);
* ``to target``: epochs and training seconds until the first evaluation whose
  test loss (mean over the agents) is at most the target; a seed that never
  reaches it counts as missing (the column says how many reached it);
* ``final loss``: the test loss after the last epoch.

The target is fixed by the unbucketed baseline (random batches each cut to
their own longest sequence, the model's default ``trim = true``): the mean,
over its seeds and over its evaluations from 70 % to 90 % of training, of its
test loss, i.e. the loss it holds at about 80 % of its training (a window,
because one evaluation's loss jumps by ±0.1 from epoch to epoch).
The issue's goal: with 8 optimal buckets, the target reached ≥ 1.5× sooner
than unbucketed, at a final loss equal within the seed spread.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys
import tempfile
import time

import _common  # noqa: F401,E402 - the repository on sys.path first

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cdsgd.data import load_dataset, sequence_lengths  # noqa: E402
from cdsgd.data.bucketing import (  # noqa: E402
    BucketBatchSampler, BucketStream, bucket_boundaries, padded_fraction,
)
from cdsgd.models import build_model  # noqa: E402
from cdsgd.executor import Simulator  # noqa: E402

BATCH = 32
LR = 0.02  # with momentum 0.9; larger steps make LSTM training chaotic here (losses then differ run to run)
SEEDS = (0, 1, 2)
BUCKETS = (1, 2, 4, 8, 16)
RULES = ("optimal", "quantile", "uniform")


def simulator(ds, lengths, n_buckets, rule, hidden, packed=False, trim=True, seed=0):
    x, y = ds.train
    bounds = bucket_boundaries(lengths, n_buckets, rule)
    probe = BucketStream(lengths, BATCH, bounds, torch.Generator().manual_seed(0))
    return Simulator(
        lambda: build_model("lstm", ds.input_shape, ds.n_classes, hidden=hidden, packed=packed, trim=trim),
        [(x, y)],
        None, "msgd", lr=LR, momentum=0.9, batch_size=BATCH, seed=seed, test_set=ds.test,
        batch_stream=lambda j, gen: BucketStream(lengths, BATCH, bounds, gen),
        steps_per_epoch=probe.batches_per_epoch,
    )


def epoch_seconds(sim, repeats: int = 3) -> float:
    """The fastest of ``repeats`` consecutive training epochs (the least disturbed by other work)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(sim.steps_per_epoch):
            sim.step()
        best = min(best, time.perf_counter() - t0)
    return best


def cost_model(ds, lengths, hidden) -> None:
    """Why epoch time follows time steps, not padded elements, for a CPU LSTM.

    Prints, per batching of one epoch, the sum over batches of the batch's
    longest sequence (the time steps the recurrence runs) next to the padded
    elements, and the time of one LSTM forward + backward at T = 400 for
    batch 8 against batch 32.
    """
    print("\n| batching | batches | Σ longest per batch (steps) | elements computed | of them padding |")
    print("|---|---|---|---|---|")
    cases = [(f"{k} optimal bucket(s)", list(BucketBatchSampler(lengths, BATCH, bucket_boundaries(lengths, k),
                                                               seed=0))) for k in (1, 8)]
    order = np.argsort(lengths, kind="stable")
    cases.append(("sorted by length", [order[i:i + BATCH].tolist() for i in range(0, len(order), BATCH)]))
    for label, batches in cases:
        steps = sum(int(lengths[b].max()) for b in batches)
        computed = sum(len(b) * int(lengths[b].max()) for b in batches)
        print(f"| {label} | {len(batches)} | {steps} | {computed} | {computed - int(lengths.sum())} |")
    rnn = torch.nn.LSTM(ds.input_shape[1] - 1, hidden, batch_first=True)
    secs = {}
    for b in (8, 32):
        x = torch.randn(b, 400, ds.input_shape[1] - 1)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            rnn(x)[0].sum().backward()
            best = min(best, time.perf_counter() - t0)
        secs[b] = best
    big = np.clip(np.random.default_rng(0).lognormal(np.log(300), 0.8, 100_000).round(), 1, 2000).astype(int)
    for k in (8, 16):
        t0 = time.perf_counter()
        bucket_boundaries(big, k)
        print(f"optimal boundaries for 10^5 log-normal lengths ({len(np.unique(big))} distinct), K = {k}: "
              f"{time.perf_counter() - t0:.2f} s")
    print(f"\nLSTM forward + backward at T = 400: batch 8 {secs[8] * 1e3:.1f} ms, batch 32 {secs[32] * 1e3:.1f} ms "
          f"(batch 8 costs {secs[8] / secs[32]:.0%} of batch 32)")


LEARN = ("dataset=plaid", "model=lstm", "n_agents=4", "batch_size=16", "lr=0.5", "momentum=0.9", "grad_clip=1")


def learning_curve(k: int, rule: str, seed: int, epochs: int, out: str):
    """(epoch, test loss, training seconds) per evaluation of one run of the settings that learn."""
    from cdsgd.config import load_config
    from cdsgd.run.experiment import run_experiment

    bare, fill = _rule(rule)
    cfg = load_config(None, [*LEARN, f"bucketing={k}", f"bucket_rule={bare}", f"bucket_fill={str(fill).lower()}",
                             f"epochs={epochs}", "eval_every=1", f"seed={seed}", f"out={out}", "overwrite=true"])
    run_experiment(cfg, progress=False, log=lambda line: None)
    return read_curve(out)


def _rule(rule: str) -> tuple[str, bool]:
    """``optimal`` or ``optimal+fill`` (with ``bucket_fill``): (the boundary rule, fill)."""
    bare, _, fill = rule.partition("+")
    if fill not in ("", "fill"):
        raise SystemExit(f"rule {rule!r}: expected a boundary rule ({', '.join(RULES)}), optionally with '+fill'")
    return bare, fill == "fill"


def classes_per_batch(k: int, rule: str, passes: int = 20) -> float:
    """The mean number of distinct classes in a full batch of the runs' streams: every agent's own
    shard and stream as ``run_experiment`` builds them (k = 1: random batches), ``passes`` passes each."""
    from cdsgd.config import load_config
    from cdsgd.run.experiment import prepare

    bare, fill = _rule(rule)
    cfg = load_config(None, [*LEARN, f"bucketing={k}", f"bucket_rule={bare}", f"bucket_fill={str(fill).lower()}"])
    parts = prepare(cfg)
    counts = []
    for j, (_, y) in enumerate(parts.shards):
        gen = torch.Generator().manual_seed(j)
        if parts.batch_stream is None:
            batches = [b for _ in range(passes) for b in torch.split(torch.randperm(len(y), generator=gen),
                                                                     cfg.batch_size)]
        else:
            stream = parts.batch_stream(j, gen)
            batches = [stream.next() for _ in range(passes * stream.batches_per_epoch)]
        counts += [len(set(y[b].tolist())) for b in batches if len(b) == cfg.batch_size]
    return float(np.mean(counts))


def read_curve(folder) -> tuple:
    """(epoch, test loss, training seconds) per evaluation, from a run folder's metrics.csv."""
    rows = np.atleast_1d(np.genfromtxt(pathlib.Path(folder) / "metrics.csv", delimiter=",", names=True))  # 1: 0-d
    return rows["epoch"], rows["test_loss"], rows["wall_seconds"]


def sweep_curves(folder) -> tuple[dict, float, tuple, tuple, tuple]:
    """The curves of a finished sweep of the settings that learn (experiments/sequences/plaid_buckets.toml):
    ({(buckets, rule, seed): curve}, the unbucketed runs' epochs, bucket counts, rules of the bucketed runs,
    seeds), from its runs. The bucketed runs may train longer (an equal budget of training seconds)."""
    from cdsgd.config import load_config

    curves, epochs = {}, set()
    for cfg_path in sorted(pathlib.Path(folder).glob("*/config.toml")):
        cfg = load_config(cfg_path)
        k = 1 if cfg.bucketing <= 1 else cfg.bucketing
        rule = cfg.bucket_rule + ("+fill" if cfg.bucket_fill else "")
        curves[k, rule if k > 1 else "optimal", cfg.seed] = read_curve(cfg_path.parent)
        if k == 1:
            epochs.add(cfg.epochs)
    if len(epochs) != 1:
        raise SystemExit(f"{folder}: expected unbucketed runs (bucketing=1) of one epoch count, the baseline of the "
                         f"target, found epochs {sorted(epochs)}, bucket counts {sorted({k for k, _, _ in curves})}")
    return (curves, epochs.pop(), tuple(sorted({k for k, _, _ in curves})),
            tuple(sorted({r for k, r, _ in curves if k > 1})), tuple(sorted({s for _, _, s in curves})))


def time_to_loss(epochs: int, buckets, rules, seeds, curves=None) -> None:
    """The table of ``--time-to-loss`` (see the module docstring); ``curves`` given: those, nothing is run."""
    ds = load_dataset("plaid", "data")
    lengths = sequence_lengths(ds.train[0]).numpy()
    cases = [(1, "optimal")] + [(k, r) for k in buckets if k > 1 for r in rules]
    if curves is None:
        curves = {}
        with tempfile.TemporaryDirectory() as tmp:
            for k, rule in cases:
                for seed in seeds:
                    curves[k, rule, seed] = learning_curve(k, rule, seed, epochs, f"{tmp}/{k}-{rule}-{seed}")
                    print(f"# done {k} {rule} seed {seed}", file=sys.stderr, flush=True)
    ep = curves[1, "optimal", seeds[0]][0]
    window = (ep >= 0.7 * epochs) & (ep <= 0.9 * epochs)
    if not window.any():  # too few epochs for a window: the evaluation nearest 80 %
        window = np.arange(len(ep)) == np.argmin(abs(ep - 0.8 * epochs))
    target = float(np.mean([curves[1, "optimal", s][1][window] for s in seeds]))
    print(f"\nTarget test loss {target:.3f}: the unbucketed runs' mean over seeds {list(seeds)} and epochs "
          f"{int(ep[window][0])}..{int(ep[window][-1])} of {epochs}.\n")
    labels = ds.train[1].numpy()
    between = sum((labels == c).sum() * (lengths[labels == c].mean() - lengths.mean()) ** 2 for c in np.unique(labels))
    print(f"Class explains {between / ((lengths - lengths.mean()) ** 2).sum():.3f} of the variance of the length "
          f"(eta squared, training split).\n")
    print("| buckets | rule | padded | classes/batch | epoch s | train s | reached | epochs to target | s to target "
          "| speedup to target | final loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def ms(v, f="{:.2f}"):
        v = np.asarray(v, dtype=float)
        if len(v) == 0:
            return "-"
        return (f + " ± " + f).format(v.mean(), v.std(ddof=1)) if len(v) > 1 else f.format(v[0])

    base = None
    for k, rule in cases:
        bare, fill = _rule(rule)
        batches = list(BucketBatchSampler(lengths, 16, bucket_boundaries(lengths, k, bare), seed=0, fill=fill))
        pad = padded_fraction(lengths, batches)
        per_epoch, total, hit_ep, hit_s, final = [], [], [], [], []
        for seed in seeds:
            e, loss, secs = curves[k, rule, seed]
            per_epoch.append(secs[-1] / e[-1])
            total.append(secs[-1])
            final.append(loss[-1])
            hit = np.flatnonzero(loss <= target)
            if len(hit):
                hit_ep.append(e[hit[0]])
                hit_s.append(secs[hit[0]])
        mean_s = float(np.mean(hit_s)) if hit_s else float("nan")
        base = mean_s if base is None else base
        label = "1 (batch cut to its longest)" if k == 1 else str(k)
        speedup = f"{base / mean_s:.2f}x" if hit_s else "-"
        print(f"| {label} | {rule if k > 1 else '-'} | {pad:.3f} | {classes_per_batch(k, rule):.2f} | "
              f"{ms(per_epoch, '{:.3f}')} | {ms(total, '{:.1f}')} | "
              f"{len(hit_s)}/{len(seeds)} | {ms(hit_ep, '{:.1f}')} | {ms(hit_s)} | {speedup} | "
              f"{ms(final, '{:.3f}')} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["plaid", "synthetic_seq"])
    parser.add_argument("--epochs", type=int, default=8, help="training epochs for the validation loss")
    parser.add_argument("--hidden", type=int, default=32, help="LSTM hidden size (default 32)")
    parser.add_argument("--cost-model", action="store_true",
                        help="only the cost-model table: steps vs padded elements per epoch (seconds)")
    parser.add_argument("--time-to-loss", action="store_true",
                        help="only the time-to-target-loss table on PLAID, the settings that learn (see above)")
    parser.add_argument("--buckets", type=int, nargs="+", default=[4, 8, 16],
                        help="--time-to-loss: bucket counts besides the unbucketed baseline")
    parser.add_argument("--rules", nargs="+", default=list(RULES),
                        help="--time-to-loss: boundary rules, each optionally with '+fill' (bucket_fill=true), "
                             "e.g. optimal optimal+fill")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="--time-to-loss: seeds")
    parser.add_argument("--from-sweep", metavar="DIR",
                        help="the --time-to-loss table from a finished sweep of "
                             "experiments/sequences/plaid_buckets.toml in DIR (no runs)")
    args = parser.parse_args(argv)
    if args.from_sweep:
        curves, epochs, buckets, rules, seeds = sweep_curves(args.from_sweep)
        print(f"# benchmarks/bucketing.py --from-sweep {args.from_sweep}  unbucketed runs of {epochs:g} epochs, "
              f"buckets {list(buckets)}, rules {list(rules)}, seeds {list(seeds)}")
        time_to_loss(epochs, [k for k in buckets if k > 1], rules, seeds, curves)
        return 0
    if args.time_to_loss:
        torch.set_num_threads(1)  # two threads on two busy cores were measured 10-50x slower
        print(f"# benchmarks/bucketing.py --time-to-loss  {datetime.datetime.now():%Y-%m-%d %H:%M}  "
              f"torch {torch.__version__}  threads 1  {' '.join(LEARN)}, {args.epochs} epochs")
        time_to_loss(args.epochs, args.buckets, args.rules, args.seeds)
        return 0
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"# benchmarks/bucketing.py  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}  LSTM hidden {args.hidden}, batch {BATCH}, "
          f"{args.epochs} epochs for the validation columns")
    for name in args.datasets:
        ds = load_dataset(name, "data")
        lengths = sequence_lengths(ds.train[0]).numpy()
        print(f"\n## {name}: {len(lengths)} training sequences, lengths {lengths.min()}..{lengths.max()} "
              f"(mean {lengths.mean():.0f}), {ds.n_classes} classes, {ds.input_shape[1] - 1} channel(s)\n")
        if args.cost_model:
            cost_model(ds, lengths, args.hidden)
            continue
        print("| buckets | rule | boundaries | padded | epoch s | speedup vs fixed | vs trimmed | val loss | val acc |")
        print("|---|---|---|---|---|---|---|---|---|")

        def validation(k, trim=True):
            """Mean ± sd over SEEDS of the test loss and accuracy after args.epochs epochs."""
            rows = []
            for seed in SEEDS:
                sim = simulator(ds, lengths, k, "optimal", args.hidden, trim=trim, seed=seed)
                rows.append(sim.run(epochs=args.epochs, eval_every_steps=args.epochs * sim.steps_per_epoch)[-1])
            loss, acc = (np.array([r[key] for r in rows]) for key in ("test_loss", "test_accuracy"))
            return f"{loss.mean():.3f} ± {loss.std(ddof=1):.3f} | {acc.mean():.3f} ± {acc.std(ddof=1):.3f}"

        # the fixed-shape baseline: no bucketing, every batch padded to the data set's longest sequence
        fixed = epoch_seconds(simulator(ds, lengths, 1, "optimal", args.hidden, trim=False))
        pad = 1 - lengths.mean() / ds.input_shape[0]
        val = validation(1, trim=False)
        print(f"| none, fixed length | - | {ds.input_shape[0]} | {pad:.3f} | {fixed:.2f} | 1.00x | | {val} |",
              flush=True)
        base = None
        for k in BUCKETS:
            for rule in RULES if k > 1 else ("optimal",):
                bounds = bucket_boundaries(lengths, k, rule)
                batches = list(BucketBatchSampler(lengths, BATCH, bounds, seed=0))
                pad = padded_fraction(lengths, batches)
                secs = epoch_seconds(simulator(ds, lengths, k, rule, args.hidden))
                base = secs if base is None else base
                val = validation(k) if rule == "optimal" else "| "
                shown = ",".join(map(str, bounds)) if len(bounds) <= 8 else f"{len(bounds)} bounds"
                label = "1 (batch cut to its longest)" if k == 1 else str(k)
                print(f"| {label} | {rule if k > 1 else '-'} | {shown} | {pad:.3f} | {secs:.2f} | "
                      f"{fixed / secs:.2f}x | {base / secs:.2f}x | {val} |", flush=True)
        print("\n| LSTM | buckets | epoch s | packed/padded time |")
        print("|---|---|---|---|")
        for k in (1, 8):
            t = {p: epoch_seconds(simulator(ds, lengths, k, "optimal", args.hidden, packed=p)) for p in (True, False)}
            print(f"| packed | {k} | {t[True]:.2f} | {t[True] / t[False]:.2f} |")
            print(f"| padded | {k} | {t[False]:.2f} | 1 |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
