"""Pallas Triton is deprecated since jax 0.12: on a jax without it (simulated by hiding
``jax.experimental.pallas.triton`` in a fresh interpreter) moejax still imports, and a GPU
program still lowers with no Triton kernel: the grouped matmul's three products on its Mosaic
GPU kernels in bf16 and on XLA's ragged dot in float32 (an H100 export), BlockFFN's
chunk-union experts on the Mosaic GPU pair kernels in bf16 and on the jnp loop in float32;
``interpret="triton"`` is refused with the reason."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import json, re, sys
    sys.modules["jax.experimental.pallas.triton"] = None  # a jax without Pallas Triton
    import jax, jax.export as je, jax.numpy as jnp
    import moejax, moejax.nn, moejax.kernels
    from moejax.kernels.grouped.pallas_gmm import gmm
    from moejax.kernels.chunk_union.pallas import chunk_union_auto
    from moejax.kernels.targets import lowering_target

    S = jax.ShapeDtypeStruct
    out = {}

    def calls(fn, *args):
        with lowering_target("cuda"):
            text = je.export(jax.jit(fn), platforms=("cuda",))(*args).mlir_module()
        return sorted(set(re.findall(r"custom_call @([\\w$.]+)", text)))

    def gmm_step(x, w, gs):
        loss = lambda x, w: jnp.sum(gmm(x, w, gs).astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, (0, 1))(x, w)

    def union_step(x, a, wu, wd):
        loss = lambda x, wu, wd: jnp.sum(chunk_union_auto(
            x, a, a > 0, wu, wd, activation="relu", tile=64, max_union=4)[0].astype(
            jnp.float32) ** 2)
        return jax.value_and_grad(loss, (0, 1, 2))(x, wu, wd)

    for dt in ("bfloat16", "float32"):
        d = jnp.dtype(dt)
        out["gmm", dt] = calls(gmm_step, S((2048, 256), d), S((8, 256, 512), d),
                               S((8,), jnp.int32))
        out["union", dt] = calls(union_step, S((256, 128), d), S((256, 8), jnp.float32),
                                 S((8, 128, 128), d), S((8, 128, 128), d))
    try:
        gmm(jnp.ones((8, 4)), jnp.ones((2, 4, 4)), jnp.array([4, 4]), interpret="triton")
        out["interpret"] = "ran"
    except ValueError as e:
        out["interpret"] = str(e)
    from moejax.kernels import decode_ffn, decode_qkv, decode_route  # XLA's decode step
    out["fused"] = [decode_qkv.supports(64, 16, "half", 1, jnp.bfloat16),
                    decode_ffn.supports(64, 32, 4, 1, jnp.bfloat16),
                    decode_route.supports(64, 4, 1, jnp.bfloat16)]
    print(json.dumps({"/".join(k) if isinstance(k, tuple) else k: v for k, v in out.items()}))
''')


@pytest.mark.slow
def test_without_pallas_triton_gpu_programs_lower_on_mosaic_gpu_and_xla():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["gmm/bfloat16"] == ["mosaic_gpu_v2"]  # the three products, Mosaic GPU
    assert got["gmm/float32"] == []  # XLA's ragged dot: no kernel call
    assert got["union/bfloat16"] == ["mosaic_gpu_v2"]
    assert got["union/float32"] == []  # the jnp loop
    assert "no Pallas Triton" in got["interpret"]
    assert got["fused"] == ["this jax ships no Pallas Triton"] * 3
