"""MoE slot (moejax.nn.moe / moejax.nn.router) against numpy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, from_json, to_json
from moejax.config_overrides import apply_overrides
from moejax.kernels.moe_ffn.jnp_paths import ffn_apply
from moejax.nn.moe import MoE, MoEConfig
from moejax.nn.moe_layer import SOWN, MoELayer
from moejax.nn.router import NoisyTopKRouter, SoftmaxRouter
from moejax.train import TrainConfig, train
from tests.devices import run_on_devices

B, T, D, F, E, K = 2, 5, 8, 12, 4, 2


def _silu(v):
    return v / (1 + np.exp(-v))


def _np_ffn(x, w_up, w_down, w_gate):
    w_up, w_down = np.asarray(w_up, np.float64), np.asarray(w_down, np.float64)
    up = x @ w_up
    h = _silu(x @ np.asarray(w_gate, np.float64)) * up if w_gate is not None else np.maximum(up, 0)
    return h @ w_down


def _np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(-1, keepdims=True)


def _np_route(logits, k, renormalize):
    probs = _np_softmax(logits)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    sel = np.take_along_axis(probs, ids, -1)
    w = sel / sel.sum(-1, keepdims=True) if renormalize else sel
    return ids, w, probs


def _x(seed=0, b=B, t=T):
    return jax.random.normal(jax.random.key(seed), (b, t, D), jnp.float32)


def _mask():
    return jnp.ones((B, T), bool).at[1, 3:].set(False)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("kw, field", [
    (dict(top_k=5), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(d_expert=0), "d_expert"),
    (dict(n_shared_experts=-1), "n_shared_experts"),
    (dict(d_shared=16), "d_shared"),
    (dict(d_universal=16), "d_universal"),
    (dict(router="noisy", renormalize=False), "renormalize"),
    (dict(balance_coef=-1.0), "balance_coef"),
    (dict(dispatch="sparse"), "dispatch"),
    (dict(balance_loss="l2"), "balance_loss"),
    (dict(activation="tanh"), "activation"),
])
def test_config_validation_names_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        MoEConfig(**{"n_experts": E, **kw})


def test_config_overrides_and_json_roundtrip():
    cfg = apply_overrides(MoEConfig(), ["dispatch=ragged", "top_k=1", "d_shared=none"])
    assert cfg.dispatch == "ragged" and cfg.top_k == 1
    assert from_json(to_json(cfg)) == cfg


# ----------------------------------------------------------------------------- params


def test_parameter_paths_and_shapes():
    cfg = MoEConfig(n_experts=E, top_k=K, d_expert=F, router="noisy", n_shared_experts=2,
                    d_shared=3, universal_ffn=True, d_universal=5)
    m = cfg.build(D, rngs=nnx.Rngs(0))
    shapes = {"/".join(map(str, path)): tuple(v.shape)
              for path, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
    assert shapes == {
        "experts/w_gate": (E, D, F), "experts/w_up": (E, D, F), "experts/w_down": (E, F, D),
        "router/w_g": (D, E), "router/w_noise": (D, E),
        "shared/w_gate": (D, 6), "shared/w_up": (D, 6), "shared/w_down": (6, D),
        "universal/w_gate": (D, 5), "universal/w_up": (D, 5), "universal/w_down": (5, D),
    }
    m2 = MoEConfig(n_experts=E, top_k=K, d_expert=F, activation="relu").build(D, rngs=nnx.Rngs(0))
    names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(m2, nnx.Param))}
    assert names == {"experts/w_up", "experts/w_down", "router/w_g"}


# ----------------------------------------------------------------------------- routers


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_router_matches_numpy(renormalize):
    r = SoftmaxRouter(D, E, K, renormalize=renormalize, rngs=nnx.Rngs(1))
    x = _x(1).reshape(-1, D)
    out = r(x)
    logits = np.asarray(x, np.float64) @ np.asarray(r.w_g[...], np.float64)
    ids, w, probs = _np_route(logits, K, renormalize)
    np.testing.assert_array_equal(np.asarray(out.ids_NK), ids)
    np.testing.assert_allclose(np.asarray(out.weights_NK), w, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out.probs_NE), probs, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out.logits_NE), logits, rtol=1e-5, atol=1e-6)
    assert out.weights_NK.dtype == jnp.float32
    assert np.allclose(np.asarray(out.weights_NK).sum(-1), 1.0) == renormalize


def test_noisy_router_formula_eval_and_train():
    r = NoisyTopKRouter(D, E, K, rngs=nnx.Rngs(2))
    r.w_noise[...] = jax.random.normal(jax.random.key(9), (D, E)) * 0.5
    x = _x(2).reshape(-1, D)
    xn = np.asarray(x, np.float64)
    clean = xn @ np.asarray(r.w_g[...], np.float64)

    ev = r(x, train=False)  # eval: no noise, no key needed
    ids, w, _ = _np_route(clean, K, True)
    np.testing.assert_array_equal(np.asarray(ev.ids_NK), ids)
    np.testing.assert_allclose(np.asarray(ev.weights_NK), w, rtol=1e-5)

    key = jax.random.key(3)
    tr = r(x, train=True, key=key)
    eps = np.asarray(jax.random.normal(key, clean.shape, jnp.float32), np.float64)
    h = clean + eps * np.log1p(np.exp(xn @ np.asarray(r.w_noise[...], np.float64)))
    ids, w, probs = _np_route(h, K, True)
    # G = softmax over the kept logits only.
    kept = np.take_along_axis(h, ids, -1)
    np.testing.assert_allclose(w, _np_softmax(kept), rtol=1e-10)
    np.testing.assert_array_equal(np.asarray(tr.ids_NK), ids)
    np.testing.assert_allclose(np.asarray(tr.weights_NK), w, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(tr.probs_NE), probs, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(tr.logits_NE), h, rtol=1e-5, atol=1e-5)

    other = r(x, train=True, key=jax.random.key(4))
    assert not np.allclose(np.asarray(other.logits_NE), np.asarray(tr.logits_NE))
    with pytest.raises(ValueError, match="explicit PRNG key"):
        r(x, train=True)


# ----------------------------------------------------------------------------- forward


def _np_moe_forward(m: MoE, x_BTD):
    """Dense numpy reference of the whole slot (eval mode)."""
    x = np.asarray(x_BTD, np.float64).reshape(-1, D)
    ids, w, _ = _np_route(x @ np.asarray(m.router.w_g[...], np.float64), m.top_k,
                          m.cfg.renormalize)
    ex = m.experts
    gate = getattr(ex, "w_gate", None)
    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[n, k]
            y[n] += w[n, k] * _np_ffn(x[n], ex.w_up[...][e], ex.w_down[...][e],
                                      None if gate is None else gate[...][e])
    for name in ("shared", "universal"):
        if hasattr(m, name):
            sub = getattr(m, name)
            y += _np_ffn(x, sub.w_up[...], sub.w_down[...],
                         sub.w_gate[...] if hasattr(sub, "w_gate") else None)
    return y.reshape(x_BTD.shape)


@pytest.mark.parametrize("dispatch", ["dense", "capacity", "ragged"])
@pytest.mark.parametrize("extras", [False, True])
def test_forward_matches_numpy(dispatch, extras):
    cfg = MoEConfig(n_experts=E, top_k=K, d_expert=F, dispatch=dispatch, capacity_factor=E / K,
                    renormalize=not extras, n_shared_experts=2 if extras else 0,
                    universal_ffn=extras)
    m = cfg.build(D, rngs=nnx.Rngs(5))
    x = _x(5)
    y, aux = m(x)
    np.testing.assert_allclose(np.asarray(y), _np_moe_forward(m, x), rtol=1e-5, atol=1e-5)
    assert float(aux["dropped_fraction"]) == 0.0


@pytest.mark.parametrize("dispatch", ["dense", "capacity", "ragged"])
@pytest.mark.parametrize("router", ["softmax", "noisy"])
def test_identical_experts_equal_single_ffn(dispatch, router):
    """Upcycling property: identical experts + renormalised weights == the FFN itself."""
    cfg = MoEConfig(n_experts=E, top_k=K, d_expert=F, dispatch=dispatch, router=router,
                    renormalize=True, capacity_factor=E / K)
    m = cfg.build(D, rngs=nnx.Rngs(6))
    ks = jax.random.split(jax.random.key(6), 3)
    w_gate = jax.random.normal(ks[0], (D, F)) / np.sqrt(D)
    w_up = jax.random.normal(ks[1], (D, F)) / np.sqrt(D)
    w_down = jax.random.normal(ks[2], (F, D)) / np.sqrt(F)
    m.experts.w_gate[...] = jnp.broadcast_to(w_gate, (E, D, F))
    m.experts.w_up[...] = jnp.broadcast_to(w_up, (E, D, F))
    m.experts.w_down[...] = jnp.broadcast_to(w_down, (E, F, D))
    x = _x(6)
    want = ffn_apply(x, w_up, w_down, w_gate, activation="swiglu")
    y, _ = m(x, train=True, key=jax.random.key(0))
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)
    if router == "softmax":  # without renormalisation the output is scaled by sum_k p_k < 1
        m2 = MoEConfig(n_experts=E, top_k=K, d_expert=F, dispatch=dispatch, renormalize=False,
                       capacity_factor=E / K).build(D, rngs=nnx.Rngs(6))
        nnx.update(m2, nnx.state(m, nnx.Param))
        y2, _ = m2(x)
        assert not np.allclose(np.asarray(y2), np.asarray(want), atol=1e-3)


# ----------------------------------------------------------------------------- aux


@pytest.mark.parametrize("balance", ["switch", "cv2", "none"])
def test_aux_statistics_with_padding_mask(balance):
    cfg = MoEConfig(n_experts=E, top_k=K, d_expert=F, dispatch="capacity", capacity_factor=E / K,
                    balance_loss=balance, balance_coef=0.03, z_loss_coef=0.002)
    m = cfg.build(D, rngs=nnx.Rngs(7))
    x, mask = _x(7), _mask()
    _, aux = m(x, mask_BT=mask)
    xn = np.asarray(x, np.float64).reshape(-1, D)
    real = np.asarray(mask).reshape(-1)
    logits = xn @ np.asarray(m.router.w_g[...], np.float64)
    ids, w, probs = _np_route(logits, K, True)
    lr, ir, wr, pr = logits[real], ids[real], w[real], probs[real]
    counts = np.bincount(ir.reshape(-1), minlength=E).astype(float)
    load = counts / counts.sum()
    sel = np.take_along_axis(pr, ir, -1).sum(-1).mean()
    z = (np.log(np.exp(lr).sum(-1)) ** 2).mean()
    if balance == "switch":
        bal = E * np.sum(load * pr.mean(0))
    elif balance == "cv2":
        gates = np.zeros_like(pr)
        np.put_along_axis(gates, ir, wr, -1)
        cv2 = lambda v: np.var(v, ddof=1) / (v.mean() ** 2 + 1e-10)  # noqa: E731
        bal = cv2(counts) + cv2(gates.sum(0))
    else:
        bal = 0.0
    np.testing.assert_allclose(np.asarray(aux["load"]), load, rtol=1e-5)
    np.testing.assert_allclose(float(aux["gate_mass_selected"]), sel, rtol=1e-5)
    np.testing.assert_allclose(float(aux["gate_mass_unselected"]), 1 - sel, rtol=1e-5)
    np.testing.assert_allclose(float(aux["z_loss"]), z, rtol=1e-5)
    np.testing.assert_allclose(float(aux["balance_loss"]), bal, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(aux["aux_loss"]), 0.03 * bal + 0.002 * z, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(aux["expert_ids"]), ids.reshape(B, T, K))
    assert float(aux["dropped_fraction"]) == 0.0

    # Padding positions may hold anything: losses and statistics do not change.
    x2 = x.at[1, 3:].set(100.0 * _x(8)[1, 3:])
    _, aux2 = m(x2, mask_BT=mask)
    for name in ("aux_loss", "balance_loss", "z_loss", "load", "gate_mass_selected"):
        np.testing.assert_allclose(np.asarray(aux2[name]), np.asarray(aux[name]), rtol=1e-6)


def test_capacity_drop_reported_and_top_k_override():
    m = MoEConfig(n_experts=E, top_k=K, d_expert=F, dispatch="capacity",
                  capacity_factor=0.25).build(D, rngs=nnx.Rngs(9))
    _, aux = m(_x(9))
    assert 0.0 < float(aux["dropped_fraction"]) < 1.0
    m.top_k = E  # "activate all experts" (distillation): every expert selected, full mass
    for disp in ("dense", "ragged"):
        m.cfg = m.cfg.replace(dispatch=disp)
        _, aux = m(_x(9))
        assert aux["expert_ids"].shape == (B, T, E)
        np.testing.assert_allclose(float(aux["gate_mass_selected"]), 1.0, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(aux["load"]), np.full(E, 1 / E), rtol=1e-6)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("router", ["softmax", "noisy"])
def test_jit_grad_train_step(router):
    cfg = MoEConfig(n_experts=E, top_k=K, d_expert=F, router=router, dispatch="capacity",
                    n_shared_experts=1, universal_ffn=True, z_loss_coef=1e-3)
    m = cfg.build(D, rngs=nnx.Rngs(10))
    x, mask = _x(10), _mask()

    @nnx.jit
    def loss_and_grad(model, x, key):
        def loss_fn(model):
            y, aux = model(x, train=True, key=key, mask_BT=mask)
            return jnp.mean(y**2) + aux["aux_loss"]
        return nnx.value_and_grad(loss_fn)(model)

    loss, grads = loss_and_grad(m, x, jax.random.key(0))
    assert np.isfinite(float(loss))
    flat = {"/".join(map(str, p)): np.asarray(v) for p, v in nnx.to_flat_state(grads)}
    for name in ("router/w_g", "experts/w_up", "experts/w_down", "experts/w_gate",
                 "shared/w_up", "universal/w_down"):
        assert np.abs(flat[name]).max() > 0, name
    if router == "noisy":
        assert np.abs(flat["router/w_noise"]).max() > 0
    # eager == jit
    y_eager, _ = m(x, train=True, key=jax.random.key(0), mask_BT=mask)
    y_jit, _ = nnx.jit(lambda mm, xx: mm(xx, train=True, key=jax.random.key(0), mask_BT=mask))(m, x)
    np.testing.assert_allclose(np.asarray(y_jit), np.asarray(y_eager), rtol=1e-5, atol=1e-6)


def test_bf16_compute_dtype():
    m = MoEConfig(n_experts=E, top_k=K, d_expert=F).build(D, rngs=nnx.Rngs(11), dtype=jnp.bfloat16)
    y, aux = m(_x(11))
    assert y.dtype == jnp.bfloat16 and aux["load"].dtype == jnp.float32
    assert m.experts.w_up[...].dtype == jnp.float32


def test_moe_layer_is_an_nnx_layer_over_the_same_moe():
    """MoELayer(cfg, d_model, rngs=) returns the MoE's output alone, sows its auxiliary
    losses and statistics as nnx.Intermediate, follows model.train() / model.eval(), and
    draws the noisy router's noise from its own rng stream (a new draw each call)."""
    cfg = MoEConfig(n_experts=E, top_k=K, d_expert=F, router="noisy", dispatch="dense")
    layer = MoELayer(cfg, D, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    layer.eval()
    y, sown = nnx.capture(layer, nnx.Intermediate)(x)
    want, aux = layer.moe(x, train=False)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    for name in SOWN:
        np.testing.assert_allclose(np.asarray(sown[name][0]), np.asarray(aux[name]))
    assert not nnx.state(layer, nnx.Intermediate)  # captured: nothing left on the layer
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(y))  # eval: no noise
    layer.train()
    a, b = layer(x), layer(x)
    assert not np.allclose(np.asarray(a), np.asarray(b))  # a fresh draw per call
    assert not np.allclose(np.asarray(a), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(layer(x, deterministic=True)), np.asarray(y))
    with pytest.raises(TypeError, match="cfg must be a MoEConfig"):
        MoELayer(D, cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dispatch", ["dense", "capacity"])
def test_moe_layer_takes_any_leading_shape_as_a_linear_does(dispatch):
    """[N, D] and [A, B, T, D] inputs (a flat token list, an image's patch grid) route each
    token as [B, T, D] does: the same outputs token for token, the same sown statistics, the
    mask in the input's leading shape; a 1-D input, a mask of another shape and a width of 0
    are refused naming the shapes."""
    cfg = MoEConfig(n_experts=E, top_k=K, d_expert=F, dispatch=dispatch, capacity_factor=2.0)
    layer = MoELayer(cfg, D, rngs=nnx.Rngs(0), deterministic=True)
    x, mask = _x(3), _mask()
    want, sown = nnx.capture(layer, nnx.Intermediate)(x, mask_BT=mask)
    for shape in ((B * T, D), (B, 1, T, D), (B, T, 1, D)):
        y, got = nnx.capture(layer, nnx.Intermediate)(x.reshape(shape),
                                                      mask_BT=mask.reshape(shape[:-1]))
        assert y.shape == shape
        np.testing.assert_allclose(np.asarray(y).reshape(B, T, D), np.asarray(want),
                                   rtol=1e-6, atol=1e-6)
        for name in ("aux_loss", "load", "dropped_fraction"):
            np.testing.assert_allclose(np.asarray(got[name][0]), np.asarray(sown[name][0]),
                                       rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"input of shape \(8,\); it needs a leading"):
        layer(x[0, 0])
    with pytest.raises(ValueError, match=r"mask_BT of shape \(2, 4\) for input"):
        layer(x, mask_BT=mask[:, :4])
    with pytest.raises(ValueError, match="d_model=0 must be a positive int"):
        MoELayer(cfg, 0, rngs=nnx.Rngs(0))


_EXPLICIT_MESH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from moejax.kernels.moe_ffn.api import expert_mesh_axes
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_layer import MoELayer

mesh = jax.make_mesh((2, 4), ("batch", "model"))  # jax's default: explicit axes
assert mesh.axis_types == (jax.sharding.AxisType.Explicit,) * 2

class Net(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(8, 16, rngs=rngs)
        self.moe = MoELayer(MoEConfig(n_experts=4, top_k=2, d_expert=8, router="noisy"), 16,
                            rngs=rngs)
        self.head = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.moe(self.proj(x)))

def loss_fn(model, x, y):
    pred, sown = nnx.capture(model, nnx.Intermediate)(x)
    return jnp.mean((pred - y) ** 2) + sown["moe"]["aux_loss"][0]

x = jax.random.normal(jax.random.key(1), (16, 4, 8))
y = jnp.sum(x, -1, keepdims=True)
ref = Net(nnx.Rngs(0))
ref.eval()
want_loss, want_grads = nnx.jit(nnx.value_and_grad(loss_fn))(ref, x, y)  # one program
model = Net(nnx.Rngs(0))
model.eval()
with jax.set_mesh(mesh), expert_mesh_axes("batch", "model"):
    xs, ys = jax.device_put(x, P("batch")), jax.device_put(y, P("batch"))
    for experts in ("replicated", "sharded"):
        if experts == "sharded":  # the experts split over "model", as a user would
            gd, st = nnx.split(model)
            st = jax.tree_util.tree_map_with_path(lambda p, v: jax.device_put(
                v, P("model") if "experts" in jax.tree_util.keystr(p) else P()), st)
            model = nnx.merge(gd, st)
        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, xs, ys)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        y_out = nnx.jit(lambda m, x: m.moe(m.proj(x)))(model, xs)
        assert y_out.sharding.spec == P("batch", None, None), y_out.sharding
        text = jax.jit(lambda st, x: nnx.merge(nnx.graphdef(model), st).moe(x)).lower(
            nnx.state(model), jnp.zeros((16, 4, 16), device=xs.sharding)).as_text()
        assert "all_to_all" in text or "all-to-all" in text
        print(experts, "OK")
    model.train()  # the noisy router's noise, and optimizer steps
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, xs, ys)) for _ in range(5)]
    assert losses[-1] < losses[0], losses
print("OK")
"""


@pytest.mark.slow
def test_moe_layer_runs_expert_parallel_under_a_mesh_of_explicit_axes():
    """Under a mesh from jax.make_mesh (explicit axes by default) with the README's
    expert_mesh_axes, a user's model with a MoELayer gives the single-device loss and
    gradients, replicated or expert-sharded weights alike, runs all-to-all expert
    parallelism, keeps the batch sharding of its output, and trains with the noisy router."""
    out = run_on_devices(_EXPLICIT_MESH_SCRIPT)
    assert "replicated OK" in out and "sharded OK" in out, out[-2000:]


def test_a_user_model_with_a_moe_layer_trains_in_the_training_loop():
    """A user's model holding a noisy-router MoELayer (its own rng stream) trains through
    moejax's loop: each step draws new noise (the stream's count comes back), and the loss
    falls."""
    class Net(nnx.Module):
        def __init__(self, rngs):
            cfg = MoEConfig(n_experts=E, top_k=K, d_expert=F, router="noisy")
            self.moe = MoELayer(cfg, D, rngs=rngs)
            self.head = nnx.Linear(D, 1, rngs=rngs)

    def source(position):
        x = np.random.default_rng([5, position]).normal(size=(B, T, D)).astype(np.float32)
        return {"x": x, "y": x.sum(-1)}

    def loss_fn(net, batch, key, train=True):
        y = net.head(net.moe(batch["x"], deterministic=not train))[..., 0]
        return jnp.mean((y - batch["y"]) ** 2)

    net = Net(nnx.Rngs(0))
    hist = train(net, source, TrainConfig(steps=8, batch_size=B, lr=3e-2, warmup_steps=0),
                 loss_fn=loss_fn, progress=False)
    assert int(net.moe.rngs.count[...]) == 8
    assert hist[-1]["loss"] < hist[0]["loss"]


@pytest.mark.parametrize("router", [SoftmaxRouter, NoisyTopKRouter])
def test_routers_start_with_variance_one_over_d_model(router):
    kw = {"renormalize": True} if router is SoftmaxRouter else {}
    r = router(256, 64, 2, rngs=nnx.Rngs(0), **kw)
    w = np.asarray(r.w_g[...])
    assert w.std() == pytest.approx(256 ** -0.5, rel=0.02) and abs(w.mean()) < 3e-3
    if router is NoisyTopKRouter:  # the noise weights start at 0: noise std softplus(0)
        assert not np.any(np.asarray(r.w_noise[...]))
