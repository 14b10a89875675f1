"""Kernels per generated token of bench_speculative's wide grown target (its variant ``wide``:
14 blocks, 106M parameters, bfloat16), compiled on this host for an H200
(:mod:`moejax.bench.gpu_program`; no GPU needed): one round of the autoregressive loop with
the dense and the token-sparse expert path, and one round of speculative decoding with the
target's first layer as the draft (draft length 4), verified with the dense and the
chunk-sparse path. The weights are random: a program's kernels follow its shapes, not its
values. Prints a markdown table: kernels per round, and the kinds that make them.
``layout=nk``: the target's lean decode step made before the loops with its products' weights
transposed (:func:`moejax.nn.lean_decode.lean_decoder`), and each product's reduction kind;
``fused=1``: each decode step's attention and FFN inputs as one kernel each (a verified block's
too).

    .venv/bin/python scripts/decode_kernels.py        # restarts itself with the GPU compiler
    .venv/bin/python scripts/decode_kernels.py max_new=64 draft_len=2 layout=nk fused=1
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.blockffn.speculative import WIDE, make_config  # noqa: E402
from moejax.bench.decode_timing import blockffn_path, grow_blockffn_lm  # noqa: E402
from moejax.bench.gpu_program import gpu_compile_env, gpu_program, loop_launches  # noqa: E402
from moejax.config_overrides import apply_overrides  # noqa: E402
from moejax.nn.decoder import keep_layers, with_dtype  # noqa: E402
from moejax.nn.lean_decode import LAYOUTS, lean_decoder  # noqa: E402
from moejax.nn.sample import _sample  # noqa: E402
from moejax.nn.speculative import _speculate  # noqa: E402
from moejax.sparse_lm import decoder_of  # noqa: E402


def _rows(max_new: int, draft_len: int, layout: str, fused: int) -> list[tuple[str, dict]]:
    cfg = apply_overrides(make_config("quick"), WIDE)
    target = with_dtype(grow_blockffn_lm(
        decoder_of(cfg.target.build(cfg.seed)), extra_layers=cfg.grow.extra_layers,
        n_experts=cfg.grow.n_experts, d_expert=cfg.grow.d_expert,
        key=jax.random.key(cfg.seed + 1)), "bfloat16")
    draft = lean_decoder(keep_layers(target, range(1)), layout, bool(fused))
    prompt = jnp.zeros((1, cfg.prompt_len), jnp.int32)
    rows = []
    for name, path, tile in (("AR dense", "dense", 1), ("AR token-sparse", "auto", 1)):
        graphdef, state = nnx.split(lean_decoder(blockffn_path(target, path, tile), layout,
                                                 bool(fused)))
        rows.append((name, loop_launches(gpu_program(
            _sample, graphdef, state, prompt, jnp.full((1,), cfg.prompt_len, jnp.int32),
            jax.random.key(0), max_new=max_new, temperature=0.0, top_p=1.0, eos_id=None,
            pad_id=0))))
    dg, ds = nnx.split(draft)
    for name, path in (("spec dense", "dense"), ("spec chunk-sparse", "auto")):
        tg, ts = nnx.split(lean_decoder(blockffn_path(target, path, draft_len + 1), layout,
                                        bool(fused)))
        rows.append((f"{name} (round of n={draft_len})", loop_launches(gpu_program(
            _speculate, tg, ts, dg, ds, prompt, jax.random.key(0), max_new=max_new,
            n=draft_len, temperature=0.0))))
    return rows


def main(argv: list[str]) -> int:
    kw = dict(max_new=128, draft_len=4, layout="kn", fused=0)
    for arg in argv:
        key, _, value = arg.partition("=")
        if (key == "layout" and value in LAYOUTS) or (key == "fused" and value in ("0", "1")):
            kw[key] = value if key == "layout" else int(value)
        elif key not in kw or key in ("layout", "fused") or not value.isdigit() or \
                int(value) < 1:
            raise SystemExit(f"{arg!r}: give max_new=N and/or draft_len=N (N >= 1), layout="
                             f"{'|'.join(LAYOUTS)}, fused=0|1")
        else:
            kw[key] = int(value)
    if importlib.util.find_spec("jax_plugins") is None:  # restart with the plugin on the path
        os.execve(sys.executable, [sys.executable, __file__, *argv], gpu_compile_env())
    print("| decoding | kernels per round | by kind (most first) |\n|---|---|---|")
    for name, kinds in _rows(**kw):
        top = ", ".join(f"{k} {v}" for k, v in kinds.most_common(8))
        print(f"| {name} | {sum(kinds.values())} | {top} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
