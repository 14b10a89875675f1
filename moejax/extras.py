"""The optional dependencies (pip extras) and how a module asks for one.

The core install (``pip install moejax``) is jax, flax, optax, orbax-checkpoint, chex and
numpy: the layers, kernels, optimizers, delta methods, training loop and checkpoints need
nothing else. The rest come with extras (``pyproject.toml``):

* ``io``: reading real weights and tokenizers (safetensors, GGUF, Hugging Face tokenizers);
* ``studies``: ``io`` plus the study stack: datasets (tensorflow-datasets, array-record),
  plots (matplotlib), progress bars (tqdm), ROUGE, clustering (scikit-learn, scipy);
* ``gpu`` / ``tpu``: the accelerator builds and tokamax's kernels; ``dev``: the test tools.

:func:`require` imports a module of an extra and, where it is missing, raises
:class:`MissingExtraError` with one line naming the extra and the install command.
:func:`progress` is tqdm's bar where tqdm is installed and a silent stand-in where not;
:func:`late_progress` the bar of work that is usually quick.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import jax

try:  # progress bars where tqdm is installed (the studies extra), silent where not
    from tqdm.auto import tqdm as _tqdm
except ImportError:
    _tqdm = None

__all__ = ["EXTRAS", "LATE_BAR_S", "MissingExtraError", "late_progress", "missing_extra",
           "progress", "require"]

# a bar over work that is usually quick (an evaluation) appears once it has run this long
LATE_BAR_S = 10.0

# the top-level module each extra provides -> the extra that installs it
EXTRAS = {
    "safetensors": "io", "gguf": "io", "tokenizers": "io",
    "tensorflow_datasets": "studies", "array_record": "studies", "matplotlib": "studies",
    "tqdm": "studies", "rouge_score": "studies", "sklearn": "studies", "scipy": "studies",
    "tensorboardX": "tb", "torch": "bench", "tokamax": "gpu",
}


class MissingExtraError(ImportError):
    """A module of an optional extra is not installed; the message names the extra."""


def missing_extra(error: ImportError, used_by: str) -> ImportError:
    """The error to raise for ``error``, an ``ImportError`` met by ``used_by``: a
    :class:`MissingExtraError` naming the extra when an extra's module is missing, else
    ``error`` itself (a broken install is not a missing extra). A module of an extra
    imports it so::

        try:
            import tensorflow_datasets as tfds
        except ImportError as e:
            raise missing_extra(e, "moejax.data.datasets") from None
    """
    top = (error.name or "").split(".")[0]
    if top not in EXTRAS:
        return error
    extra = EXTRAS[top]
    return MissingExtraError(
        f"{used_by} needs {top}, which the core install leaves out. Fix: pip install "
        f"'moejax[{extra}]' (from a checkout: pip install -e '.[{extra}]')")


def require(module: str, used_by: str) -> ModuleType:
    """``import module`` (e.g. ``"sklearn.cluster"``) where it is used, or
    :class:`MissingExtraError` naming the extra that installs it and ``used_by``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise missing_extra(e, used_by) from None


class _Silent:
    """What a tqdm bar is asked for in the library, doing nothing (tqdm is not installed)."""

    def __init__(self, iterable=None, **_):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def update(self, n=1):
        pass

    def set_postfix(self, *args, **kw):
        pass

    def close(self):
        pass


def progress(iterable=None, **kw):
    """``tqdm.auto.tqdm(iterable, **kw)`` where tqdm is installed, else a silent bar."""
    return (_tqdm or _Silent)(iterable, **kw)


def late_progress(iterable=None, **kw):
    """:func:`progress` for work that is usually quick (an evaluation, a clustering): the bar
    appears once the work has run ``LATE_BAR_S``, is cleared when it ends, and is drawn by the
    first process only."""
    return progress(iterable, leave=False, delay=LATE_BAR_S, disable=jax.process_index() != 0,
                    **kw)
