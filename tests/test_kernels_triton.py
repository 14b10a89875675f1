"""The chunk-sparse BlockFFN Triton kernel (moejax.kernels.chunk_union.fused_triton).

On a CPU machine with ``triton`` installed, the kernel runs in Triton's interpreter on numpy
arrays (dressed as the torch-like tensors the interpreter takes) and must match the dense
oracle and the jnp chunk-union reference: empty and full unions, tiles shorter than the
16-row ``tl.dot`` minimum, token counts not a multiple of the tile, gated experts, every
activation. Without ``triton`` (it lives in the ``gpu`` extra) those tests skip. The
``jax_triton`` path needs a GPU: tests/test_kernels_chunk_union.py, ``gpu`` marker."""

import importlib
import os

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels.chunk_union.pallas import tile_unions
from moejax.kernels.chunk_union.reference import chunk_union_experts, dense_experts

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: its own library too

triton = pytest.importorskip(
    "triton", reason="triton is not installed (gpu extra): pip install -e '.[gpu]', or "
    "`pip install triton` to run the kernel in Triton's CPU interpreter")


@pytest.fixture(scope="module")
def kernel_module():
    import moejax.kernels.chunk_union.fused_triton as m

    return importlib.reload(m)  # decorate the kernel for the interpreter


class _Storage:
    def __init__(self, buf):
        self.buf = buf

    def data_ptr(self):
        return self.buf.ctypes.data

    def cpu(self):
        return self

    def copy_(self, other):
        del other  # host memory already: nothing to copy back


class HostTensor:
    """A contiguous numpy array with the torch-tensor surface Triton's interpreter uses."""

    def __init__(self, arr):
        self.arr = np.ascontiguousarray(arr)
        self.dtype = f"torch.{self.arr.dtype}"

    def data_ptr(self):
        return self.arr.ctypes.data

    def untyped_storage(self):
        return _Storage(self.arr)

    def storage_offset(self):
        return 0

    def size(self):
        return self.arr.shape

    def stride(self):
        return tuple(s // self.arr.itemsize for s in self.arr.strides)

    def new_empty(self, *args, **kwargs):
        return HostTensor(self.arr[:0])

    def set_(self, storage, offset, size, stride):
        self.arr = storage.buf
        return self


N, D, E, F = 13, 6, 5, 20


def inputs(seed=0, gated=False, density=0.5):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype(np.float32)
    a = np.maximum(rng.normal(size=(N, E)) - (1 - density), 0).astype(np.float32)
    a[4:8] = 0.0  # tile 1 (tile = 4): empty union
    w = [(rng.normal(size=s) / np.sqrt(s[1])).astype(np.float32)
         for s in ((E, D, F), (E, F, D), (E, D, F))]
    return x, a, w[0], w[1], w[2] if gated else None


def run_kernel(module, x, a, wu, wd, wg, activation, tile, max_union, **blocks):
    xp, ap, ids, count, _ = tile_unions(tile, max_union, jnp.asarray(x), jnp.asarray(a),
                                        jnp.asarray(a > 0))
    out = module.launch_interpreted(xp, ap, ids, count, wu, wd, wg, activation=activation,
                                    tile=tile, wrap=HostTensor, **blocks)
    return out.arr[:x.shape[0]]


@pytest.mark.parametrize("tile", [1, 4, 5, 13])
@pytest.mark.parametrize("activation", ["swish", "swiglu", "relu", "gelu", "gelu_tanh"])
def test_interpreted_kernel_equals_dense_oracle(kernel_module, tile, activation):
    gated = activation == "swiglu"
    x, a, wu, wd, wg = inputs(gated=gated)
    y = run_kernel(kernel_module, x, a, wu, wd, wg, activation, tile, E)
    ref = dense_experts(jnp.asarray(x), jnp.asarray(a), wu, wd, wg, activation)
    np.testing.assert_allclose(y, np.asarray(ref), rtol=1e-4, atol=1e-5)
    if tile == 4:
        np.testing.assert_array_equal(y[4:8], 0)  # the empty union writes zeros


@pytest.mark.parametrize("gated", [False, True])
def test_interpreted_kernel_walks_model_and_hidden_width_in_blocks(kernel_module, gated):
    rng = np.random.default_rng(7)
    d, f = 40, 70  # three D blocks and five F blocks of 16, both with a ragged last block
    x = rng.normal(size=(N, d)).astype(np.float32)
    a = np.maximum(rng.normal(size=(N, E)) - 0.5, 0).astype(np.float32)
    w = [(rng.normal(size=s) / np.sqrt(s[1])).astype(np.float32)
         for s in ((E, d, f), (E, f, d), (E, d, f))]
    wg, act = (w[2], "swiglu") if gated else (None, "swish")
    y = run_kernel(kernel_module, x, a, w[0], w[1], wg, act, 4, E, block_f=16, block_d=16)
    ref = dense_experts(jnp.asarray(x), jnp.asarray(a), w[0], w[1], wg, act)
    np.testing.assert_allclose(y, np.asarray(ref), rtol=1e-4, atol=1e-5)


def test_interpreted_kernel_with_capped_union_matches_reference(kernel_module):
    x, a, wu, wd, _ = inputs(seed=1, density=2.0)  # full unions
    for cap in (E, 2, 1):
        y = run_kernel(kernel_module, x, a, wu, wd, None, "swish", 4, cap)
        ref, overflow = chunk_union_experts(jnp.asarray(x), jnp.asarray(a), jnp.asarray(a > 0),
                                            wu, wd, None, "swish", tile=4, max_union=cap)
        np.testing.assert_allclose(y, np.asarray(ref), rtol=1e-4, atol=1e-5)
        assert (float(overflow) > 0) == (cap < E)


def test_launch_config_pads_to_tl_dot_minimum_and_rejects_unknown_activation(kernel_module):
    cfg = kernel_module.launch_config(tile=1, d=6, f=20, activation="swish", gated=False)
    assert (cfg["BLOCK_T"], cfg["BLOCK_D"], cfg["BLOCK_F"]) == (16, 16, 32)
    assert kernel_module.launch_config(40, 300, 1000, "relu", True)["BLOCK_T"] == 64
    with pytest.raises(ValueError, match="no Triton kernel"):
        kernel_module.launch_config(4, 6, 20, "softplus", False)
