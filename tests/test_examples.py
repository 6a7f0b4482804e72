"""Every ``cdsgd`` example in ``--help``, the README and docs/ runs (issue 16, item 1).

The examples are extracted from the text users read: each verb's ``--help``
epilog and the shell code blocks of README.md and docs/*.md. Cheap ones run
for real (``topo``, ``data`` on bundled data, ``--help``); the others are
dry-run from the repository root through the same code path up to the
point where work would start: ``run`` with ``--print-config`` (the config,
graph files, model options and algorithm are validated), ``launch
--dry-run`` (the process layout too), ``sweep --dry-run`` (the sweep file
expands); ``plot``/``export``/``sweep --collect`` need a folder an earlier
command makes, so their arguments are parsed only.
"""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from cdsgd import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: data sets that need no file from outside the package
BUNDLED = {"digits", "synthetic"}


def _help_examples() -> list[tuple[str, str]]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.choices and "run" in a.choices)
    found = []
    for verb, p in sub.choices.items():
        epilog = p.epilog or ""
        for line in epilog.splitlines():
            line = line.strip()
            if line.startswith("example:"):
                line = line[len("example:"):].strip()
            if line.startswith("cdsgd "):
                found.append((f"cdsgd {verb} --help", line))
    return found


def _doc_examples() -> list[tuple[str, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("experiments/**/*.md"))]:
        text = path.read_text()
        for block in re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", text, flags=re.S):
            block = block.replace("\\\n", " ")
            for line in block.splitlines():
                for part in line.split("&&"):
                    part = part.split("|")[0].strip()
                    part = part[2:] if part.startswith("$ ") else part
                    words = part.split()
                    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # OMP_NUM_THREADS=1 cdsgd ...
                        words = words[1:]
                    part = " ".join(words)
                    if not words or words[0] != "cdsgd":
                        continue
                    if len(words) > 1 and (words[1].endswith(":") or words[2:3] and words[2].startswith("(")):
                        continue  # output shown in a block ("cdsgd run: error: ...", "cdsgd run (rank 0): ...")
                    if any(w.startswith("[") for w in words):
                        continue  # a synopsis ("cdsgd run [CONFIG.toml] [key=value ...]"), not an example
                    found.append((str(path.relative_to(ROOT)), part))
    return found


EXAMPLES = sorted(set(_help_examples() + _doc_examples()))


def test_examples_are_found():
    """The extraction finds the examples (a change of format must not make this file test nothing)."""
    where = {w for w, _ in EXAMPLES}
    assert "README.md" in where and "cdsgd launch --help" in where and "cdsgd run --help" in where
    assert len(EXAMPLES) >= 40, EXAMPLES


def _dry(argv: list[str], tmp_path) -> list[str] | None:
    """The argument list that checks ``argv`` without doing the work, or None to parse it only."""
    verb = argv[0] if argv else ""
    if "--help" in argv or "-h" in argv or "--version" in argv or verb not in cli.build_parser()._subparsers._group_actions[0].choices:
        return argv
    if verb == "run":
        return argv + ["--print-config"]
    if verb == "launch":
        return argv + ["--dry-run"]
    if verb == "sweep":
        return None if "--collect" in argv else argv + ["--dry-run"]
    if verb == "topo":
        return [a if not a.endswith(".png") else str(tmp_path / "g.png") for a in argv]
    if verb == "data":
        return argv if argv[1] in BUNDLED else None
    return None  # plot, export: they need a folder made by an earlier command


@pytest.mark.parametrize("where,command", EXAMPLES, ids=[f"{w}: {c}" for w, c in EXAMPLES])
def test_example_runs(where, command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    argv = shlex.split(command, comments=True)[1:]
    dry = _dry(argv, tmp_path)
    if dry is None:
        args = cli.build_parser().parse_args(argv)  # parses, or exits 2
        for value in vars(args).values():  # files it names that are in the repository must exist
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, str) and v.startswith(("experiments/", "docs/")):
                    assert (ROOT / v).exists(), f"{where}: {command!r} names {v}, which does not exist"
        return
    try:
        code = cli.main(dry)
    except SystemExit as e:  # --help, --version
        code = e.code
    out = capsys.readouterr()
    assert code == 0, f"{where}: {command!r} exits {code}: {out.err.strip()[-500:]}"


def test_data_help_names_every_data_set(capsys):
    """``cdsgd data --help`` lists every registered data set, the sequence ones included."""
    from cdsgd.data import DATASETS

    with pytest.raises(SystemExit):
        cli.main(["data", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    missing = [name for name in DATASETS if name not in text]
    assert not missing, missing
    assert "seed of the partition" in text  # --seed has its help
