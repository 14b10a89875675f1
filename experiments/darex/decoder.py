"""Decoder DAREx study (paper Table 3 analog): DARE vs DAREx-q on a fine-tuned causal LM.

* quick (CPU): the ``dense_lm_prose`` substrate (a small byte-level decoder pre-trained on the
  Python 3.11 documentation sources, :mod:`moejax.substrates`, built once and cached) is
  fine-tuned on code (CPython stdlib source);
* full (GPU): SmolLM2-135M-Instruct (``moejax.io.smollm2.load_smollm2``) fine-tuned on stdlib code
  with its own tokenizer.

Fine-tuning runs twice (AdamW without weight decay, and AdamR-L2). The attention / FFN matrix
deltas are pruned at p = 0.95 and 0.99 with DARE, DAREx-q (q_v: validation loss; q_e:
last-layer logit change on one batch) and per-layer q_e (analytic, Eq. 5). Metric: held-out
code cross-entropy (nats/token; lower is better) and next-token accuracy on the test files,
which neither fine-tuning nor q_v's validation files share. Table ``l2_sweep``
(Sec. 5.2, Fig. 3 analog): AdamR-L2 at each weight of ``l2_sweep``, unpruned and with DARE at
each p, and the share of AdamW fine-tuning's gain over the pre-trained model that DARE at the
highest p keeps.

    python -m experiments.darex.decoder                 # quick
    python -m experiments.darex.decoder preset=full     # SmolLM2-135M on a GPU
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import numpy as np
from flax import nnx

from experiments.darex.common import PAPER_SCALE, beats_pretrained
from moejax import delta as dl
from moejax.config import Config, config
from moejax.data.corpora import corpus_tokens
from moejax.data.lm_batches import WindowBatches
from moejax.delta import MethodName, PruneContext, delta_stats, matmul_input_stats, run_methods
from moejax.evaluate import LMEvaluator, outputs_on
from moejax.harness.claims import (
    Claim,
    lookup,
    measured,
    paired_compare,
    per_seed,
    threshold_claim,
    top_column,
)
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.io.smollm2 import load_smollm2
from moejax.substrates import build as build_substrate
from moejax.substrates import substrate_config
from moejax.substrates.lm import LMSubstrateConfig
from moejax.train import (
    TrainConfig,
    adam_linear_config,
    lm_loss_fn,
    params_loss,
    require_read,
    train_params,
)
from moejax.train.hparams import OPTIMIZER_NAMES


@config
class DecoderStudyConfig(Config):
    """Model source, corpus sizes, training lengths and the pruning grid."""

    NONEMPTY = ("ps", "methods")

    model: Literal["substrate", "smollm2_135m"] = "substrate"
    # model="substrate": the dense byte-level LM pre-trained on prose (moejax.substrates)
    substrate: LMSubstrateConfig = substrate_config("dense_lm_prose", "quick")
    substrate_cache: str = ""  # "" = $MOEJAX_SUBSTRATE_DIR or ~/.cache/moejax/substrates
    seq_len: int = 64
    # the DAREx recipe, run with Adam (no decay) and with AdamR-L2 (lambda = l2_weight)
    finetune: TrainConfig = adam_linear_config(200, 1e-3, batch_size=16, warmup=20)
    l2_weight: float = 0.1
    # Fig. 3: AdamR-L2 at each weight, pruned with DARE at ps (() = no sweep)
    l2_sweep: tuple[float, ...] = (0.01, 0.1, 1.0)
    corpus_bytes: int = 2_000_000  # bytes of each corpus read
    eval_batches: int = 4
    ps: tuple[float, ...] = (0.95, 0.99)
    methods: tuple[MethodName, ...] = ("DARE", "DAREx-q (q_v)", "DAREx-q (q_e)",
                                "DAREx-q (per-layer q_e)")
    q_num: int = 20
    eta_num: int = 12
    # what is pruned: "all" (the official drop_decoder: every delta but an untied output head;
    # a tied embedding is the embedding and is pruned) or "matrices" (the blocks' attention
    # and FFN matrices only)
    prune: Literal["all", "matrices"] = "all"
    # the per-layer q's bound (moejax.delta.analytic_q): "two_sided" or "official_signed"
    per_layer_form: Literal["two_sided", "official_signed"] = "two_sided"
    q_spacing: Literal["geometric", "linear"] = "geometric"  # the searched q grid (q_grid)
    seed: int = 0  # batch order, DARE masks (replaces finetune.seed)

    def unread_fields(self) -> dict[str, str]:
        return self._read_only_with("model", {"substrate": ("substrate",)})

    def validate(self):
        require_read(self, "finetune", "each fine-tune")
        self._require(self.seq_len >= 8, f"seq_len={self.seq_len} must be >= 8")
        self._require(self.model != "substrate" or self.seq_len <= self.substrate.max_seq_len,
                      f"seq_len={self.seq_len} exceeds substrate.max_seq_len="
                      f"{self.substrate.max_seq_len}")
        self._require(all(0 < p < 1 for p in self.ps), f"ps={self.ps} must lie in (0, 1)")
        self._require(self.corpus_bytes >= self.seq_len + 2,
                      f"corpus_bytes={self.corpus_bytes} cannot hold one window of seq_len + 1 = "
                      f"{self.seq_len + 1} tokens at a random offset (at least seq_len + 2 = "
                      f"{self.seq_len + 2} bytes); raise corpus_bytes")
        self._require(self.q_num >= 1, f"q_num={self.q_num} must be >= 1 grid steps")
        self._require(self.eta_num >= 1, f"eta_num={self.eta_num} must be >= 1 grid steps")
        self._require(self.l2_weight > 0, f"l2_weight={self.l2_weight}: AdamR-L2's lambda must "
                      "be > 0 (lambda 0 is the AdamW run it is compared with)")
        self._require(all(w > 0 for w in self.l2_sweep),
                      f"l2_sweep={self.l2_sweep}: AdamR-L2 weights must be > 0 (weight 0 is "
                      "the AdamW run, always there)")


def make_config(preset: str) -> DecoderStudyConfig:
    if preset == "quick":
        return DecoderStudyConfig()
    return DecoderStudyConfig(model="smollm2_135m", seq_len=256,
                              finetune=adam_linear_config(1000, 1e-4, batch_size=16, warmup=20),
                              corpus_bytes=20_000_000, eval_batches=16)


# ------------------------------------------------------------------------------ data


# ------------------------------------------------------------------------------ model pieces


def build_models(cfg: DecoderStudyConfig):
    """``(graphdef, rest, theta_P, tokenizer_or_None, substrate_or_None)``: SmolLM2, or the
    ``dense_lm_prose`` substrate (built once and cached)."""
    if cfg.model == "smollm2_135m":
        model, tok = load_smollm2(max_seq_len=max(cfg.seq_len, 512))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return graphdef, rest, params, tok, None
    sub = build_substrate("dense_lm_prose", cfg.substrate, cache_dir=cfg.substrate_cache or None,
                          progress=True)
    graphdef, params, rest = nnx.split(sub.model, nnx.Param, ...)
    return graphdef, rest, params, None, sub


LABEL = {k: OPTIMIZER_NAMES[k] for k in ("adamw", "adamr_l2")}


class _Data(NamedTuple):
    """The fine-tuning stream, the held-out evaluators and the calibration batch."""

    train_src: WindowBatches
    val_eval: object
    test_eval: object
    calib: np.ndarray


def run(cfg: DecoderStudyConfig, run: RunDir) -> dict:
    graphdef, rest, pre, tok, sub = build_models(cfg)
    data = _data(cfg, tok, graphdef, rest)
    loss_fn = params_loss(graphdef, rest, lm_loss_fn)
    before = data.test_eval(pre)
    base_rows, rows, tuned = [], [], {}
    for opt, weight in (("adamw", 0.0), ("adamr_l2", cfg.l2_weight)):
        tcfg = cfg.finetune.replace(optimizer="adam" if opt == "adamw" else opt,
                                    weight_decay=weight, seed=cfg.seed)
        fin, _ = train_params(pre, data.train_src, tcfg, loss_fn, desc=f"finetune code ({opt})")
        tuned[weight] = fin
        base, pruned = _prune(cfg, graphdef, rest, pre, fin, data, LABEL[opt])
        base_rows.append({"fine-tuning": LABEL[opt], "test_loss_pretrained": before["loss"],
                          **base})
        rows += pruned
    run.note(_start_note(sub))
    pruned = ("every delta but an untied output head (the tied embedding and the norm scales "
              "too, as the official drop_decoder)" if cfg.prune == "all" else
              "the attention and FFN matrices of every block (prune=matrices; the tied "
              "embedding and the norm scales keep their full delta)")
    run.note(f"Fine-tuned {cfg.finetune.steps} steps at lr {cfg.finetune.lr:g}. Pruned: "
             f"{pruned}. q_v minimises the loss on the validation files, every reported loss is on "
             f"the test files (disjoint); q_e the mean |logit change| on one "
             f"fixed training batch, over a {cfg.q_spacing} grid of {cfg.q_num} steps; "
             f"per-layer q_e uses Eq. 5's {cfg.per_layer_form} bound with the signed mean "
             "x_j of each matrix input on that batch (other pruned leaves: 1-p), over "
             f"{cfg.eta_num} etas. Same drop mask for every q.")
    run.table("finetuned", base_rows,
              title="Held-out code loss (nats/token) before / after fine-tuning, unpruned")
    run.table("pruned", rows, title="Held-out code loss after delta pruning (lower is better)")
    run.table("pruned_wide", [
        {"fine-tuning": lab, "method": m, **{f"p={r['p']}": r["test_loss"] for r in rows
                                             if r["fine-tuning"] == lab and r["method"] == m}}
        for lab in LABEL.values() for m in cfg.methods], title="Held-out code loss by drop rate")
    if cfg.l2_sweep:
        _l2_sweep(cfg, run, pre, data, loss_fn, tuned, before["loss"],
                  base_rows[0]["test_loss_finetuned"])
    p_hi = max(cfg.ps)
    at_p = {r["method"]: r["test_loss"] for r in rows
            if r["fine-tuning"] == "AdamW" and r["p"] == p_hi}
    out = {"pretrained_loss": before["loss"],
           "finetuned_loss": base_rows[0]["test_loss_finetuned"],
           **{f"{m} p={p_hi}": at_p[m] for m in cfg.methods}}
    start = "substrate dense_lm_prose" if sub is not None else cfg.model
    out["headline"] = (f"{start}: code loss pre-trained {before['loss']:.3f}, fine-tuned "
                       f"{out['finetuned_loss']:.3f}; at p={p_hi} " + ", ".join(
                           f"{m} {at_p[m]:.3f}" for m in cfg.methods))
    return out


def _data(cfg: DecoderStudyConfig, tok, graphdef, rest) -> _Data:
    """Code windows to fine-tune on; the validation evaluator (q_v's choice) and the test
    evaluator (every reported loss) on windows of two disjoint sets of held-out files, as the
    paper tunes q_v on a validation set and reports on the test set; a calibration batch from
    the training stream (for q_e)."""
    code = lambda split: corpus_tokens("stdlib_code", split, tok, cfg.corpus_bytes)  # noqa: E731
    bs = cfg.finetune.batch_size
    train_src = WindowBatches(code("train"), batch_size=bs, seq_len=cfg.seq_len,
                              seed=cfg.seed + 1)

    def held(split, seed):
        windows = WindowBatches(code(split), batch_size=bs, seq_len=cfg.seq_len, seed=seed)
        return LMEvaluator([windows.batch(i) for i in range(cfg.eval_batches)])

    return _Data(train_src, held("validation", 10_000).bind(graphdef, rest),
                 held("test", 20_000).bind(graphdef, rest),
                 train_src.batch(10**6)["inputs"][: max(2, bs // 2)])


def _mask(cfg: DecoderStudyConfig, D):
    """The pruned leaves of the delta ``D`` (``cfg.prune``)."""
    return (dl.select_leaves(D, exclude=r"^w_head$", min_ndim=0) if cfg.prune == "all"
            else dl.select_leaves(D, include=r"blocks/.*/(attn|ffn)/w_"))


def _l2_sweep(cfg: DecoderStudyConfig, run: RunDir, pre, data: _Data, loss_fn, tuned: dict,
              pretrained_loss: float, adamw_loss: float) -> None:
    """Fig. 3 analog: AdamR-L2 at each weight of ``cfg.l2_sweep`` (weight 0: the AdamW run;
    a weight fine-tuned already is reused), unpruned and with DARE at each p (the drop mask
    of the main table), and the share of AdamW's gain that DARE at the highest p keeps."""
    key, p_hi, rows = jax.random.key(cfg.seed + 3), max(cfg.ps), []
    for w in (0.0, *cfg.l2_sweep):
        if w not in tuned:
            tcfg = cfg.finetune.replace(optimizer="adamr_l2", weight_decay=w, seed=cfg.seed)
            tuned[w], _ = train_params(pre, data.train_src, tcfg, loss_fn,
                                       desc=f"finetune code (AdamR-L2 {w:g})")
        D = dl.delta(pre, tuned[w])
        mask = _mask(cfg, D)
        row = {"l2_weight": w, "unpruned": data.test_eval(tuned[w])["loss"]}
        for p in cfg.ps:
            row[f"DARE p={p}"] = data.test_eval(dl.apply_delta(
                pre, dl.dare(key, D, p, mask=mask)))["loss"]
        row["kept_of_AdamW_gain"] = ((pretrained_loss - row[f"DARE p={p_hi}"])
                                     / (pretrained_loss - adamw_loss))
        rows.append(row)
    run.table("l2_sweep", rows, title="AdamR-L2 weight vs DARE (Fig. 3 analog): held-out code "
              f"loss (weight 0: AdamW); kept_of_AdamW_gain: (pre-trained - DARE p={p_hi}) / "
              "(pre-trained - AdamW unpruned)")
    xs = [0.0, *(-float(np.log10(1 - p)) for p in cfg.ps)]  # the paper's log-scaled p
    run.line_plot("l2_sweep", {f"L2 {r['l2_weight']:g}": (xs, [
        r["unpruned"], *(r[f"DARE p={p}"] for p in cfg.ps)]) for r in rows},
        xlabel="-log10(1 - p)   (0: unpruned, 1: p = 0.9, 2: p = 0.99)",
        ylabel="held-out code loss (nats/token)", markers=True, logy=True,
        hlines={"pre-trained": pretrained_loss, "AdamW unpruned": adamw_loss},
        title="DARE after AdamR-L2 of each weight (weight 0: AdamW)")


def _prune(cfg, graphdef, rest, pre, fin, data: _Data, label: str):
    """The fine-tuned model's unpruned row and one row per (method, drop rate)."""
    D = dl.delta(pre, fin)
    mask = _mask(cfg, D)
    after = data.test_eval(fin)
    base = {"fine-tuning": label, "test_loss_finetuned": after["loss"],
            "test_acc_finetuned": after["accuracy"], **delta_stats(D, mask)}
    x_stats = {}
    if any("per-layer" in m for m in cfg.methods):
        x_stats = matmul_input_stats(lambda prm: nnx.merge(graphdef, prm, rest)(data.calib)[0],
                                     fin)
    ctx = PruneContext(pretrained=pre, delta=D, mask=mask, key=jax.random.key(cfg.seed + 3),
                       val_metric=lambda prm: -data.val_eval(prm)["loss"],
                       test_metric=lambda prm: -data.test_eval(prm)["loss"],
                       outputs_fn=outputs_on(graphdef, rest, data.calib), x_stats=x_stats,
                       q_num=cfg.q_num, eta_num=cfg.eta_num,
                       analytic_form=cfg.per_layer_form, q_spacing=cfg.q_spacing)
    rows = [{"fine-tuning": label, "p": r["p"], "method": r["method"], "test_loss": -r["metric"],
             "q": r["q"], "seconds": r["seconds"]}
            for r in run_methods(ctx, cfg.methods, cfg.ps, desc=f"prune ({label})")]
    return base, rows


def _start_note(sub) -> str:
    if sub is None:
        return "Started from SmolLM2-135M-Instruct (imported GGUF weights)."
    sc = sub.config
    return (f"Started from the substrate `dense_lm_prose` ({sub.path.name}: a "
            f"{sc.n_layers}-layer d={sc.d_model} byte-level LM pre-trained "
            f"{sc.train.steps} steps on {sc.corpus}, validation loss "
            f"{sub.metrics['val_loss']:.3f} nats/byte there).")


def claims(t: dict[str, list[dict]]) -> list[Claim]:
    """The DAREx paper's decoder claims on this study's tables (held-out loss: lower is
    better), each judged on the paired per-seed differences at the highest drop rate, with
    its control: the winner beats the pre-trained model
    (:func:`experiments.darex.common.beats_pretrained`), so that it wins by the delta it
    keeps, not only by the other's collapse."""
    p = top_column(t.get("pruned_wide"))

    def at(ft, m):
        return (f"{ft} {m} {p}",
                lambda r: lookup(r.get("pruned_wide"), {"fine-tuning": ft, "method": m}, p))

    def checked(c, winner):
        runs = per_seed(t)
        pre = [measured(lookup(r.get("finetuned"), {"fine-tuning": winner[0]},
                               "test_loss_pretrained")) for r in runs]
        return beats_pretrained(c, [measured(at(*winner)[1](r)) for r in runs], pre,
                                better="lower")

    def below_dare(method, where):
        return checked(paired_compare(f"{method} has a lower loss than DARE at the highest "
                                      f"drop rate ({where})", t, at("AdamW", method),
                                      at("AdamW", "DARE"), better="lower"), ("AdamW", method))

    out = [below_dare("DAREx-q (q_v)", "Sec. 4.1, Table 3"),
           checked(paired_compare("AdamR-L2 fine-tuning lowers DARE's loss at the highest "
                                  "drop rate (Sec. 4.2)", t, at("AdamR-L2", "DARE"),
                                  at("AdamW", "DARE"), better="lower"), ("AdamR-L2", "DARE")),
           below_dare("DAREx-q (q_e)", "Sec. 4.1, Table 3"),
           below_dare("DAREx-q (per-layer q_e)", "Sec. 4.1, App. C.9, Table 3")]
    if t.get("l2_sweep"):
        out.append(_sweep_claim(t))
    return out


# the share of AdamW fine-tuning's gain that counts as "maintaining performance" at the
# highest drop rate (Sec. 5.2, Fig. 3; the paper gives no number)
KEPT_SHARE = 0.9


def _sweep_claim(t: dict) -> Claim:
    """Fig. 3: some AdamR-L2 weight lets DARE prune at the highest drop rate keeping at least
    :data:`KEPT_SHARE` of what AdamW fine-tuning gained over the pre-trained model (a share
    of AdamW's gain, not of the weight's own, so that a weight strong enough to keep the
    delta at zero wins nothing). The weight with the highest mean share, its share per seed
    run at a Bonferroni level over the weights (:func:`moejax.harness.claims.
    threshold_claim`)."""
    runs = per_seed(t)
    first = t["l2_sweep"]
    col = top_column(first, "DARE p=")
    claim = (f"An AdamR-L2 weight lets DARE prune at {col[5:]} keeping >= {KEPT_SHARE:g} of "
             "AdamW fine-tuning's gain (Sec. 5.2, Fig. 3)")
    pre = [measured(lookup(r.get("finetuned"), {"fine-tuning": "AdamW"},
                           "test_loss_pretrained")) for r in runs]
    tuned = [measured(lookup(r.get("finetuned"), {"fine-tuning": "AdamW"},
                             "test_loss_finetuned")) for r in runs]
    if None in pre or None in tuned or any(a - b <= 0 for a, b in zip(pre, tuned)):
        return Claim(claim, None, "AdamW fine-tuning gained nothing over the pre-trained model "
                     "in a seed run (or was not recorded): no gain to keep", inconclusive=True)
    shares = {}
    for w in (float(r["l2_weight"]) for r in first if float(r["l2_weight"]) > 0):
        got = [measured(lookup(r.get("l2_sweep"), {"l2_weight": w}, "kept_of_AdamW_gain"))
               for r in runs]
        if None not in got:
            shares[w] = got
    if not shares:
        return Claim(claim, None, "no AdamR-L2 weight measured in every seed run")
    best = max(shares, key=lambda w: sum(shares[w]) / len(shares[w]))
    c = threshold_claim(claim, shares[best], KEPT_SHARE, fmt=".3f", candidates=len(shares))
    return c._replace(evidence=f"L2 weight {best:g} (the best of {len(shares)}), share of "
                               f"AdamW's gain kept {c.evidence}")


STUDY = Study(
    "darex_decoder", make_config, run, claims=claims,
    seed_keys=("seed",),
    quick_repeat=5,
    smoke=("q_num=3",),
    paper_scale=PAPER_SCALE,
    derived_keys=(("finetune.optimizer", "AdamW's run (Adam, no decay) and AdamR-L2's"),
                  ("finetune.weight_decay", "0 for AdamW, l2_weight and l2_sweep for AdamR-L2"),
                  ("finetune.seed", "seed")),
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
