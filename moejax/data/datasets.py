"""Build-on-first-use access to the moejax TFDS datasets (array_record; no tensorflow needed).

    from moejax.data import datasets
    train = datasets.load("wordnet_glosses", "train")      # builds into the data dir once
    ex = train[0]                                            # random access, dict of numpy/bytes

Names (``DATASETS``): ``stdlib_code``, ``prose/pydoc``, ``prose/kjv``, ``wordnet_glosses``,
``chitchat``, ``mnist5k``, ``digits``. The data directory is ``data_dir`` if given, else
``$MOEJAX_DATA_DIR``, else ``~/.cache/moejax/tfds``. ``max_examples_per_split=n`` builds a small
slice (first ``n`` examples of each split, for tests) into ``<data dir>/_slices/max<n>`` so it can
never be mistaken for the full dataset.

TFDS writes into an ``incomplete.*`` directory and renames it on success; a failed build (missing
raw data raises :class:`~moejax.data.raw_files.MissingDataError` before writing) leaves nothing
behind in the data directory. A file lock beside the dataset's versions lets one process build it
while others that want it at the same time wait, then read what it built.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path

from moejax.extras import missing_extra

try:
    import tensorflow_datasets as tfds
    from tensorflow_datasets.core.utils import tqdm_utils
except ImportError as _e:
    raise missing_extra(_e, "moejax.data.datasets (the TFDS datasets)") from None

from moejax.data import raw_files
from moejax.data.builders_images import MoejaxDigits, MoejaxMnist5k
from moejax.data.builders_labelled import MoejaxChitchat, MoejaxWordnetGlosses
from moejax.data.builders_text import MoejaxProse, MoejaxStdlibCode
from moejax.files import exclusive

__all__ = ["DATASETS", "get_builder", "load", "load_split", "decode_text", "read_all", "SPLITS"]

DATASETS: dict[str, tuple[type, str | None]] = {
    "stdlib_code": (MoejaxStdlibCode, None),
    "prose/pydoc": (MoejaxProse, "pydoc"),
    "prose/kjv": (MoejaxProse, "kjv"),
    "wordnet_glosses": (MoejaxWordnetGlosses, None),
    "chitchat": (MoejaxChitchat, None),
    "mnist5k": (MoejaxMnist5k, None),
    "digits": (MoejaxDigits, None),
}
SPLITS = ("train", "validation", "test")


def _resolve_dir(data_dir, max_examples_per_split) -> Path:
    root = raw_files.data_dir(data_dir)
    if max_examples_per_split is not None:
        root = root / "_slices" / f"max{int(max_examples_per_split)}"
    return root


def _clean_incomplete(builder_dir: Path, min_age_s: float = 3600.0) -> None:
    """Remove ``incomplete.*`` leftovers of a killed build (TFDS removes its own on exceptions).

    Only directories untouched for ``min_age_s`` are removed, so a build running concurrently in
    another process is left alone.
    """
    parent = builder_dir.parent
    if parent.is_dir():
        for p in parent.glob(f"incomplete.*{builder_dir.name}"):
            if time.time() - p.stat().st_mtime > min_age_s:
                shutil.rmtree(p, ignore_errors=True)


def _prepare(builder, max_examples_per_split) -> None:
    _clean_incomplete(Path(builder.data_dir))
    dl_config = tfds.download.DownloadConfig(max_examples_per_split=max_examples_per_split)
    tqdm_utils.display_progress_bar(False)
    with tempfile.TemporaryDirectory(prefix="moejax-tfds-dl-") as dl_dir:
        # nothing is downloaded; keep TFDS's empty downloads/ out of the data dir
        builder.download_and_prepare(download_dir=dl_dir, download_config=dl_config)


def get_builder(
    name: str, *, data_dir=None, max_examples_per_split: int | None = None, prepare: bool = True
) -> tfds.core.DatasetBuilder:
    """The (prepared, unless ``prepare=False``) array_record builder of dataset ``name``."""
    if name not in DATASETS:
        raise KeyError(f"unknown dataset {name!r}; available: {sorted(DATASETS)}")
    cls, config = DATASETS[name]
    root = _resolve_dir(data_dir, max_examples_per_split)
    kwargs = {"config": config} if config else {}
    absl_logger = logging.getLogger("absl")
    level, bar = absl_logger.level, tqdm_utils._active
    absl_logger.setLevel(logging.ERROR)  # TFDS is chatty about first builds
    try:
        builder = cls(data_dir=str(root), file_format="array_record", **kwargs)
        if prepare and not builder.is_prepared():
            home = Path(builder.data_dir).parent
            home.mkdir(parents=True, exist_ok=True)
            with exclusive(home / ".lock"):  # another process may be building it right now
                builder = cls(data_dir=str(root), file_format="array_record", **kwargs)
                if not builder.is_prepared():
                    _prepare(builder, max_examples_per_split)
    finally:
        absl_logger.setLevel(level)
        tqdm_utils.display_progress_bar(bar)
    return builder


def load(name: str, split: str | None = None, **kwargs):
    """``tfds`` random-access data source(s) of ``name``: one split, or a dict of all splits."""
    builder = get_builder(name, **kwargs)
    sources_by_split = builder.as_data_source()
    if split is None:
        return sources_by_split
    if split not in sources_by_split:
        raise KeyError(f"dataset {name!r} has splits {sorted(sources_by_split)}, not {split!r}")
    return sources_by_split[split]


def read_all(ds, chunk: int = 4096, limit: int = 0) -> list[dict]:
    """Every example of a data source (the first ``limit`` when > 0), in order (batched
    reads, much faster than one ``ds[i]`` per example)."""
    n = min(len(ds), limit) if limit else len(ds)
    out: list[dict] = []
    for start in range(0, n, chunk):
        out += ds.__getitems__(list(range(start, min(start + chunk, n))))
    return out


def load_split(name: str, split: str, limit: int = 0, **kwargs) -> list[dict]:
    """All examples of one split (the first ``limit`` when > 0) as a list, in the data
    source's (deterministic) order."""
    return read_all(load(name, split, **kwargs), limit=limit)


def decode_text(value) -> str:
    """TFDS ``Text`` features come back as ``bytes``; decode to ``str``."""
    return value.decode("utf-8") if isinstance(value, bytes | bytearray) else str(value)
