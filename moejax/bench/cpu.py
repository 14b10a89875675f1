"""Measurements behind ``experiments/benchmarks/dispatch.py`` (its one-run table of ratios).

* :func:`matmul_gflops`: GFLOP/s of a jitted (or numpy) ``[m, k] @ [k, n]`` float32 matmul
  here, allocation excluded (the rate that turns FLOPs into the bound of a compute-bound op);
* :func:`moe_block_flops` / :func:`moe_block_fwd_bwd`: fwd+bwd of one MoE slot (loss = sum of
  squares of the output, gradients w.r.t. input and every parameter) for a dispatch path;
* :func:`torch_moe_block_s`: the PyTorch peer, an expert loop written the way Hugging Face's
  Mixtral block is (softmax router, top-k, renormalised, ``index_select`` / ``index_add_``),
  same shapes and FLOPs; ``None`` when torch is not installed (it is never a dependency);
* :func:`delta_op_times`: each delta operation jitted over a parameter tree vs a jitted
  ``x * 2`` over the same tree and a numpy copy of the same bytes.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.bench.timing import time_call, time_interleaved
from moejax.delta import dare, magnitude_prune, wanda_prune
from moejax.delta.quant_jnp import fake_quantize_tree
from moejax.delta.tree import leaf_paths
from moejax.nn.moe import MoEConfig

__all__ = ["matmul_gflops", "moe_block_flops", "moe_block_fwd_bwd", "torch_moe_block_s",
           "delta_op_times", "tree_of_shapes"]


def matmul_gflops(m: int = 4096, k: int = 256, n: int = 1024, repeats: int = 10,
                  backend: str = "xla", inner: int = 8) -> float:
    """GFLOP/s of a float32 ``[m, k] @ [k, n]``: jitted (``backend="xla"``) or numpy's BLAS
    (``"numpy"``, the library the host dispatch paths call); median of ``repeats``.

    The rate of the multiply, not of the allocation around it: numpy writes a preallocated
    ``out``, and XLA runs ``inner`` matmuls (distinct right-hand sides, so none is hoisted)
    in one call whose output buffer is allocated once. Timed one call per matmul, XLA's fresh
    output costs a page fault per 4 KiB whenever glibc serves it from a new mapping, which
    depends on what the process freed before, and the rate would measure the allocator."""
    if backend == "numpy":
        rng = np.random.default_rng(0)
        a, b = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n)))
        out = np.empty((m, n), np.float32)
        t = time_call(lambda: np.matmul(a, b, out=out), repeats=repeats)["median_s"]
        return 2.0 * m * k * n / t / 1e9
    if backend != "xla":
        raise ValueError(f"matmul_gflops: backend {backend!r}; use 'xla' or 'numpy'")
    if inner < 1:
        raise ValueError(f"matmul_gflops: inner={inner}; use at least 1 matmul per call")
    a = jnp.ones((m, k), jnp.float32)
    b_IKN = jax.random.normal(jax.random.key(0), (inner, k, n), jnp.float32)

    @jax.jit
    def matmuls(a, b_IKN):
        return jax.lax.fori_loop(1, inner, lambda i, _: a @ b_IKN[i], a @ b_IKN[0])

    t = time_call(matmuls, a, b_IKN, repeats=repeats)["median_s"]
    return 2.0 * inner * m * k * n / t / 1e9


def moe_block_flops(n_tokens: int, d: int, f: int, top_k: int, gated: bool = True) -> float:
    """Expert FLOPs of fwd + bwd (3x the forward's ``2 N k d f`` per matrix)."""
    return 3.0 * 2.0 * n_tokens * top_k * d * f * (3 if gated else 2)


def moe_block_fwd_bwd(cfg: MoEConfig, d_model: int, n_tokens: int, seed: int = 0):
    """``(jitted fn, args)``: fn(params, x) -> (loss, grads of params and x)."""
    slot = cfg.build(d_model, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(slot)
    x = jax.random.normal(jax.random.key(seed + 1), (1, n_tokens, d_model), jnp.float32)

    def loss(p, x):
        y, _ = nnx.merge(graphdef, p)(x)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (params, x)


NO_CUDA = "no CUDA"  # torch_moe_block_s: a GPU asked for, torch without one


def torch_moe_block_s(n_tokens: int, d: int, f: int, n_experts: int, top_k: int,
                      repeats: int = 10, threads: int | None = None,
                      device: str = "cpu") -> tuple[float | None, str]:
    """``(median seconds, device name)`` of the PyTorch peer's fwd+bwd (f32) on ``device``
    (``"cuda"``: the GPU jax uses; ``"cpu"``), ``(None, "")`` without torch and ``(None,
    "no CUDA")`` when ``device`` is ``"cuda"`` and this torch sees no GPU: it is then not
    timed on the CPU instead, since its time would be compared with the GPU's. On a GPU each
    step ends with ``torch.cuda.synchronize``."""
    try:
        import torch
    except ImportError:
        return None, ""
    if device == "cuda" and not torch.cuda.is_available():
        return None, NO_CUDA
    if threads:
        torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(device).requires_grad_()  # noqa: E731
    router = mk(d, n_experts)
    w_gate, w_up, w_down = mk(n_experts, d, f), mk(n_experts, d, f), mk(n_experts, f, d)
    x = torch.randn(n_tokens, d, generator=g).to(device).requires_grad_()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step():
        probs = torch.softmax(x @ router, dim=-1)
        weights, chosen = torch.topk(probs, top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(n_experts):
            tok, slot = torch.where(chosen == e)
            if tok.numel() == 0:
                continue
            xe = x.index_select(0, tok)
            h = torch.nn.functional.silu(xe @ w_gate[e]) * (xe @ w_up[e])
            ye = (h @ w_down[e]) * weights[tok, slot, None]
            out = out.index_add(0, tok, ye)
        (out**2).sum().backward()
        sync()

    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    return float(np.median(times)), name


def tree_of_shapes(shapes: dict[str, tuple], seed: int = 0) -> dict:
    key = jax.random.key(seed)
    return {name: 0.01 * jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32)
            for i, (name, s) in enumerate(shapes.items())}


def delta_op_times(tree: dict, p: float = 0.9, bits: int = 4, repeats: int = 5) -> list[dict]:
    """Rows ``{op, seconds, min_seconds, gb_s, vs_x2, vs_numpy_copy}``: median and fastest of
    ``repeats`` round-robin rounds (:func:`moejax.bench.timing.time_interleaved`), ratios of
    medians; bytes = read + write of the tree (8 per float32 parameter)."""
    nbytes = 2 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    key = jax.random.key(0)
    matrices = jax.tree.map(lambda x: x.ndim >= 2, tree)
    norms = {path: jnp.ones(x.shape[-2], jnp.float32)
             for path, x in zip(leaf_paths(tree), jax.tree.leaves(tree)) if x.ndim >= 2}
    ops = {
        "jitted x * 2 (reference)": jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t)),
        "DARE p=0.9 (hash masks)": jax.jit(lambda t: dare(key, t, p)),
        "DAREx-q p=0.9 q=0.2 (hash)": jax.jit(lambda t: dare(key, t, p, q=0.2)),
        "DARE p=0.9 (threefry masks)": jax.jit(lambda t: dare(key, t, p, rng="threefry")),
        f"{bits}-bit midrise quantisation (jnp, group 64)": jax.jit(
            lambda t: fake_quantize_tree(t, bits, mask=matrices)),
        "WANDA p=0.9 (threshold select)": jax.jit(
            lambda t: wanda_prune(t, norms, p, mask=matrices)),
        "magnitude p=0.9 (threshold select)": jax.jit(
            lambda t: magnitude_prune(t, p, mask=matrices)),
    }
    host = [np.asarray(x) for x in jax.tree.leaves(tree)]

    def numpy_copy(_):
        for x in host:   # each copy dropped at once: its memory is reused, as memcpy's would be
            np.copy(x)

    fns = {"numpy copy (reference)": numpy_copy, **ops}
    times = time_interleaved(fns, tree, warmup=1, repeats=repeats)
    rows = [{"op": name, "seconds": t["median_s"], "min_seconds": t["min_s"],
             "gb_s": nbytes / t["median_s"] / 1e9} for name, t in times.items()]
    t_np, t_x2 = rows[0]["seconds"], rows[1]["seconds"]
    for r in rows:
        r["vs_x2"] = t_x2 / r["seconds"]
        r["vs_numpy_copy"] = t_np / r["seconds"]
    return rows
