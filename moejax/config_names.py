"""The conventions every moejax config shares, checked by field name (also inside tuples such
as ``draft_lens``): sizes and counts are positive, a count of seeds too; seeds, token ids,
coefficients, weights and the counts where 0 means "none" or "all" are non-negative; seeds
are below 2**32 (the seeds a JAX key tells apart); rates and fractions lie in [0, 1]; floats
are finite. A tuple of values (a sweep: rates, ranks, methods, paths) holds each value once.
A field whose meaning differs from its name's checks itself in its config's ``validate()``."""

from __future__ import annotations

import dataclasses
import math

__all__ = ["SEED_LIMIT", "convention_error"]

SEED_LIMIT = 2**32  # jax.random.key(seed) keeps the low 32 bits without 64-bit mode

_POSITIVE_INTS = {"seq_len", "eval_batches", "batch_size", "steps", "d_model", "n_layers",
                  "n_heads", "vocab_size", "max_seq_len", "n_experts", "n_seeds",
                  "d_hidden", "d_expert", "n_tokens", "eval_batch_size", "n_kv_heads",
                  "patch_size", "n_train", "n_val", "n_test", "n_adj", "n_st", "n_prompts",
                  "corpus_bytes", "max_new_tokens", "q_num", "eta_num", "ka_m", "ka_ms",
                  "draft_lens", "n_clusters", "block_d", "block_f", "block_tokens",
                  "block_experts", "block_top_k", "ffn_width", "sample_tokens", "tokens"}
_POSITIVE_SUFFIXES = ("_d_model", "_d_expert", "_n_layers", "_rank", "_ranks", "_len",
                      "_repeats", "repeats")
_NON_NEGATIVE = {"seed", "alpha", "top_k", "n_shared", "n_shared_experts", "extra_layers",
                 "eval_examples", "max_train_examples", "eval_rows", "weight_decay",
                 "l2_sweep", "lora_rank"}  # (lora_rank 0: no LoRA run)
_NON_NEGATIVE_SUFFIXES = ("_seed", "_id", "_coef", "_weight", "_lam0", "_eps", "_std",
                          "_lambda", "_lambdas", "_beta")
_UNIT_INTERVAL = {"sm_rate", "sm_rates", "frozen_sm_rate", "target_tls", "kd_alpha",
                  "jsd_beta", "kd_ratio", "on_policy_fraction"}


def convention_error(name: str, value) -> str | None:
    """Why a field called ``name`` may not hold ``value`` (a number or a tuple of them), or
    ``None`` where it may."""
    if isinstance(value, bool):
        return None
    if isinstance(value, tuple) and not any(dataclasses.is_dataclass(v) for v in value):
        seen = set()
        for v in value:  # a sweep that names a value twice would run it, and row it, twice
            if v in seen:
                return f"repeats {v!r}: give each value once"
            seen.add(v)
    numbers = [v for v in (value if isinstance(value, tuple) else (value,))
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if (name in _POSITIVE_INTS or name.endswith(_POSITIVE_SUFFIXES)) and name not in _NON_NEGATIVE:
        if any(isinstance(v, int) and v < 1 for v in numbers):
            return "must be >= 1"
    if name in _NON_NEGATIVE or name.endswith(_NON_NEGATIVE_SUFFIXES):
        if any(v < 0 for v in numbers):
            return "must be >= 0" + (" (PRNG seeds are unsigned)" if "seed" in name else "")
    if name == "seeds" or name.endswith("_seeds"):  # a count of seeds, or the seeds
        if isinstance(value, int) and value < 1:
            return "must be >= 1 (the number of seeds)"
        if any(v < 0 for v in numbers):
            return "seeds must be >= 0 (PRNG seeds are unsigned)"
    if "seed" in name and any(v >= SEED_LIMIT for v in numbers):
        return (f"must be < 2**32 ({SEED_LIMIT}): a JAX key keeps a seed's low 32 bits, so "
                "seed 2**32 would run as seed 0")
    if name in _UNIT_INTERVAL and any(not 0 <= v <= 1 for v in numbers):
        return "must lie in [0, 1]"
    if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
        return "must be a finite number"
    return None
