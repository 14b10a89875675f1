"""DeRS experts applied from the shared weight and the selected experts' increments
(moejax.ops.ders_apply, ``DeRSMoEConfig.synthesis="selected"``) against synthesising every
expert and running the dense dispatch oracle, and streamed one expert at a time
(``synthesis="stream"``) against synthesising every expert and running the capacity dispatch:
outputs and gradients, SM and LM, gated and not; the increment products against numpy; the
streamed gradient's memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.nn.ders_moe import DeRSMoEConfig
from moejax.nn.moe import MoEConfig
from moejax.ops.ders_apply import delta_product

D, F, E = 12, 20, 5


def test_delta_products_equal_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, D)).astype(np.float32)
    e = rng.integers(0, E, 7)
    idx = np.stack([rng.choice(D * F, 9, replace=False) for _ in range(E)]).astype(np.int32)
    v = rng.normal(size=(E, 9)).astype(np.float32)
    want = np.zeros((7, F))
    for p in range(7):
        dense = np.zeros(D * F)
        dense[idx[e[p]]] = v[e[p]]
        want[p] = x[p] @ dense.reshape(D, F)
    got = delta_product("sm", jnp.asarray(x), jnp.asarray(e), {"idx": idx, "v": v}, F)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    a, b = rng.normal(size=(E, D, 3)), rng.normal(size=(E, 3, F))
    want = np.stack([x[p] @ a[e[p]] @ b[e[p]] for p in range(7)])
    got = delta_product("lm", jnp.asarray(x), jnp.asarray(e), {"a": a, "b": b}, F)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def _layer(form, activation, synthesis, dispatch="dense", capacity=1.25, d=D, f=F, e=E):
    moe = MoEConfig(n_experts=e, top_k=2, d_expert=f, activation=activation, dispatch=dispatch,
                    capacity_factor=capacity)
    cfg = DeRSMoEConfig(moe=moe, form=form, sm_rate=0.8, lm_rank=3, synthesis=synthesis)
    layer = cfg.build(d, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)  # non-zero increments (they start at zero)
    for path, var in nnx.iter_graph(layer):
        if isinstance(var, nnx.Param) and path[-1][:2] in ("v_", "b_"):
            var[...] = jnp.asarray(rng.normal(size=var[...].shape) * 0.3, jnp.float32)
    return layer


@pytest.mark.parametrize("form", ["sm", "lm"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("synthesis,dispatch,capacity", [
    ("selected", "dense", 1.25),   # dropless, against the dense oracle
    ("stream", "capacity", 0.6),   # some assignments dropped, by the same rule on both paths
])
def test_synthesis_paths_equal_synthesising_every_expert(form, activation, synthesis, dispatch,
                                                         capacity):
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 6, D)), jnp.float32)
    ct = jnp.cos(jnp.arange(2 * 6 * D, dtype=jnp.float32)).reshape(2, 6, D)
    real = jnp.arange(6)[None, :] < jnp.array([[6], [3]])  # padding takes no capacity

    def loss(layer):
        y, aux = layer(x, mask_BT=real)
        return jnp.sum(y * ct), (y, aux["dropped_fraction"])

    (g_all, (y_all, drop_all)), (g_new, (y_new, drop_new)) = (
        _grad(_layer(form, activation, s, dispatch=dispatch, capacity=capacity), loss)
        for s in ("all", synthesis))
    assert float(drop_new) == float(drop_all)
    assert (float(drop_all) > 0) == (dispatch == "capacity")
    _assert_same_grads(y_all, g_all, y_new, g_new)


def _grad(layer, loss):
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    grad = jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest)), has_aux=True)
    return jax.jit(grad)(params)


def _assert_same_grads(y_all, g_all, y_sel, g_sel):
    np.testing.assert_allclose(np.asarray(y_sel), np.asarray(y_all), rtol=1e-4, atol=1e-5)
    flat_all, flat_sel = (dict(nnx.to_flat_state(g)) for g in (g_all, g_sel))
    assert flat_all.keys() == flat_sel.keys()
    for k, v in flat_all.items():
        np.testing.assert_allclose(np.asarray(flat_sel[k][...]), np.asarray(v[...]),
                                   rtol=1e-4, atol=1e-5, err_msg=str(k))
    increments = [k for k in flat_all if k[-1][:2] in ("v_", "b_")]
    assert increments and all(np.abs(np.asarray(flat_all[k][...])).max() > 1e-4
                              for k in increments)


def test_streamed_gradient_keeps_one_experts_weights():
    """Compiled temporaries of the layer's gradient, 16 SwiGLU experts of 64 x 256: the
    synthesise-all path keeps the 16 x 3 synthesised matrices for the backward (3.1 MB; 4.0 MB
    of temporaries measured), the streamed one about one expert's (0.58 MB measured)."""
    x = jnp.ones((4, 32, 64), jnp.float32)
    temp = {}
    for s in ("all", "stream"):
        layer = _layer("lm", "swiglu", s, dispatch="capacity", d=64, f=256, e=16)
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        grad = jax.jit(jax.grad(lambda p, g=graphdef, r=rest: jnp.sum(nnx.merge(g, p, r)(x)[0])))
        temp[s] = grad.lower(params).compile().memory_analysis().temp_size_in_bytes
    copies = 16 * 3 * 64 * 256 * 4
    assert temp["all"] > copies, temp
    assert temp["stream"] < temp["all"] - 0.75 * copies, temp
