"""cdsgd.data.corpora and cdsgd.data.text: byte-level corpora, the document split, windows, bigram floor.

Expected values are computed here independently: fortune files split by
hand, counts by Python loops, divergences by explicit sums. Tests of the
fortunes corpus skip when Debian's ``fortunes`` package is not installed,
unless CDSGD_REQUIRE_FORTUNES=1 (CI) makes its absence a failure.
"""

from __future__ import annotations

import math
import os
import re
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from cdsgd import cli
from cdsgd.data import (Corpus, Dataset, bigram_loss, byte_divergence, byte_windows, check_data, load_dataset,
                        partition, read_corpus, split_documents, text_dataset)
from cdsgd.data import corpora
from cdsgd.run import plan

REQUIRE_FORTUNES = os.environ.get("CDSGD_REQUIRE_FORTUNES") == "1"


def _fortune_files() -> list[Path]:
    folder = corpora.FORTUNES_DIR
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink()
                   and p.suffix not in (".dat", ".u8")) if folder.is_dir() else []
    if not files:
        if REQUIRE_FORTUNES:
            pytest.fail(f"CDSGD_REQUIRE_FORTUNES=1 but {folder} holds no fortune files")
        pytest.skip(f"Debian's fortunes corpus is not installed at {folder} (apt-get install fortunes)")
    return files


@pytest.fixture(scope="module")
def fortune_files() -> list[Path]:
    return _fortune_files()


@pytest.fixture(scope="module")
def small_fortunes(fortune_files) -> Dataset:
    """600 kB of fortunes in windows of 64 bytes."""
    return load_dataset("fortunes", context=64, max_bytes=600_000, seed=1)


def toy_corpus() -> Corpus:
    """Two sources with disjoint alphabets (lower case, upper case), five documents each."""
    lower = [b"the quick brown fox", b"jumps over", b"the lazy dog and", b"runs far away", b"into the woods"]
    upper = [b"LOREM IPSUM DOLOR", b"SIT AMET", b"CONSECTETUR ADIPISCING", b"ELIT SED DO", b"EIUSMOD TEMPOR"]
    return Corpus("toy", tuple(lower + upper), (0,) * 5 + (1,) * 5, ("lower", "upper"), b"\n")


# --------------------------------------------------------------------------- #
# Windows, split, groups
# --------------------------------------------------------------------------- #


def test_windows_have_stride_t_and_targets_shifted_by_one():
    data = bytes(range(10, 60))  # 50 bytes
    for t in (1, 3, 7, 49, 50):
        x, y = byte_windows(data, t)
        n = (len(data) - 1) // t
        assert x.shape == y.shape == (n, t) and x.dtype == y.dtype == torch.int64
        for i in range(n):  # an explicit loop: window i starts at byte i*t
            assert x[i].tolist() == list(data[i * t:i * t + t])
            assert y[i].tolist() == list(data[i * t + 1:i * t + t + 1])
        # every byte but the first is a target exactly once, in order
        assert y.flatten().tolist() == list(data[1:n * t + 1])


def test_split_is_by_whole_document_with_one_training_document_per_source_at_least():
    corpus = Corpus("c", tuple(bytes([65 + i]) * 5 for i in range(23)), (0,) * 20 + (1,) * 2 + (2,),
                    ("a", "b", "c"), b"\n")
    is_val = split_documents(corpus, val_fraction=0.1, seed=3)
    src = np.array(corpus.sources)
    # ⌈0.1 · 23⌉ = 3 documents; shares 60/23, 6/23, 3/23 give 2, 0, 0 and the largest remainder (source 0) one more
    assert [int(is_val[src == s].sum()) for s in range(3)] == [3, 0, 0]
    # ⌈0.9 · 23⌉ = 21 > the 20 that may go: each source keeps one document in training
    assert [int(split_documents(corpus, val_fraction=0.9, seed=3)[src == s].sum()) for s in range(3)] == [19, 1, 0]
    # small sources give their share: 30 sources of two documents, f = 0.25 → ⌈15⌉ documents, one from each of 15
    pairs = Corpus("p", tuple(bytes([i, j]) for i in range(30) for j in range(2)), tuple(i for i in range(30) for _ in range(2)),
                   tuple(f"s{i:02d}" for i in range(30)), b"\n")
    assert split_documents(pairs, val_fraction=0.25).sum() == 15
    assert (split_documents(corpus, val_fraction=0.1, seed=3) == is_val).all()
    assert any((split_documents(corpus, val_fraction=0.1, seed=s) != is_val).any() for s in range(4, 10))


def test_windows_are_exactly_the_documents_of_their_split_and_source():
    corpus = toy_corpus()
    ds = text_dataset(corpus, context=4, val_fraction=0.4, seed=2)
    is_val = split_documents(corpus, val_fraction=0.4, seed=2)
    for (x, y), val in ((ds.train, False), (ds.test, True)):
        expected_x, expected_y = [], []
        for s in range(2):  # the stream of each source, built here from the documents' identities
            stream = b"".join(corpus.documents[i] + b"\n" for i in range(10)
                              if corpus.sources[i] == s and is_val[i] == val)
            n = (len(stream) - 1) // 4
            expected_x += [list(stream[4 * i:4 * i + 4]) for i in range(n)]
            expected_y += [list(stream[4 * i + 1:4 * i + 5]) for i in range(n)]
        assert x.tolist() == expected_x and y.tolist() == expected_y
    assert ds.group_names == ("lower", "upper") and ds.n_classes == 256 and ds.bytes_per_token == 1.0
    # windows never cross sources: a window of group g holds only the alphabet of source g
    for row, g in zip(ds.train[0].tolist(), ds.groups.tolist()):
        letters = {chr(b) for b in row} - {" ", "\n"}
        assert all(c.islower() for c in letters) if g == 0 else all(c.isupper() for c in letters)


def test_no_validation_fortune_is_in_any_training_window(small_fortunes, fortune_files):
    corpus = read_corpus("fortunes", max_bytes=600_000, seed=1)
    is_val = split_documents(corpus, val_fraction=0.1, seed=1)
    assert 0 < is_val.sum() < len(is_val)
    ds = small_fortunes
    # the training text, read back from the windows source by source (stride T: x rows then the last target)
    text = []
    for g in range(len(ds.group_names)):
        x, y = ds.train[0][ds.groups == g], ds.train[1][ds.groups == g]
        if len(x):
            text.append(bytes(x.flatten().tolist() + [int(y[-1, -1])]))
    training = b"\x00".join(text)
    train_docs = [d for d, v in zip(corpus.documents, is_val) if not v]
    checked = 0
    for doc, val in zip(corpus.documents, is_val):
        if val and len(doc) >= 80 and not any(doc in d for d in train_docs):  # a fortune repeated in two files
            assert doc not in training
            checked += 1
    assert checked > 100
    assert all(doc in training for doc in train_docs[:50] if len(doc) < 2000)  # and training ones are there
    x, y = ds.test
    assert (x[:, 1:] == y[:, :-1]).all()


def test_fortunes_are_the_files_split_at_percent_lines(fortune_files):
    corpus = read_corpus("fortunes", max_bytes=None)
    assert corpus.source_names == tuple(p.name for p in fortune_files) and len(fortune_files) >= 40
    for path in fortune_files[:6]:
        s = corpus.source_names.index(path.name)
        docs = [d for d, src in zip(corpus.documents, corpus.sources) if src == s]
        raw = path.read_bytes()
        # by hand: lines up to each line that is exactly "%"
        expected, lines = [], []
        for line in raw.split(b"\n")[:-1] if raw.endswith(b"\n") else raw.split(b"\n"):
            if line == b"%":
                expected.append(b"".join(l + b"\n" for l in lines))
                lines = []
            else:
                lines.append(line)
        expected.append(b"".join(l + b"\n" for l in lines))
        assert docs == [d for d in expected if d.strip()]
        if raw.endswith(b"\n%\n"):
            assert b"".join(d + b"%\n" for d in docs) == raw


def test_python_code_reads_the_standard_library_by_package():
    root = Path(sysconfig.get_paths()["stdlib"])
    corpus = read_corpus("python_code", max_bytes=None)
    assert {"json", "email", "asyncio", "(modules)"} <= set(corpus.source_names)
    assert not {"test", "idlelib", "site-packages"} & set(corpus.source_names)
    json = [d for d, s in zip(corpus.documents, corpus.sources) if corpus.source_names[s] == "json"]
    assert json == [p.read_bytes() for p in sorted((root / "json").rglob("*.py")) if p.read_bytes().strip()]
    small = read_corpus("python_code", max_bytes=200_000, seed=5)
    assert 150_000 < small.n_bytes <= 200_000
    again = read_corpus("python_code", max_bytes=200_000, seed=5)
    assert again.documents == small.documents and again.sources == small.sources
    assert read_corpus("python_code", max_bytes=200_000, seed=6).documents != small.documents
    ds = load_dataset("python_code", context=32, max_bytes=200_000, seed=5)
    assert ds.input_shape == (32,) and ds.group_names == small.source_names


# --------------------------------------------------------------------------- #
# Partitions
# --------------------------------------------------------------------------- #


def _source_tv(ds: Dataset, shards) -> float:
    """Mean total-variation distance between each agent's source mix and the whole training set's."""
    g = ds.groups.numpy()
    whole = np.bincount(g, minlength=len(ds.group_names)) / len(g)
    return float(np.mean([0.5 * np.abs(np.bincount(g[s], minlength=len(whole)) / len(s) - whole).sum()
                          for s in shards]))


def test_dirichlet_over_sources_gives_different_mixes_iid_does_not(small_fortunes):
    ds = small_fortunes
    labels = ds.partition_labels.numpy()
    assert ds.partition_labels is ds.groups
    skewed = partition(labels, 6, "dirichlet", seed=0, alpha=0.05, min_size=10)
    mixed = partition(labels, 6, "iid", seed=0)
    assert _source_tv(ds, skewed) > 0.4 and _source_tv(ds, mixed) < 0.1
    by_source = partition(labels, 6, "classes")
    assert all(len(set(labels[a]) & set(labels[b])) == 0 for a in by_source for b in by_source if a is not b)
    # the training windows' bytes differ more among skewed agents than among iid ones
    assert byte_divergence(ds, skewed).mean() > 3 * byte_divergence(ds, mixed).mean()


def test_a_train_subset_keeps_each_window_with_its_group():
    ds = text_dataset(toy_corpus(), context=3, val_fraction=0.2)
    x, y, g = plan._subset(7, 0, "train_subset", *ds.train, ds.partition_labels)
    assert len(x) == len(y) == len(g) == 7
    for row, target, group in zip(x.tolist(), y.tolist(), g.tolist()):
        i = ds.train[0].tolist().index(row)
        assert ds.train[1][i].tolist() == target and int(ds.groups[i]) == group


def test_partition_labels_are_the_labels_without_groups():
    ds = load_dataset("synthetic", n_train=40, n_test=10)
    assert ds.partition_labels is ds.train[1] and ds.groups is None and ds.bytes_per_token is None


# --------------------------------------------------------------------------- #
# Bigram floor and byte divergence, against loops
# --------------------------------------------------------------------------- #


def _bigram_by_loops(ds: Dataset) -> float:
    v = ds.n_classes
    pairs, firsts = Counter(), Counter()
    for row_x, row_y in zip(ds.train[0].tolist(), ds.train[1].tolist()):
        for a, b in zip(row_x, row_y):
            pairs[a, b] += 1
            firsts[a] += 1
    total, m = 0.0, 0
    for row_x, row_y in zip(ds.test[0].tolist(), ds.test[1].tolist()):
        for a, b in zip(row_x, row_y):
            total -= math.log((pairs[a, b] + 1) / (firsts[a] + v))
            m += 1
    return total / m


def test_bigram_loss_equals_the_counts_made_here():
    ds = text_dataset(toy_corpus(), context=5, val_fraction=0.4, seed=1)
    assert bigram_loss(ds) == pytest.approx(_bigram_by_loops(ds), rel=1e-12)
    g = torch.Generator().manual_seed(0)  # a small vocabulary: the smoothing's V is n_classes
    x = torch.randint(0, 5, (30, 7), generator=g)
    small = Dataset("v5", (x[:20], x[:20].roll(1, 1)), (x[20:], x[20:].roll(1, 1)), 5, (7,))
    assert bigram_loss(small) == pytest.approx(_bigram_by_loops(small), rel=1e-12)


def test_bigram_loss_of_fortunes_is_below_uniform_and_above_zero(small_fortunes):
    loss = bigram_loss(small_fortunes)
    assert 2.0 < loss < math.log(256)


def test_byte_divergence_equals_a_hand_computation():
    x = torch.tensor([[0, 0, 1], [1, 2, 2], [2, 2, 2]])
    ds = Dataset("toy", (x, x), (x, x), 256, (3,))
    shards = [np.array([0]), np.array([1, 2]), np.array([0, 1, 2])]
    q = {0: 2 / 9, 1: 2 / 9, 2: 5 / 9}
    expected = []
    for p in ({0: 2 / 3, 1: 1 / 3, 2: 0.0}, {0: 0.0, 1: 1 / 6, 2: 5 / 6}, q):
        js = 0.0
        for b in (0, 1, 2):
            m = (p[b] + q[b]) / 2
            js += 0.5 * (p[b] * math.log2(p[b] / m) if p[b] else 0) + 0.5 * q[b] * math.log2(q[b] / m)
        expected.append(js)
    assert byte_divergence(ds, shards) == pytest.approx(expected, abs=1e-12)
    assert byte_divergence(ds, shards)[2] == 0


# --------------------------------------------------------------------------- #
# Bad input, a missing corpus, the record's checks
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", ["fortunes", "python_code"])
@pytest.mark.parametrize("options, message", [
    ({"context": 0}, r"context must be an integer >= 1, got 0"),
    ({"context": 2.5}, r"context must be an integer >= 1, got 2.5"),
    ({"val_fraction": 1.5}, r"val_fraction must be in \(0, 1\), got 1.5"),
    ({"val_fraction": 0}, r"val_fraction must be in \(0, 1\), got 0"),
    ({"contxt": 8}, r"has no option 'contxt'; did you mean 'context'\? allowed: context, val_fraction, seed, max_bytes"),
    ({"max_bytes": 0}, r"max_bytes must be an integer >= 1, got 0"),
    ({"seed": -1}, r"seed must be an integer >= 0, got -1"),
])
def test_bad_options_are_one_line_errors(name, options, message, monkeypatch):
    monkeypatch.setattr(corpora, "FORTUNES_DIR", Path("/nonexistent"))  # the options are checked before reading
    with pytest.raises(ValueError, match=message) as err:
        load_dataset(name, **options)
    assert "\n" not in str(err.value)


def test_a_context_longer_than_any_stream_is_refused():
    with pytest.raises(ValueError, match=r"toy: the training split \(\d+ documents\) holds no window of "
                                         r"context=500 \+ 1 bytes; lower context"):
        text_dataset(toy_corpus(), context=500)


def test_a_missing_fortunes_package_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(corpora, "FORTUNES_DIR", tmp_path / "games" / "fortunes")
    for call in (lambda: load_dataset("fortunes"), lambda: check_data("fortunes")):
        with pytest.raises(FileNotFoundError) as err:
            call()
        text = str(err.value)
        assert "\n" not in text and "apt-get install fortunes" in text and str(tmp_path / "games" / "fortunes") in text


@pytest.mark.parametrize("change, message", [
    ({"train": (torch.zeros(4, 3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))},
     r"labels must be int64 of shape \(4, 3\) \(as the token ids\)"),
    ({"train": (torch.full((4, 3), 300), torch.zeros(4, 3, dtype=torch.int64))}, r"token ids span 300..300; allowed 0..255"),
    ({"groups": torch.zeros(3, dtype=torch.int64)}, r"groups must be int64 of shape \(4,\)"),
    ({"groups": torch.tensor([0, 1, 2, 0])}, r"groups span 0..2; allowed 0..1"),
    ({"bytes_per_token": 0.0}, r"bytes_per_token must be a number > 0 or None, got 0.0"),
])
def test_the_record_checks_token_data(change, message):
    x = torch.zeros(4, 3, dtype=torch.int64)
    fields = dict(name="t", train=(x, x), test=(x, x), n_classes=256, input_shape=(3,),
                  groups=torch.tensor([0, 1, 0, 1]), group_names=("a", "b"), bytes_per_token=1.0)
    Dataset(**fields)
    with pytest.raises(ValueError, match=message):
        Dataset(**{**fields, **change})


# --------------------------------------------------------------------------- #
# cdsgd data CORPUS
# --------------------------------------------------------------------------- #


def test_cdsgd_data_describes_the_corpus_and_the_agents(fortune_files, capsys):
    assert cli.main(["data", "fortunes", "--agents", "4", "--partition", "dirichlet", "--alpha", "0.1"]) == 0
    out = capsys.readouterr().out
    ds = load_dataset("fortunes")
    corpus = read_corpus("fortunes")
    is_val = split_documents(corpus)
    sizes = np.array([len(d) for d in corpus.documents])
    assert out.startswith(f"fortunes: byte-level text (vocabulary 256), context 128, {len(ds.group_names)} sources\n")
    assert re.search(rf"training\s+{(~is_val).sum()}\s+{sizes[~is_val].sum()}\s+{len(ds.train[1])}\n", out)
    assert re.search(rf"validation\s+{is_val.sum()}\s+{sizes[is_val].sum()}\s+{len(ds.test[1])}\n", out)
    assert "sources (training windows): art " in out
    shards = partition(ds.groups.numpy(), 4, "dirichlet", alpha=0.1)
    js = byte_divergence(ds, shards)
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(.+)$", out, flags=re.M)
    assert [(int(a), int(n)) for a, n, _, _ in rows] == [(j, len(s)) for j, s in enumerate(shards)]
    assert [float(v) for _, _, v, _ in rows] == pytest.approx(js, abs=1e-5)
    top = ds.group_names[int(np.bincount(ds.groups.numpy()[shards[0]]).argmax())]
    assert rows[0][3].startswith(top + " ")
    assert f"mean JS divergence {js.mean():.5f} bits" in out
