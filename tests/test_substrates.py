"""Substrate cache: build-on-first-use, dependency chain (prose LM -> code fine-tune), cached
reload, resume from the training run dir, error messages; tiny recipes so it runs in seconds.
Also checks the experiment step's config (experiments/substrate_build.py)."""

import json
import time

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors", reason="pip install safetensors")

from experiments import substrate_build as sb
from moejax import substrates
from moejax.config import ConfigError
from moejax.config_overrides import apply_overrides
from moejax.evaluate import ClassifierEvaluator
from moejax.harness import experiment
from moejax.io._common import flat_params
from moejax.substrates import registry
from moejax.substrates.classify import MiniLMTaskConfig, mnist_arrays
from moejax.substrates.mlp import init_mlp, load_tasks, mlp, mlp_loss
from tests.tiny_substrates import tiny_lm as _tiny_lm


def _same_params(a, b):
    fa, fb = flat_params(a), flat_params(b)
    assert set(fa) == set(fb)
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)


@pytest.mark.slow
def test_lm_chain_build_cache_and_resume(tiny_recipes):
    cache = tiny_recipes
    code = substrates.get("dense_lm_code", "quick", cache_dir=cache)
    prose_dir = substrates.substrate_dir("dense_lm_prose", _tiny_lm("dense_lm_prose", "quick"),
                                         label="quick", cache_dir=cache)
    assert (prose_dir / "model.safetensors").is_file()  # dependency built first
    assert code.path.name.startswith("quick-") and code.path.parent.name == "dense_lm_code"
    m = code.metrics
    for k in ("val_loss", "val_ppl", "val_loss_before", "base_corpus_val_loss_before",
              "base_corpus_val_loss_after", "wall_s"):
        assert np.isfinite(m[k]), k
    assert m["val_ppl"] == pytest.approx(np.exp(m["val_loss"]))
    assert json.loads((code.path / "metrics.json").read_text()) == m
    # the fine-tune starts from the prose model: before training it scores exactly like it
    # on the prose validation windows (same eval settings in both tiny configs)
    prose = substrates.get("dense_lm_prose", "quick", cache_dir=cache)
    assert prose.model.cfg == code.model.cfg
    assert m["base_corpus_val_loss_before"] == pytest.approx(prose.metrics["val_loss"], rel=1e-5)
    assert m["base_corpus_val_loss_after"] != m["base_corpus_val_loss_before"]

    t0 = time.time()
    again = substrates.get("dense_lm_code", "quick", cache_dir=cache, build_if_missing=False)
    assert time.time() - t0 < 10  # loaded, not trained
    _same_params(again.model, code.model)
    x = jnp.arange(16, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(np.asarray(again.model(x)[0]), np.asarray(code.model(x)[0]))

    # interrupted after the last checkpoint but before export: rebuild resumes, same params
    (code.path / "model.safetensors").unlink()
    resumed = substrates.get("dense_lm_code", "quick", cache_dir=cache)
    _same_params(resumed.model, code.model)


def test_a_full_disk_while_caching_names_the_directory_and_the_space(tiny_recipes, monkeypatch,
                                                                      capsys):
    """ENOSPC while writing the weights: one OSError naming the substrate's directory and the
    megabytes its weights need, nothing that looks cached, and a study's main prints one
    line (exit 1); the next build, with space again, resumes from the trained run."""
    import errno

    real = registry.export_params

    def full(model, path, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(registry, "export_params", full)
    with pytest.raises(OSError) as e:
        substrates.get("dense_lm_prose", "quick", cache_dir=tiny_recipes)
    d = substrates.substrate_dir("dense_lm_prose", _tiny_lm("dense_lm_prose", "quick"),
                                 label="quick", cache_dir=tiny_recipes)
    assert e.value.errno == errno.ENOSPC and "\n" not in e.value.strerror
    assert e.value.strerror.startswith(f"disk full caching substrate dense_lm_prose in {d}: "
                                       "its weights need ")
    assert " MB; the trained run " in e.value.strerror
    assert not (d / "model.safetensors").exists() and not (d / "integrity.json").exists()

    def study(cfg, run):
        substrates.get("dense_lm_prose", "quick", cache_dir=tiny_recipes)

    cfg = _tiny_lm("dense_lm_prose", "quick")
    assert experiment.main("full_disk", lambda preset: cfg, study,
                           [f"out={tiny_recipes / 'study'}"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: disk full writing ") and str(d) in line
    monkeypatch.setattr(registry, "export_params", real)
    substrates.get("dense_lm_prose", "quick", cache_dir=tiny_recipes)
    assert (d / "model.safetensors").is_file()


def test_custom_config_gets_own_cache_key(tiny_recipes):
    cfg = _tiny_lm("dense_lm_prose", "quick")
    other = cfg.replace(train=cfg.train.replace(steps=2))
    a = substrates.substrate_dir("dense_lm_prose", cfg, label="quick", cache_dir=tiny_recipes)
    b = substrates.substrate_dir("dense_lm_prose", other, cache_dir=tiny_recipes)
    assert a != b and b.name.startswith("custom-")


def test_vit_substrate(tiny_recipes):
    sub = substrates.get("vit_mnist5k", "quick", cache_dir=tiny_recipes)
    assert sub.metrics["train_examples"] > 4000
    # the cached weights reproduce the accuracy recorded when they were trained
    val = ClassifierEvaluator(*mnist_arrays("validation"))(sub.model)
    assert val["accuracy"] == pytest.approx(sub.metrics["val_accuracy"], abs=1e-6)
    logits, _ = sub.model(jnp.zeros((2, 28, 28, 1)))
    assert logits.shape == (2, 10)


def test_errors(tmp_path):
    with pytest.raises(KeyError, match="available"):
        substrates.get("nope", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="python -m experiments.substrate_build"):
        substrates.get("vit_mnist5k", "quick", cache_dir=tmp_path, build_if_missing=False)
    with pytest.raises(ValueError, match="preset"):
        substrates.substrate_config("vit_mnist5k", "huge")


def test_experiment_config():
    q, f = sb.make_config("quick"), sb.make_config("full")
    assert q.dense_lm_code.init_from == "dense_lm_prose"
    assert f.dense_lm_prose.train.steps > q.dense_lm_prose.train.steps
    assert isinstance(q.minilm_wordnet_lexname, MiniLMTaskConfig)
    assert q.minilm_wordnet_lexname.task == "lexname"
    c = apply_overrides(q, ["only=vit_mnist5k", "vit_mnist5k.train.steps=70"])
    assert c.names() == ["vit_mnist5k"] and c.vit_mnist5k.train.steps == 70
    with pytest.raises(ConfigError, match="unknown"):
        apply_overrides(q, ["only=bogus"])


def test_controlled_mlp_matches_numpy_and_tasks_split_disjointly():
    import jax

    p = init_mlp(jax.random.key(0), 12, 8, n_classes=3)
    x = np.random.default_rng(0).normal(size=(5, 12)).astype(np.float32)

    def rms(v, s):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + 1e-6) * s

    q = {k: np.asarray(v) for k, v in p.items()}
    h = np.maximum(rms(x, q["norm_in"]) @ q["w1"] + q["b1"], 0)
    want = rms(h, q["norm_h"]) @ q["wo"] + q["bo"]
    np.testing.assert_allclose(np.asarray(mlp(p, x)), want, rtol=1e-5, atol=1e-6)
    y = np.array([0, 1, 2, 1, 0], np.int32)
    logp = want - np.log(np.exp(want).sum(-1, keepdims=True))
    np.testing.assert_allclose(float(mlp_loss(p, {"inputs": x, "labels": y})),
                               -logp[np.arange(5), y].mean(), rtol=1e-5)
    tasks = load_tasks(0)
    for task in ("A", "B"):
        xs = [np.asarray(tasks[task, s][0]) for s in ("train", "validation", "test")]
        assert all(a.shape[1] == 784 for a in xs) and 0 <= xs[0].min() and xs[0].max() <= 1
        rows = {a.tobytes() for a in np.concatenate(xs[1:])}
        assert sum(r.tobytes() in rows for r in xs[0]) <= 0.01 * len(xs[0])  # duplicates only
