"""The Mosaic GPU decode kernel (one chunk of 1 to 64 tokens on a Hopper GPU, one launch) in
Mosaic GPU's interpreter: it equals the dense oracle for every activation and chunk length;
it reads no weight of an expert outside the chunk's union; its gradient (recomputed through
the pair kernels) is the oracle's; it lowers for ``cuda`` to one Mosaic GPU custom call at the
benchmark shapes, and ``chunk_union_auto`` takes it for a decode-sized bf16 chunk on a Hopper
GPU (a float32 chunk: the dense product with the non-members weighted 0, which equals the
union path in values and gradients); bad calls are refused before any lowering. The interpreter
stands in for the TMA reduce-add with a read-modify-write (the module docstring); a GPU run
proves the rest."""

import json
import re

import jax
import jax.export as je
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import tuning
from moejax.kernels.activation_forms import kernel_activation
from moejax.kernels.chunk_union import decode_gpu
from moejax.kernels.chunk_union.decode_gpu import (
    TUNED_ROWS,
    blocks,
    chunk_rows,
    chunk_union_decode_gpu,
    l2_boxes,
    l2_prefetch,
    smem_bytes,
    supports,
)
from moejax.kernels.chunk_union.pallas import chunk_union_auto, decode_chunk, decode_route
from moejax.kernels.chunk_union.reference import chunk_union_experts, dense_chunk, dense_experts
from moejax.kernels.mgpu import SMEM_BYTES, blocks_per_sm
from moejax.kernels.targets import lowering_target
from moejax.kernels.tiling import hopper_target
from moejax.ops.activations import ACTIVATIONS, activation_fn, is_gated
from moejax.train.aot import TRITON

E, D, F = 6, 256, 128  # two D blocks: the down-projection alternates its buffers
BF = jnp.bfloat16


def _chunk(n, activation, seed=0, density=0.3):
    k = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(k[0], (n, D)).astype(BF)
    on = jax.random.uniform(k[1], (n, E)) < density
    a = jnp.where(on, jax.random.uniform(k[2], (n, E), minval=0.1, maxval=1.0), 0.0)
    w = [(jax.random.normal(kk, s) / np.sqrt(s[1])).astype(BF)
         for kk, s in ((k[3], (E, D, F)), (k[4], (E, F, D)), (k[5], (E, D, F)))]
    return x, a, on, w[0], w[1], w[2] if is_gated(activation) else None


def _oracle(x, a, wu, wd, wg, activation):
    f32 = lambda z: None if z is None else z.astype(jnp.float32)  # noqa: E731
    return jax.jit(dense_experts, static_argnums=5)(f32(x), a, f32(wu), f32(wd), f32(wg),
                                                    activation)


def _steps(y, want) -> float:
    """The largest error of a bf16 output of float32 sums, in bf16 steps (2^-8) of the
    oracle's largest value (tests accept 2); inf when the output is not bf16."""
    if y.dtype != BF:
        return float("inf")
    err = np.abs(np.asarray(y, np.float32) - np.asarray(want, np.float32)).max()
    if err == 0:
        return 0.0
    largest = np.abs(np.asarray(want)).max()  # an all-zero oracle must be met exactly
    return float(err / (2.0 ** -8 * largest)) if largest > 0 else float("inf")


@pytest.mark.parametrize("activation,n", list(zip(sorted(ACTIVATIONS), [1, 8, 17, 33, 64, 5])))
def test_the_kernel_equals_the_dense_oracle(activation, n):
    x, a, on, wu, wd, wg = _chunk(n, activation, seed=n)
    y = chunk_union_decode_gpu(x, a, on, wu, wd, wg, activation=activation, interpret=True)
    assert _steps(y, _oracle(x, a, wu, wd, wg, activation)) <= 2


ON_HOPPER = jax.default_backend() == "gpu" and hopper_target()


@pytest.mark.skipif(not ON_HOPPER, reason="the compiled kernel needs a Hopper GPU (make gpu-check)")
@pytest.mark.parametrize("activation,n,residual", [("swish", 1, False), ("swiglu", 8, False),
                                                   ("geglu", 64, False), ("relu", 5, True),
                                                   ("swiglu", 1, True)])
def test_the_compiled_kernel_equals_the_dense_oracle_on_a_hopper_gpu(activation, n, residual):
    """The kernel as the GPU runs it: TMA reduce-add (the rows past ``n`` dropped, into zeros
    or a residual), wgmma, early exit."""
    x, a, on, wu, wd, wg = _chunk(n, activation, seed=n)
    r = (4 * jax.random.normal(jax.random.key(n), x.shape)).astype(BF) if residual else None
    y = jax.jit(lambda *z: chunk_union_decode_gpu(*z[:6], activation=activation,
                                                  residual_nD=z[6]))(x, a, on, wu, wd, wg, r)
    want = _oracle(x, a, wu, wd, wg, activation)
    assert _steps(y, want if r is None else want + r.astype(jnp.float32)) <= 2


@pytest.mark.skipif(not ON_HOPPER, reason="the compiled kernel needs a Hopper GPU (make gpu-check)")
@pytest.mark.parametrize("prefetch,splits", [(1, 1), (2, 1), (0, 2), (2, 2)])
def test_the_compiled_kernel_with_a_prefetch_or_a_split_equals_the_oracle(prefetch, splits):
    """The TMA prefetches and the split programs' reduce-adds as the GPU runs them."""
    x, a, on, wu, wd, wg = _chunk(5, "swiglu", seed=11)
    with tuning.forced(tuning.TritonConfig(128, 64, 128, 4, 3, prefetch, splits)):
        y = jax.jit(lambda *z: chunk_union_decode_gpu(*z, activation="swiglu"))(
            x, a, on, wu, wd, wg)
    assert _steps(y, _oracle(x, a, wu, wd, wg, "swiglu")) <= 2


@pytest.mark.parametrize("n,activation", [(1, "swiglu"), (5, "relu"), (40, "geglu")])
def test_a_residual_is_the_start_of_the_sum(n, activation):
    """With a residual the kernel returns ``residual + y``, rounded once to the residual's
    dtype (bf16 here, a decoder's residual stream; float32 for the last case), and its
    gradient through :func:`decode_chunk` gives the residual the output's cotangent."""
    x, a, on, wu, wd, wg = _chunk(n, activation, seed=20 + n)
    dtype = jnp.float32 if n == 40 else BF
    r = (4 * jax.random.normal(jax.random.key(n), x.shape)).astype(dtype)
    y = jax.jit(lambda r: chunk_union_decode_gpu(x, a, on, wu, wd, wg, activation=activation,
                                                 interpret=True, residual_nD=r))(r)
    assert y.dtype == dtype
    want = r.astype(jnp.float32) + _oracle(x, a, wu, wd, wg, activation)
    err = np.abs(np.asarray(y, np.float32) - np.asarray(want)).max()
    assert err <= (2 * 2.0 ** -8 if dtype == BF else 1e-3) * np.abs(np.asarray(want)).max()
    ct = jax.random.normal(jax.random.key(1), x.shape)
    dr = jax.jit(jax.grad(lambda r: jnp.sum(decode_chunk(
        x, a, on, wu, wd, wg, r, activation, True, "mosaic_gpu").astype(jnp.float32) * ct)))(r)
    np.testing.assert_array_equal(np.asarray(dr), np.asarray(ct.astype(dtype)))
    with pytest.raises(ValueError, match="residual"):
        chunk_union_decode_gpu(x, a, on, wu, wd, wg, activation=activation,
                               residual_nD=r[:, :8])


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_the_kernels_activations_are_the_models(activation):
    """What the kernels compute (primitives every backend lowers) is jax.nn's function."""
    x = jnp.concatenate([jnp.linspace(-30.0, 30.0, 2001), jnp.array([-88.0, 88.0])])
    np.testing.assert_allclose(kernel_activation(activation)(x), activation_fn(activation)(x),
                               rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("members", [(), (3,), (0, 5)])
def test_it_reads_no_weight_outside_the_union(members):
    """Every other expert's weights are NaN: a program that read them would spread NaN."""
    on = np.zeros((4, E), bool)
    for i, e in enumerate(members):
        on[i % 4, e] = True
    x, a, _, wu, wd, wg = _chunk(4, "swiglu")
    a = jnp.where(on, jnp.abs(a) + 0.5, 0.0)
    keep = jnp.asarray(on.any(0))[:, None, None]
    poisoned = [jnp.where(keep, w, jnp.nan).astype(BF) for w in (wu, wd, wg)]
    y = chunk_union_decode_gpu(x, a, jnp.asarray(on), *poisoned, activation="swiglu",
                               interpret=True)
    clean = [jnp.where(keep, w, 0).astype(BF) for w in (wu, wd, wg)]
    assert _steps(y, _oracle(x, a, *clean, "swiglu")) <= 2
    if not members:
        assert not np.any(np.asarray(y, np.float32))


def test_its_gradient_is_the_oracles():
    x, a, on, wu, wd, wg = (z if z is None or z.dtype == bool else z.astype(jnp.float32)
                            for z in _chunk(6, "relu", density=0.5))

    def grads(fn):
        return jax.grad(lambda *z: jnp.sum(fn(*z).astype(jnp.float32) ** 2),
                        argnums=(0, 1, 2, 3))(x.astype(BF), a, wu.astype(BF), wd.astype(BF))

    got = jax.jit(lambda: grads(lambda x, a, wu, wd: decode_chunk(
        x, a, on, wu, wd, None, None, "relu", True, "mosaic_gpu")))()
    want = jax.jit(lambda: grads(lambda x, a, wu, wd: dense_experts(x, a, wu, wd, None,
                                                                    "relu")))()
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, atol=0.05 * np.abs(w).max(), rtol=0)


def _shapes(n, dtype=BF, e=64, d=2048, f=256, gated=True):
    return [jax.ShapeDtypeStruct(s, t) for s, t in
            (((n, d), dtype), ((n, e), dtype), ((n, e), jnp.bool_), ((e, d, f), dtype),
             ((e, f, d), dtype)) + ((((e, d, f), dtype),) if gated else ())]


@pytest.mark.parametrize("n", [1, 8, 32])
def test_it_lowers_for_cuda_to_one_mosaic_gpu_launch_at_the_benchmark_shapes(n):
    """d 2048, 64 experts of width 256, bf16, gated: one Mosaic GPU custom call, no Triton."""
    def fn(*z):
        return chunk_union_decode_gpu(*z, activation="swiglu")

    with lowering_target("cuda"):
        text = je.export(jax.jit(fn), platforms=("cuda",))(*_shapes(n)).mlir_module()
    assert text.count("mosaic_gpu_v2") == 1
    assert "triton" not in text and "callback" not in text


@pytest.mark.parametrize("n,a_dtype,residual", [(1, jnp.float32, False), (8, BF, False),
                                                (5, jnp.float32, False), (1, BF, True),
                                                (8, jnp.float32, True)])
def test_only_the_outputs_start_and_cast_surround_the_kernel(n, a_dtype, residual):
    """The members and their combine weights are read by the kernel from ``a`` as given
    (float32 or the operands' 16-bit dtype) and the chunk from ``x`` (its rows past ``n``
    are out-of-bounds reads), and the kernel writes ``y`` in its own orientation and rows:
    outside the launch there is the float32 output's start (a broadcast zero, or the
    residual's conversion) and its one conversion to the output's dtype, and nothing else
    (no reduction, transpose, slice, pad, copy or add)."""
    def fn(*z):
        if residual:
            return chunk_union_decode_gpu(*z[:-1], activation="swiglu", residual_nD=z[-1])
        return chunk_union_decode_gpu(*z, activation="swiglu")

    shapes = _shapes(n) + ([jax.ShapeDtypeStruct((n, 2048), BF)] if residual else [])
    shapes[1] = jax.ShapeDtypeStruct(shapes[1].shape, a_dtype)
    with lowering_target("cuda"):
        text = je.export(jax.jit(fn), platforms=("cuda",))(*shapes).mlir_module()
    hlo = [line for line in text.splitlines() if "stablehlo." in line and "custom_call" not in line]
    ops = [re.search(r"stablehlo\.(\w+)", line).group(1) for line in hlo]
    assert sorted(ops) == (["convert"] * 2 if residual else
                           ["broadcast_in_dim", "constant", "convert"]), ops
    hlo = "\n".join(hlo)
    assert re.search(rf"stablehlo.convert %\d+ : \(tensor<{n}x2048xf32>\) -> "
                     rf"tensor<{n}x2048xbf16>", hlo)  # the output's, not a's
    assert not residual or re.search(rf"stablehlo.convert %arg5 : \(tensor<{n}x2048xbf16>\) "
                                     rf"-> tensor<{n}x2048xf32>", hlo)  # the residual's


@pytest.mark.parametrize("dtype,d,kernel", [(BF, 2048, "mosaic_gpu_v2"), (jnp.float32, 2048, None),
                                            (BF, 48, None)])
def test_auto_takes_it_for_a_decode_chunk_on_hopper(dtype, d, kernel):
    """A bf16 chunk of 8 tokens decodes through the Mosaic GPU kernel; one the kernel does
    not take (float32, or a width of 48 off its blocks) as one dense product (no kernel
    launch); 9 tokens, past the tile, through the pair kernels."""
    def fn(*z):
        return chunk_union_auto(*z, activation="swiglu", tile=8, max_union=64)[0]

    def export(n):
        return je.export(jax.jit(fn), platforms=("cuda",),
                         disabled_checks=[je.DisabledSafetyCheck.custom_call(TRITON)])(
            *_shapes(n, dtype, d=d)).mlir_module()

    local = hopper_target()  # the attached device's answer: False on a CPU
    x, _, _, w_up, _, w_gate = _shapes(8, dtype, d=d)
    with lowering_target("cuda"):
        assert hopper_target()
        text, longer = export(8), export(9)
        route = decode_route(x, w_up, w_gate)  # what a benchmark's table says it timed
    assert route == ("decode kernel (Mosaic GPU)" if kernel else
                     "dense product, non-members weighted 0")
    assert decode_route(x, w_up, w_gate, "tpu") == "decode kernel (TPU)"
    assert decode_route(x, w_up, w_gate, "cpu") == "jnp loop"
    if kernel:
        assert kernel in text and "triton" not in text
    else:
        assert "custom_call" not in text
        assert "custom_call" in longer
    assert hopper_target() is local  # the named target is gone again
    if jax.default_backend() == "cpu":
        assert local is False


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_the_dense_chunk_equals_the_union_path_with_gradients(activation):
    """Combine weights of an inactive (token, expert) pair are kept for union members and
    dropped for the rest, as the union path does; values and every gradient."""
    x, a, on, wu, wd, wg = _chunk(5, activation, seed=3)
    x, a, wu, wd = (z.astype(jnp.float32) for z in (x, a, wu, wd))
    wg = None if wg is None else wg.astype(jnp.float32)
    on = on.at[:, 5].set(False)
    a = a.at[2, 5].set(0.5)  # expert 5 is in no token's active set: outside the union
    a = a.at[0, 3].set(0.25).at[1, 3].set(0.0)
    on = on.at[1, 3].set(True).at[0, 3].set(False)  # 3 in the union, token 0 inactive for it

    def loss(fn):
        def f(x, a, wu, wd):
            return jnp.sum(fn(x, a, wu, wd) ** 2)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, a, wu, wd)

    got = loss(lambda x, a, wu, wd: dense_chunk(x, a, on, wu, wd, wg, activation))
    want = loss(lambda x, a, wu, wd: chunk_union_experts(
        x, a, on, wu, wd, wg, activation, tile=5, max_union=E)[0])
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)
    assert float(jnp.abs(got[1][1][2, 5])) == 0.0  # outside the union: no gradient to a


def test_bad_calls_are_refused_before_lowering():
    x, a, on, wu, wd, _ = _chunk(4, "relu")
    assert supports(x, wu) and not supports(x.astype(jnp.float32), wu)
    with pytest.raises(ValueError, match="float16"):
        chunk_union_decode_gpu(x.astype(jnp.float32), a, on, wu, wd, activation="relu")
    with pytest.raises(ValueError, match="1 to 64"):
        chunk_union_decode_gpu(jnp.zeros((65, D), BF), jnp.zeros((65, E)),
                               jnp.zeros((65, E), bool), wu, wd, activation="relu")
    with pytest.raises(ValueError, match="w_down"):
        chunk_union_decode_gpu(x, a, on, wu, wd[:, :, :64], activation="relu")
    with pytest.raises(ValueError, match="unknown activation"):
        chunk_union_decode_gpu(x, a, on, wu, wd, activation="tanh")
    with pytest.raises(ValueError, match=r"the residual \(4, 8\) must be x's \(4, 256\)"):
        chunk_union_auto(x, a, on, wu, wd, activation="relu", tile=4, max_union=E,
                         residual_ND=x[:, :8])


# around the limit for a chunk of 8 and of 64 tokens, plain and gated
SMEM_CASES = [(64, 64, 128, 3), (128, 64, 128, 4), (128, 64, 128, 3), (256, 64, 128, 4),
              (256, 64, 128, 3), (128, 128, 256, 4), (128, 128, 128, 4), (256, 128, 128, 3),
              (256, 64, 256, 2)]


def _lowers(n, gated) -> bool:
    """Whether the kernel at the benchmark shapes lowers for an H100 (False: refused for its
    shared memory; any other failure is raised)."""
    act = "swiglu" if gated else "relu"
    try:
        with lowering_target("cuda"):
            je.export(jax.jit(lambda *z: chunk_union_decode_gpu(*z, activation=act)),
                      platforms=("cuda",))(*_shapes(n, gated=gated))
    except Exception as e:  # noqa: BLE001 - only the shared-memory refusal is an answer
        if "shared memory" not in str(e):
            raise
        return False
    return True


@pytest.mark.parametrize("n,gated", [(8, False), (8, True), (64, False), (64, True)])
def test_its_shared_memory_estimate_is_the_lowerings(n, gated):
    """smem_bytes tells which configurations Mosaic GPU refuses for their shared memory."""
    verdicts = []
    for bk, bf, bd, st in SMEM_CASES:
        with tuning.forced(tuning.TritonConfig(bk, bf, bd, 4, st)):
            fits = smem_bytes((bk, bf, bd, st), gated, chunk_rows(n)) <= SMEM_BYTES
            verdicts.append((fits, _lowers(n, gated)))
    assert all(f == lowered for f, lowered in verdicts), verdicts
    assert {f for f, _ in verdicts} == {True, False}  # both sides of the limit seen


def test_a_configuration_too_large_for_a_chunk_is_fitted(tmp_path, monkeypatch):
    """A table entry tuned on plain experts and chunks of 8 rows, whose 4 stages of 128-row
    steps let two programs share an SM: a gated expert's second weight block or a chunk of 32
    rows would leave room for one, so those calls get 3 stages and keep two; a 64-token chunk,
    whose staged output alone keeps it to one program per SM, keeps the most stages that fit
    (4 plain; gated, whose 4 do not fit, 3). Every one lowers."""
    with lowering_target("cuda") as device:
        kind = device.device_kind
    entry = {"tm": 128, "tk": 64, "tn": 128, "num_warps": 4, "num_stages": 4, "ms": 0.01}
    table = {kind: {"decode_mgpu": {"bfloat16": {tuning.bucket(2048, 256): entry}}}}
    (tmp_path / "t.json").write_text(json.dumps(table))
    monkeypatch.setenv("MOEJAX_KERNEL_TABLE", str(tmp_path / "t.json"))
    four = (128, 64, 128, 4)
    assert blocks_per_sm(smem_bytes(four, gated=False, rows=TUNED_ROWS)) == 2
    assert blocks_per_sm(smem_bytes(four, gated=False, rows=32)) == 1
    assert blocks_per_sm(smem_bytes(four, gated=True, rows=8)) == 1
    assert smem_bytes(four, gated=True, rows=64) > SMEM_BYTES
    with lowering_target("cuda"):
        assert blocks(BF, 2048, 256, gated=False, rows=8) == four
        assert blocks(BF, 2048, 256, gated=False, rows=32) == (128, 64, 128, 3)
        assert blocks(BF, 2048, 256, gated=True, rows=8) == (128, 64, 128, 3)
        assert blocks(BF, 2048, 256, gated=False, rows=64) == four
        assert blocks(BF, 2048, 256, gated=True, rows=64) == (128, 64, 128, 3)
    for fitted, rows in (((128, 64, 128, 3), 32), ((128, 64, 128, 3), 8)):
        assert blocks_per_sm(smem_bytes(fitted, gated=rows == 8, rows=rows)) == 2
    assert _lowers(64, gated=True) and _lowers(64, gated=False) and _lowers(32, gated=False)


@pytest.mark.parametrize("f,along", [(0, 0), (3, 0), (2, 1)])
def test_the_l2_prefetch_boxes_cover_a_programs_block_once(f, along):
    """A program's up-projection columns [D, bF] (cut along D) or down rows [bF, D] (cut
    along D): the boxes tile the block exactly, each within a TMA box's 256 a side."""
    d, bf, box = 2048, 64, 256
    block = ((0, d), (f * bf, bf)) if along == 0 else ((f * bf, bf), (0, d))
    seen = np.zeros((d + bf, d + 4 * bf), int)
    for (r0, nr), (c0, nc) in l2_boxes(*block, box, along):
        assert nr <= 256 and nc <= 256
        seen[r0:r0 + nr, c0:c0 + nc] += 1
    (r0, nr), (c0, nc) = block
    want = np.zeros_like(seen)
    want[r0:r0 + nr, c0:c0 + nc] = 1
    np.testing.assert_array_equal(seen, want)
    with pytest.raises(ValueError, match="no whole number"):
        l2_boxes((0, 2000), (0, 64), 256, 0)


@pytest.mark.parametrize("prefetch,gated", [(0, True), (1, True), (2, True), (2, False)])
def test_the_l2_prefetch_lowers_as_configured(prefetch, gated, monkeypatch):
    """A configuration's ``l2_prefetch`` (none / the down weights / all) is what the cuda
    lowering asks the L2 for: one block per weight it names, and TMA prefetch instructions
    in the kernel exactly when it names any; one Mosaic GPU launch either way."""
    asked = []
    real = decode_gpu._prefetch_to_l2
    monkeypatch.setattr(decode_gpu, "_prefetch_to_l2",
                        lambda w, *args, **kw: (asked.append(kw["along"]), real(w, *args, **kw)))

    def fn(*z):
        return chunk_union_decode_gpu(*z, activation="swiglu" if gated else "relu")

    with tuning.forced(tuning.TritonConfig(128, 64, 128, 4, 6, prefetch)), \
            lowering_target("cuda"):
        assert l2_prefetch(BF, 2048, 256) == prefetch
        text = je.export(jax.jit(fn), platforms=("cuda",))(
            *_shapes(8, gated=gated)).mlir_module()
    up = 2 if gated else 1
    assert sorted(asked) == {0: [], 1: [1], 2: [0] * up + [1]}[prefetch]
    assert text.count("mosaic_gpu_v2") == 1
    assert ("cp.async.bulk.prefetch.tensor" in text) == (prefetch > 0)


@pytest.mark.parametrize("prefetch,splits,n", [(2, 1, 8), (0, 2, 5), (1, 2, 8)])
def test_a_prefetching_or_split_configuration_computes_the_same(prefetch, splits, n):
    """The prefetch moves no value (in the interpreter it is no operation); programs split
    over the model width each add their own D blocks (D 256 in two 128-wide blocks: one a
    program): the kernel still equals the oracle."""
    x, a, on, wu, wd, wg = _chunk(n, "swiglu", seed=3 + n)
    with tuning.forced(tuning.TritonConfig(128, 64, 128, 4, 3, prefetch, splits)):
        assert decode_gpu.d_splits(BF, D, F) == splits
        y = chunk_union_decode_gpu(x, a, on, wu, wd, wg, activation="swiglu", interpret=True)
    assert _steps(y, _oracle(x, a, wu, wd, wg, "swiglu")) <= 2


def test_four_programs_over_the_width_each_add_their_own_d_block():
    """Four splits of D 512 (one 128-wide D block a program), as the autotune's four-split
    candidates run: the kernel still equals the oracle."""
    k = jax.random.split(jax.random.key(11), 5)
    d, n = 512, 3
    x = jax.random.normal(k[0], (n, d)).astype(BF)
    on = jax.random.uniform(k[1], (n, E)) < 0.4
    a = jnp.where(on, jax.random.uniform(k[2], (n, E), minval=0.1, maxval=1.0), 0.0)
    wu = (jax.random.normal(k[3], (E, d, F)) / np.sqrt(d)).astype(BF)
    wd = (jax.random.normal(k[4], (E, F, d)) / np.sqrt(F)).astype(BF)
    with tuning.forced(tuning.TritonConfig(128, 64, 128, 4, 3, 0, 4)):
        assert decode_gpu.d_splits(BF, d, F) == 4
        y = chunk_union_decode_gpu(x, a, on, wu, wd, activation="relu", interpret=True)
    assert _steps(y, _oracle(x, a, wu, wd, None, "relu")) <= 2


@pytest.mark.parametrize("splits,d,want", [(2, 2048, 2), (4, 2048, 4), (2, 384, 1), (3, 2048, 1)])
def test_a_split_is_taken_only_where_the_width_divides(splits, d, want):
    """Splits that leave a program no whole number of 128-wide D blocks fall back to one
    program per F block; the others lower to one launch of ``E x F / bF x splits``
    programs."""
    with tuning.forced(tuning.TritonConfig(128, 64, 128, 4, 3, 0, splits)):
        assert decode_gpu.d_splits(BF, d, 256) == want
        if d == 2048:
            with lowering_target("cuda"):
                text = je.export(jax.jit(lambda *z: chunk_union_decode_gpu(
                    *z, activation="relu")), platforms=("cuda",))(
                        *_shapes(8, gated=False)).mlir_module()
            assert text.count("mosaic_gpu_v2") == 1


def test_the_l2_prefetch_is_read_from_the_devices_table_entry(tmp_path, monkeypatch):
    """A tuned entry's ``l2_prefetch`` is what the decode kernel lowers with; an entry
    written before the field existed, and a device without an entry, prefetch nothing."""
    with lowering_target("cuda") as device:
        kind = device.device_kind
    entry = {"tm": 128, "tk": 64, "tn": 128, "num_warps": 4, "num_stages": 4, "ms": 0.01}
    path = tmp_path / "t.json"
    monkeypatch.setenv("MOEJAX_KERNEL_TABLE", str(path))
    got = []
    for table in ({kind: {"decode_mgpu": {"bfloat16": {
                      tuning.bucket(2048, 256): {**entry, "l2_prefetch": 1}}}}},
                  {kind: {"decode_mgpu": {"bfloat16": {tuning.bucket(2048, 256): entry}}}},
                  {}):
        path.write_text(json.dumps(table))
        with lowering_target("cuda"):
            got.append(l2_prefetch(BF, 2048, 256))
    assert got == [1, 0, 0]
