"""Evaluation of generated responses and of MoE routers (the distillation studies).

* :class:`GenerationEvaluator`: ROUGE-L (F-measure, ``rouge-score``, words Porter-stemmed as
  in MiniLLM's evaluation, which "Every Expert Matters" follows) of responses sampled from a
  decoder LM against the references of prompt/response batches, mean and standard deviation
  over generation seeds.
* :func:`response_kl`: ``KL(teacher || student)`` per response token on fixed held-out
  prompt/response batches (how close a distilled student came to its teacher).
* :class:`ResponseScorer`: the three test metrics of a distilled LM at once: ROUGE-L per
  sampling seed, response-token perplexity, KL to a reference teacher.
* :func:`gate_mass_by_layer` / :func:`router_kl_by_layer`: router statistics of MoE LMs (how
  much gate mass the selected experts hold; how far two routers' gate distributions are),
  over the batches' real tokens (:func:`real_tokens`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.extras import late_progress, missing_extra

try:
    from rouge_score import rouge_scorer
except ImportError as _e:
    raise missing_extra(_e, "moejax.evaluate_generation (ROUGE)") from None

from moejax.data.packing import prompt_response_real
from moejax.evaluate import Evaluator, LMEvaluator
from moejax.nn.sample import sampler
from moejax.ops.distill_losses import forward_kl
from moejax.train.step import lm_model_kwargs

__all__ = ["GenerationEvaluator", "ResponseScorer", "rouge_l", "response_kl",
           "gate_mass_by_layer", "router_kl_by_layer", "real_tokens"]


def rouge_l(predictions: Sequence[str], references: Sequence[str], *,
            stem: bool = True) -> np.ndarray:
    """ROUGE-L F-measure of each prediction against its reference (``rouge-score``: lower-cased
    alphanumeric word tokens, Porter-stemmed unless ``stem=False``, longest common
    subsequence; 0 when either side has no word). The stemming is MiniLLM's evaluation
    (``RougeScorer(["rougeL"], use_stemmer=True)``), whose ROUGE-L the paper reports."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=stem)
    return np.asarray([scorer.score(r, p)["rougeL"].fmeasure
                       for p, r in zip(predictions, references)], np.float64)


class GenerationEvaluator(Evaluator):
    """ROUGE-L of sampled responses on fixed prompt/response batches
    (:class:`~moejax.data.batches.PromptResponseBatches` rows): for each seed in ``seeds`` every
    prompt gets one response of up to ``response_len`` tokens (``temperature`` 0 = greedy);
    ``decode(ids) -> str`` turns tokens into text; ``stem``: :func:`rouge_l`'s. Returns
    ``rouge_l`` (mean over seeds of the mean over prompts), ``rouge_l_std`` (sample std over
    seeds; 0 for one) and ``rouge_l_seeds``."""

    def __init__(self, batches: Sequence[dict], decode: Callable, *, seeds=(0,),
                 temperature: float = 1.0, top_p: float = 1.0, eos_id: int = 2,
                 pad_id: int = 0, stem: bool = True):
        if not batches:
            raise ValueError("GenerationEvaluator needs at least one batch")
        if not tuple(seeds):  # a ROUGE-L of no sample would be NaN
            raise ValueError("GenerationEvaluator needs at least one sampling seed")
        self.batches, self.decode, self.seeds = list(batches), decode, tuple(seeds)
        self.stem = stem
        self.kw = dict(temperature=temperature, top_p=top_p, eos_id=eos_id, pad_id=pad_id)
        self.references = [decode(row[m > 0]) for b in self.batches
                           for row, m in zip(b["tokens"], b["response_mask"])]

    def generate(self, model, seed: int, bar=None) -> list[str]:
        """One sampled response per prompt, in batch order (``bar``: a progress bar that
        counts the batches)."""
        out, draws = [], {}  # a sampler per response length: the model split once for each
        for i, b in enumerate(self.batches):
            max_new = b["tokens"].shape[1] - b["prompts"].shape[1]
            if max_new not in draws:
                draws[max_new] = sampler(model, max_new, **self.kw)
            s = draws[max_new](b["prompts"], b["prompt_lens"],
                               key=jax.random.fold_in(jax.random.key(seed), i))
            toks, resp = jax.device_get((s.tokens_BS, s.response_mask_BS))
            out += [self.decode(row[m]) for row, m in zip(toks, resp)]
            if bar is not None:
                bar.update()
        return out

    def _evaluate(self, graphdef, params, rest) -> dict:
        model = nnx.merge(graphdef, params, rest)
        bar = late_progress(total=len(self.seeds) * len(self.batches),
                            desc="sampling responses", unit="batch")
        try:
            per_seed = [float(rouge_l(self.generate(model, s, bar), self.references,
                                      stem=self.stem).mean())
                        for s in self.seeds]
        finally:
            bar.close()
        std = float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else 0.0
        return {"rouge_l": float(np.mean(per_seed)), "rouge_l_std": std,
                "rouge_l_seeds": per_seed}

    def __call__(self, model: nnx.Module, step: int | None = None) -> dict:
        out = super().__call__(model, step)
        return out if step is None else {k: v for k, v in out.items() if k != "rouge_l_seeds"}


@functools.partial(jax.jit, static_argnums=(0, 2))
def _kl_sums(graphdef_t, state_t, graphdef_s, state_s, batch):
    kw = {"train": False, "mask_BT": batch["real"]}
    t_logits, _ = nnx.merge(graphdef_t, state_t)(batch["inputs"], **kw)
    s_logits, _ = nnx.merge(graphdef_s, state_s)(batch["inputs"], **kw)
    n = jnp.sum(batch["mask"])
    return forward_kl(t_logits, s_logits, batch["mask"], "token") * n, n


def response_kl(teacher, student, batches: Sequence[dict]) -> float:
    """Mean over the batches' response tokens (``mask`` > 0) of ``KL(p_teacher || q_student)``
    of the next-token distributions, both models teacher-forced on the dataset responses
    (``train=False``: each MoE routes as trained, the batches' real tokens only:
    :func:`real_tokens`)."""
    gt, st = nnx.split(teacher)
    gs, ss = nnx.split(student)
    total = count = 0.0
    for b in batches:
        kl, n = jax.device_get(_kl_sums(gt, st, gs, ss, {
            "inputs": jnp.asarray(b["inputs"]), "mask": jnp.asarray(b["mask"]),
            "real": jnp.asarray(real_tokens(b))}))
        total, count = total + float(kl), count + float(n)
    if count == 0:
        raise ValueError("response_kl: the batches hold no response token (mask is all 0)")
    return total / count


class ResponseScorer:
    """Test metrics of a decoder LM on a :class:`GenerationEvaluator`'s batches:
    ``rouge_l`` (mean over its sampling seeds) and ``rouge_l_seeds``, ``ppl`` (exp of the
    mean cross-entropy of the reference response tokens, teacher-forced) and ``kl``
    (:func:`response_kl` from ``reference``, e.g. the teacher; skipped with ``kl=False``)."""

    def __init__(self, generation: GenerationEvaluator, reference=None):
        self.generation, self.reference = generation, reference
        self.lm = LMEvaluator(generation.batches)

    def __call__(self, model, kl: bool = True) -> dict:
        ev = self.generation(model)
        out = {"rouge_l": ev["rouge_l"], "rouge_l_seeds": ev["rouge_l_seeds"],
               "ppl": math.exp(self.lm(model)["loss"])}
        if kl and self.reference is not None:
            out["kl"] = response_kl(self.reference, model, self.generation.batches)
        return out


@functools.partial(jax.jit, static_argnums=0)
def _router_stats(graphdef, state, inputs_BT, real_BT):
    _, aux = nnx.merge(graphdef, state)(inputs_BT, train=False, mask_BT=real_BT)
    return [{k: la[k] for k in ("gate_mass_selected", "gate_probs")}
            for la in aux["layers"] if "gate_probs" in la]


def real_tokens(batch: dict) -> np.ndarray:
    """``[B, T]`` bool over a batch's ``inputs``: True on its real tokens, False on the padding
    after them: what :func:`~moejax.train.step.lm_model_kwargs` shows the model (``segment_ids``
    or ``token_mask``), else a prompt/response batch's prompt part and response
    (:func:`~moejax.data.packing.prompt_response_real`), else every token."""
    mask = lm_model_kwargs(batch)["mask_BT"]
    if mask is not None:
        return np.asarray(mask)
    if "prompt_lens" in batch:
        T = np.shape(batch["inputs"])[1]
        return prompt_response_real(np.asarray(batch["prompt_lens"]),
                                    np.asarray(batch["response_mask"]))[:, :T]
    return np.ones(np.shape(batch["inputs"]), bool)


def _moe_aux(model, batch):
    graphdef, state = nnx.split(model)
    real_BT = real_tokens(batch)
    return _router_stats(graphdef, state, jnp.asarray(batch["inputs"]), jnp.asarray(real_BT))


def gate_mass_by_layer(model, batches: Sequence[dict]) -> list[float]:
    """Per MoE layer: mean over the batches' real tokens (:func:`real_tokens`; the padding
    masked out of attention and of the statistic) of the gate probability held by the experts
    the router selected (the paper's Fig. 1; the rest sits on unused experts)."""
    sums, count = None, 0.0
    for b in batches:
        n = float(real_tokens(b).sum())
        vals = [n * float(la["gate_mass_selected"]) for la in _moe_aux(model, b)]
        sums = vals if sums is None else [a + v for a, v in zip(sums, vals)]
        count += n
    if batches and count == 0:
        raise ValueError("gate_mass_by_layer: the batches hold no real token (all padding)")
    return [v / max(count, 1.0) for v in (sums or [])]


def router_kl_by_layer(model_a, model_b, batches: Sequence[dict]) -> list[dict]:
    """Per MoE layer: mean and max over the batches' real tokens (:func:`real_tokens`) of
    ``KL(g_a || g_b)`` between the full gate distributions of two models with the same layout
    (e.g. a teacher before and after SAR), each run on the same tokens (layer inputs are each
    model's own hidden states)."""
    out = None
    for b in batches:
        la, lb = _moe_aux(model_a, b), _moe_aux(model_b, b)
        if len(la) != len(lb):
            raise ValueError(f"models have {len(la)} and {len(lb)} MoE layers")
        real = real_tokens(b)
        kls = []
        for xa, xb in zip(la, lb):
            pa = jnp.clip(xa["gate_probs"].astype(jnp.float32), 1e-30, 1.0)
            pb = jnp.clip(xb["gate_probs"].astype(jnp.float32), 1e-30, 1.0)
            kls.append(np.asarray(jnp.sum(pa * (jnp.log(pa) - jnp.log(pb)), -1))[real])
        out = kls if out is None else [np.concatenate([o, k]) for o, k in zip(out, kls)]
    if out and not out[0].size:
        raise ValueError("router_kl_by_layer: the batches hold no real token (all padding)")
    return [{"layer": i, "mean_kl": float(k.mean()), "max_kl": float(k.max())}
            for i, k in enumerate(out or [])]
