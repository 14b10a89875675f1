"""moejax.bench.gpu_program: a program's GPU kernels counted from its compilation on this
host, with no GPU. The counter on a written program; the one-token lean decode compiled for
an H200 within a kernel budget per block, and a round of the sampling and speculative loops
with one lengths update and one causal mask for all layers."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from moejax.bench.gpu_program import (
    gpu_compile_env,
    gpu_program,
    launches,
    loop_launches,
    reductions,
)
from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import keep_layers
from moejax.nn.lean_decode import lean_decoder
from moejax.nn.sample import _sample
from moejax.nn.speculative import _speculate
from tests.test_lean_decode import SLOTS, _model

PROGRAM = """HloModule jit_step, is_scheduled=true

%fused_compare (param_0: s32[]) -> pred[] {
  %param_0 = s32[] parameter(0)
  %constant_4 = s32[] constant(4)
  ROOT %compare.1 = pred[] compare(%param_0, %constant_4), direction=LT
}

%branch_a (p.1: f32[4]) -> f32[4] {
  %p.1 = f32[4]{0} parameter(0)
  ROOT %loop_exponential_fusion = f32[4]{0} fusion(%p.1), kind=kLoop, calls=%fused_exponential
}

%branch_b (p.2: f32[4]) -> f32[4] {
  %p.2 = f32[4]{0} parameter(0)
  ROOT %copy.3 = f32[4]{0} copy(%p.2)
}

%inner_body (t.1: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t.1 = (s32[], f32[4]{0}) parameter(0)
  ROOT %t.2 = (s32[], f32[4]{0}) tuple(%t.1)
}

%body.7 (arg_tuple.1: (s32[], f32[4])) -> (s32[], f32[4]) {
  %arg_tuple.1 = (s32[], f32[4]{0}) parameter(0)
  %gte.1 = s32[] get-tuple-element(%arg_tuple.1), index=0
  %gte.2 = f32[4]{0} get-tuple-element(%arg_tuple.1), index=1
  %f.12 = bf16[768]{0} fusion(%gte.2), kind=kInput, calls=%fused_reduce.12
  %f.13 = bf16[256]{0} fusion(%f.12), kind=kInput, calls=%fused_reduce.13
  %f.2 = bf16[1,160,8,32]{3,2,1,0} fusion(%gte.2), kind=kLoop, calls=%fused_dynamic_update_slice.2
  %pc.70 = bf16[1,8,32]{2,1,0} custom-call(%gte.2), custom_call_target="__gpu$xla.gpu.triton"
  %c.1 = f32[4]{0} conditional(%gte.1, %gte.2, %gte.2), branch_computations={%branch_a, %branch_b}
  %while.2 = (s32[], f32[4]{0}) while(%arg_tuple.1), condition=%region_cond.9, body=%inner_body
  %bitcast.1 = f32[4]{0} bitcast(%c.1)
  ROOT %tuple.3 = (s32[], f32[4]{0}) tuple(%gte.1, %bitcast.1)
}

%region_cond.9 (arg_tuple.2: (s32[], f32[4])) -> pred[] {
  %arg_tuple.2 = (s32[], f32[4]{0}) parameter(0)
  %get-tuple-element.3 = s32[] get-tuple-element(%arg_tuple.2), index=0
  ROOT %loop_compare_fusion = pred[] fusion(%get-tuple-element.3), kind=kLoop, calls=%fused_compare
}

ENTRY %main.113 (x.1: f32[4], n.1: s32[]) -> (s32[], f32[4]) {
  %x.1 = f32[4]{0} parameter(0)
  %n.1 = s32[] parameter(1)
  %loop_add_fusion = s32[] fusion(%n.1), kind=kLoop, calls=%fused_add
  %tuple.1 = (s32[], f32[4]{0}) tuple(%loop_add_fusion, %x.1)
  %while.5 = (s32[], f32[4]{0}) while(%tuple.1), condition=%region_cond.9, body=%body.7
  ROOT %gemm.1 = f32[4]{0} custom-call(%x.1), custom_call_target="__cublas$gemm"
}
"""


def test_the_counter_reads_a_programs_kernels():
    assert launches(PROGRAM) == {"loop_add_fusion": 1, "while": 1, "custom-call __cublas$gemm": 1}
    # one round: the body's kernels, each branch of its conditional, the loop inside it once,
    # and the condition's kernel
    assert loop_launches(PROGRAM) == {
        "input_reduce_fusion": 2, "loop_dynamic_update_slice_fusion": 1,
        "custom-call __gpu$xla.gpu.triton": 1, "conditional": 1, "loop_exponential_fusion": 1,
        "copy": 1, "while": 1, "loop_compare_fusion": 1}
    with pytest.raises(ValueError, match="no while loop"):
        loop_launches(PROGRAM.replace("while(", "call("))
    with pytest.raises(ValueError, match="ENTRY"):
        launches("HloModule m\n")


REDUCES = """HloModule m

%fused_reduce (p.0: bf16[256,768], p.1: bf16[256]) -> f32[768] {
  %p.0 = bf16[256,768]{1,0} parameter(0)
  %p.1 = bf16[256]{0} parameter(1)
  %c.0 = f32[] constant(0)
  %rows = f32[768]{0} reduce(%p.0, %c.0), dimensions={1}, to_apply=%add
  %cols = f32[768]{0} reduce(%p.0, %c.0), dimensions={0}, to_apply=%add
  %t.0 = bf16[256,768]{0,1} parameter(2)
  %cols_of_transposed = f32[768]{0} reduce(%t.0, %c.0), dimensions={1}, to_apply=%add
  %one = bf16[1,1,256]{2,1,0} parameter(3)
  %whole = f32[1,1]{1,0} reduce(%one, %c.0), dimensions={2}, to_apply=%add
  ROOT %r = f32[768]{0} reduce(%p.1, %c.0), dimensions={0}, to_apply=%add
}

ENTRY %main (x.1: f32[4]) -> f32[4] {
  ROOT %x.1 = f32[4]{0} parameter(0)
}
"""


def test_reductions_are_told_apart_by_their_operands_layout():
    # a reduction over the minor dimension is a row reduction; over the major one, or over the
    # minor one of a transposed layout ({0,1}), a column reduction
    assert reductions(REDUCES) == {"row": 1, "column": 2, "whole": 2}


def test_compiling_for_a_gpu_names_what_is_missing(monkeypatch, tmp_path):
    step = jax.jit(lambda x: x + 1)
    with pytest.raises(ValueError, match="gpu='a100'; known: h200"):
        gpu_program(step, jnp.zeros(3), gpu="a100")
    # this process started without the plugin on its path: refused, naming the fix
    with pytest.raises(RuntimeError, match="gpu_compile_env"):
        gpu_program(step, jnp.zeros(3))
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make setup"):
        gpu_compile_env()


# kernels per block of the one-token lean decode, 2 blocks against 1 (d 256, 4 heads, 2 kv
# heads, bf16, a 256-slot cache) compiled for an H200 (4 against 1 counts within a third of a
# kernel of it): the
# residual stream written once with its sum of squares, each product reading it (12 dense, 14
# BlockFFN on the chunk-union kernel, 13 on the dense path, whose router's product is the
# experts' input product)
BUDGET = {"dense": 12.5, "blockffn": 14.5, "blockffn_dense": 13.5}
# fused=True, weights transposed ("nk"): the attention input as one kernel (the previous block's
# residual add, the norm's factor, the q/k/v product, RoPE and both cache writes), the flash
# kernel, the o product, the FFN input as one kernel (the residual add, the norm's factor, the in
# product with BlockFFN's router, its norm, the activation), the down product, and the cache's
# lengths: 6 dense and on BlockFFN's dense path; 6 on its token-sparse path, where the FFN input
# (the residual add, the norm's factor, the router with its norm, the experts' input, the expert
# part's zeroed target) and the chunk-union decode kernel take the FFN's place
FUSED_BUDGET = {"dense_fused": 6.5, "blockffn_dense_fused": 6.5, "blockffn_fused": 6.5}
FUSED_PRODUCTS = {"dense_fused": 2, "blockffn_dense_fused": 2, "blockffn_fused": 1}


def _step_program(kind: str, layers: int, layout: str = "kn") -> str:
    slots = {**SLOTS, "blockffn_dense": BlockFFNConfig(n_experts=16, d_expert=64, path="dense")}
    base, fused = kind.removesuffix("_fused"), kind.endswith("_fused")
    model = nnx.eval_shape(lambda: lean_decoder(_model(  # shapes only: no weights drawn
        slots[base], layers=layers, d=256, dtype="bfloat16", param_dtype="bfloat16"),
        "nk" if fused else layout, fused))
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, tok, c, g=graphdef: nnx.merge(g, s).decode(tok, c),
                   donate_argnums=2)
    return gpu_program(step, state, jnp.zeros((1, 1), jnp.int32), model.init_cache(1, 256))


def _per_block() -> dict[str, dict[str, float]]:
    out, programs = {}, {}
    for kind in (*BUDGET, *FUSED_BUDGET):
        counts = []
        for layers in (1, 2):
            programs[kind, layers] = _step_program(kind, layers)
            counts.append(launches(programs[kind, layers]))
        out[kind] = {k: counts[1][k] - counts[0][k] for k in counts[1]}
    # the products' reductions of 1 dense block (4 products) and the head, per layout
    nk = _step_program("dense", 1, "nk")
    out["reductions"] = {"kn": dict(reductions(programs["dense", 1])),
                         "nk": dict(reductions(nk)), "nk_kernels": dict(launches(nk)),
                         "kn_kernels": dict(launches(programs["dense", 1]))}
    # one round of the greedy sampling loop of a 4-block dense decoder
    def target_and_draft():
        model = _model(SLOTS["dense"], layers=4, d=256, dtype="bfloat16", param_dtype="bfloat16")
        return model, keep_layers(model, range(1))

    model, draft = nnx.eval_shape(target_and_draft)
    graphdef, state = nnx.split(model)
    out["sample_round"] = dict(loop_launches(gpu_program(
        _sample, graphdef, state, jnp.zeros((1, 8), jnp.int32), jnp.full((1,), 8, jnp.int32),
        jax.random.key(0), max_new=16, temperature=0.0, top_p=1.0, eos_id=None, pad_id=0)))
    # one round of greedy speculative decoding, its first layer as the draft (n = 3)
    dg, ds = nnx.split(draft)
    out["spec_round"] = dict(loop_launches(gpu_program(
        _speculate, graphdef, state, dg, ds, jnp.zeros((1, 8), jnp.int32), jax.random.key(0),
        max_new=16, n=3, temperature=0.0)))
    return out


@pytest.mark.slow
def test_the_lean_decode_compiled_for_a_gpu_launches_within_its_budget():
    proc = subprocess.run([sys.executable, "-m", "tests.test_gpu_program"], env=gpu_compile_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    per = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind, budget in BUDGET.items():
        assert sum(per[kind].values()) <= budget, (kind, per[kind])
        # each cache written in place; one flash kernel
        assert per[kind]["loop_dynamic_update_slice_fusion"] == 2, (kind, per[kind])
        assert per[kind]["custom-call __gpu$xla.gpu.triton"] == 1, (kind, per[kind])
    # no product's input recomputed over its whole weight: one loop fusion of products per
    # block (the activation), not one per product
    assert per["dense"].get("loop_multiply_fusion", 0) <= 1, per["dense"]
    assert per["blockffn_dense"].get("loop_multiply_fusion", 0) <= 1, per["blockffn_dense"]
    # the residual stream and its sum of squares made together, before each RMSNorm
    assert per["dense"]["input_add_reduce_fusion"] == 2, per["dense"]
    assert per["blockffn"]["custom-call mosaic_gpu_v2"] == 1, per["blockffn"]
    assert per["blockffn_fused"]["custom-call mosaic_gpu_v2"] == 1, per["blockffn_fused"]
    # fused: three Pallas kernels (attention input, flash, FFN input) and the two products
    # (token-sparse: the o product and the chunk-union kernel);
    # no cache-write, RoPE, residual-stream or activation fusion left; at most half the
    # kernels of the XLA step
    for kind, budget in FUSED_BUDGET.items():
        fused, plain = per[kind], per[kind.removesuffix("_fused")]
        assert sum(fused.values()) <= budget, (kind, fused)
        assert fused["custom-call __gpu$xla.gpu.triton"] == 3, (kind, fused)
        assert fused["input_reduce_fusion"] == FUSED_PRODUCTS[kind], (kind, fused)
        assert sum(fused.values()) <= sum(plain.values()) / 2 + 0.5, (kind, fused, plain)
    # the sampling loop carries one filled-lengths array for all 4 layers: their `+ 1` is one
    # add a round, not one per layer
    round_ = per["sample_round"]
    assert round_.get("loop_add_fusion", 0) <= 2, round_
    assert round_["custom-call __gpu$xla.gpu.triton"] == 4, round_
    # and so does the speculative loop: one causal mask for the verifying layers, and the
    # rolled-back lengths are not copied into each layer's cache
    spec = per["spec_round"]
    assert spec.get("loop_add_fusion", 0) <= 6 and spec.get("loop_compare_fusion", 0) <= 3, spec
    assert spec.get("copy", 0) <= 1, spec
    # the products' weights transposed (layout "nk"): every product a row reduction, each
    # output's weights contiguous; in the modules' layout every block's are column reductions
    red = per["reductions"]
    assert red["nk"].get("column", 0) == 0 and red["nk"]["row"] >= 4, red
    assert red["kn"]["column"] >= 4, red
    assert (sum(red["nk_kernels"].values()) <= sum(red["kn_kernels"].values())), red


def test_the_decode_kernels_script_refuses_a_bad_argument_before_compiling(monkeypatch):
    script = Path(__file__).resolve().parents[1] / "scripts" / "decode_kernels.py"
    spec = importlib.util.spec_from_file_location("decode_kernels", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for owner, name in ((module, "_rows"), (module.os, "execve")):  # neither restart nor compile
        monkeypatch.setattr(owner, name, lambda *a, n=name, **kw: pytest.fail(f"{n} reached"))
    for arg in ("max_new=0", "steps=3", "layout=mn", "draft_len=x", "fused=2"):
        with pytest.raises(SystemExit, match=f"{arg!r}: give max_new=N"):
            module.main([arg])


if __name__ == "__main__":  # the compilation, in a process started with the plugin on its path
    print(json.dumps(_per_block()))
