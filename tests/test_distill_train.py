"""Distillation through the one training loop: what each method trains (SAR: the student and
the teacher's router only; the others: the student only), that the trained teacher passed in is
never modified, that the objectives are the stated divergences, and the vocabulary check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moejax.distill.training as distill_mod
from moejax.config import ConfigError
from moejax.data.batches import PromptResponseBatches
from moejax.data.packing import prompt_response_rows
from moejax.distill.routing_modes import ModeRouter
from moejax.distill.training import (
    DistillConfig,
    FrozenParam,
    RouterParam,
    distil,
    distill_loss_fn,
    distill_pair,
    distill_tx,
)
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.moe import MoEConfig
from moejax.ops.distill_losses import distill_divergence, forward_kl, reverse_kl
from moejax.pytree import named_leaves
from moejax.train import step_cache
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train
from moejax.train.step import init_state, make_step_fn
from tests.toy_models import jitted, logits_of

V = 40


def _lm(moe: bool, n_layers=2, vocab=V, seed=0):
    slot = (MoEConfig(n_experts=4, top_k=2, d_expert=8, router="noisy", dispatch="dense",
                      balance_loss="cv2") if moe else DenseFFNConfig(d_hidden=16,
                                                                     activation="swiglu"))
    cfg = DecoderConfig(vocab_size=vocab, d_model=16, n_layers=n_layers, n_heads=2,
                        n_kv_heads=1, max_seq_len=32, ffn_slots=(slot,) * n_layers)
    return DecoderLM(cfg, rngs=nnx.Rngs(seed))


def _source():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, V, rng.integers(1, 5)) for _ in range(16)]
    responses = [rng.integers(3, V, rng.integers(1, 6)) for _ in range(16)]
    return PromptResponseBatches(prompt_response_rows(prompts, responses, 8, 6), batch_size=4)


def _params(model):
    return {k: np.asarray(v) for k, v in named_leaves(nnx.state(model, nnx.Param))}


# gkd / all reuse kd's and ka's paths (on-policy sampling, rerouting); their objectives are
# checked below without a training loop
@pytest.mark.parametrize("method", ["sft", "kd", "ka", "sar"])
def test_each_method_trains_only_what_it_should(method):
    teacher, student = _lm(True, seed=1), _lm(False, n_layers=1, seed=2)
    t0, s0 = _params(teacher), _params(student)
    cfg = DistillConfig(method=method, ka_m=2, ka_lambda=0.5, router_lr=1e-2)
    pair = distill_pair(student, teacher, cfg)
    tcfg = TrainConfig(steps=3, batch_size=4, lr=1e-2, schedule="constant", log_every=1)
    hist = train(pair, _source(), tcfg, loss_fn=distill_loss_fn(cfg), tx=distill_tx(cfg, tcfg),
                 progress=False)
    assert len(hist) == 3 and all(np.isfinite(h["loss"]) for h in hist)
    # the teacher passed in is untouched, always
    for k, v in _params(teacher).items():
        np.testing.assert_array_equal(v, t0[k])
    # the student moved
    assert any(not np.array_equal(v, s0[k]) for k, v in _params(pair.student).items())
    if method == "sft":
        assert pair.teacher is None
        return
    trainable = {k for k, _ in named_leaves(nnx.state(pair.teacher, nnx.Param))}
    frozen = nnx.state(pair.teacher, FrozenParam)
    assert not trainable  # the loop optimises the student only
    routers = named_leaves(nnx.state(pair.teacher, RouterParam))
    if method == "sar":  # SAR's own AdamW moved the router weights, and only them
        assert routers and all("/router/" in f"/{k}/" for k, _ in routers)
        moved = [k for k, v in routers if not np.array_equal(np.asarray(v),
                                                             t0[k.replace("/inner", "")])]
        assert any(k.endswith("w_g") for k in moved) and any(k.endswith("w_noise") for k in moved)
        assert "sar_kl" in hist[-1] and "sar_balance" in hist[-1]
    else:
        assert not routers
    # every frozen teacher array equals the trained teacher's
    for k, v in named_leaves(frozen):
        np.testing.assert_array_equal(np.asarray(v), t0[k.replace("/inner", "")])


class _Killed(RuntimeError):
    pass


class _KilledAt(PromptResponseBatches):
    """The toy batches, killing the job when asked for data position ``at``."""

    name = "PromptResponseBatches"  # the same stream as the toy batches', to its checkpoints

    def __init__(self, at, rows, **kw):
        super().__init__(rows, **kw)
        self.at = at

    def batch(self, position):
        if position == self.at:
            raise _Killed(f"killed at data position {position}")
        return super().batch(position)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gkd", "ka", "sar"])
def test_a_killed_distillation_resumes_bitwise(tmp_path, method):
    """Killed after its step-2 checkpoint, a distillation resumed in the same run directory
    ends bitwise where an uninterrupted one ends: the student, and with SAR the teacher's
    router weights and their AdamW state (updated inside the loss); on-policy samples and
    KA's M sequential updates per batch drawn and taken as in the straight run."""
    rows = prompt_response_rows(
        *zip(*[(np.arange(3, 3 + i % 4 + 1), np.arange(5, 5 + i % 5 + 1)) for i in range(16)]),
        8, 6)
    cfg = DistillConfig(method=method, ka_m=2, ka_lambda=0.5, router_lr=1e-2)
    tcfg = TrainConfig(steps=4, batch_size=4, lr=1e-2, schedule="constant", log_every=1,
                       ckpt_every=2, seed=7)

    def models():
        return _lm(False, n_layers=1, seed=2), _lm(True, seed=1)

    def state(pair):
        keep = (nnx.Param, RouterParam, nnx.Variable) if method == "sar" else nnx.Param
        return {k: np.asarray(v) for k, v in named_leaves(nnx.state(pair, keep))}

    student, teacher = models()
    _, straight, hist_a = distil(student, teacher, cfg, tcfg,
                                 PromptResponseBatches(rows, batch_size=4),
                                 run_dir=str(tmp_path / "a"))
    student, teacher = models()
    with pytest.raises(_Killed):
        distil(student, teacher, cfg, tcfg, _KilledAt(3, rows, batch_size=4),
               run_dir=str(tmp_path / "b"))
    student, teacher = models()
    _, resumed, hist_b = distil(student, teacher, cfg, tcfg,
                                PromptResponseBatches(rows, batch_size=4),
                                run_dir=str(tmp_path / "b"))
    assert [h["step"] for h in hist_b] == [3, 4]
    assert [h["loss"] for h in hist_b] == [h["loss"] for h in hist_a[2:]]
    want, got = state(straight), state(resumed)
    assert want.keys() == got.keys() and len(want) > 0
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    if method == "sar":
        assert any("router_opt" in k for k in want) and any("w_noise" in k for k in want)


def test_kd_objective_is_half_forward_kl_half_ce_on_dataset_responses():
    teacher, student = _lm(True, seed=1), _lm(False, n_layers=1, seed=2)
    cfg = DistillConfig(method="kd")
    pair = distill_pair(student, teacher, cfg)
    b = {k: jnp.asarray(v) for k, v in _source().batch(0).items()}
    loss, m = nnx.jit(distill_loss_fn(cfg))(pair, b, jax.random.key(0))
    t_logits, _ = jitted(teacher)(b["inputs"])
    s_logits, _ = jitted(student)(b["inputs"])
    kl = forward_kl(t_logits, s_logits, b["mask"])
    # the responses' cross-entropy, by hand: mean over response tokens of -log q(target)
    logq = np.asarray(jax.nn.log_softmax(s_logits, -1))
    tgt, msk = np.asarray(b["targets"]), np.asarray(b["mask"])
    ce = -(np.take_along_axis(logq, tgt[..., None], -1)[..., 0] * msk).sum() / msk.sum()
    np.testing.assert_allclose(float(loss), 0.5 * float(kl) + 0.5 * ce, rtol=1e-5)
    np.testing.assert_allclose(float(m["distill"]), float(kl), rtol=1e-5)
    pure = DistillConfig(method="kd", kd_ratio=1.0)  # the named option: pure forward KL
    pure_loss = nnx.jit(distill_loss_fn(pure))(pair, b, jax.random.key(0))[0]
    np.testing.assert_allclose(float(pure_loss), float(kl), rtol=1e-5)
    # teacher_k = N: the top-k teacher equals the ALL teacher
    k4 = nnx.jit(distill_loss_fn(DistillConfig(method="kd", teacher_k=4, kd_ratio=1.0)))(
        distill_pair(student, teacher, DistillConfig(method="kd", teacher_k=4)), b,
        jax.random.key(0))[0]
    all_ = nnx.jit(distill_loss_fn(DistillConfig(method="all", on_policy_fraction=0.0,
                                                 divergence="forward_kl")))(
        distill_pair(student, teacher, DistillConfig(method="all")), b, jax.random.key(0))[0]
    np.testing.assert_allclose(float(k4), float(all_), rtol=1e-5)


def test_on_policy_rows_are_student_samples(monkeypatch):
    """With on_policy_fraction = 1 the scored responses are the student's own samples: the
    loss equals the divergence recomputed on exactly the sequences the sampler returned for
    the student (recorded by a pass-through wrapper), and differs from the loss on the
    dataset's responses."""
    teacher, student = _lm(False, n_layers=1, seed=5), _lm(False, n_layers=1, seed=2)
    cfg = DistillConfig(method="gkd")
    pair = distill_pair(student, teacher, cfg)
    b = {k: jnp.asarray(v) for k, v in _source().batch(0).items()}
    seen = []

    def recording_sampler(model, *args, **kw):
        out = distill_mod.sample_traced.__wrapped__(model, *args, **kw)
        seen.append((model, out))
        return out

    recording_sampler.__wrapped__ = distill_mod.sample_traced
    monkeypatch.setattr(distill_mod, "sample_traced", recording_sampler)
    loss, m = distill_loss_fn(cfg)(pair, b, jax.random.key(0))
    (sampler_model, s), = seen
    tokens, resp = s.tokens_BS, s.response_mask_BS
    np.testing.assert_allclose(logits_of(sampler_model, tokens), logits_of(student, tokens),
                               rtol=1e-6)
    mask = resp[:, 1:].astype(jnp.float32)
    want = distill_divergence(cfg.divergence_kind, logits_of(teacher, tokens[:, :-1]),
                              logits_of(student, tokens[:, :-1]), mask, beta=cfg.jsd_beta,
                              reduction=cfg.reduction)
    assert float(m["response_tokens"]) == pytest.approx(float(jnp.sum(mask)) / 4)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    off = DistillConfig(method="gkd", on_policy_fraction=0.0)
    loss_data, _ = distill_loss_fn(off)(distill_pair(student, teacher, off), b,
                                        jax.random.key(0))
    assert abs(float(loss_data) - float(loss)) > 1e-4


def test_a_jsd_beta_without_the_jsd_is_refused():
    """jsd_beta weighs the generalised JSD only: with another divergence it was taken and
    recorded, and did nothing."""
    with pytest.raises(ConfigError, match="jsd_beta=0.2 is read only with divergence='jsd'"):
        DistillConfig(method="gkd", jsd_beta=0.2)
    assert DistillConfig(method="gkd", divergence="jsd", jsd_beta=0.2).jsd_beta == 0.2


def test_a_loss_that_draws_refuses_to_run_without_a_key():
    """A method that draws (student samples, KA's teacher passes, SAR's noisy gate) called
    without a key is refused: it drew every call from one fixed key, the same samples at
    every step. KD and SFT draw nothing and take key=None."""
    teacher, student = _lm(True, n_layers=1, seed=5), _lm(False, n_layers=1, seed=2)
    b = {k: jnp.asarray(v) for k, v in _source().batch(0).items()}
    for cfg in (DistillConfig(method="gkd"), DistillConfig(method="all"),
                DistillConfig(method="ka", on_policy_fraction=0.0),
                DistillConfig(method="sar", on_policy_fraction=0.0)):
        with pytest.raises(ValueError, match=f"method='{cfg.method}' draws .* needs an "
                                             "explicit PRNG key, a new one each step"):
            distill_loss_fn(cfg)(distill_pair(student, teacher, cfg), b, None)
    for cfg in (DistillConfig(method="kd"), DistillConfig(method="sft"),
                DistillConfig(method="gkd", on_policy_fraction=0.0)):
        pair = distill_pair(student, teacher, cfg)
        loss, _ = distill_loss_fn(cfg)(pair, b, None)
        np.testing.assert_array_equal(
            loss, distill_loss_fn(cfg)(pair, b, jax.random.key(3))[0])


def test_bad_pairs_and_configs_raise():
    with pytest.raises(ValueError, match="vocabulary of 40 tokens and student.* of 50"):
        distill_pair(_lm(False, vocab=50), _lm(True), DistillConfig(method="kd"))
    with pytest.raises(ValueError, match="no MoE layer"):
        distill_pair(_lm(False), _lm(False), DistillConfig(method="ka"))
    with pytest.raises(ConfigError, match="on_policy_fraction"):
        DistillConfig(on_policy_fraction=1.5)
    # the student's samples end at eos_id and are padded with pad_id: both must be ids of its
    # vocabulary (a pad id of 300 for 40 tokens gave a NaN loss, an eos id of 99 never ended
    # a response); off policy, neither is used
    for bad in (dict(pad_id=300), dict(eos_id=99)):
        name, v = next(iter(bad.items()))
        with pytest.raises(ValueError, match=f"{name}={v} lies outside the student's "
                                             r"vocabulary \[0, 40\)"):
            distill_pair(_lm(False), _lm(True), DistillConfig(method="gkd", **bad))
        distill_pair(_lm(False), _lm(True), DistillConfig(method="kd", on_policy_fraction=0.0,
                                                          **bad))
    # the loop checks the first batch's ids against the pair's vocabulary, as a model's (ids
    # up to 89 for 40 tokens gave a NaN loss, blamed on the learning rate)
    rng = np.random.default_rng(0)
    wide = PromptResponseBatches(prompt_response_rows(
        [rng.integers(3, 90, 4) for _ in range(8)], [rng.integers(3, 90, 4) for _ in range(8)],
        8, 6), batch_size=4)
    with pytest.raises(ValueError, match="token id .* but the model's vocab_size is 40"):
        distil(_lm(False), _lm(True), DistillConfig(method="kd"),
               TrainConfig(steps=1, batch_size=4), wide)


def test_sar_step_is_router_adamw_then_distillation_under_the_new_router():
    """One SAR loss call = (1) one optax AdamW step of the router on KL(p_noisy || q) + beta
    CV^2, computed here by hand from the same key, then (2) reverse KL against the teacher
    under the updated router; both route (and balance) each row's real tokens only, its
    prompt part and response, not the padding after them."""
    import optax

    teacher, student = _lm(True, seed=1), _lm(False, n_layers=1, seed=2)
    cfg = DistillConfig(method="sar", on_policy_fraction=0.0, router_lr=0.05, sar_beta=0.3)
    pair = distill_pair(student, teacher, cfg)
    b = {k: jnp.asarray(v) for k, v in _source().batch(0).items()}
    key = jax.random.key(4)
    # the oracle, from the same key schedule as the loss
    _, k_teacher = jax.random.split(key)
    k_noise, k_clean = jax.random.split(k_teacher)
    graphdef, router, rest = nnx.split(pair.teacher, RouterParam, ...)
    pure0 = nnx.to_pure_dict(router)
    n_B = np.asarray(b["prompt_lens"]) + np.asarray(b["response_mask"]).sum(-1)
    real = jnp.asarray(np.arange(b["inputs"].shape[1])[None, :] < n_B[:, None])
    assert not bool(real.all())  # the batch has padding for the rule to skip
    s_logits, _ = jitted(student)(b["inputs"])

    def objective(pure):
        r = jax.tree.map(lambda x: x, router)
        nnx.replace_by_pure_dict(r, pure)
        logits, aux = nnx.merge(graphdef, r, rest)(b["inputs"], train=True, key=k_noise,
                                                   mask_BT=real)
        bal = sum(la["balance_loss"] for la in aux["layers"])
        return forward_kl(logits, s_logits, b["mask"]) + 0.3 * bal

    grads = jax.jit(jax.grad(objective))(pure0)
    tx = optax.adamw(0.05, weight_decay=cfg.router_weight_decay)
    want = optax.apply_updates(pure0, tx.update(grads, tx.init(pure0), pure0)[0])
    loss, m = nnx.jit(distill_loss_fn(cfg))(pair, b, key)  # updates pair's router
    got = nnx.to_pure_dict(nnx.state(pair.teacher, RouterParam))
    for (_, a), (_, w) in zip(named_leaves(got), named_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-7)
    assert any(not np.allclose(np.asarray(a), np.asarray(w0))
               for (_, a), (_, w0) in zip(named_leaves(got), named_leaves(pure0)))
    t_logits, _ = jitted(pair.teacher, train=False)(b["inputs"], key=k_clean,  # updated router
                                                    mask_BT=real)
    np.testing.assert_allclose(float(loss), float(reverse_kl(t_logits, s_logits, b["mask"])),
                               rtol=1e-5)


def test_runs_of_one_recipe_share_one_compiled_step(monkeypatch):
    """distil builds its loss as a value (equal for equal configs) and lets the loop build the
    optimizer from the TrainConfig, so a second run of a recipe (another seed) reuses the
    first one's jitted step instead of compiling and holding another."""
    monkeypatch.setattr(step_cache, "LOW_MEMORY_FRACTION", 0.0)  # kept on a host short of memory
    cfg = DistillConfig(method="kd", kd_ratio=0.5)
    assert distill_loss_fn(cfg) == distill_loss_fn(DistillConfig(method="kd", kd_ratio=0.5))
    assert hash(distill_loss_fn(cfg)) == hash(distill_loss_fn(cfg))
    assert distill_loss_fn(cfg) != distill_loss_fn(cfg.replace(method="sft"))
    teacher, student = _lm(True, seed=1), _lm(False, n_layers=1, seed=2)
    before = step_cache.cached_step.cache_info()
    for seed in (0, 1):
        tcfg = TrainConfig(steps=2, batch_size=4, lr=1e-2, schedule="constant", seed=seed)
        distil(student, teacher, cfg, tcfg, _source())
    after = step_cache.cached_step.cache_info()
    assert after.misses - before.misses == 1 and after.hits - before.hits == 1


def test_ka_takes_m_updates_per_batch_on_one_student_sample_by_default(monkeypatch):
    """Algorithm 1: per step one student sample, then M optimizer updates (the optimizer's
    count moves by M per step, the sampler is traced once per step); ka_updates="averaged"
    (the named option) averages the M teacher passes into one update."""
    import optax

    assert DistillConfig(method="ka").ka_updates == "sequential"
    teacher, student = _lm(True, seed=1), _lm(False, n_layers=1, seed=2)
    b = {k: jnp.asarray(v) for k, v in _source().batch(0).items()}
    tcfg = TrainConfig(steps=2, batch_size=4, lr=1e-2, schedule="constant", warmup_steps=0)
    counts = {}
    for mode, m in (("sequential", 3), ("averaged", 3)):
        cfg = DistillConfig(method="ka", ka_m=m, ka_lambda=0.5, ka_updates=mode)
        loss = distill_loss_fn(cfg)
        assert loss.updates_per_batch == (m if mode == "sequential" else 1)
        pair = distill_pair(student, teacher, cfg)
        graphdef, params, rest = nnx.split(pair, nnx.Param, ...)
        tx = distill_tx(cfg, tcfg)
        state = init_state(params, rest, tx, seed=0)
        calls = []
        real = distill_mod.sample_traced

        def counting(*a, calls=calls, real=real, **kw):
            calls.append(1)
            return real(*a, **kw)

        monkeypatch.setattr(distill_mod, "sample_traced", counting)
        new, metrics = jax.jit(make_step_fn(graphdef, loss, tx, tcfg))(state, b)
        monkeypatch.setattr(distill_mod, "sample_traced", real)
        assert np.isfinite(float(metrics["loss"])) and len(calls) == 1
        found = {int(c) for _, c in optax.tree_utils.tree_get_all_with_path(new.opt_state,
                                                                            "count")}
        (counts[mode],) = found
    assert counts == {"sequential": 3, "averaged": 1}


def _batch():
    return {k: jnp.asarray(v) for k, v in _source().batch(0).items()}


def test_a_fraction_of_rows_take_student_samples_drawn_with_the_configs_settings(monkeypatch):
    """on_policy_fraction = 0.5: each row is the student's sample or the dataset's response,
    about half of each over 64 rows; the sampler gets the config's temperature, top-p and
    EOS."""
    teacher, student = _lm(False, n_layers=1, seed=5), _lm(False, n_layers=1, seed=2)
    cfg = DistillConfig(method="gkd", on_policy_fraction=0.5, temperature=0.7, top_p=0.9,
                        eos_id=5)
    pair, b = distill_pair(student, teacher, cfg), _batch()
    samples, settings = [], []

    def recording(model, *a, **kw):
        out = distill_mod.sample_traced.__wrapped__(model, *a, **kw)
        samples.append(np.asarray(out.tokens_BS))
        settings.append({k: kw[k] for k in ("temperature", "top_p", "eos_id")})
        return out

    recording.__wrapped__ = distill_mod.sample_traced
    monkeypatch.setattr(distill_mod, "sample_traced", recording)
    sampled = 0
    data = np.asarray(b["tokens"])[:, :-1]
    for i in range(16):
        inputs = np.asarray(distill_mod._sequences(pair, b, cfg, jax.random.key(i))[0])
        s = samples[-1][:, :-1]
        for row, s_row, d_row in zip(inputs, s, data):
            assert (row == s_row).all() or (row == d_row).all()
            sampled += int((row == s_row).all() and not (row == d_row).all())
    assert 16 <= sampled <= 48, sampled  # Binomial(64, 0.5): mean 32, sd 4
    assert settings[0] == {"temperature": 0.7, "top_p": 0.9, "eos_id": 5}


def test_distillation_scores_the_configs_divergence_beta_and_reduction():
    teacher, student = _lm(True, seed=1), _lm(False, n_layers=1, seed=2)
    cfg = DistillConfig(method="gkd", on_policy_fraction=0.0, divergence="jsd", jsd_beta=0.2,
                        reduction="sequence")
    b = _batch()
    loss, _ = nnx.jit(distill_loss_fn(cfg))(distill_pair(student, teacher, cfg), b,
                                            jax.random.key(0))
    t_logits, _ = jitted(teacher)(b["inputs"])
    s_logits, _ = jitted(student)(b["inputs"])
    want = distill_divergence("jsd", t_logits, s_logits, b["mask"], beta=0.2,
                              reduction="sequence")
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    other = distill_divergence("jsd", t_logits, s_logits, b["mask"], beta=0.5,
                               reduction="token")
    assert abs(float(want) - float(other)) > 1e-4


def test_averaged_ka_is_the_mean_over_m_teacher_passes_each_with_its_own_key():
    """ka_updates="averaged": the loss is the mean of the M divergences, the i-th teacher pass
    routed with the i-th key split from the step's teacher key; ka_lambda reaches every
    rerouted layer."""
    teacher, student = _lm(True, seed=1), _lm(False, n_layers=1, seed=2)
    cfg = DistillConfig(method="ka", ka_m=3, ka_lambda=1.0, ka_updates="averaged",
                        on_policy_fraction=0.0)
    pair, b, key = distill_pair(student, teacher, cfg), _batch(), jax.random.key(7)
    routers = [m for _, m in nnx.iter_modules(pair.teacher) if isinstance(m, ModeRouter)]
    assert len(routers) == 2 and all(r.mode.ka_lambda == 1.0 for r in routers)
    assert all(r.mode.ka_lambda == 0.3 for _, r in nnx.iter_modules(distill_pair(
        student, teacher, cfg.replace(ka_lambda=0.3)).teacher) if isinstance(r, ModeRouter))
    loss, _ = distill_loss_fn(cfg)(pair, b, key)
    k_seq, k_teacher = jax.random.split(key)
    inputs, _, mask, real = distill_mod._sequences(pair, b, cfg, k_seq)
    s_logits, _ = student(inputs, mask_BT=real)
    divs = [float(reverse_kl(pair.teacher(inputs, key=k, mask_BT=real)[0], s_logits, mask))
            for k in jax.random.split(k_teacher, 3)]
    np.testing.assert_allclose(float(loss), np.mean(divs), rtol=1e-5)
    assert np.ptp(divs) > 1e-5  # the three passes routed differently


def test_sequential_ka_gives_every_update_of_a_step_that_steps_learning_rate():
    """KA's M updates per step (Algorithm 1) each take the schedule's rate at the loop's step:
    with Adam on a constant gradient every update moves a parameter by that rate."""
    cfg = DistillConfig(method="ka", ka_m=2)
    tcfg = TrainConfig(steps=4, batch_size=4, lr=1.0, schedule="linear", min_lr_ratio=0.0,
                       warmup_steps=0, grad_clip=0.0)
    tx = distill_tx(cfg, tcfg)
    params = {"b": jnp.zeros(3)}  # 1-D: no weight decay
    state, moves = tx.init(params), []
    for _ in range(6):
        updates, state = tx.update({"b": jnp.ones(3)}, state, params)
        moves.append(-float(updates["b"][0]))
    rates = [1.0, 1.0, 0.75, 0.75, 0.5, 0.5]  # lr (1 - step / 4) at steps 0, 0, 1, 1, 2, 2
    np.testing.assert_allclose(moves, rates, rtol=1e-4)


def test_settings_no_method_can_honour_are_refused():
    with pytest.raises(ConfigError, match="top_p=0.0 must be in"):
        DistillConfig(top_p=0.0)
    with pytest.raises(ValueError, match=r"teacher_k=2\) changes an MoE teacher's routing"):
        distill_pair(_lm(False), _lm(False), DistillConfig(method="kd", teacher_k=2))
