"""LoRA init/apply/merge on selected matrices; LoRA + DAREx-q on the merged delta."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.delta import (
    apply,
    dare,
    lora_apply,
    lora_dare,
    lora_delta,
    lora_factor_pruner,
    lora_init,
    lora_merge,
    lora_num_params,
    search_q_v,
    select_leaves,
)


def test_lora_init_apply_merge_and_dare():
    r = np.random.default_rng(0)
    params = {
        "ffn": {
            "w_up": jnp.asarray(r.normal(size=(8, 16)), jnp.float32),
            "w_down": jnp.asarray(r.normal(size=(2, 16, 8)), jnp.float32),
        },
        "norm": jnp.ones(8),
        "embed": jnp.asarray(r.normal(size=(10, 8)), jnp.float32),
    }
    mask = select_leaves(params, include="ffn/")
    lora = lora_init(jax.random.PRNGKey(0), params, mask, rank=2)
    assert lora["norm"] is None and lora["embed"] is None
    assert lora_num_params(lora) == 2 * (8 + 16) + 2 * 2 * (16 + 8)
    for leaf in jax.tree_util.tree_leaves(lora_delta(params, lora)):
        assert not np.any(np.asarray(leaf))  # B = 0 -> zero delta at init
    lora = jax.tree_util.tree_map(lambda x: x + 0.1, lora)  # "train"
    merged, d = lora_merge(params, lora, alpha=4.0)
    a, b = np.asarray(lora["ffn"]["w_up"].a), np.asarray(lora["ffn"]["w_up"].b)
    np.testing.assert_allclose(
        merged["ffn"]["w_up"], np.asarray(params["ffn"]["w_up"]) + 2.0 * a @ b, rtol=1e-5
    )
    a2, b2 = np.asarray(lora["ffn"]["w_down"].a), np.asarray(lora["ffn"]["w_down"].b)
    np.testing.assert_allclose(
        d["ffn"]["w_down"], 2.0 * np.einsum("eir,ero->eio", a2, b2), rtol=1e-5
    )
    np.testing.assert_array_equal(merged["embed"], params["embed"])
    # gradients flow into the factors through lora_apply
    g = jax.grad(lambda lo: jnp.sum(lora_apply(params, lo)["ffn"]["w_up"] ** 2))(lora)
    assert np.any(np.asarray(g["ffn"]["w_up"].b))
    # LoRA + DAREx-q: prune the merged LoRA delta at p=0.9 with a q
    pruned = dare(jax.random.PRNGKey(1), d, 0.9, q=0.3, mask=mask)
    w = np.asarray(pruned["ffn"]["w_up"])
    nz = w != 0
    np.testing.assert_allclose(w[nz], np.asarray(d["ffn"]["w_up"])[nz] / 0.3, rtol=1e-5)
    assert 0.02 < nz.mean() < 0.25
    out = apply(params, pruned)
    assert out["ffn"]["w_up"].shape == (8, 16)
    for rank in (0, 2.5, True):  # True would be rank 1, 2.5 failed deep in jax.random
        with pytest.raises(ValueError, match="an integer >= 1"):
            lora_init(jax.random.PRNGKey(0), params, mask, rank=rank)


def test_lora_dare_prunes_the_factors_and_feeds_the_q_search():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(32, 24)), jnp.float32),
              "b": jnp.zeros((24,), jnp.float32)}
    lora = {"w": lora_init(jax.random.key(0), params, {"w": True, "b": False}, 4)["w"]
            ._replace(b=jnp.asarray(rng.normal(size=(4, 24)), jnp.float32)), "b": None}
    p = 0.9
    pruned = lora_dare(jax.random.key(1), lora, p, q=0.2)
    for full, cut in ((lora["w"].a, pruned["w"].a), (lora["w"].b, pruned["w"].b)):
        kept = np.asarray(cut) != 0
        assert 0.03 < kept.mean() < 0.2  # ~ 1 - p of each factor's entries
        np.testing.assert_allclose(np.asarray(cut)[kept], np.asarray(full)[kept] / 0.2,
                                   rtol=1e-6)
    assert pruned["b"] is None
    delta = lora_factor_pruner(params, p)(jax.random.key(1), lora, 0.2)
    np.testing.assert_allclose(np.asarray(delta["w"]),
                               np.asarray(pruned["w"].a @ pruned["w"].b), rtol=1e-5)
    assert delta["w"].shape == (32, 24) and not np.any(np.asarray(delta["b"]))
    # the q search scores the factor-pruned model at every q
    target = lora_delta(params, lora)

    def score(prm):
        return -float(jnp.mean((prm["w"] - params["w"] - target["w"]) ** 2))

    grid = [0.1, 0.3, 0.6, 1.0]
    r = search_q_v(jax.random.key(1), params, lora, p, score, grid=grid,
                   pruner=lora_factor_pruner(params, p))
    want = [score({"w": params["w"] + lora_factor_pruner(params, p)(jax.random.key(1), lora,
                                                                     q)["w"]}) for q in grid]
    np.testing.assert_allclose(np.asarray(r.scores), want, rtol=1e-5)
    assert r.best == grid[int(np.argmax(want))]
