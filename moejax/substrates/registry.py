"""Cached, resumable "substrate" models that the studies reuse.

    from moejax import substrates
    sub = substrates.get("dense_lm_code", preset="quick")   # trains on first use, then cached
    sub.model, sub.config, sub.metrics, sub.path

Substrates (``SUBSTRATES``):

============================  ===============================================================
``dense_lm_prose``            dense byte-level LM pre-trained from scratch on ``prose/pydoc``
``dense_lm_code``             ``dense_lm_prose`` fine-tuned on ``stdlib_code`` (pre/fine pair)
``dense_lm_chat``             wider byte-level LM pre-trained on the chit-chat dialogues
``vit_mnist5k``               small ViT trained on MNIST-5k
``mlp_mnist5k``               the DAREx controlled MLP pre-trained on MNIST-5k (task A)
``byte_encoder_wordnet_pos``  small byte-level BERT trained on WordNet gloss -> part of speech
``minilm_wordnet_pos``        all-MiniLM-L6-v2 fine-tuned on WordNet gloss -> part of speech
``minilm_wordnet_lexname``    all-MiniLM-L6-v2 fine-tuned on WordNet gloss -> supersense
============================  ===============================================================

Presets: ``"quick"`` (a few CPU minutes at most) and ``"full"`` (GPU). Recipes and their
configs live in :mod:`moejax.substrates.lm` and :mod:`moejax.substrates.classify`; the
experiment ``python -m experiments.substrate_build`` builds them with CLI overrides.

Cache: ``$MOEJAX_SUBSTRATE_DIR`` or ``~/.cache/moejax/substrates``, one directory per
``<name>/<preset>-<hash of the config (and of the substrates it starts from)>``, holding
``train/`` (the training loop's run dir: metrics CSVs and checkpoints, so an interrupted build
resumes), ``config.json``, ``metrics.json``, ``model.safetensors`` and ``integrity.json``
(SHA-256 of the other three, written last, atomically: its presence marks the substrate
complete). Every load verifies the files against it; a damaged entry (a flipped byte, a
truncated file, unreadable JSON) is moved aside to ``<entry>.corrupt-<time>`` and rebuilt,
with a warning naming the file. An entry from before ``integrity.json`` existed is adopted when
it loads. A file lock keeps two processes from training the same substrate at once.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flax import nnx

from moejax.config import Config, to_json
from moejax.files import atomic_write_text, exclusive, move_aside, writable_dir
from moejax.harness.smoke import SMOKE_SUFFIX, smoke_config
from moejax.io.safetensors_io import export_params, import_params
from moejax.pytree import count_bytes
from moejax.substrates import classify as cls_r
from moejax.substrates import lm as lm_r
from moejax.substrates import mlp as mlp_r

log = logging.getLogger(__name__)

__all__ = ["SUBSTRATES", "Substrate", "Recipe", "get", "build", "substrate_config",
           "substrate_dir", "cache_root", "is_cached"]

PRESETS = ("quick", "full")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to configure, construct and train one substrate.

    ``deps(cfg)`` -> ``{role: (substrate name, preset)}`` substrates it starts from;
    ``train(cfg, run_dir, deps, progress)`` -> ``(model, metrics)`` (``deps`` maps role to
    :class:`Substrate`).
    """

    make_config: Callable[[str], Config]
    make_model: Callable[[Config], Any]
    train: Callable[..., tuple[Any, dict]]
    deps: Callable[[Config], dict] = lambda cfg: {}
    description: str = ""


SUBSTRATES: dict[str, Recipe] = {
    "dense_lm_prose": Recipe(lambda p: lm_r.lm_config("dense_lm_prose", p), lm_r.make_lm,
                             lm_r.train_lm,
                             description="dense byte-level LM pre-trained on prose/pydoc"),
    "dense_lm_code": Recipe(lambda p: lm_r.lm_config("dense_lm_code", p), lm_r.make_lm,
                            lm_r.train_lm,
                            deps=lambda c: {"init": (c.init_from, c.init_preset)},
                            description="dense_lm_prose fine-tuned on stdlib_code"),
    "dense_lm_chat": Recipe(lambda p: lm_r.lm_config("dense_lm_chat", p), lm_r.make_lm,
                            lm_r.train_lm,
                            description="byte-level LM pre-trained on the chit-chat "
                                        "dialogues"),
    "vit_mnist5k": Recipe(cls_r.vit_substrate_config, cls_r.make_vit, cls_r.train_vit,
                          description="small ViT trained on MNIST-5k"),
    "mlp_mnist5k": Recipe(mlp_r.mlp_substrate_config, mlp_r.make_mlp, mlp_r.train_mlp_substrate,
                          description="DAREx controlled MLP pre-trained on MNIST-5k"),
    "byte_encoder_wordnet_pos": Recipe(lambda p: cls_r.byte_encoder_task_config("pos", p),
                                       cls_r.make_byte_encoder_classifier,
                                       cls_r.train_byte_encoder,
                                       description="byte-level BERT trained: WordNet gloss -> "
                                                   "POS"),
    "minilm_wordnet_pos": Recipe(lambda p: cls_r.minilm_task_config("pos", p),
                                 cls_r.make_minilm_classifier, cls_r.train_minilm,
                                 description="MiniLM fine-tuned: WordNet gloss -> POS"),
    "minilm_wordnet_lexname": Recipe(lambda p: cls_r.minilm_task_config("lexname", p),
                                     cls_r.make_minilm_classifier, cls_r.train_minilm,
                                     description="MiniLM fine-tuned: WordNet gloss -> "
                                                 "supersense"),
}


@dataclasses.dataclass
class Substrate:
    """A trained substrate: the model (``nnx.Module``), its recipe config, metrics, dir."""

    name: str
    model: Any
    config: Config
    metrics: dict
    path: Path


def cache_root(cache_dir=None) -> Path:
    """``cache_dir``, else ``$MOEJAX_SUBSTRATE_DIR``, else ``~/.cache/moejax/substrates``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("MOEJAX_SUBSTRATE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "moejax" / "substrates"


def _recipe(name: str) -> Recipe:
    if name not in SUBSTRATES:
        raise KeyError(f"unknown substrate {name!r}; available: {sorted(SUBSTRATES)}")
    return SUBSTRATES[name]


def substrate_config(name: str, preset: str = "quick") -> Config:
    """The default config of substrate ``name`` for ``preset``; ``"<preset>_smoke"``: that
    preset cut as a smoke run (:mod:`moejax.harness.smoke`; how a smoke run's substrates name the
    substrates they start from)."""
    base = preset.removesuffix(SMOKE_SUFFIX)
    if base not in PRESETS:
        raise ValueError(f"preset={preset!r}; use one of {PRESETS} (or with {SMOKE_SUFFIX!r})")
    cfg = _recipe(name).make_config(base)
    return smoke_config(cfg) if preset != base else cfg


def _key(name: str, cfg: Config) -> str:
    """Hash of the config and (recursively) of the default configs of its dependencies."""
    h = hashlib.sha256(to_json(cfg).encode())
    for role, (dep, dep_preset) in sorted(_recipe(name).deps(cfg).items()):
        h.update(f"{role}={dep}:{_key(dep, substrate_config(dep, dep_preset))}".encode())
    return h.hexdigest()[:12]


def substrate_dir(name: str, cfg: Config, *, label: str = "custom", cache_dir=None) -> Path:
    return cache_root(cache_dir) / name / f"{label}-{_key(name, cfg)}"


def _label(name: str, cfg: Config) -> str:
    return next((p for p in PRESETS if substrate_config(name, p) == cfg), "custom")


def is_cached(name: str, preset_or_cfg="quick", *, cache_dir=None) -> bool:
    cfg = (substrate_config(name, preset_or_cfg) if isinstance(preset_or_cfg, str)
           else preset_or_cfg)
    d = substrate_dir(name, cfg, label=_label(name, cfg), cache_dir=cache_dir)
    return (d / "model.safetensors").is_file()


_CACHED_FILES = ("config.json", "metrics.json", "model.safetensors")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_integrity(d: Path) -> None:
    atomic_write_text(d / "integrity.json", json.dumps(
        {name: _sha256(d / name) for name in _CACHED_FILES}, indent=2))


def _damage(d: Path) -> str | None:
    """Why the cache entry ``d`` cannot be trusted, or None (intact, or from before
    ``integrity.json``)."""
    record = d / "integrity.json"
    if not record.is_file():
        return None
    try:
        want = json.loads(record.read_text())
    except (OSError, ValueError) as e:
        return f"integrity.json is unreadable ({e})"
    for name in _CACHED_FILES:
        if not (d / name).is_file():
            return f"{name} is missing"
        if _sha256(d / name) != want.get(name):
            return f"{name} differs from the SHA-256 recorded when it was built"
    return None


def _load(name: str, cfg: Config, d: Path) -> Substrate | None:
    """The cached substrate in ``d``, verified; None (the entry moved aside, with a warning)
    when it is damaged."""
    problem = _damage(d)
    if problem is None:
        try:
            model = import_params(d / "model.safetensors",
                                  lambda: _recipe(name).make_model(cfg))
            metrics = json.loads((d / "metrics.json").read_text())
        except (OSError, ValueError) as e:  # WeightFileError and JSONDecodeError included
            problem = f"it does not load ({type(e).__name__}: {str(e)[:200]})"
        else:
            if not (d / "integrity.json").is_file():
                _write_integrity(d)  # an entry from before integrity.json: adopt it
            return Substrate(name, model, cfg, metrics, d)
    dest = move_aside(d)
    log.warning("substrate cache %s is damaged: %s; moved to %s and rebuilt", d, problem, dest)
    return None


def _writable_root(d: Path) -> None:
    writable_dir(d, "the substrate cache", "set MOEJAX_SUBSTRATE_DIR (or cache_dir) to a "
                 "writable directory", root=d.parent.parent)


def build(name: str, cfg: Config | None = None, *, preset: str = "quick", cache_dir=None,
          progress: bool = False, rebuild: bool = False) -> Substrate:
    """Load substrate ``name`` trained with ``cfg`` (default: the ``preset`` config) from the
    cache, training it first (resuming any interrupted run) when it is not there."""
    recipe = _recipe(name)
    cfg = substrate_config(name, preset) if cfg is None else cfg
    d = substrate_dir(name, cfg, label=_label(name, cfg), cache_dir=cache_dir)
    if rebuild and d.exists():
        shutil.rmtree(d)
    _writable_root(d)
    with exclusive(d / ".lock"):  # waits while another process builds it
        if (d / "model.safetensors").is_file():
            sub = _load(name, cfg, d)
            if sub is not None:
                return sub
            return build(name, cfg, preset=preset, cache_dir=cache_dir, progress=progress)
        deps = {role: build(dep, preset=dep_preset, cache_dir=cache_dir, progress=progress)
                for role, (dep, dep_preset) in recipe.deps(cfg).items()}
        atomic_write_text(d / "config.json", to_json(cfg))
        t0 = time.time()
        model, metrics = recipe.train(cfg, str(d / "train"), deps, progress)
        metrics = {"wall_s": round(time.time() - t0, 1), **metrics}
        try:
            atomic_write_text(d / "metrics.json", json.dumps(metrics, indent=2))
            export_params(model, d / "model.safetensors", config=cfg,
                          metadata={"substrate": name})
            _write_integrity(d)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise OSError(errno.ENOSPC, (
                f"disk full caching substrate {name} in {d}: its weights need "
                f"{count_bytes(nnx.state(model, nnx.Param)) / 1e6:.1f} MB; the trained run "
                f"in {d / 'train'} is kept and the next build resumes from it"),
                e.filename) from e
    return Substrate(name, model, cfg, metrics, d)


def get(name: str, preset: str = "quick", *, cache_dir=None, build_if_missing: bool = True,
        progress: bool = False) -> Substrate:
    """Substrate ``name`` at ``preset``; trains and caches it on first use unless
    ``build_if_missing=False`` (then a missing substrate raises ``FileNotFoundError``
    naming the command that builds it)."""
    cfg = substrate_config(name, preset)
    d = substrate_dir(name, cfg, label=preset, cache_dir=cache_dir)
    if (d / "model.safetensors").is_file():
        sub = _load(name, cfg, d)
        if sub is not None:
            return sub
    if not build_if_missing:
        raise FileNotFoundError(f"substrate {name!r} (preset {preset}) is not cached in {d}; "
                                f"build it: python -m experiments.substrate_build "
                                f"preset={preset} only={name}")
    return build(name, cfg, cache_dir=cache_dir, progress=progress)
