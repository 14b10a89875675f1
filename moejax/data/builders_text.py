"""TFDS builders for the unlabelled text corpora (array_record, readable without tensorflow).

* ``moejax_stdlib_code``: the CPython standard-library ``.py`` sources (tests excluded), one
  example per file. Split by a stable hash of the relative path.
* ``moejax_prose/pydoc``: the reStructuredText sources of the Python 3.11 documentation (Debian
  ``python3.11-doc``), one example per ``.rst`` file, split by relative path.
* ``moejax_prose/kjv``: the King James Bible (Debian ``bible-kjv``, read with ``bible -f``), one
  example per chapter (1189), split by chapter reference.

Every example is ``{"doc_id": str, "text": str}``. Splits: train 90% / validation 5% / test 5%.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator

from moejax.extras import missing_extra

try:
    import tensorflow_datasets as tfds
except ImportError as _e:
    raise missing_extra(_e, "moejax.data.builders_text (the TFDS text datasets)") from None

from moejax.data import raw_files
from moejax.data.raw_files import LM_SPLITS
from moejax.data.stdlib_corpus import stdlib_files, stdlib_root
from moejax.data.tfds_base import OfflineBuilder

__all__ = ["MoejaxStdlibCode", "MoejaxProse", "LM_SPLITS", "iter_kjv_chapters"]


def _text_features() -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict(
        {"doc_id": tfds.features.Text(), "text": tfds.features.Text()}
    )


class MoejaxStdlibCode(OfflineBuilder):
    """CPython standard-library source files (a real code corpus present on every machine)."""

    name = "moejax_stdlib_code"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "One example per .py file; train/validation/test by path hash."}

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=__doc__, features=_text_features(), homepage="https://www.python.org/"
        )

    def _split_generators(self, dl_manager):
        root = stdlib_root()  # raises if the sources are missing, before anything is written
        return {split: self._generate_examples(root, split) for split in LM_SPLITS}

    def _generate_examples(self, root, split) -> Iterator[tuple[str, dict]]:
        for path in stdlib_files(root):
            rel = str(path.relative_to(root))
            if raw_files.split_of(rel, LM_SPLITS) != split:
                continue
            text = path.read_bytes().decode("utf-8", errors="replace")
            yield rel, {"doc_id": rel, "text": text}


def iter_kjv_chapters() -> Iterator[tuple[str, str]]:
    """``(chapter_ref, text)`` for the 1189 chapters of the KJV, in canonical order."""
    exe = raw_files.bible_executable()
    out = subprocess.run(
        [exe, "-f", "gen1:1-rev22:21"], capture_output=True, check=True, text=True
    ).stdout
    pattern = re.compile(r"^(\S+?)(\d+):(\d+) (.*)$")
    current, verses = None, []
    for line in out.splitlines():
        m = pattern.match(line)
        if m is None:  # continuation of a long verse
            if verses and line.strip():
                verses[-1] += " " + line.strip()
            continue
        ref = f"{m.group(1)}{m.group(2)}"
        if ref != current:
            if current is not None:
                yield current, "\n".join(verses) + "\n"
            current, verses = ref, []
        verses.append(f"{m.group(3)} {m.group(4)}")
    if current is not None:
        yield current, "\n".join(verses) + "\n"


class MoejaxProse(OfflineBuilder):
    """English prose: the Python documentation sources, or the King James Bible by chapter."""

    name = "moejax_prose"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "pydoc: one example per .rst file; kjv: one per chapter."}
    BUILDER_CONFIGS = [
        tfds.core.BuilderConfig(name="pydoc", description="Python 3.11 documentation .rst sources"),
        tfds.core.BuilderConfig(
            name="kjv", description="King James Bible, one example per chapter"
        ),
    ]
    DEFAULT_CONFIG_NAME = "pydoc"

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(description=__doc__, features=_text_features())

    def _split_generators(self, dl_manager):
        if self.builder_config.name == "pydoc":
            raw_files.pydoc_sources_dir()  # fail before writing anything
        else:
            raw_files.bible_executable()
        return {split: self._generate_examples(split) for split in LM_SPLITS}

    def _generate_examples(self, split) -> Iterator[tuple[str, dict]]:
        if self.builder_config.name == "pydoc":
            root = raw_files.pydoc_sources_dir()
            for path in sorted(root.rglob("*.txt")):
                rel = str(path.relative_to(root))
                if raw_files.split_of(rel, LM_SPLITS) == split:
                    text = path.read_bytes().decode("utf-8", errors="replace")
                    yield rel, {"doc_id": rel, "text": text}
        else:
            for ref, text in iter_kjv_chapters():
                if raw_files.split_of(ref, LM_SPLITS) == split:
                    yield ref, {"doc_id": ref, "text": text}
