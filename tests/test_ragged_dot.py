"""tokamax's grouped matmul (moejax.kernels.grouped.ragged), the dropless path dispatch="auto"
takes on GPU and TPU: on the CPU it runs tokamax's reference implementation, whose values and
gradients equal a per-row dense oracle (empty groups included; the "tokamax" dispatch path
against the dense dispatch oracle is in test_kernels_gmm). Exported for an H100 and a TPU v5p
from this CPU, forward and both gradients are tokamax's Mosaic GPU / Mosaic TPU kernels
(three custom calls), at the full presets' widths too, and what tokamax does not take (f32 on
Mosaic GPU, a short contraction on Mosaic TPU) runs on the project's own Pallas kernel, as do
the GPU's products from the size where it was measured faster and the GPU's weight gradient
at every size (tokamax's Hopper kernel for it failed the oracle); the export context leaves
tokamax's device lookup as it found it."""

import logging
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.export as je
import jax.numpy as jnp
import numpy as np
import pytest
from absl import logging as absl_logging

from moejax.kernels.grouped import ragged as rd
from moejax.kernels.moe_ffn import api as dp
from moejax.kernels.moe_ffn.api import dispatch, resolve_dispatch
from moejax.kernels.targets import lowering_target

pytestmark = pytest.mark.skipif(not rd.AVAILABLE, reason="tokamax is not installed "
                                "(pip install -e '.[dev]')")
KERNEL = {"cuda": "mosaic_gpu_v2", "tpu": "tpu_custom_call"}
ROOT = Path(__file__).resolve().parents[1]


def _oracle(x_MK, w_GKN, sizes_G):
    """Row by row: ``x[m] @ w[group of m]``, picked from every group's whole product (no
    weight copied per row)."""
    group_M = np.repeat(np.arange(len(sizes_G)), sizes_G)
    return jnp.einsum("mk,gkn->gmn", x_MK, w_GKN)[group_M, np.arange(len(group_M))]


@pytest.mark.parametrize("sizes", [(5, 0, 9, 2), (16, 0, 0, 0), (1, 1, 1, 13)])
def test_values_and_gradients_equal_the_dense_oracle(sizes):
    m, k, n = sum(sizes), 12, 20
    kx, kw, kc = jax.random.split(jax.random.key(len(sizes) + sizes[0]), 3)
    x = jax.random.normal(kx, (m, k))
    w = jax.random.normal(kw, (len(sizes), k, n))
    ct = jax.random.normal(kc, (m, n))
    gs = jnp.asarray(sizes, jnp.int32)

    def loss(f):
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(f(x, w) * ct), (0, 1)))

    (lv, (gx, gw)) = loss(lambda x, w: rd.ragged_dot(x, w, gs))(x, w)
    (ov, (ox, ow)) = loss(lambda x, w: _oracle(x, w, np.asarray(sizes)))(x, w)
    np.testing.assert_allclose(float(lv), float(ov), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(ox), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(ow), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(gw[np.asarray(sizes) == 0]).max(initial=0.0)) == 0.0  # empty: no grad
    with pytest.raises(ValueError, match="cast one"):
        rd.ragged_dot(x.astype(jnp.bfloat16), w, gs)
    with pytest.raises(ValueError, match=r"\[M, K\] and \[G, K, N\]"):
        rd.ragged_dot(x[:, :5], w, gs)


@pytest.mark.parametrize("m,k,n,sizes", [
    (20, 8, 12, (5, 0, 9, 6)),        # every dimension off the kernels' tiles
    (1000, 64, 100, (300, 0, 650, 50)),
    (7, 100, 65, (0, 7, 0, 0)),
])
def test_bf16_off_tile_shapes_equal_the_oracle(m, k, n, sizes):
    """bf16 is what the accelerator kernels take (on a GPU: Mosaic GPU on zero-padded
    operands); the oracle runs in f32 on the same bf16 inputs."""
    kx, kw, kc = jax.random.split(jax.random.key(m + k + n), 3)
    x = jax.random.normal(kx, (m, k)).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (len(sizes), k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    ct = jax.random.normal(kc, (m, n))
    gs = jnp.asarray(sizes, jnp.int32)

    def grads(f):
        loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * ct)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)

    got = grads(lambda x, w: rd.ragged_dot(x, w, gs))
    want = grads(lambda x, w: _oracle(x.astype(jnp.float32), w.astype(jnp.float32),
                                      np.asarray(sizes)))
    y = rd.ragged_dot(x, w, gs).astype(jnp.float32)
    y_ref = _oracle(x.astype(jnp.float32), w.astype(jnp.float32), np.asarray(sizes))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=2e-2, atol=2e-2)
    for g, o in zip(got[1], want[1]):
        scale = float(jnp.abs(o.astype(jnp.float32)).max()) + 1e-6
        np.testing.assert_allclose(np.asarray(g, np.float32) / scale,
                                   np.asarray(o, np.float32) / scale, atol=2e-2)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("m,k,n,g", [
    (2048, 768, 1408, 8),    # K and N off powers of two
    (512, 2048, 1408, 16),   # D 2048
    (20, 8, 12, 4),          # M, K and N off the Mosaic GPU tiles: zero-padded to them
    (1000, 64, 100, 4),
])
def test_forward_and_both_gradients_export_as_the_platforms_kernels(platform, m, k, n, g):
    def step(x, w, gs):
        loss = lambda x, w: jnp.sum(rd.ragged_dot(x, w, gs).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.value_and_grad(loss, (0, 1))(x, w)

    S = jax.ShapeDtypeStruct
    args = (S((m, k), jnp.bfloat16), S((g, k, n), jnp.bfloat16), S((g,), jnp.int32))
    with lowering_target(platform):
        text = je.export(jax.jit(step), platforms=(platform,))(*args).mlir_module()
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    assert calls.count(KERNEL[platform]) == 3, calls  # forward, dX and dW
    assert not any("callback" in c for c in calls), calls


@pytest.mark.parametrize("platform,dtype,k,kernel", [
    ("cuda", jnp.float32, 256, "__gpu$xla.gpu.triton"),   # Mosaic GPU takes bf16 / f16 only
    ("tpu", jnp.bfloat16, 64, "tpu_custom_call"),          # Mosaic TPU: a contraction >= 128
])
def test_what_tokamax_does_not_take_runs_on_the_own_kernel_never_dense(platform, dtype, k,
                                                                       kernel):
    def step(x, w, gs):
        loss = lambda x, w: jnp.sum(rd.ragged_dot(x, w, gs).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.value_and_grad(loss, (0, 1))(x, w)

    S = jax.ShapeDtypeStruct
    args = (S((512, k), dtype), S((8, k, 384), dtype), S((8,), jnp.int32))
    checks = [je.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with lowering_target(platform):
        text = je.export(jax.jit(step), platforms=(platform,), disabled_checks=checks)(
            *args).mlir_module()
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    assert calls.count(kernel) == 3 and KERNEL["cuda"] not in calls, calls


# tokamax's Hopper kernel for dW (the ragged contraction), which failed the oracle on an H200,
# and the project's Mosaic GPU kernels for dW and for the row products (forward, dX)
TOKAMAX_DW, OURS_DW, OURS_ROWS = ("ragged_contracting_dim_dot_sm90", "moejax_tgmm_mgpu",
                                  "moejax_gmm_mgpu")


def test_large_products_run_on_the_own_kernel_where_it_was_measured_faster():
    """From OWN_FROM_FLOPS on a GPU the forward product is the own Triton gmm (from 130
    GFLOP the own Mosaic GPU one) and dX the own Mosaic GPU one, below it tokamax's Mosaic GPU
    kernels; dW is the own Mosaic GPU kernel at every size (tokamax's was wrong). The TPU and
    the CPU keep tokamax's choice."""
    big, small = (4096, 1024, 1408), (2048, 768, 1408)  # 11.8 and 4.4 GFLOP
    largest = (65536, 2048, 1408)  # 378 GFLOP
    want = {"fwd": ("gmm_mgpu", "gmm", "mosaic_gpu"),
            "dlhs": ("gmm_mgpu", "gmm_mgpu", "mosaic_gpu"),
            "drhs": ("gmm_mgpu", "gmm_mgpu", "gmm_mgpu")}
    assert rd.OWN_FROM_FLOPS == {"cuda": {"fwd": 8e9, "dlhs": 8e9}}
    for which in rd.PASSES:
        assert tuple(rd.implementation("cuda", which, *s)
                     for s in (largest, big, small)) == want[which]
        assert rd.implementation("tpu", which, *big) == "mosaic_tpu"
        assert rd.implementation("cpu", which, *big) == "xla"
    with pytest.raises(ValueError, match="which"):
        rd.implementation("cuda", "dx", *big)

    def step(x, w, gs):
        loss = lambda x, w: jnp.sum(rd.ragged_dot(x, w, gs).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.value_and_grad(loss, (0, 1))(x, w)

    S = jax.ShapeDtypeStruct
    (m, k, n), g = big, 16
    args = (S((m, k), jnp.bfloat16), S((g, k, n), jnp.bfloat16), S((g,), jnp.int32))
    checks = [je.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with lowering_target("cuda"):
        text = je.export(jax.jit(step), platforms=("cuda",), disabled_checks=checks)(
            *args).mlir_module()
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    assert sorted(calls) == ["__gpu$xla.gpu.triton", KERNEL["cuda"], KERNEL["cuda"]], calls
    assert OURS_DW in text and OURS_ROWS in text and TOKAMAX_DW not in text


@pytest.mark.parametrize("kernel", ["measured", "library"])
@pytest.mark.parametrize("m,k,n,g", [(4096, 256, 704, 8), (65536, 2048, 1408, 64)])
def test_the_weight_gradient_never_runs_on_tokamaxs_hopper_kernel(kernel, m, k, n, g):
    """dW at bench_grouped's smallest and largest shapes, with the measured choice and with
    the library's: the project's Mosaic GPU kernel, never tokamax's ragged contraction."""
    def step(x, w, gs):
        loss = lambda x, w: jnp.sum(  # noqa: E731
            rd.ragged_dot(x, w, gs, kernel=kernel).astype(jnp.float32) ** 2)
        return jax.grad(loss, 1)(x, w)

    S = jax.ShapeDtypeStruct
    args = (S((m, k), jnp.bfloat16), S((g, k, n), jnp.bfloat16), S((g,), jnp.int32))
    checks = [je.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with lowering_target("cuda"):
        text = je.export(jax.jit(step), platforms=("cuda",), disabled_checks=checks)(
            *args).mlir_module()
    assert OURS_DW in text and TOKAMAX_DW not in text


@pytest.mark.parametrize("kernel", rd.KERNEL_CHOICES)
def test_bf16_values_and_gradients_at_default_precision_on_this_device(kernel):
    """bench_grouped's smallest shape scaled down (random group sizes off every tile), bf16 at
    the default matmul precision, which is what runs tokamax's Mosaic GPU kernels on a GPU
    (at "highest", as the GPU check's f32 tests set it, tokamax declines and the Triton
    kernel runs): values and both gradients against the float32 oracle, for every kernel
    choice. On the CPU every choice is the reference, checked once."""
    if jax.default_backend() == "cpu" and kernel != "measured":
        pytest.skip("on the CPU every kernel choice runs the reference (the 'measured' case)")
    m, k, n, g = 2048, 256, 384, 8
    kx, kw, kc, kg = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(kx, (m, k)).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (g, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    ct = jax.random.normal(kc, (m, n))
    sizes = np.bincount(np.asarray(jax.random.randint(kg, (m,), 0, g)), minlength=g)
    gs = jnp.asarray(sizes, jnp.int32)

    def grads(f):
        loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * ct)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)

    with jax.default_matmul_precision("default"):
        y = rd.ragged_dot(x, w, gs, kernel=kernel).astype(jnp.float32)
        got = grads(lambda x, w: rd.ragged_dot(x, w, gs, kernel=kernel))
    with jax.default_matmul_precision("highest"):
        y_ref = _oracle(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
        want = grads(lambda x, w: _oracle(x.astype(jnp.float32), w.astype(jnp.float32),
                                          sizes))
    for a, b in ((y, y_ref), *zip(got[1], want[1])):
        scale = float(jnp.abs(b.astype(jnp.float32)).max())
        err = float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()) / scale
        assert err < 2e-2, (kernel, a.shape, err)


@pytest.mark.parametrize("method,triton", [("auto", 2), ("tokamax", 0)])
def test_auto_takes_the_own_kernel_for_large_gpu_products_and_tokamax_keeps_the_library(
        method, triton):
    """An MoE layer's dispatch at 4096 tokens x top-2 over 16 experts of 1024 x 1408 (each
    product 23.6 GFLOP), forward and backward, exported for an H100: ``auto``'s two forward
    products on the Triton gmm and the rest on Mosaic GPU (dX and dW on the own kernel);
    ``tokamax``'s all on Mosaic GPU, dW on the own kernel."""
    N, D, F, E = 4096, 1024, 1408, 16

    def step(x, w_up, w_down, ids, wts):
        def loss(x, w_up, w_down):
            return jnp.sum(dispatch(method, x, ids, wts, w_up, w_down, activation="relu")
                           .y_ND.astype(jnp.float32) ** 2)
        return jax.grad(loss, (0, 1, 2))(x, w_up, w_down)

    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    args = (S((N, D), bf), S((E, D, F), bf), S((E, F, D), bf), S((N, 2), jnp.int32),
            S((N, 2), jnp.float32))
    checks = [je.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with lowering_target("cuda"):
        text = je.export(jax.jit(step), platforms=("cuda",), disabled_checks=checks)(
            *args).mlir_module()
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    # two layers of products: forward, dX and dW
    assert (calls.count("__gpu$xla.gpu.triton"), calls.count(KERNEL["cuda"])) == (
        triton, 6 - triton), calls
    assert OURS_DW in text and TOKAMAX_DW not in text
    assert (OURS_ROWS in text) == (method == "auto")  # dX past OWN_FROM_FLOPS


def test_the_export_context_restores_tokamax_and_auto_picks_it_on_accelerators(monkeypatch):
    lookup = rd.tokamax_gpu_utils()._compute_capability
    local = lookup()  # None on a machine without a GPU
    with lowering_target("cuda"):
        assert rd.tokamax_gpu_utils()._compute_capability() == 9.0
        assert rd.tokamax().config.cross_compile.value is True
    assert rd.tokamax_gpu_utils()._compute_capability is lookup
    assert rd.tokamax().config.cross_compile.value is False
    assert lookup() == local

    monkeypatch.setattr(dp.jax, "default_backend", lambda: "gpu")
    assert resolve_dispatch("auto") == "tokamax"
    monkeypatch.setattr(dp, "target_device", lambda: ("cuda", "NVIDIA H200"))
    assert dp.describe_dispatch("auto") == (
        "tokamax (fwd: mosaic_gpu, gmm from 8 GFLOP, gmm_mgpu from 130 GFLOP; dlhs: "
        "mosaic_gpu, gmm_mgpu from 8 GFLOP; drhs: gmm_mgpu)")
    assert dp.describe_dispatch("tokamax") == "tokamax"
    monkeypatch.setattr(dp, "RAGGED_DOT_AVAILABLE", False)
    assert resolve_dispatch("auto") == "gmm"  # the project's kernel where tokamax is absent


_IMPORTS = """
import sys
import experiments.lm_demo, moejax.harness.experiment, moejax.train.loop  # noqa: E401, F401
print(sorted(m for m in sys.modules if m.split(".")[0] == "tokamax"))
import jax.numpy as jnp
from moejax.kernels.grouped import ragged_dot
ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 4)), jnp.array([3, 1]))
print("tokamax" in sys.modules)
"""


def test_tokamax_is_imported_by_its_first_kernel_not_by_moejax():
    """A study command, the training loop and the harness start without importing tokamax
    (about 1.3 s of every process's start, a refused command's too); the first grouped
    product imports it."""
    proc = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["[]", "True"], proc.stdout


def test_the_export_context_logs_each_autotuning_miss_once(caplog):
    miss = rd.AUTOTUNING_MISS + " for %s on %s with key %s"

    def log_all():
        for key in ("a", "a", "b", "a"):
            absl_logging.warning(miss, "RaggedDot", "TPU v5p", key)
        for _ in range(2):
            absl_logging.warning("another warning")

    def logged():
        lines = [r.getMessage() for r in caplog.records]
        caplog.clear()
        return (sum(m.startswith(rd.AUTOTUNING_MISS) for m in lines),
                lines.count("another warning"))

    with caplog.at_level(logging.WARNING):
        with lowering_target("tpu"):
            log_all()
        assert logged() == (2, 2)  # one line per distinct miss; other lines all kept
        log_all()
        assert logged() == (4, 2)  # outside the export context, nothing is filtered
