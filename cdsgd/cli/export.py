"""``cdsgd export``: write a run's trained model (one agent, or the average of all) as a ``state_dict``."""

from __future__ import annotations

import argparse

__all__: list[str] = []

EXAMPLES = """\
examples:
  cdsgd run epochs=1 save_params=true out=runs/demo --no-progress
  cdsgd export runs/demo -o average.pt
  cdsgd export runs/demo --agent 2 -o agent2.pt
then, in Python:
  import torch, cdsgd.models
  model = cdsgd.models.build_model("mlp", (1, 8, 8), 10)      # the run's model, input shape, classes
  model.load_state_dict(torch.load("average.pt", weights_only=True))
docs: docs/running.md (Exporting a model)"""


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's trained model (an agent's or the average) as a state_dict",
        description="Rebuild the model of a run folder from its config.toml, load the final parameters of one "
        "agent (--agent J) or their average over all agents (--average; the default when neither is given) "
        "from its params.pt (written by runs with save_params=true), and save the model's state_dict with "
        "torch.save. It loads into cdsgd.models.build_model(model, input_shape, n_classes, **model_params) with "
        "the run's model and model_params and its data set's input shape and class count (the data set is "
        "loaded once to learn them, from the run's data_dir relative to the working directory).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder holding config.toml and params.pt")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--agent", type=int, default=None, metavar="J", help="agent J's parameters (0..n_agents-1)")
    which.add_argument("--average", action="store_true",
                       help="the average of all agents' parameters (the default)")
    p.add_argument("-o", "--out", required=True, metavar="FILE.pt", help="where to write the state_dict")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args) -> int:
    from ..config import load_config
    from ..report.export import save_model
    from ..models import n_parameters

    model = save_model(args.run_dir, args.out, agent=args.agent, average=args.average)
    cfg = load_config(f"{args.run_dir}/config.toml")
    which = f"agent {args.agent}" if args.agent is not None else f"the average of {cfg.n_agents} agents"
    print(f"wrote {args.out}: model {cfg.model!r} ({n_parameters(model)} parameters), {which}, from {args.run_dir}")
    return 0
