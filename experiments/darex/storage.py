"""Storage study: bytes of a pruned + quantised delta checkpoint, load/apply time, and the time to
apply DARE / DAREx-q to a SmolLM2-135M-sized tree.

Table ``storage``: for each pruning method, drop rate p and bit width, the delta is pruned and
written with :mod:`moejax.delta.storage` (``.npz``, no pickle). The methods: DARE (survivors
rescaled by 1 / (1 - p)) and DAREx-q (q_v) (DAREx paper, Sec. 4.1: the same survivors rescaled
by 1 / q_v, q_v chosen on the validation accuracy), the paper's recipe for high drop rates;
the delta is AdamR-L2's (Sec. 4.2). Both store the same entries, so the same bytes:
* p = 0: dense leaves (32 = float32, 16 = bfloat16, b <= 8 = symmetric per-channel k-bit codes);
* p > 0: pruned matrices as flat indices (smallest unsigned dtype) + their surviving values
  (float32, bfloat16, or k-bit codes with one scale per matrix); vectors stay dense float32.

Columns: the method and its q, exact array bytes, ratio to the dense float32 delta, relative
error of the decoded delta against the pruned one, accuracy of ``theta_P + decoded delta``
(quick preset: the AdamR-L2 fine-tuned MLP of ``darex_controlled``), and save / load+decode /
apply seconds. Plot ``accuracy_vs_size``: accuracy against the storage ratio.

Table ``delta_worth`` (with a metric): the metric of ``theta_P`` alone and with the dense
delta, the control of the storage claim.

Table ``apply_time``: jitted ``theta_P + prune(Delta)`` on a tree with SmolLM2-135M's exact
parameter shapes (random values: a stand-in for the real weights, same bytes and FLOPs) for DARE,
DAREx-q with a global q and with per-layer q; bytes moved = read theta_P + read Delta + write
theta (3 x 4 bytes per parameter, float32). The first call of the first variant includes
compilation; the others reuse it (q is a traced argument).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from experiments.darex.common import PAPER_SCALE, worth_checked
from moejax import delta as dl
from moejax.config import Config, config
from moejax.delta.pruned_codec import decode_pruned, encode_pruned
from moejax.harness.claims import Claim, lookup, measured, per_seed, threshold_claim
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.nn.decoder import param_shapes, smollm2_135m_config
from moejax.substrates import build as build_substrate
from moejax.substrates import substrate_config
from moejax.substrates.mlp import MLPSubstrateConfig, accuracy_fn, finetune_mlp, load_tasks
from moejax.train import TrainConfig, adam_linear_config, require_read
from moejax.train.hparams import OPTIMIZER_NAMES

# the fine-tuning whose delta the study stores (DAREx Sec. 4.2: AdamR-L2 before DARE)
RECIPE_OPTIMIZER = "adamr_l2"


@config
class StorageConfig(Config):
    """What delta to store, at which drop rates / bit widths, and the timing tree."""

    NONEMPTY = ("ps", "bits", "methods")

    # smollm2_shapes: a random delta with SmolLM2-135M's shapes, sizes and times only (no model
    # to evaluate); smollm2_shapes_tiny: the same layout at 2 layers of width 64 (tests only)
    source: Literal["mlp", "smollm2_shapes", "smollm2_shapes_tiny"] = "mlp"
    delta_std: float = 1e-3  # std of the random delta when source="smollm2_shapes[_tiny]"
    ps: tuple[float, ...] = (0.0, 0.9, 0.95, 0.99)
    # how the survivors of p > 0 are rescaled; DAREx-q (q_v) needs a model to validate q on
    methods: tuple[Literal["DARE", "DAREx-q (q_v)"], ...] = ("DARE", "DAREx-q (q_v)")
    bits: tuple[int, ...] = (32, 16, 8, 4, 2)
    timing_tree: Literal["smollm2_135m", "tiny", "none"] = "smollm2_135m"  # tiny: tests only
    timing_repeats: int = 3
    # source="mlp": the mlp_mnist5k substrate (moejax.substrates.mlp) fine-tuned with AdamR-L2
    substrate: MLPSubstrateConfig = substrate_config("mlp_mnist5k", "quick")
    substrate_cache: str = ""  # "" = $MOEJAX_SUBSTRATE_DIR or ~/.cache/moejax/substrates
    finetune: TrainConfig = adam_linear_config(300, 1e-3, batch_size=128, warmup=20,
                                               optimizer=RECIPE_OPTIMIZER, weight=0.1)
    seed: int = 0  # replaces finetune.seed

    def unread_fields(self) -> dict[str, str]:
        unread = {**self._read_only_with("source", {f: ("mlp",) for f in (
            "substrate", "substrate_cache", "finetune")}),
            **self._read_only_with("timing_tree", {"timing_repeats": ("smollm2_135m", "tiny")})}
        if self.source == "mlp" and self.timing_tree == "none":  # no random delta drawn
            unread["delta_std"] = ("read only with a random delta: source='smollm2_shapes[_tiny]' "
                                   "or a timing_tree (this config has source='mlp', "
                                   "timing_tree='none')")
        return unread

    def validate(self):
        require_read(self, "finetune", "each fine-tune")
        self._require(all(0 <= p < 1 for p in self.ps), f"ps={self.ps} must lie in [0, 1)")
        self._require(all(b in (32, 16) or 1 <= b <= 8 for b in self.bits),
                      f"bits={self.bits}: use 32 (float32), 16 (bfloat16) or 1..8 (k-bit codes)")
        self._require(self.timing_repeats >= 1, "timing_repeats must be >= 1")
        self._require(self.delta_std > 0, f"delta_std={self.delta_std} must be > 0 (a zero "
                      "delta has nothing to prune, quantise or store)")
        self._require(self.source == "mlp" or "DAREx-q (q_v)" not in self.methods,
                      f"source={self.source!r} is a random delta without a model to choose "
                      "DAREx-q's q_v on: use methods=('DARE',)")


def make_config(preset: str) -> StorageConfig:
    if preset == "quick":
        return StorageConfig()
    return StorageConfig(source="smollm2_shapes", methods=("DARE",), timing_repeats=10)


# ------------------------------------------------------------------------------ delta sources


def smollm2_shapes_tree(key: jax.Array, std: float, tiny: bool = False) -> dict:
    """``{path: array}`` with SmolLM2-135M's exact parameter shapes, entries N(0, std^2)
    (``tiny``: its 2-layer, d=64 variant, for tests)."""
    shapes = param_shapes(smollm2_135m_config(tiny=tiny))
    keys = jax.random.split(key, len(shapes))
    return {p: jax.random.normal(k, s, jnp.float32) * std
            for (p, s), k in zip(shapes.items(), keys)}


def mlp_source(cfg: StorageConfig):
    """``(theta_P, Delta, test accuracy_fn, validation accuracy_fn)`` of the fine-tuned
    controlled MLP."""

    tasks = load_tasks(cfg.substrate.split_seed)
    pre = build_substrate("mlp_mnist5k", cfg.substrate, cache_dir=cfg.substrate_cache or None,
                          progress=True).model.params()
    fin = finetune_mlp(pre, tasks, cfg.finetune.replace(seed=cfg.seed))
    return (pre, dl.delta(pre, fin), accuracy_fn(tasks["B", "test"]),
            accuracy_fn(tasks["B", "validation"]))


# ------------------------------------------------------------------------------ encode / decode


def _flat(tree) -> dict:
    return dict(zip(dl.leaf_paths(tree), jax.tree_util.tree_leaves(tree)))


def _block(tree):
    jax.tree_util.tree_map(lambda x: x.block_until_ready(), tree)
    return tree


def pruned_deltas(cfg: StorageConfig, pre, delta_tree, val_fn) -> list[tuple[str, float, float,
                                                                             dict]]:
    """``(method, p, q, {path: pruned delta})`` for every drop rate and method (p = 0: the
    delta itself, method "unpruned"). Every method drops the same entries at a drop rate (one
    key per run); DAREx-q (q_v) rescales them by the q of the best ``val_fn`` accuracy on
    the DAREx grid (:func:`moejax.delta.search_q_v`)."""
    flat_d, mask = _flat(delta_tree), dl.select_leaves(delta_tree)
    key = jax.random.key(cfg.seed)
    out = []
    for p in cfg.ps:
        if p == 0:
            out.append(("unpruned", 0.0, 1.0, flat_d))
            continue
        for method in cfg.methods:
            q = 1.0 - p
            if method == "DAREx-q (q_v)":
                q = float(dl.search_q_v(key, pre, delta_tree, p, val_fn, mask=mask).best)
            out.append((method, p, q, _flat(dl.dare(key, delta_tree, p, q=q, mask=mask))))
    return out


def storage_rows(cfg: StorageConfig, pre, delta_tree, metric_fn, val_fn=None) -> list[dict]:
    flat_pre, flat_d = _flat(pre), _flat(delta_tree)
    treedef = jax.tree_util.tree_structure(pre)
    mask = _flat(dl.select_leaves(delta_tree))
    dense, n_params = dl.dense_bytes(delta_tree), dl.count_params(delta_tree)
    shapes = {k: v.shape for k, v in flat_d.items()}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # warm-up (first-call compilation of the eager ops), not timed
        stored = encode_pruned(flat_d, mask, 0.0, 32)
        _block(dl.apply_delta(flat_pre, decode_pruned(stored, shapes)))
        for method, p, q, pruned in pruned_deltas(cfg, pre, delta_tree, val_fn):
            ref_norm = float(jnp.sqrt(sum(jnp.sum(v * v) for v in pruned.values())))
            for bits in cfg.bits:
                stored = encode_pruned(pruned, mask, p, bits)
                f = Path(tmp) / f"delta_{len(rows)}.npz"
                t0 = time.perf_counter()
                dl.save(str(f), stored)
                t_save = time.perf_counter() - t0
                t0 = time.perf_counter()
                back = _block(decode_pruned(dl.load(str(f)), shapes))
                t_load = time.perf_counter() - t0
                t0 = time.perf_counter()
                theta = _block(dl.apply_delta(flat_pre, back))
                t_apply = time.perf_counter() - t0
                err = float(jnp.sqrt(sum(jnp.sum((back[k] - pruned[k]) ** 2) for k in back)))
                rep = dl.storage_report(stored)
                metric = (float(metric_fn(jax.tree_util.tree_unflatten(
                    treedef, [theta[k] for k in flat_pre]))) if metric_fn else float("nan"))
                rows.append({
                    "method": method, "q": q, "p": p, "bits": bits, "bytes": rep["array_bytes"],
                    "file_bytes": f.stat().st_size, "ratio_vs_fp32": dense / rep["array_bytes"],
                    "bits_per_param": 8 * rep["array_bytes"] / n_params,
                    "rel_err": err / max(ref_norm, 1e-30), "metric": metric,
                    "save_s": t_save, "load_decode_s": t_load, "apply_s": t_apply,
                })
    return rows


# ------------------------------------------------------------------------------ apply timing


def apply_timing_rows(cfg: StorageConfig) -> tuple[list[dict], int]:
    """Jitted apply of DARE / DAREx-q on the SmolLM2-135M-shaped tree (random stand-in)."""
    k_pre, k_d, k_drop = jax.random.split(jax.random.key(cfg.seed), 3)
    tiny = cfg.timing_tree == "tiny"
    pre = smollm2_shapes_tree(k_pre, 0.02, tiny)
    delta_tree = smollm2_shapes_tree(k_d, cfg.delta_std, tiny)
    mask = dl.select_leaves(delta_tree)
    n = dl.count_params(delta_tree)
    moved = 3 * 4 * n  # read theta_P + read Delta + write theta, float32
    # one jitted function for all variants: p is static (0.99), q a traced {path: q} argument
    flat_mask = _flat(mask)
    variants = {
        "DARE p=0.99 (q=1-p)": {k: 0.01 for k in flat_mask},
        "DAREx-q p=0.99 (global q=0.1)": {k: 0.1 for k in flat_mask},
        "DAREx-q p=0.99 (per-layer q)": {k: 0.05 + 0.1 * (i % 3) for i, k in enumerate(flat_mask)},
    }
    fn = jax.jit(lambda key, P, D, q: dl.apply_delta(P, dl.dare(key, D, 0.99, q=q, mask=mask)))
    rows = []
    for name, q in variants.items():
        q = {k: jnp.float32(v) for k, v in q.items()}
        t0 = time.perf_counter()
        _block(fn(k_drop, pre, delta_tree, q))
        t_first = time.perf_counter() - t0
        times = []
        for r in range(cfg.timing_repeats):
            t0 = time.perf_counter()
            _block(fn(jax.random.fold_in(k_drop, r + 1), pre, delta_tree, q))
            times.append(time.perf_counter() - t0)
        t = float(np.median(times))
        rows.append({"variant": name, "params": n, "first_call_s": t_first,
                     "median_s": t, "GB_moved": moved / 1e9, "GB_per_s": moved / t / 1e9,
                     "params_per_s": n / t, "device": jax.devices()[0].device_kind})
    return rows, n


def run(cfg: StorageConfig, run: RunDir) -> dict:
    if cfg.source == "mlp":
        pre, delta_tree, metric_fn, val_fn = mlp_source(cfg)
        tuned_with = cfg.finetune.optimizer_label()
        what = (f"{tuned_with} fine-tuned MLP (started from substrate mlp_mnist5k; MNIST -> "
                "sklearn digits); metric = test accuracy")
        run.note(f"The delta: the MLP fine-tuned with {tuned_with}"
                 + ("." if cfg.finetune.optimizer == RECIPE_OPTIMIZER else
                    f", not the recipe's {OPTIMIZER_NAMES[RECIPE_OPTIMIZER]} (DAREx Sec. 4.2: "
                    "DARE at high drop rates after AdamR-L2)."))
    else:
        k1, k2 = jax.random.split(jax.random.key(cfg.seed))
        tiny = cfg.source == "smollm2_shapes_tiny"
        pre, delta_tree, metric_fn, val_fn = (smollm2_shapes_tree(k1, 0.02, tiny),
                                              smollm2_shapes_tree(k2, cfg.delta_std, tiny),
                                              None, None)
        what = (f"random delta (std {cfg.delta_std}) with SmolLM2-135M"
                f"{' (tiny)' if tiny else ''} shapes; no metric")
    rows = storage_rows(cfg, pre, delta_tree, metric_fn, val_fn)
    run.table("storage", rows, title=f"Delta checkpoint size and load/apply time: {what}")
    if metric_fn is not None:  # the control: what the delta is worth at all
        tuned = float(metric_fn(dl.apply_delta(pre, delta_tree)))
        _plot_accuracy(run, rows, tuned)
        pre_metric = float(metric_fn(pre))
        run.table("delta_worth", [{"pretrained": pre_metric, "finetuned": tuned,
                                   "delta_worth": tuned - pre_metric}],
                  title="The metric without the delta (theta_P) and with the dense float32 "
                        "delta: what any compression can lose")
    dense = dl.dense_bytes(delta_tree)
    run.note(f"Dense float32 delta: {dense} bytes ({dl.count_params(delta_tree)} parameters).")
    out = {"dense_bytes": dense}
    best = min(rows, key=lambda r: r["bytes"])
    out["smallest"] = f"p={best['p']} bits={best['bits']}: {best['bytes']} B"
    if cfg.timing_tree != "none":
        trows, n = apply_timing_rows(cfg)
        run.table("apply_time", trows, title="theta_P + prune(Delta), jitted, on a random tree "
                  f"with SmolLM2-135M's exact shapes ({n} params, float32)")
        out["dare_apply_s"] = trows[0]["median_s"]
        out["darex_apply_s"] = trows[1]["median_s"]
        out["dare_GB_per_s"] = trows[0]["GB_per_s"]
    out["headline"] = (f"delta {dense / 1e6:.2f} MB dense; smallest checkpoint {out['smallest']}"
                       + (f"; DARE on the 135M tree {out['dare_apply_s']:.2f} s "
                          f"({out['dare_GB_per_s']:.2f} GB/s)" if "dare_apply_s" in out else ""))
    return out


def _plot_accuracy(run: RunDir, rows: list[dict], unpruned: float) -> None:
    """Accuracy against the storage ratio of the claim's method (:func:`claims`), a line
    per bit width over the drop rates, with the claim's bounds: the unpruned accuracy less
    the tolerance, and 10x."""
    method = _recipe(r["method"] for r in rows)
    series = {}
    for bits in dict.fromkeys(r["bits"] for r in rows):
        pts = [r for r in rows if r["bits"] == bits and r["method"] in ("unpruned", method)]
        series[f"{bits} bits"] = ([r["ratio_vs_fp32"] for r in pts], [r["metric"] for r in pts])
    run.line_plot("accuracy_vs_size", series, xlabel="storage ratio to the dense float32 delta",
                  ylabel="test accuracy", logx=True, markers=True,
                  hlines={f"unpruned - {ACCURACY_TOLERANCE:g}": unpruned - ACCURACY_TOLERANCE},
                  vlines={f"{MIN_RATIO:g}x": MIN_RATIO},
                  title=f"{method}: accuracy against size, p = 0 to {max(r['p'] for r in rows):g}")


def _recipe(methods) -> str:
    """The method the storage claim judges: the paper's DAREx-q (q_v) where the run has it,
    else DARE."""
    return "DAREx-q (q_v)" if "DAREx-q (q_v)" in set(methods) else "DARE"


# how much test accuracy a compressed delta may lose and still count as "minimally
# compromising performance" (DAREx paper, Sec. 3.1; the paper gives no number)
ACCURACY_TOLERANCE = 0.02
# the size the claim asks of a compressed delta, as a ratio to the dense float32 one
MIN_RATIO = 10.0


def claims(t: dict[str, list[dict]]) -> list[Claim]:
    """Storage: what delta pruning is for (DAREx paper, Sec. 1 and Table 13): some delta
    pruned (and quantised) to store at least 10x smaller than the dense float32 one loses at
    most :data:`ACCURACY_TOLERANCE` of the unpruned delta's accuracy. The delta is pruned by
    the paper's recipe, DAREx-q (q_v) (DARE in a run without it). Size alone would hold at
    any drop rate, so the claim is judged on accuracy: among the settings at least 10x
    smaller in every seed run, the one with the smallest mean loss, its loss per seed
    (paired with the unpruned delta of the same run) against the tolerance at a Bonferroni
    level over those settings (:func:`moejax.harness.claims.threshold_claim`); and only
    where the delta is worth more than the tolerance (table ``delta_worth``): a delta worth
    less keeps "within the tolerance" when dropped whole."""
    claim = (f"A delta compressed without losing more than {ACCURACY_TOLERANCE:g} accuracy "
             "stores at least 10x smaller than dense (Sec. 1, Table 13)")
    runs = [run.get("storage") or [] for run in per_seed(t)]
    losses = [_losses(rows) for rows in runs]
    if not runs or any(lost is None for lost in losses):
        # a random delta (the full preset's SmolLM2-135M shapes): sizes only
        return [Claim(claim, None, "no accuracy in the storage table (a delta without a model "
                      "to evaluate: sizes and times only)")]
    recipe = _recipe(k[0] for k in losses[0])
    small = [k for k in losses[0] if k[0] in (recipe, "unpruned")
             and all(k in lost and lost[k][0] >= MIN_RATIO for lost in losses)]
    if not small:
        return [Claim(claim, None, f"no setting of the run stores {MIN_RATIO:g}x smaller "
                      "than dense: untested", inconclusive=True)]

    def mean_loss(k):
        return sum(lost[k][1] for lost in losses) / len(losses)

    best = min(small, key=mean_loss)
    c = threshold_claim(claim, [lost[best][1] for lost in losses], ACCURACY_TOLERANCE,
                        better="lower", fmt=".4f", candidates=len(small))
    ratio = min(lost[best][0] for lost in losses)
    c = c._replace(evidence=f"{best[0]} at p={best[1]:g}, {best[2]} bits ({ratio:.1f}x smaller, "
                            "the least "
                            f"loss of {len(small)} settings >= {MIN_RATIO:g}x), accuracy lost "
                            f"vs the unpruned delta {c.evidence}")
    worths = [measured((run.get("delta_worth") or [{}])[0].get("delta_worth"))
              for run in per_seed(t)]
    return [worth_checked(c, worths, ACCURACY_TOLERANCE)]


def _losses(rows) -> dict[tuple[str, float, int], tuple[float, float]] | None:
    """``{(method, p, bits): (ratio to dense float32, accuracy lost vs the unpruned delta)}``
    of one run's storage table (a table without methods: DARE's); None without an
    accuracy."""
    base = lookup(rows, {"p": 0.0, "bits": 32})
    acc0 = measured(None if base is None else base.get("metric"))
    if acc0 is None:
        return None
    return {(r.get("method") or "DARE", float(r["p"]), int(float(r["bits"]))):
            (float(r["ratio_vs_fp32"]), acc0 - float(r["metric"])) for r in rows}


STUDY = Study(
    "darex_storage", make_config, run, claims=claims,
    seed_keys=("seed",),
    quick_repeat=5,
    smoke=("timing_repeats=1",),
    paper_scale=PAPER_SCALE,
    derived_keys=(("finetune.seed", "seed"),),
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
