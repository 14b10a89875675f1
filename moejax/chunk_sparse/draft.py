"""Drafts for speculative decoding trained from their target.

Greedy speculative decoding commits a drafted token only when it is the target's argmax
(:mod:`moejax.nn.speculative`), so a draft is worth what its argmax agrees with the target's
on the contexts decoding visits. A draft trained on the data learns the data; one distilled
from the target learns the target (DistillSpec, Zhou et al. 2024). Two recipes, both through
the library's distillation (:mod:`moejax.distill.training`) and its one training loop:

* ``"kd"`` (sequence-level): the target's own continuations of training prompts
  (:func:`target_continuations`, greedy by default) are the responses, and the draft fits the
  target's full next-token distribution on them: forward ``KL(p || q)`` (``kd_ratio`` 1, no
  cross-entropy term: the responses are the target's, not data);
* ``"gkd"`` (on-policy): the draft samples its own responses to the same prompts and
  minimises the reverse ``KL(q || p)`` to the target on them.

A self-draft needs no training: :func:`moejax.nn.decoder.keep_layers` keeps the target's first
layers with its embedding, final norm and head (early exit); :func:`distill_draft` can then
fine-tune it the same way.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import Config, config
from moejax.data.batches import PromptResponseBatches
from moejax.data.source import stream_fingerprint
from moejax.distill.training import DistillConfig, distil
from moejax.nn.decoder import DecoderLM
from moejax.nn.generate import check_decode_inputs, host_or_device
from moejax.nn.sample import sampler
from moejax.train.hparams import TrainConfig
from moejax.train.loop_options import History

__all__ = ["DraftDistillConfig", "DistilledDraft", "target_continuations", "distill_draft",
           "argmax_agreement"]


@config
class DraftDistillConfig(Config):
    """method: ``"kd"`` (forward KL on the target's continuations) or ``"gkd"`` (reverse KL on
    the draft's own samples); ``prompts`` training prompts of ``prompt_len`` tokens, each
    continued by ``response_len`` target tokens (greedy at ``temperature`` 0)."""

    method: Literal["kd", "gkd"] = "kd"
    prompts: int = 512
    prompt_len: int = 32
    response_len: int = 96
    temperature: float = 0.0
    train: TrainConfig = TrainConfig(steps=300, batch_size=16, lr=1e-3, warmup_steps=20,
                                     schedule="cosine", weight_decay=0.0, log_every=50)

    def validate(self) -> None:
        r = self._require
        r(self.prompts >= 1, f"prompts={self.prompts} must be >= 1")
        r(self.prompt_len >= 1 and self.response_len >= 2,
          f"prompt_len={self.prompt_len} must be >= 1 and response_len={self.response_len} >= 2")
        r(self.temperature >= 0, f"temperature={self.temperature} must be >= 0 (0 = greedy)")

    def distill(self) -> DistillConfig:
        """The :class:`DistillConfig` of this recipe (no EOS and no padding: byte windows
        have neither, so every response runs to its full length)."""
        return DistillConfig(method=self.method, kd_ratio=1.0, on_policy_fraction=1.0,
                             temperature=1.0, eos_id=None, pad_id=0)


def target_continuations(target: DecoderLM, prompts_PT, response_len: int, *, key: jax.Array,
                         temperature: float = 0.0, batch: int = 64) -> dict[str, np.ndarray]:
    """Rows for :class:`PromptResponseBatches`: every prompt (one common length ``T``)
    followed by ``response_len`` tokens the target generates (``temperature`` 0: greedy).
    ``prompts [P, T]``, ``prompt_lens [P]``, ``tokens [P, T + response_len]``,
    ``response_mask`` (1 on the generated tokens)."""
    prompts_PT = np.asarray(prompts_PT)  # the sampler refuses ids that are not integers
    P, T = prompts_PT.shape
    tokens, draw = [], sampler(target, response_len, temperature=temperature)
    for i in range(0, P, batch):
        rows = prompts_PT[i:i + batch]
        s = draw(rows, np.full((rows.shape[0],), T, np.int32), key=jax.random.fold_in(key, i))
        tokens.append(np.asarray(s.tokens_BS))
    tokens_PS = np.concatenate(tokens)
    mask = np.zeros(tokens_PS.shape, np.float32)
    mask[:, T:] = 1.0
    return {"prompts": prompts_PT.astype(np.int32), "prompt_lens": np.full((P,), T, np.int32),
            "tokens": tokens_PS, "response_mask": mask}


@config
class DistilledDraft(Config):
    """What a distilled draft's checkpoints are of (stored with them, compared on resume):
    the recipe, its seed, and the name of the draft it started from."""

    recipe: DraftDistillConfig = DraftDistillConfig()
    seed: int = 0
    start: str = ""


def distill_draft(draft: DecoderLM, target: DecoderLM, prompts_PT, cfg: DraftDistillConfig,
                  *, seed: int = 0, desc: str = "distil draft", run_dir=None,
                  start: str = "") -> tuple[DecoderLM, History]:
    """A copy of ``draft`` distilled from ``target`` on ``prompts_PT`` (``[P, T]`` training
    prompts, at least ``cfg.prompts`` rows of ``cfg.prompt_len`` tokens, cut to that) by
    ``cfg.method`` (module docstring); ``draft`` and ``target`` are left unchanged. Returns
    ``(draft, history)``. ``run_dir``: checkpoints there (with :class:`DistilledDraft` of ``cfg``,
    ``seed`` and ``start``, the starting draft's name), so a stopped distillation resumes and
    a finished one is restored instead of trained again."""
    prompts_PT = np.asarray(prompts_PT)
    if (prompts_PT.ndim != 2 or prompts_PT.shape[1] < cfg.prompt_len
            or prompts_PT.shape[0] < cfg.prompts
            or not np.issubdtype(prompts_PT.dtype, np.integer)):
        raise ValueError(f"distill_draft: prompts of shape {prompts_PT.shape} and dtype "
                         f"{prompts_PT.dtype}; need integer token ids [P >= prompts="
                         f"{cfg.prompts}, T >= prompt_len={cfg.prompt_len}]")
    prompts_PT = prompts_PT[:cfg.prompts, :cfg.prompt_len]
    key = jax.random.key(seed)
    rows = target_continuations(target, prompts_PT, cfg.response_len,
                                key=jax.random.fold_in(key, 0), temperature=cfg.temperature)
    tcfg = cfg.train.replace(seed=seed)
    src = PromptResponseBatches(rows, batch_size=tcfg.batch_size, seed=seed)
    # The responses are the target's samples, which a GPU need not reproduce bit for bit
    # after a restart (its matmul algorithms are chosen per process): the stream a resumed
    # run must match is named by its prompts (the recipe and seed are in the run's config).
    src.fingerprint = stream_fingerprint("target continuations", {"prompts": prompts_PT},
                                         batch=tcfg.batch_size, seed=seed)
    student, _, hist = distil(draft, target, cfg.distill(), tcfg, src, desc=desc,
                              run_dir=run_dir,
                              config=DistilledDraft(recipe=cfg, seed=seed, start=start))
    return student, hist


def argmax_agreement(draft: DecoderLM, target: DecoderLM, tokens_BS) -> float:
    """Share of positions of ``tokens_BS`` where the draft's next-token argmax is the
    target's (teacher-forced): the per-token acceptance a greedy speculative round sees."""
    toks = host_or_device(tokens_BS)
    check_decode_inputs(toks, min(draft.cfg.vocab_size, target.cfg.vocab_size), 0.0)
    toks = jnp.asarray(toks, jnp.int32)
    return float(jnp.mean(_argmax(draft, toks) == _argmax(target, toks)))


@nnx.jit
def _argmax(model, tokens_BS):
    return jnp.argmax(model(tokens_BS)[0], -1)
