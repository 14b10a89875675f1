"""TFDS array_record builders: build small slices, read back, splits disjoint, deterministic."""

import tempfile
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from moejax.data import datasets, raw_files
from moejax.data.builders_labelled import CHAT_SPLITS, LEXNAMES, POS_NAMES
from moejax.data.builders_text import LM_SPLITS

N = 12  # examples per split in the slices built here


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


def _all(name, data_dir):
    srcs = datasets.load(name, data_dir=data_dir, max_examples_per_split=N)
    return {split: [ds[i] for i in range(len(ds))] for split, ds in srcs.items()}


@pytest.mark.parametrize(
    "name,key",
    [
        ("stdlib_code", "doc_id"),
        ("prose/pydoc", "doc_id"),
        ("prose/kjv", "doc_id"),
        ("wordnet_glosses", "gloss"),
        ("chitchat", "conversation_id"),
        ("mnist5k", "index"),
        ("digits", "index"),
    ],
)
def test_build_read_disjoint(name, key, data_dir):
    splits = _all(name, data_dir)
    assert set(splits) == set(datasets.SPLITS)
    seen = {}
    for split, exs in splits.items():
        assert len(exs) == N, (split, len(exs))
        for ex in exs:
            k = ex[key].decode() if isinstance(ex[key], bytes) else int(ex[key])
            assert seen.setdefault(k, split) == split, f"{k!r} in {seen[k]} and {split}"
    # the slice lives under _slices/, never in the real cache location
    b = datasets.get_builder(name, data_dir=data_dir, max_examples_per_split=N)
    assert "_slices" in str(b.data_dir) and b.info.splits["train"].num_examples == N


def test_text_examples_are_documents_in_their_hashed_split(data_dir):
    for name in ("stdlib_code", "prose/pydoc", "prose/kjv"):
        for split, exs in _all(name, data_dir).items():
            for ex in exs:
                assert raw_files.split_of(ex["doc_id"].decode(), LM_SPLITS) == split
                assert len(ex["text"]) > 0
    kjv = _all("prose/kjv", data_dir)["train"]
    assert all(datasets.decode_text(e["text"]).startswith("1 ") for e in kjv)  # whole chapters


def test_wordnet_labels(data_dir):
    for exs in _all("wordnet_glosses", data_dir).values():
        for ex in exs:
            pos, lex = POS_NAMES[ex["pos"]], LEXNAMES[ex["lexname"]]
            assert lex.split(".")[0] == pos  # noun.*, verb.*, adj.*, adv.*
            assert ex["synset"].decode()[0] in "nvasr" and ex["gloss"]


def test_chitchat_pairs(data_dir):
    for split, exs in _all("chitchat", data_dir).items():
        for ex in exs:
            assert raw_files.split_of(ex["conversation_id"].decode(), CHAT_SPLITS) == split
            assert ex["prompt"] and ex["response"] and ex["turn"] >= 1
            assert datasets.decode_text(ex["context"]).endswith(datasets.decode_text(ex["prompt"]))


def test_images(data_dir):
    for name, shape, hi in (("mnist5k", (28, 28), 255), ("digits", (8, 8), 16)):
        exs = _all(name, data_dir)["test"]
        for ex in exs:
            assert ex["image"].shape == shape and ex["image"].dtype == np.uint8
            assert ex["image"].max() <= hi and 0 <= ex["label"] < 10


def test_tfds_data_source_api_and_determinism(data_dir, tmp_path):
    slice_dir = datasets.get_builder("digits", data_dir=data_dir, max_examples_per_split=N).data_dir
    root = str(slice_dir).split("/moejax_digits")[0]
    ds = tfds.data_source("moejax_digits", split="validation", data_dir=root)
    assert len(ds) == N
    again = datasets.load("digits", "validation", data_dir=tmp_path, max_examples_per_split=N)
    for i in range(N):
        assert ds[i]["index"] == again[i]["index"]
        np.testing.assert_array_equal(ds[i]["image"], again[i]["image"])


def test_two_builds_at_once_build_it_once_and_both_read_it(tmp_path, monkeypatch):
    """Two processes (here threads, each its own lock file handle) asking for the same
    unbuilt dataset: the second waits while the first builds, then reads what it built (TFDS
    alone lets both build and the second's rename fail on the first's directory)."""
    import threading

    builds, started = [], threading.Event()
    real = datasets.tfds.core.DatasetBuilder.download_and_prepare

    def slow_build(self, *a, **k):
        builds.append(1)
        started.set()
        time.sleep(0.5)  # the other caller arrives while this one builds
        return real(self, *a, **k)

    monkeypatch.setattr(datasets.tfds.core.DatasetBuilder, "download_and_prepare", slow_build)
    got, errors = [], []

    def get():
        try:
            got.append(datasets.get_builder("digits", data_dir=tmp_path, max_examples_per_split=N))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    first = threading.Thread(target=get)
    first.start()
    assert started.wait(60)
    second = threading.Thread(target=get)
    second.start()
    first.join(120)
    second.join(120)
    assert errors == [] and len(got) == 2 and len(builds) == 1
    assert all(b.is_prepared() and b.info.splits["test"].num_examples == N for b in got)


def test_builder_of_an_unbuilt_dataset_leaves_no_temporary_folder(tmp_path, monkeypatch):
    """TFDS looks for pre-computed metadata of an unbuilt dataset on its bucket, making a
    temporary folder first; an offline builder has none to look up, so none is made."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    for name in datasets.DATASETS:
        b = datasets.get_builder(name, data_dir=tmp_path / "data", prepare=False)
        assert not b.is_prepared() and b.info.description
    assert list(scratch.iterdir()) == []
