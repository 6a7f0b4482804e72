"""``cdsgd topo``: describe a topology (or a time-varying schedule) and its mixing matrix."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def _parse_params(pairs: Sequence[str]) -> dict:
    """``--param KEY=VALUE`` pairs, each value read as a config override's is (a TOML value, else the text)."""
    from ..config import parse_override

    params = {}
    for pair in pairs:
        try:
            key, value = parse_override(pair)
        except ValueError:
            raise ValueError(f"--param expects KEY=VALUE, got {pair!r}") from None
        params[key] = value
    return params


# --------------------------------------------------------------------- topo


def _add_topo(sub) -> None:
    import topologies

    p = sub.add_parser(
        "topo",
        help="describe a topology and its mixing matrix",
        description="Build a named topology (or read a graph file), compute its mixing matrix, and print "
        "n, edge count, degree range, diameter, the second-largest eigenvalue modulus and the spectral gap "
        "(and the matrix itself for n <= 16). For a time-varying schedule: its period, the rate at which a "
        "period contracts the distance to the average, each W_k and their product (with --json, or n <= 16).",
        epilog=f"topologies: {', '.join(topologies.BUILDERS.names())}\n"
        f"time-varying schedules: {', '.join(topologies.SCHEDULES.names())}\n"
        f"graph files: {', '.join(topologies.FORMATS)}\n"
        f"rules: {', '.join(topologies.RULES.names())}\n"
        "example: cdsgd topo erdos_renyi --n 16 --param p=0.3 --param seed=1 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("topology", metavar="NAME_OR_PATH", help="builder or schedule name, or graph file path")
    p.add_argument("--n", type=int, default=None, help="number of nodes (required for builder names)")
    p.add_argument("--rule", default=None,
                   help="weight rule, the config's mixing (default: metropolis; a schedule has its own weights)")
    p.add_argument("--param", "-p", action="append", default=[], metavar="KEY=VALUE",
                   help="builder parameter, e.g. p=0.3, seed=1, rows=4 (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--draw", metavar="FILE.png", default=None, help="save a picture of the graph with its weights")
    p.set_defaults(func=_cmd_topo)


def _weights_caption(rule: str) -> str:
    """How a drawing's title names the weights of ``rule``: ``'metropolis weights'``, and for the rule that
    takes them from the graph ``'weights as given'`` (not ``'weight weights'``).

    >>> _weights_caption("lazy_metropolis"), _weights_caption("weight")
    ('lazy_metropolis weights', 'weights as given (mixing=weight)')
    """
    return "weights as given (mixing=weight)" if rule == "weight" else f"{rule} weights"


def _warn(lines) -> int:
    """A topology's warnings (:func:`topologies.mixing_warnings`) on stderr after its description, as a run
    prints them; returns the exit status, 0 (a warning is no error)."""
    sys.stdout.flush()
    for line in lines:
        print(f"warning: {line}", file=sys.stderr)
    return 0


#: the text output prints matrices of at most this many nodes (16 columns of 7 characters fit a terminal);
#: a display limit only: how W is stored is topologies.DENSE_UP_TO's business
PRINT_UP_TO = 16


def _format_matrix(W) -> str:
    W = W.toarray() if hasattr(W, "toarray") else W
    return "\n".join("  " + " ".join(f"{x:6.3f}" for x in row) for row in W)


def _cmd_topo(args) -> int:
    import topologies

    params = _parse_params(args.param)
    # the reading `cdsgd run` gives topology=..., mixing=... (cdsgd.run.plan): the same graph and W
    G, W = topologies.graph_and_mixing(args.topology, args.n, args.rule, **params)
    if isinstance(W, topologies.Schedule):
        return _topo_schedule(args, params, W)
    rule = args.rule or "metropolis"
    info = {"topology": str(args.topology), "params": params, "rule": rule,
            **topologies.describe(G, W, matrix=args.json)}
    if args.draw:
        from ..report.plotting import draw_topology

        given = ", ".join([f"n={info['n']}"] + [f"{k}={v}" for k, v in params.items()])
        draw_topology(G, W, args.draw, title=f"{args.topology} ({given}), {_weights_caption(rule)}")
    if args.json:
        print(json.dumps(info))
        return _warn(info["warnings"])
    print(f"topology      {info['topology']}" + (f" {params}" if params else ""))
    print(f"n             {info['n']}")
    print(f"edges         {info['edges']}")
    print(f"degree        {info['degree_min']}..{info['degree_max']}")
    print(f"diameter      {info['diameter']}")
    if info["draw"] is not None:
        print(f"draw          seed {info['draw']['seed']} after {info['draw']['redraws']} redraw(s) "
              "(a disconnected draw is redrawn; this seed alone gives this graph)")
    print(f"rule          {info['rule']}")
    print(f"lambda2       {info['lambda2']:.10g}   (second-largest eigenvalue modulus)")
    print(f"spectral gap  {topologies.format_gap(info['spectral_gap'], 6)}")
    print(f"effective neighbours  {info['effective_neighbours']:.4g}   (n_W at decay {topologies.EFFECTIVE_DECAY}; "
          "Vogels et al. 2022)")
    if info["n"] <= PRINT_UP_TO:
        print("mixing matrix")
        print(_format_matrix(W))
    if args.draw:
        print(f"drawing       {args.draw}")
    return _warn(info["warnings"])


def _topo_schedule(args, params, s) -> int:
    """``cdsgd topo`` for a time-varying schedule ``s``: period, rate, the matrices and their product."""
    import topologies

    if args.draw:
        raise ValueError("--draw draws one graph; a schedule has one per step (use --json for its matrices)")
    gap = topologies.spectral_gap(s)
    info = {"topology": args.topology, "params": params, "schedule": True, "n": s.n, "period": len(s),
            "symmetric": s.symmetric, "consensus_rate": s.consensus_rate(), "lambda2": gap.lambda2,
            "spectral_gap": gap.gap, "effective_neighbours": topologies.effective_neighbours(s),
            "warnings": topologies.mixing_warnings(s, gap)}
    if args.json:
        dense = [W.toarray() if hasattr(W, "toarray") else W for W in s]
        info["matrices"] = [W.tolist() for W in dense]
        info["product"] = s.product().tolist()
        print(json.dumps(info))
        return _warn(info["warnings"])
    print(f"schedule        {args.topology}" + (f" {params}" if params else ""))
    print(f"n               {s.n}")
    print(f"period          {len(s)} steps (W_k = W_(k mod {len(s)}))")
    print(f"symmetric       {'yes' if info['symmetric'] else 'no'}")
    print(f"consensus rate  {info['consensus_rate']:.6g}   (||W_(T-1)...W_0 - 11^T/n||_2 over a period; 0: exact "
          "average)")
    print(f"spectral gap    {topologies.format_gap(gap.gap, 6)}   (per-step equivalent: 1 - rate^(1/period))")
    print(f"effective neighbours  {info['effective_neighbours']:.4g}   (n_W at decay {topologies.EFFECTIVE_DECAY})")
    if s.n <= PRINT_UP_TO:
        for k, W in enumerate(s):
            print(f"W_{k}")
            print(_format_matrix(W))
        print("product over a period")
        print(_format_matrix(s.product()))
    return _warn(info["warnings"])
