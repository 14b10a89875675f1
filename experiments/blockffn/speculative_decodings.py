"""bench_speculative's decodings and how each is timed (the study,
:mod:`experiments.blockffn.speculative`, trains the models and drafts they decode with): the
autoregressive baselines and every draft's speculative decoding, each timed once per device,
config, code and weights, its row, longest kernels (with what they fuse), kernels by kind and
compiled loop written as it is measured."""

from __future__ import annotations

import re
import sys

import numpy as np
from tqdm.auto import tqdm

from experiments.blockffn.speculative_tables import DECODE_TITLE, ratio_columns
from moejax.bench.decode_timing import (
    blockffn_path,
    decode_timing,
    expert_routes,
    matching_prefix,
    spec_chunk_sparsity,
)
from moejax.bench.profile import fused_ops, kernel_kind_rows, sees_device, top_kernel_rows
from moejax.bench.resume import (
    MeasurementStore,
    device_basis,
    source_fingerprint,
    weights_fingerprint,
)
from moejax.chunk_sparse.draft import argmax_agreement
from moejax.config import to_dict
from moejax.files import atomic_write_text
from moejax.harness.results import RunDir
from moejax.nn.decoder import with_dtype
from moejax.nn.lean_decode import lean_decoder
from moejax.pytree import count_params

__all__ = ["modes", "time_decodings"]


def modes(target, drafts, cfg):
    """``(mode, target variant, draft name, draft, n)``: the autoregressive baselines, then
    every draft with chunk-sparse verification (the first draft also with dense)."""
    yield "AR dense", blockffn_path(target, "dense"), "", None, 0
    yield "AR token-sparse", blockffn_path(target, "auto", 1), "", None, 0
    for i, (name, draft) in enumerate(drafts.items()):
        for n in cfg.draft_lens:
            if i == 0:
                yield "spec dense", blockffn_path(target, "dense"), name, draft, n
            yield "spec chunk-sparse", blockffn_path(target, "auto", n + 1), name, draft, n


def time_decodings(name, target, drafts, prompts, cfg, rows, run: RunDir,
                   prompt_rows: list):
    """Time every decoding of ``target`` into ``rows``. The table is rewritten after each
    row, and each decoding is kept in ``measured_<name>.json``
    (:class:`moejax.bench.resume.MeasurementStore`, under the config, the device, the code of
    this module and the study's, and the models' weights), so the same command again after a
    time limit times only the decodings still missing. Each prompt's own wall time goes to
    ``prompt_rows`` (the ``decode_prompts`` table: what the speed claim pairs by prompt)."""
    if cfg.decode_dtype != "float32":  # the drafts are cast once, in the study's run()
        target = with_dtype(target, cfg.decode_dtype)
    store = MeasurementStore(run.path / f"measured_{name}.json", {
        "config": to_dict(cfg), "device": device_basis(),
        # the code: this module's, which times, and the study's, which picks the prompts
        "code": source_fingerprint(sys.modules[__name__], sys.modules[type(cfg).__module__]),
        "target": weights_fingerprint(target),
        "drafts": {k: weights_fingerprint(d) for k, d in drafts.items()}})
    if store.dropped:
        print(f"bench_speculative: {store.dropped}", flush=True)
    ref, agree, token_kernels, kernel_kinds, reused = None, {}, [], [], 0
    total = 2 + len(cfg.draft_lens) * (len(drafts) + 1)
    # one path variant (a copy of the target's weights) alive at a time, not all of them
    for mode, model, dname, d, n in tqdm(modes(target, drafts, cfg), total=total, desc=name,
                                         leave=False):
        key = f"{mode} | {dname} | {n}"
        kept = store.get(key)
        reused += kept is not None
        if kept is None:
            fresh = _decoding(name, target, mode, model, dname, d, n, prompts, ref, agree, cfg)
            if (program := fresh.pop("program", None)) is not None:
                atomic_write_text(run.path / "programs" / f"{name}_{_slug(key)}.hlo", program)
            kept = store.put(key, fresh)
        row = dict(kept["row"])  # the summary's ratios are added to the table's copy
        if mode == "AR dense":
            ref = {"tokens": np.asarray(kept["tokens"], np.int32),
                   "tokens_per_s": row["tokens_per_s"]}
        if dname:
            agree.setdefault(dname, row["agreement"])
        rows.append(row)
        prompt_rows += [{"model": name, "mode": mode, "draft": dname, "draft_len": n or "",
                         "prompt": i, "seconds": sec}
                        for i, sec in enumerate(kept.get("prompt_seconds") or ())]
        if prompt_rows:
            run.table("decode_prompts", prompt_rows, title="Each prompt's decoding wall time "
                      "(seconds; the speed claim pairs the decodings by prompt)")
        token_kernels += kept["kernels"]
        kernel_kinds += kept.get("kinds", [])
        run.table("decode", rows, title=DECODE_TITLE)
        if token_kernels:
            run.table(f"token_kernels_{name}", token_kernels, title=(
                f"Where a generated token's device time goes, {name} target: each decoding's "
                f"{cfg.profile_top} longest kernels (profiler), milliseconds per token"))
        if kernel_kinds:
            run.table(f"kernel_kinds_{name}", kernel_kinds, title=(
                f"What a generated token's kernels are, {name} target: each decoding's kernels "
                "by kind (the name without XLA's instance numbers), launches and milliseconds "
                "per token, longest first"))
    if reused:
        run.note(f"{name} target: {reused} of {total} decodings were timed by an earlier "
                 f"command of this run on the same device ({store.path.name}), the others by "
                 "this one.")
    rows[:] = ratio_columns(rows)


def _slug(key: str) -> str:
    """A decoding's key (``"spec chunk-sparse | distilled | 4"``) as a file name."""
    return re.sub(r"[^a-z0-9]+", "_", key.lower()).strip("_")


def _decoding(name, target, mode, model, dname, d, n, prompts, ref, agree, cfg) -> dict:
    """One decoding timed: its table row, its longest kernels and (AR dense, the reference
    ``ref`` of the others: None when timing it) its tokens. ``agree``: each draft's argmax
    agreement measured so far (read, not written: the caller keeps the row's)."""
    # the lean decode steps made once, before the loops (as a server holds them), with their
    # products' weights in the configured layout, the one-token steps fused where configured
    lean = dict(layout=cfg.decode_layout, fused=cfg.decode_fused)
    r = decode_timing(lean_decoder(model, **lean), prompts, cfg.max_new_tokens,
                      draft=None if d is None else lean_decoder(d, **lean),
                      draft_len=max(n, 1),
                      profile=cfg.profile and sees_device(),
                      command_buffers=cfg.command_buffers, fix=(
                          f"lower grow.extra_layers (now {cfg.grow.extra_layers}) or "
                          f"grow.d_expert (now {cfg.grow.d_expert}), or prompt_len (now "
                          f"{cfg.prompt_len}) or max_new_tokens (now {cfg.max_new_tokens})"))
    ref = ref or r
    ref_tokens = ref["tokens"]
    agreement = agree.get(dname, "") if d is None or dname in agree else argmax_agreement(
        d, target, ref_tokens)
    row = {"model": name, "params": count_params(target), "decode_dtype": cfg.decode_dtype,
           "mode": mode, "expert_path": "dense" if mode.endswith("dense") else
           expert_routes(target, n + 1, cfg.decode_dtype), "draft": dname,
           "draft_params": count_params(d) if d is not None else "",
           "agreement": agreement,
           "draft_len": n or "", "tokens_per_s": r["tokens_per_s"],
           "command_buffers": r["command_buffers"], "layout": cfg.decode_layout,
           "decode_step": "fused" if cfg.decode_fused else "xla",
           "speedup_vs_AR_dense": r["tokens_per_s"] / ref["tokens_per_s"],
           "mean_accepted_length": r.get("mean_accepted_length", 1.0),
           "same_tokens_as_AR": bool(np.array_equal(r["tokens"], ref_tokens)),
           "tokens_matching_AR": matching_prefix(r["tokens"], ref_tokens, cfg.prompt_len)}
    kernels, kinds = [], []
    if r.get("kernels_per_token") is not None:
        row["kernels_per_token"] = r["kernels_per_token"]
        row["device_busy"] = r["device_busy"]
        keys = ("model", "mode", "draft", "draft_len")
        kinds = kernel_kind_rows([{**row, "kernels": r["kernels"],
                                   "kernel_counts": r.get("kernel_counts")}], keys)
        kernels = top_kernel_rows([{**row, "kernels": r["kernels"],
                                    "fuses": fused_ops(r["program"])}], cfg.profile_top, keys)
    sp = spec_chunk_sparsity(target, ref_tokens, max(n, 0) + 1)
    row["TLS"], row["CLS_block"] = sp["tls"], sp["cls"]
    row["ffn_fraction_bound"] = 1 - (sp["cls"] if mode.endswith("chunk-sparse")
                                     else sp["tls"] if mode == "AR token-sparse" else 0.0)
    return {"row": row, "kernels": kernels, "kinds": kinds, "program": r.get("program"),
            "prompt_seconds": [float(x) for x in r["prompt_seconds"]],
            "tokens": r["tokens"] if ref is r else None}
