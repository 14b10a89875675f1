"""Build (or load from the cache) the substrate models the studies reuse.

Substrates (see :mod:`moejax.substrates`): ``dense_lm_prose`` (dense byte-level LM
pre-trained from scratch on the Python-docs prose corpus), ``dense_lm_code`` (that model
fine-tuned on the CPython stdlib code corpus), ``vit_mnist5k`` (small ViT on MNIST-5k),
``mlp_mnist5k`` (the DAREx controlled MLP on MNIST-5k),
``byte_encoder_wordnet_pos`` (small byte-level BERT on WordNet gloss -> part of speech),
``minilm_wordnet_pos`` / ``minilm_wordnet_lexname`` (all-MiniLM-L6-v2 fine-tuned on the WordNet
gloss tasks). Each is trained by :func:`moejax.train.loop.train` in its cache directory, so
an interrupted build resumes; a finished one is just loaded.

    python -m experiments.substrate_build                           # quick presets (CPU)
    python -m experiments.substrate_build preset=full               # GPU
    python -m experiments.substrate_build only=vit_mnist5k vit_mnist5k.train.steps=100

Other experiments get a substrate with ``moejax.substrates.get(name, preset)``; overriding
a config here caches the result under a different key (``custom-<hash>``), so the preset
substrates are never overwritten. ``dense_lm_code`` always starts from the *preset*
``dense_lm_prose``.
"""

from __future__ import annotations

import time

from moejax import substrates
from moejax.config import Config, config
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.substrates.classify import ByteEncoderTaskConfig, MiniLMTaskConfig, ViTSubstrateConfig
from moejax.substrates.lm import LMSubstrateConfig
from moejax.substrates.mlp import MLPSubstrateConfig

_q = lambda n: substrates.substrate_config(n, "quick")  # noqa: E731


@config
class SubstrateBuildConfig(Config):
    only: str = ""  # comma-separated substrate names; "" = all
    cache_dir: str = ""  # "" = $MOEJAX_SUBSTRATE_DIR or ~/.cache/moejax/substrates
    dense_lm_prose: LMSubstrateConfig = _q("dense_lm_prose")
    dense_lm_code: LMSubstrateConfig = _q("dense_lm_code")
    dense_lm_chat: LMSubstrateConfig = _q("dense_lm_chat")
    vit_mnist5k: ViTSubstrateConfig = _q("vit_mnist5k")
    mlp_mnist5k: MLPSubstrateConfig = _q("mlp_mnist5k")
    byte_encoder_wordnet_pos: ByteEncoderTaskConfig = _q("byte_encoder_wordnet_pos")
    minilm_wordnet_pos: MiniLMTaskConfig = _q("minilm_wordnet_pos")
    minilm_wordnet_lexname: MiniLMTaskConfig = _q("minilm_wordnet_lexname")

    def validate(self):
        bad = [n for n in self.names() if n not in substrates.SUBSTRATES]
        self._require(not bad, f"only={self.only!r}: unknown {bad}; choose from "
                      f"{sorted(substrates.SUBSTRATES)}")

    def names(self) -> list[str]:
        return [n for n in self.only.split(",") if n] or list(substrates.SUBSTRATES)


def make_config(preset: str) -> SubstrateBuildConfig:
    return SubstrateBuildConfig(**{n: substrates.substrate_config(n, preset)
                                   for n in substrates.SUBSTRATES})


_HEADLINE_METRICS = ("val_loss", "val_ppl", "val_bpb", "val_accuracy", "test_accuracy",
                     "val_loss_before", "val_accuracy_before", "base_corpus_val_loss_before",
                     "base_corpus_val_loss_after", "majority_class_rate")


def run(cfg: SubstrateBuildConfig, run: RunDir) -> dict:
    rows, out = [], {}
    for name in cfg.names():
        sub_cfg = getattr(cfg, name)
        cached = substrates.is_cached(name, sub_cfg, cache_dir=cfg.cache_dir or None)
        t0 = time.time()
        sub = substrates.build(name, sub_cfg, cache_dir=cfg.cache_dir or None, progress=True)
        row = {"substrate": name, "cached": cached,
               "build_wall_s": sub.metrics.get("wall_s"),
               "this_call_s": round(time.time() - t0, 1),
               **{k: sub.metrics[k] for k in _HEADLINE_METRICS if k in sub.metrics},
               "path": str(sub.path)}
        rows.append(row)
        for k in ("val_loss", "val_accuracy"):
            if k in sub.metrics:
                out[f"{name}/{k}"] = round(float(sub.metrics[k]), 4)
    run.table("substrates", rows, title="Substrate models (metrics on the validation split; "
              "LM losses in nats/byte)")
    run.note("Get one in code: `moejax.substrates.get(name, preset)`. `build_wall_s` is "
             "the training wall time when the substrate was built; `cached` rows were loaded.")
    parts = [f"{r['substrate']}: " + (f"val loss {r['val_loss']:.3f}" if "val_ppl" in r
                                      else f"val acc {r.get('val_accuracy', float('nan')):.3f}")
             for r in rows]
    out["headline"] = "; ".join(parts)
    return out


STUDY = Study(
    "substrate_build", make_config, run,
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
