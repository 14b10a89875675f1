"""Speculative decoding with chunk-sparse verification (BlockFFN Sec. 3.3 / App. G, Table 11
analog): decode tokens/s at batch 1, greedy, for

* ``AR dense`` / ``AR token-sparse``: the jitted autoregressive loop, BlockFFN experts dense or
  through the exact union path per token (FFN work ~ 1 - TLS);
* ``spec dense`` / ``spec chunk-sparse``: a small draft proposes ``n`` tokens, the target
  verifies ``n + 1`` in one pass, dense or through the union of the block (FFN work ~
  1 - CLS_{n+1});

on (a) the trained BlockFFN LM of the BlockFFN studies (``moejax.sparse_lm`` quick model) and
(b) a >= 100M-parameter BlockFFN LM grown from it
(:func:`moejax.bench.decode_timing.grow_blockffn_lm`: zero-residual extra layers with routers tiled
from the trained one and calibrated to its TLS, so it predicts the same tokens with the
trained routing statistics). Drafts (``drafts``):

* ``independent``: a small dense LM trained by the same loop on the same data and tokenizer;
* ``distilled``: that draft distilled from the target
  (:func:`moejax.chunk_sparse.draft.distill_draft`: forward KL on the target's greedy
  continuations of training prompts, or on-policy reverse KL), from the trained small target,
  whose logits the grown one reproduces exactly;
* ``self``: the target's first ``self_layers`` layers with its final norm and head (early exit,
  no training), and ``self distilled``: the same fine-tuned by the same distillation. Fewer
  layers than the trained model have, so the self-draft of the grown target is not the trained
  model itself (whose zero-residual extra layers would make it exact by construction).

Each draft's ``agreement`` is the share of positions of the autoregressive output where its
argmax equals the target's. Every speculative output is checked token for token against the
autoregressive one.

``decode_dtype`` is what the trained models decode in. ``float32`` (the default) is exact: a
speculative decode that differs from the autoregressive one stops the run. ``bfloat16``
halves the weight bytes each token reads and takes the 16-bit kernels (on a Hopper GPU, the
chunk-union decode kernel), but a verified block and a single token sum in different orders,
so a near-tie can round the other way; there the table gives each decoding's
``tokens_matching_AR`` (the share of new tokens before its first difference, over prompts)
and the serving claims are judged on speed, their evidence naming that share.

Variant ``wide``: the quick recipe at width 256 (16 experts of width 64), grown with 64 experts
of width 256 to 106M parameters, shapes the Hopper decode kernel takes. The quick model's
width 48 is off the kernel's blocks, so on a GPU its chunk-sparse rows run the dense product
and measure the draft and the verification, not the union kernel.

A GPU's variants (``STUDY.accelerator_variants``) serve the quick or wide models in bfloat16
at draft length 4, the wide ones also with command buffers or with the lean decode's product
weights transposed (``decode_layout=nk``), that with each decode step's attention input and
each one-token step's FFN input as one kernel each (``decode_fused=true``), or the full preset
cut short.

    python -m experiments.blockffn.speculative
    python -m experiments.blockffn.speculative variant=wide_bf16   # a GPU
    python -m experiments.blockffn.speculative preset=full   # GPU, bigger target
"""

from __future__ import annotations

from typing import Literal

import jax
import numpy as np

from experiments.blockffn.common import PAPER_SCALE, blockffn_changes
from experiments.blockffn.speculative_claims import claims
from experiments.blockffn.speculative_decodings import time_decodings
from experiments.blockffn.speculative_tables import (  # derived_tables: read by results_doc
    best_notes,
    decode_table,
    derived_tables,  # noqa: F401
)
from moejax.bench.decode_timing import grow_blockffn_lm
from moejax.chunk_sparse.draft import DraftDistillConfig, distill_draft
from moejax.config import Config, config
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.nn.decoder import keep_layers, with_dtype
from moejax.pytree import count_params
from moejax.sparse_lm import (
    ARCH_NAMES,
    SparseLMConfig,
    data_sources,
    decoder_of,
    sparse_lm_preset,
    train_and_evaluate,
)
from moejax.train.hparams import TrainConfig, require_read

EVAL_BATCHES = 2  # validation batches of the models' PPL (and the first decoded prompts)


@config
class GrowConfig(Config):
    """The >= 100M-parameter target: extra zero-residual BlockFFN layers (0 = skip (b))."""

    extra_layers: int = 12
    n_experts: int = 64
    d_expert: int = 1408

    def unread_fields(self) -> dict[str, str]:
        return {} if self.extra_layers else {
            f: "read only with extra_layers >= 1 (this config has extra_layers=0: no grown "
               "target)" for f in ("n_experts", "d_expert")}


@config
class DraftsConfig(Config):
    """Which drafts run besides the independently trained one (module docstring)."""

    distilled: bool = True
    self_layers: int = 1  # self-draft: the target's first layers (0 = no self-draft)
    self_distilled: bool = True
    distil: DraftDistillConfig = DraftDistillConfig()


@config
class SpecBenchConfig(Config):
    target: SparseLMConfig = SparseLMConfig()
    draft: SparseLMConfig = SparseLMConfig(arch="dense", d_model=32, n_layers=1, n_heads=2,
                                           n_experts=4, d_expert=16)
    train: TrainConfig = TrainConfig()
    seq_len: int = 64
    draft_lens: tuple[int, ...] = (2, 4, 6)
    # the claim takes the fastest of len(draft_lens) x drafts settings at a Bonferroni level,
    # its interval over the prompts: 8 (7 degrees of freedom) to tell a 2x speedup from 1.5x
    n_prompts: int = 8
    prompt_len: int = 32
    max_new_tokens: int = 96
    grow: GrowConfig = GrowConfig()
    drafts: DraftsConfig = DraftsConfig()
    decode_dtype: Literal["float32", "bfloat16"] = "float32"
    # each decoding traced once more by the profiler on a GPU or TPU (a CPU trace has no
    # device plane): kernels per generated token, the fraction of the wall time the device
    # is busy, the profile_top longest kernels per token (tables "token_kernels_<target>")
    # and every kernel by kind, with its launches per token ("kernel_kinds_<target>"), and the
    # compiled decoding loop's HLO, which says what each kernel fuses
    # ("programs/<target>_<decoding>.hlo")
    profile: bool = True
    profile_top: int = 6
    # time the trained (small) target's decodings as well as the grown one's (false: the
    # grown target's only, where a GPU's minutes go to the >= 100M-parameter claim)
    decode_trained: bool = True
    # every decoding's loop compiled with XLA's command buffers taking its while loops and
    # conditionals (moejax.xla_flags.COMMAND_BUFFERS), where this XLA has them; the
    # command_buffers column says which ran
    command_buffers: bool = False
    # each decoding's lean decode step (moejax.nn.lean_decode) made before its loop, its
    # products' weights as the modules lay them out ("kn") or transposed ("nk": on a GPU
    # each one-row product a row reduction rather than a column reduction)
    decode_layout: Literal["kn", "nk"] = "kn"
    # each decode step's attention input (the residual add, the norm's factor, the q/k/v
    # product, RoPE and both cache writes; up to 8 new tokens) and each one-token step's FFN
    # input as one kernel on a GPU (moejax.kernels.decode_qkv, decode_ffn), XLA's elsewhere
    # and where a kernel does not take the call; the decode_step column says which was asked
    decode_fused: bool = False
    seed: int = 0

    def unread_fields(self) -> dict[str, str]:
        unread = self._read_only_with("profile", {"profile_top": (True,)})
        if not (self.drafts.distilled or self.drafts.self_distilled):
            unread["drafts.distil"] = ("read only with drafts.distilled or "
                                       "drafts.self_distilled (this config has neither)")
        return unread

    def validate(self):
        require_read(self, "train", "the target's and draft's training", run_dir=True)
        require_read(self, "drafts.distil.train", "each draft's distillation", run_dir=True)
        r = self._require
        r(self.target.arch == "blockffn", "target.arch must be 'blockffn' (chunk sparsity)")
        for name, spec in (("target", self.target), ("draft", self.draft)):
            for key, value in spec.unread((spec.arch,)).items():
                r(False, f"{name}.{key}={value!r} is not read by a {spec.arch} model; leave "
                         f"it at its default, {SparseLMConfig._default(key)!r}")
        r(all(n >= 1 for n in self.draft_lens) and self.draft_lens, "draft_lens must be >= 1")
        r(self.profile_top >= 1, f"profile_top={self.profile_top} must be >= 1")
        r(self.decode_trained or self.grow.extra_layers > 0,
          "decode_trained=false needs grow.extra_layers >= 1: else nothing is decoded")
        r(not self.grow.extra_layers or self.grow.n_experts % self.target.n_experts == 0,
          f"grow.n_experts={self.grow.n_experts} must be a multiple of target.n_experts="
          f"{self.target.n_experts}: the extra routers tile the trained last one")
        r(self.n_prompts >= 1 and self.prompt_len >= 1 and self.max_new_tokens >= 1,
          "n_prompts, prompt_len and max_new_tokens must be >= 1")
        # the prompts are the heads of validation windows, the drafts' training prompts of
        # training windows (seq_len tokens each)
        distils = self.drafts.distilled or self.drafts.self_distilled
        for key, n in (("prompt_len", self.prompt_len),
                       *((("drafts.distil.prompt_len", self.drafts.distil.prompt_len),)
                         if distils else ())):
            r(n <= self.seq_len, f"{key}={n} exceeds seq_len={self.seq_len}, the windows the "
                                 "prompts are cut from; lower it or raise seq_len")
        longest = min(self.target.max_seq_len, self.draft.max_seq_len)
        r(self.seq_len <= longest, f"seq_len={self.seq_len} (the training window) exceeds the "
                                   f"models' max_seq_len={longest}")
        need = self.prompt_len + self.max_new_tokens + 2 * (max(self.draft_lens) + 1)
        r(need <= min(self.target.max_seq_len, self.draft.max_seq_len),
          f"prompt_len + max_new_tokens + 2 (max draft_len + 1) = {need} exceeds the models' "
          "max_seq_len")
        r(0 <= self.drafts.self_layers < self.target.n_layers,
          f"drafts.self_layers={self.drafts.self_layers} must be in [0, target.n_layers="
          f"{self.target.n_layers}): a self-draft keeps fewer layers than the trained target")
        r(self.drafts.self_layers or not self.drafts.self_distilled,
          "drafts.self_distilled needs drafts.self_layers >= 1")
        d = self.drafts.distil
        r(d.prompt_len + d.response_len <= min(self.target.max_seq_len,
                                                self.draft.max_seq_len),
          "drafts.distil.prompt_len + response_len exceeds the models' max_seq_len")


def make_config(preset: str) -> SpecBenchConfig:
    base = sparse_lm_preset(preset)
    kw = dict(target=base["model"].without_unread(("blockffn",)), train=base["train"],
              seq_len=base["seq_len"])
    if preset == "quick":
        return SpecBenchConfig(**kw)
    # the GPU preset serves in bfloat16, as a deployment would (the 16-bit decode kernels)
    draft = SpecBenchConfig._default("draft").replace(d_model=128, n_layers=2, n_heads=4)
    return SpecBenchConfig(**kw, draft=draft, n_prompts=16, max_new_tokens=256,
                           decode_dtype="bfloat16",
                           grow=GrowConfig(extra_layers=24, n_experts=160, d_expert=1024))


def _drafts(cfg, target, draft, train_src, run) -> dict:
    """The drafts to time, by name (module docstring), and a note on each."""
    out = {"independent": draft}
    dc = cfg.drafts
    prompts = np.concatenate([train_src.batch(i)["inputs"] for i in range(
        -(-dc.distil.prompts // cfg.train.batch_size))])
    how = ("forward KL on the target's greedy continuations" if dc.distil.method == "kd"
           else "on-policy reverse KL on the draft's own samples")
    # checkpointed in the run directory, as the target and draft are
    if dc.distilled:
        out["distilled"], _ = distill_draft(draft, target, prompts, dc.distil, seed=cfg.seed,
                                            desc="distil draft", start="independent",
                                            run_dir=run.path / "distilled")
    if dc.self_layers:
        name = f"self ({dc.self_layers} layer)"
        out[name] = self_draft = keep_layers(target, range(dc.self_layers))
        if dc.self_distilled:
            out[f"{name} distilled"], _ = distill_draft(
                self_draft, target, prompts, dc.distil, seed=cfg.seed, desc="distil self-draft",
                start=name, run_dir=run.path / "self_distilled")
    run.note(f"Drafts: {', '.join(out)}; distillation ({dc.distil.method}): {how}, "
             f"{dc.distil.prompts} training prompts of {dc.distil.prompt_len} bytes, "
             f"{dc.distil.response_len} target tokens each, {dc.distil.train.steps} steps of "
             f"{dc.distil.train.batch_size}, lr {dc.distil.train.lr}.")
    return out


def run(cfg: SpecBenchConfig, run: RunDir) -> dict:
    if note := blockffn_changes(cfg.target):
        run.note(note)
    tcfg = cfg.train.replace(seed=cfg.seed)
    train_src, val, prompts = _sources(cfg, tcfg)
    # checkpointed in the run directory (the drafts distilled from the target too): the same
    # command again (a GPU command's time limit) restores the trained models and goes
    # straight to the decodings
    target_ev = train_and_evaluate(cfg.target, tcfg, train_src, val, run.path / "target")
    draft_ev = train_and_evaluate(cfg.draft, tcfg, train_src, val, run.path / "draft")
    target, draft = decoder_of(target_ev["model"]), decoder_of(draft_ev["model"])
    run.note(f"Target: the BlockFFN LM trained {tcfg.steps} steps on stdlib code "
             f"({count_params(target)} params, val PPL {target_ev['val_ppl']:.2f}, TLS "
             f"{target_ev['tls']:.3f}); draft: a {ARCH_NAMES[cfg.draft.arch]} LM "
             f"({count_params(draft)} params, val PPL {draft_ev['val_ppl']:.2f}) trained the "
             "same way. Greedy, batch 1, "
             f"{cfg.n_prompts} prompts of {cfg.prompt_len} bytes, {cfg.max_new_tokens} new "
             f"tokens each, on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), "
             f"decoded in {cfg.decode_dtype}.")
    rows: list[dict] = []
    prompt_rows: list[dict] = []
    drafts = _drafts(cfg, target, draft, train_src, run)
    if cfg.decode_dtype != "float32":
        drafts = {k: with_dtype(d, cfg.decode_dtype) for k, d in drafts.items()}
    if cfg.decode_trained:
        time_decodings("trained", target, drafts, prompts, cfg, rows, run, prompt_rows)
    if cfg.grow.extra_layers:
        time_decodings("grown", _grown(cfg, run, target, target_ev["tls"], val), drafts,
                       prompts, cfg, rows, run, prompt_rows)
    decode_table(run, rows)
    best = best_notes(run, rows)
    differ = [r for r in rows if not r["same_tokens_as_AR"]]
    if differ and cfg.decode_dtype == "float32":
        raise RuntimeError("a speculative decode differs from the autoregressive one: see "
                           f"{run.path / 'decode.md'} (same_tokens_as_AR)")
    if cfg.decode_dtype != "float32":
        run.note(f"Decoded in {cfg.decode_dtype}: {len(differ)} of {len(rows)} decodings "
                 "differ from the autoregressive one somewhere (a verified block and a single "
                 "token sum in different orders); the lowest tokens_matching_AR is "
                 f"{min(r['tokens_matching_AR'] for r in rows):.3f}.")
    g = best.get("grown") or best.get("trained")
    return {"headline": f"{g['model']} target {g['params'] / 1e6:.1f}M: speculative + "
            f"chunk-sparse with the {g['draft']} draft {g['speedup_vs_AR_token_sparse']:.2f}x "
            f"AR token-sparse, {g['speedup_vs_AR_dense']:.2f}x AR dense (n={g['draft_len']}, "
            f"accepted {g['mean_accepted_length']:.2f})",
            **{f"{r['model']}_{r['mode'].replace(' ', '_')}_{r['draft'] or 'none'}_"
               f"n{r['draft_len']}_tok_s": round(r["tokens_per_s"], 1) for r in rows}}


def _sources(cfg: SpecBenchConfig, tcfg: TrainConfig):
    """``(training source, validation batches, prompts [n_prompts, prompt_len])``: the
    prompts are the heads of the validation windows, the PPL's batches and as many after them
    as ``n_prompts`` takes."""
    n = max(EVAL_BATCHES, -(-cfg.n_prompts // tcfg.batch_size))
    train_src, windows = data_sources(tcfg.batch_size, cfg.seq_len, cfg.seed, n)
    prompts = np.concatenate([b["inputs"][:, :cfg.prompt_len] for b in windows])
    return train_src, windows[:EVAL_BATCHES], prompts[:cfg.n_prompts]


def _grown(cfg: SpecBenchConfig, run: RunDir, target, tls: float, val):
    """The trained target grown by zero-residual BlockFFN layers to the paper's scale."""
    big = grow_blockffn_lm(target, extra_layers=cfg.grow.extra_layers,
                           n_experts=cfg.grow.n_experts, d_expert=cfg.grow.d_expert,
                           key=jax.random.key(cfg.seed + 1), target_tls=tls,
                           calib_tokens=np.concatenate([b["inputs"] for b in val]))
    run.note(f"Grown target: {count_params(big) / 1e6:.1f}M parameters ("
             f"{cfg.grow.extra_layers} zero-residual layers of {cfg.grow.n_experts} "
             f"experts of width {cfg.grow.d_expert}, routers tiled from the trained last "
             "router, shifted so the extra layers' TLS matches the trained model's "
             f"{tls:.3f} on validation tokens): same greedy tokens as the "
             "trained model by construction. It costs what a 100M-parameter model costs "
             f"but predicts what the {count_params(target):,}-parameter trained model "
             "predicts, so a draft distilled from it imitates a small model: its "
             "acceptance is an upper estimate of what a draft of the same size would reach "
             "against a trained 100M-parameter target.")
    return big


# the module docstring's variant: width 256, experts on the Hopper decode kernel's blocks
WIDE = ("target.d_model=256", "target.n_heads=8", "target.d_expert=64", "grow.d_expert=256")
# served in bfloat16 at draft length 4, each decoding's 40 longest kernels listed with what
# they fuse (about two per block of the grown target's 14)
GPU_DECODE = ("decode_dtype=bfloat16", "draft_lens=(4,)", "profile_top=40")

STUDY = Study(
    "bench_speculative", make_config, run, claims=claims,
    seed_keys=("seed",),  # what `repeat=N` offsets per run: training, distillation, growth
    smoke=("n_prompts=2", "max_new_tokens=16", "drafts.distil.prompts=8"),
    # smoke=true at reduced depth: the grown target's 24 extra layers (2.0B parameters) need more
    # than this CPU's 24 GB; 8 of them keep every layer's shape
    smoke_depth=("grow.extra_layers=8",),
    paper_scale=PAPER_SCALE,
    derived_keys=(("train.seed", "seed"), ("drafts.distil.train.seed", "seed")),
    variants=(("wide", WIDE),),
    # a GPU's: the full preset's 16 x 256 new tokens cut to 4 x 128 (one command's time); the
    # quick models in bf16 (the wide: the grown target only), the wide with command buffers
    accelerator_variants=(("short", ("n_prompts=4", "max_new_tokens=128", "draft_lens=(2,4)")),
                          ("bf16", GPU_DECODE),
                          ("wide_bf16", (*WIDE, *GPU_DECODE, "decode_trained=false")),
                          ("wide_bf16_graphs", (*WIDE, *GPU_DECODE, "decode_trained=false",
                                                "command_buffers=true")),
                          ("wide_bf16_nk", (*WIDE, *GPU_DECODE, "decode_trained=false",
                                            "decode_layout=nk")),
                          ("wide_bf16_nk_fused", (*WIDE, *GPU_DECODE, "decode_trained=false",
                                                  "decode_layout=nk", "decode_fused=true"))),
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
