"""``cdsgd data``: how a data set splits among agents (a class histogram; for a text corpus, sources and bytes)."""

from __future__ import annotations

import argparse


def _add_data(sub) -> None:
    from ..config import key_info

    p = sub.add_parser(
        "data",
        help="show how a data set splits among agents",
        description="Load a data set and print each agent's shard size and class histogram under a partition.\n"
        "For a text corpus (fortunes, python_code; with its default options: context 128, val_fraction 0.1,\n"
        "seed 0): documents, bytes and windows of the training and validation splits, the sources, and per\n"
        "agent its windows, its top sources and the Jensen-Shannon divergence (bits) of its byte histogram\n"
        "from the whole training set's, and their mean (dirichlet and classes split by source, iid by window).",
        epilog="examples:\n  cdsgd data digits --agents 5 --partition classes\n"
        "  cdsgd data fortunes --agents 8 --partition dirichlet --alpha 0.1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dataset", metavar="DATASET", help=key_info("dataset")["help"])
    p.add_argument("--agents", type=int, default=5, help="number of agents (default 5)")
    p.add_argument("--partition", default="iid", help="iid, classes or dirichlet (default iid)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (default 0.5)")
    p.add_argument("--min-size", type=int, default=10, help="dirichlet: least samples per agent (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the partition's random draws (default 0)")
    p.add_argument("--data-dir", default="data", help="where data files are looked for (default: data)")
    p.add_argument("--download", action="store_true", help="download missing files (SHA-256 verified)")
    p.set_defaults(func=_cmd_data)


def _cmd_data(args) -> int:
    from ..data import CORPORA, class_histogram, load_dataset, partition

    if args.dataset in CORPORA:
        return _data_text(args)
    ds = load_dataset(args.dataset, args.data_dir, download=args.download)
    labels = ds.train[1].numpy()
    shards = partition(labels, args.agents, args.partition, seed=args.seed, alpha=args.alpha,
                       min_size=args.min_size)
    hist = class_histogram(labels, shards, ds.n_classes)
    print(f"{ds.name}: {len(labels)} training and {len(ds.test[1])} test samples, {ds.n_classes} classes, "
          f"input {tuple(ds.input_shape)}; partition {args.partition} among {args.agents} agents")
    width = max(5, len(str(int(hist.max()))) + 1)
    print("agent   size  " + "".join(f"{c:>{width}}" for c in range(ds.n_classes)))
    for j, (s, h) in enumerate(zip(shards, hist)):
        print(f"{j:>5} {len(s):>6}  " + "".join(f"{int(v):>{width}}" for v in h))
    unused = len(labels) - sum(len(s) for s in shards)
    if unused:
        print(f"({unused} samples unused)")
    return 0


def _data_text(args) -> int:
    """``cdsgd data CORPUS``: the document split, the sources, and what each agent holds."""
    import textwrap

    import numpy as np

    from ..data import byte_divergence, class_histogram, partition, read_corpus, split_documents, text_dataset

    corpus = read_corpus(args.dataset)
    ds = text_dataset(corpus)
    is_val = split_documents(corpus)
    sizes = np.array([len(d) for d in corpus.documents])
    print(f"{ds.name}: byte-level text (vocabulary {ds.n_classes}), context {ds.input_shape[0]}, "
          f"{len(ds.group_names)} sources")
    print(f"{'split':<10} {'documents':>9} {'bytes':>10} {'windows':>8}")
    for split, mask, n in (("training", ~is_val, len(ds.train[1])), ("validation", is_val, len(ds.test[1]))):
        print(f"{split:<10} {int(mask.sum()):>9} {int(sizes[mask].sum()):>10} {n:>8}")
    groups = ds.partition_labels.numpy()
    per_source = np.bincount(groups, minlength=len(ds.group_names))
    print(textwrap.fill("sources (training windows): " + ", ".join(
        f"{name} {int(n)}" for name, n in zip(ds.group_names, per_source)), width=110, subsequent_indent="  "))
    shards = partition(groups, args.agents, args.partition, seed=args.seed, alpha=args.alpha, min_size=args.min_size)
    hist = class_histogram(groups, shards, len(ds.group_names))
    js = byte_divergence(ds, shards)
    alpha = f" (alpha {args.alpha:g})" if args.partition == "dirichlet" else ""
    print(f"partition {args.partition}{alpha} among {args.agents} agents (JS bits: the Jensen-Shannon divergence "
          "of an agent's byte histogram from the whole training set's)")
    print("agent  windows  JS bits  top sources")
    for j, (s, h) in enumerate(zip(shards, hist)):
        top = [k for k in np.argsort(-h, kind="stable")[:3] if h[k]]
        print(f"{j:>5} {len(s):>8}  {js[j]:.5f}  " + ", ".join(f"{ds.group_names[k]} {h[k] / len(s):.0%}" for k in top))
    print(f"mean JS divergence {np.nanmean(js):.5f} bits")
    unused = len(groups) - sum(len(s) for s in shards)
    if unused:
        print(f"({unused} windows unused)")
    return 0
