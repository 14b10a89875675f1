"""``matmul_input_stats`` against the inputs collected by hand: each matrix's mean, mean |x| and
l2 norm per input feature, through nested jit, dtype casts, remat, custom derivatives and
scan / while / cond bodies, accumulated over several batches; a DecoderLM's statistics are the
same with and without remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.delta import analytic_q_tree, delta, matmul_input_stats, select_leaves, wanda_prune
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.moe import MoEConfig

K = jax.random.split(jax.random.key(0), 4)
PARAMS = {"w1": jax.random.normal(K[0], (6, 5)), "w2": jax.random.normal(K[1], (5, 3)),
          "b": jnp.ones((3,))}
X1 = jax.random.normal(K[2], (4, 7, 6))
X2 = jax.random.normal(K[3], (2, 7, 6))


def _mlp(p, x):
    h = jnp.tanh(x @ p["w1"])
    return h @ p["w2"].astype(jnp.bfloat16).astype(jnp.float32) + p["b"], h


def _oracle(*batches):
    """The statistics of the inputs of w1 (the data) and w2 (tanh(x @ w1)), by hand."""
    xs = np.concatenate([np.asarray(x).reshape(-1, 6) for x in batches])
    hs = np.concatenate([np.asarray(_mlp(PARAMS, x)[1]).reshape(-1, 5) for x in batches])
    return {k: (v.mean(0), np.abs(v).mean(0), np.sqrt((v ** 2).sum(0)), len(v))
            for k, v in (("w1", xs), ("w2", hs))}


def _ways():
    """The same two matmuls on X1, reached through each kind of inner program."""
    mlp = lambda p, x: _mlp(p, x)[0]  # noqa: E731

    def custom(p, x):
        f = jax.custom_vjp(lambda p, x: mlp(p, x))
        f.defvjp(lambda p, x: (mlp(p, x), None), lambda r, g: (None, None))
        return f(p, x)

    def jvp(p, x):
        f = jax.custom_jvp(lambda p, x: mlp(p, x))
        f.defjvp(lambda pr, tg: (mlp(*pr), mlp(*pr)))
        return f(p, x)

    def scanned(p, x):  # over the rows of the batch, the matrices closed over
        return jax.lax.scan(lambda c, xi: (c + mlp(p, xi).sum(), None), 0.0, x)[0]

    def looped(p, x):  # fori_loop with a bound only known when run: a while loop
        n = jnp.asarray(x.shape[0]) + 0 * jnp.sum(x).astype(jnp.int32)
        return jax.lax.fori_loop(0, n, lambda i, c: c + mlp(p, x[i]).sum(), 0.0)

    def branched(p, x):  # only the branch taken counts
        return jax.lax.cond(jnp.sum(x) > -1e9, lambda: mlp(p, x), lambda: mlp(p, 2 * x))

    return {"plain": mlp, "nested jit": jax.jit(lambda p, x: jax.jit(mlp)(p, x)),
            "remat": jax.checkpoint(mlp), "custom_vjp": custom, "custom_jvp": jvp,
            "scan": scanned, "while": looped, "cond": branched}


@pytest.mark.parametrize("way", list(_ways()))
def test_statistics_equal_the_inputs_collected_by_hand(way):
    fn = _ways()[way]
    got = matmul_input_stats(lambda p: fn(p, X1), PARAMS)
    assert set(got) == {"w1", "w2"}  # the bias is no matrix
    for k, (mean, mean_abs, l2, count) in _oracle(X1).items():
        assert got[k].count == count, (k, got[k].count)
        np.testing.assert_allclose(got[k].mean, mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[k].mean_abs, mean_abs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[k].l2, l2, rtol=1e-5, atol=1e-6)


def test_several_batches_accumulate_like_one():
    got = matmul_input_stats(lambda p: [_mlp(p, x)[0] for x in (X1, X2)], PARAMS)
    for k, (mean, mean_abs, l2, count) in _oracle(X1, X2).items():
        assert got[k].count == count == (4 + 2) * 7
        for g, want in zip((got[k].mean, got[k].mean_abs, got[k].l2), (mean, mean_abs, l2)):
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_a_matrix_used_transposed_or_nowhere_is_absent_and_none_is_an_error():
    got = matmul_input_stats(lambda p: X1 @ p["w1"] @ p["w2"].T.T, PARAMS)
    assert set(got) == {"w1"}  # w2 enters transposed: a transpose is no cast
    with pytest.raises(ValueError, match="no `x @ W`"):
        matmul_input_stats(lambda p: jnp.sum(p["w1"]) * X1, PARAMS)


def test_a_decoder_has_the_same_statistics_with_and_without_remat():
    ffn = DenseFFNConfig(d_hidden=32, activation="gelu")
    cfg = DecoderConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1,
                        max_seq_len=16, ffn_slots=(ffn,) * 2)
    graphdef, params, rest = nnx.split(DecoderLM(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 9)), jnp.int32)
    stats = [matmul_input_stats(lambda p, r=r: nnx.merge(graphdef, p, rest)(tokens, remat=r)[0],
                                params) for r in (False, True)]
    assert set(stats[0]) == set(stats[1]) and len(stats[0]) == 2 * (4 + 2)  # attn 4, ffn 2
    for k, s in stats[0].items():
        assert s.count == stats[1][k].count == 18
        np.testing.assert_allclose(stats[1][k].mean, s.mean, rtol=1e-5, atol=1e-6)


def test_a_scan_of_no_steps_records_nothing_and_returns_its_outputs():
    def fn(p):
        empty = jax.lax.scan(lambda c, x: (c, x @ p["w1"]), 0.0, jnp.zeros((0, 6)))[1]
        return X1 @ p["w1"], empty
    got = matmul_input_stats(fn, PARAMS)
    assert got["w1"].count == 4 * 7


def test_a_grouped_matmul_records_each_experts_rows_apart():
    """``ragged_dot`` over a stack of experts: expert g's statistics are those of its own
    rows (the rows past the groups, padding, count for none)."""
    w = jax.random.normal(K[0], (3, 6, 4))
    sizes = jnp.asarray([5, 0, 9], jnp.int32)
    x = jax.random.normal(K[1], (16, 6))  # 14 rows in groups, 2 of padding
    got = matmul_input_stats(lambda p: jax.lax.ragged_dot(x, p["w"], sizes), {"w": w})["w"]
    assert got.mean.shape == got.l2.shape == (3, 6) and list(got.count) == [5, 0, 9]
    rows = np.asarray(x)
    for g, (a, b) in enumerate([(0, 5), (5, 5), (5, 14)]):
        want = rows[a:b] if b > a else np.zeros((0, 6))
        np.testing.assert_allclose(got.mean[g], want.mean(0) if b > a else 0, atol=1e-6)
        np.testing.assert_allclose(got.mean_abs[g], np.abs(want).mean(0) if b > a else 0,
                                   atol=1e-6)
        np.testing.assert_allclose(got.l2[g], np.sqrt((want ** 2).sum(0)), atol=1e-5)


def test_an_moe_on_the_dropless_path_gives_per_expert_statistics_for_per_layer_q():
    """Each expert's count is the tokens routed to it; gate and up see the same rows; the
    per-layer q of the experts' deltas follows from them (Eq. 5 per expert unit)."""
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=16, dispatch="ragged")
    cfg = DecoderConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                        max_seq_len=16, ffn_slots=(moe,))
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 9)), jnp.int32)
    stats = matmul_input_stats(lambda p: nnx.merge(graphdef, p, rest)(tokens)[0], params)
    ids = np.asarray(model(tokens)[1]["layers"][0]["expert_ids"]).reshape(-1)
    up, gate, down = (stats[f"blocks/0/ffn/experts/{w}"] for w in ("w_up", "w_gate", "w_down"))
    assert list(up.count) == list(np.bincount(ids, minlength=4)) and up.count.sum() == 18 * 2
    np.testing.assert_array_equal(up.mean, gate.mean)
    assert up.mean.shape == (4, 16) and down.mean.shape == (4, 16)
    tuned = jax.tree.map(lambda a: a + 0.01 * jax.random.normal(K[2], a.shape), params)
    d = delta(params, tuned)
    mask = select_leaves(d, include=r"experts/")
    qs = analytic_q_tree(d, {k: s.mean for k, s in stats.items()}, 0.9, 1.0, mask=mask)
    assert set(qs) >= {"blocks/0/ffn/experts/w_up", "blocks/0/ffn/experts/w_down"}
    assert all(0.1 <= q <= 1.0 for k, q in qs.items() if "experts/" in k)
    pruned = wanda_prune(d, {k: s.l2 for k, s in stats.items()}, 0.5, mask=mask)
    kept = np.asarray(pruned["blocks"][0]["ffn"]["experts"]["w_up"][...]) != 0
    assert kept.shape == (4, 16, 16) and abs(kept.mean() - 0.5) < 0.01
