"""Substrates: the small pretrained models studies start from, trained once per config hash
and cached (:mod:`moejax.substrates.registry`); recipes for the language models
(:mod:`moejax.substrates.lm`) and the classifiers (:mod:`moejax.substrates.classify`).

    from moejax import substrates
    sub = substrates.get("dense_lm_prose", preset="quick")   # trains on first use, then cached
"""

from moejax.substrates.registry import (
    SUBSTRATES,
    Recipe,
    Substrate,
    build,
    cache_root,
    get,
    is_cached,
    substrate_config,
    substrate_dir,
)

__all__ = ["SUBSTRATES", "Substrate", "Recipe", "get", "build", "substrate_config",
           "substrate_dir", "cache_root", "is_cached"]
