r"""Why MGRIT training failed on long sequences: monitors recorded along one training run.

Run::

    python benchmarks/mgrit_diagnose.py --train mgrit  --out mgrit.csv    # the failing run (before the fix)
    python benchmarks/mgrit_diagnose.py --train serial --out serial.csv   # the same monitors on serial's path
    python benchmarks/mgrit_diagnose.py --plot mgrit.csv serial.csv --png diagnose.png

The task of ``benchmarks/mgrit.py --tables training``'s long row (synthetic_seq,
256 sequences of mean length 1000, lengths 200–4000; ``pgru`` hidden 32;
momentum SGD lr 0.3, μ 0.9, clipping 1, batch 16, 30 epochs), trained by a
plain loop that follows either MGRIT's gradients (``--train mgrit``) or the
serial loop's (``--train serial``). Defaults reproduce the configuration that
failed: cf 8, 3 fixed FCF iterations, backward-Euler coarse step, no
tolerance and no fall-back (``--rtol``, ``--fallback``, ``--coarse``,
``--iters`` change it). At every step, on that step's batch:

* ``cos``, ``norm_ratio``, ``rel_err``: MGRIT's parameter gradient against
  the serial loop's (:func:`cdsgd.mgrit.gradient_error`);
* ``fwd_res0``/``fwd_res``, ``bwd_res0``/``bwd_res``: the C-point residual
  max-norm before the first and after the last iteration, forward and adjoint;

and every 2 epochs, from the exact (serial) states of the batch:

* ``coarse_err``: ‖Φ_c(h_{kc}) − h_{(k+1)c}‖ / ‖h_{(k+1)c}‖, how well one coarse
  step predicts c fine ones (backward Euler, the configuration's coarse step);
* ``fine_growth``/``coarse_growth``: how much a small perturbation of h_{kc}
  grows over c fine steps / over one coarse step (mean over intervals and
  sequences; below 1 the dynamics forget within an interval);
* ``jac_mean``/``jac_max``: the spectral norm of the per-step Jacobian
  ∂Φ_1/∂h along the trajectory (every 7th step; above 1 the dynamics expand);
* ``test_acc_serial``: the test accuracy with the serial recurrence.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time

import _common  # noqa: F401 - the repository on sys.path first

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cdsgd.data import load_dataset  # noqa: E402
from cdsgd.mgrit import gradient_error, implicit_gru_step  # noqa: E402
from cdsgd.models import build_model  # noqa: E402

BATCH, EPOCH_STEPS = 16, 16


def dynamics(cell, x, cf, coarse):
    """The coarse-step error and the perturbation growth of fine and coarse steps, from the serial states."""
    with torch.no_grad():
        lengths = (x[:, :, 0] > 0).sum(1)
        T = int(lengths.max()) // cf * cf
        xp = cell.project(x[:, :T, 1:]).transpose(0, 1)                 # (T, B, 3H)
        whh, bhh = cell.weight_hh, cell.bias_hh
        h = [torch.zeros(x.shape[0], cell.hidden_size)]
        for t in range(T):
            h.append(implicit_gru_step(h[-1], xp[t], whh, bhh))
        u = torch.stack(h)                                               # (T+1, B, H)
        start, land = u[0:-1:cf], u[cf::cf]
        xc = xp[cf - 1::cf]                                              # the coarse step's input (landing point)
        out = {"coarse_err": float((implicit_gru_step(start, xc, whh, bhh, float(cf), coarse) - land).norm()
                                   / land.norm())}
        d = torch.randn_like(start)
        d = 1e-4 * d / d.norm(dim=-1, keepdim=True)
        a, b = start + d, start.clone()
        xpv = xp.view(T // cf, cf, *xp.shape[1:])
        for i in range(cf):
            a, b = (implicit_gru_step(v, xpv[:, i], whh, bhh) for v in (a, b))
        out["fine_growth"] = float(((a - b).norm(dim=-1) / 1e-4).mean())
        a, b = (implicit_gru_step(v, xc, whh, bhh, float(cf), coarse) for v in (start + d, start))
        out["coarse_growth"] = float(((a - b).norm(dim=-1) / 1e-4).mean())
    ts = torch.arange(0, T, 7)
    step = torch.func.jacrev(lambda hh, aa: implicit_gru_step(hh, aa, whh.detach(), bhh.detach()))
    J = torch.func.vmap(step)(u[ts].reshape(-1, cell.hidden_size), xp[ts].reshape(-1, xp.shape[-1]))
    sv = torch.linalg.matrix_norm(J, ord=2)
    out.update(jac_mean=float(sv.mean()), jac_max=float(sv.max()))
    return out


def train(args) -> list[dict]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ds = load_dataset("synthetic_seq", "data", n_train=256, n_test=128, mean_length=1000.0, min_length=200,
                      max_length=4000)
    model = build_model("pgru", ds.input_shape, ds.n_classes, hidden=32, mode="mgrit", cf=args.cf, iters=args.iters,
                        rtol=args.rtol, fallback=args.fallback, coarse=args.coarse)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    X, Y = ds.train
    gen = torch.Generator().manual_seed(1)
    rows, t0 = [], time.time()
    for k in range(args.epochs * EPOCH_STEPS + 1):
        idx = torch.randint(len(X), (BATCH,), generator=gen)
        x, y = X[idx], Y[idx]
        row = {"step": k, "epoch": k / EPOCH_STEPS}
        err = gradient_error(model, lambda: F.cross_entropy(model(x), y))
        res = model.rnn.last_residuals  # of the MGRIT pass (gradient_error runs MGRIT first)
        row.update(cos=err["cosine"], norm_ratio=err["norm_ratio"], rel_err=err["rel_error"],
                   loss_mgrit=err["loss_mgrit"], loss_serial=err["loss_serial"])
        for d in ("forward", "backward"):
            norms = res.get(d) or [float("nan")]
            row.update({f"{d[:3].replace('bac', 'bwd').replace('for', 'fwd')}_res0": norms[0],
                        f"{d[:3].replace('bac', 'bwd').replace('for', 'fwd')}_res": norms[-1]})
        if k % (2 * EPOCH_STEPS) == 0:
            row.update(dynamics(model.rnn.cell, x, args.cf, args.coarse))
            model.eval()
            mode, model.rnn.mode = model.rnn.mode, "serial"
            with torch.no_grad():
                pred = torch.cat([model(t).argmax(1) for t in ds.test[0].split(64)])
            model.rnn.mode = mode
            model.train()
            row["test_acc_serial"] = float((pred == ds.test[1]).float().mean())
        rows.append(row)
        if k == args.epochs * EPOCH_STEPS:
            break
        model.zero_grad()
        model.rnn.mode = args.train
        F.cross_entropy(model(x), y).backward()
        model.rnn.mode = "mgrit"
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if k % EPOCH_STEPS == 0:
            print(f"{time.time() - t0:6.0f} s  epoch {k // EPOCH_STEPS:2d}  cos {row['cos']:+.3f}  "
                  f"norm ratio {row['norm_ratio']:.3g}  forward residual {row['fwd_res']:.2g}", flush=True)
    return rows


def plot(paths, png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for p in paths:
        with open(p, newline="") as f:
            runs[p] = [{k: float(v) if v else float("nan") for k, v in r.items()} for r in csv.DictReader(f)]
    labels = {p: ("trained with MGRIT" if "mgrit" in p else "on serial training's path") for p in paths}
    plt.rcParams.update({"font.size": 8})
    fig, axes = plt.subplots(2, 2, figsize=(6.6, 4.8), sharex=True, constrained_layout=True)
    for (p, rows), color in zip(runs.items(), ("C0", "C1")):
        ep = [r["epoch"] for r in rows]
        axes[0, 0].plot(ep, [r["cos"] for r in rows], color=color, lw=0.7, label=labels[p])
        axes[0, 1].semilogy(ep, [r["fwd_res"] for r in rows], color=color, lw=0.7, label=f"forward, {labels[p]}")
        axes[0, 1].semilogy(ep, [r["bwd_res"] / max(r["bwd_res0"], 1e-30) for r in rows], ":", color=color, lw=0.7,
                            label=f"adjoint (relative), {labels[p]}")
        sub = [r for r in rows if r["coarse_err"] == r["coarse_err"]]
        e2 = [r["epoch"] for r in sub]
        axes[1, 0].plot(e2, [r["test_acc_serial"] for r in sub], "-o", color=color, ms=3, label=labels[p])
        if "serial" in p:
            for key, mark, name in (("coarse_err", "o", "coarse-step error (relative)"),
                                    ("fine_growth", "s", "perturbation growth over c fine steps"),
                                    ("jac_mean", "v", "mean ‖∂Φ₁/∂h‖₂ per step"),
                                    ("jac_max", "^", "max ‖∂Φ₁/∂h‖₂ per step")):
                axes[1, 1].plot(e2, [r[key] for r in sub], "-" + mark, ms=3, lw=0.8, label=name)
            axes[1, 1].axhline(1.0, color="grey", lw=0.5)
    axes[0, 0].set(ylabel="gradient cosine, MGRIT vs serial", ylim=(-1.05, 1.05))
    axes[0, 1].set(ylabel="residual after 3 iterations", ylim=(1e-6, 1e6))
    axes[1, 0].set(ylabel="test accuracy (serial states)", xlabel="epoch")
    axes[1, 1].set(ylabel="dynamics on serial's path", xlabel="epoch")
    for ax in axes.flat:
        ax.legend(fontsize=6, frameon=False)
        ax.grid(alpha=0.3, lw=0.4)
    fig.savefig(png, dpi=150)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", choices=("serial", "mgrit"), default="mgrit", help="whose gradients the run follows")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--cf", type=int, default=8)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rtol", type=float, default=0.0, help="0: fixed iterations (the failing configuration)")
    p.add_argument("--fallback", action="store_true")
    p.add_argument("--coarse", default="euler")
    p.add_argument("--out", help="CSV of the per-step monitors")
    p.add_argument("--plot", nargs="+", metavar="CSV", help="draw these CSVs (instead of training)")
    p.add_argument("--png", default="mgrit_diagnose.png")
    args = p.parse_args(argv)
    if args.plot:
        plot(args.plot, args.png)
        return 0
    if not args.out:
        p.error("--out is needed to train")
    rows = train(args)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
