"""BlockFFN experiment modules: presets build and validate, overrides work, and the active-set
extraction used for the baselines' metrics (TopK / DSMoE expert ids -> [B, T, N])."""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ConfigError, apply_overrides

MODULES = ["blockffn_baselines", "blockffn_ablations", "blockffn_granularity"]


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("preset", ["quick", "full"])
def test_presets_build(name, preset):
    mod = importlib.import_module(f"experiments.{name}")
    cfg = mod.make_config(preset)
    cfg2 = apply_overrides(cfg, ["train.steps=3", "train.warmup_steps=1", "model.al_coef=0.001"])
    assert cfg2.train.steps == 3 and cfg2.model.al_coef == 0.001
    with pytest.raises(ConfigError, match="model.arch"):
        apply_overrides(cfg, ["model.arch=gshard"])


def test_active_sets_topk_and_dsmoe():
    from experiments.blockffn_common import SparseLMConfig, active_sets

    ids = jnp.array([[[0, 2], [1, 2]]])  # [B=1, T=2, k=2] routed ids
    act, a = active_sets(SparseLMConfig(arch="topk", n_experts=4, top_k=2),
                         {"expert_ids": ids})
    np.testing.assert_array_equal(np.asarray(act), [[[1, 0, 1, 0], [0, 1, 1, 0]]])
    assert a is None
    act, _ = active_sets(SparseLMConfig(arch="dsmoe", n_experts=4, top_k=3, n_shared=1),
                         {"expert_ids": ids})
    # shared expert first (always on), then the 3 routed experts
    np.testing.assert_array_equal(np.asarray(act), [[[1, 1, 0, 1], [1, 0, 1, 1]]])
    act, _ = active_sets(SparseLMConfig(arch="grin", n_experts=4), {"expert_ids": ids})
    np.testing.assert_array_equal(np.asarray(act), [[[1, 0, 1, 0], [0, 1, 1, 0]]])
    assert active_sets(SparseLMConfig(arch="dense"), {}) == (None, None)


def test_grin_slot():
    from experiments.blockffn_common import SparseLMConfig
    from moejax.nn.grin import GRINConfig

    slot = SparseLMConfig(arch="grin", n_experts=8, d_expert=4, grin_eps=0.1).slot()
    assert isinstance(slot, GRINConfig)
    assert (slot.n_experts, slot.top_k, slot.d_expert, slot.jitter_eps) == (8, 2, 4, 0.1)
    assert slot.activation == "swish" and slot.dispatch == "dense"
