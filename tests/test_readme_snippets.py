"""The README's Python blocks run as printed. Each is run here with the names it takes from the
prose around it (a model, data, a key, a validation metric) defined at toy size, and the few
literals a test must change (paths, step and device counts) replaced; a replacement that no
longer matches fails, and so does a block that no test runs. The own-model block runs in a
lean install (``tests/test_lean_install.py``)."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.data.batches import PackedLMBatches, PromptResponseBatches
from moejax.data.packing import pack_documents, prompt_response_rows
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.moe import MoEConfig
from moejax.pytree import named_leaves
from moejax.train import checkpoint_format
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train
from tests.devices import run_on_devices

ROOT = Path(__file__).resolve().parents[1]
V = 48

# a marker each block holds (and no other), and where the block is run
RUN_BY = {
    "layer_pattern(": "test_the_decoder_block",
    "class Regressor": "tests/test_lean_install.py",
    "adamr(3e-4": "test_the_finetuning_and_plain_orbax_blocks",
    "dl.select_leaves": "test_the_delta_toolkit_block",
    "distill_pair(": "test_the_distillation_block",
    "load_hf_moe(": "test_the_hugging_face_block_on_four_devices",
    "ocp.CheckpointManager": "test_the_finetuning_and_plain_orbax_blocks",
}


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _block(marker: str, replace: dict[str, str] | None = None) -> str:
    found = [b for b in _blocks() if marker in b]
    assert len(found) == 1, f"{len(found)} README blocks hold {marker!r}"
    code = found[0]
    for old, new in (replace or {}).items():
        assert code.count(old) == 1, f"the README block with {marker!r} no longer has {old!r}"
        code = code.replace(old, new)
    return code


def _lm(slots, *, seed=0, d_model=32):
    cfg = DecoderConfig(vocab_size=V, d_model=d_model, n_layers=len(slots), n_heads=2,
                        n_kv_heads=1, max_seq_len=32, ffn_slots=tuple(slots))
    return DecoderLM(cfg, rngs=nnx.Rngs(seed))


def _params(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in named_leaves(nnx.state(model, nnx.Param))}


def test_every_python_block_is_run_by_a_test():
    blocks = _blocks()
    assert len(blocks) >= len(set(RUN_BY.values()))
    for b in blocks:
        held = [m for m in RUN_BY if m in b]
        assert len(held) == 1, f"README block {b.splitlines()[0]!r} ... is run by no test " \
                               f"(or holds several markers: {held})"
    here = Path(__file__).read_text()
    for test in set(RUN_BY.values()):
        if test.startswith("test_"):
            assert f"def {test}(" in here, test
        else:  # another test file runs it
            assert "README" in (ROOT / test).read_text(), test


def test_the_decoder_block():
    ns = {"tokens_BT": jnp.arange(16, dtype=jnp.int32).reshape(2, 8),
          "key": jax.random.key(0)}
    exec(_block("layer_pattern("), ns)
    logits, aux = ns["logits"], ns["aux"]
    assert logits.shape == (2, 8, 256) and bool(jnp.all(jnp.isfinite(logits)))
    assert np.isfinite(float(aux["aux_loss"]))
    # the comment's promise: block i's routing statistics, in the MoE blocks (every other one)
    assert aux["layers"][1]["load"].shape == (8,)
    assert float(jnp.sum(aux["layers"][1]["load"])) > 0


def test_the_delta_toolkit_block():
    model = _lm([DenseFFNConfig(d_hidden=64, activation="swiglu")] * 2)
    graphdef, pretrained, rest = nnx.split(model, nnx.Param, ...)
    key = jax.random.key(0)
    finetuned = jax.tree.map(lambda a: a + 0.02 * jax.random.normal(key, a.shape), pretrained)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, (4, 16)), jnp.int32)
    forward = lambda prm: nnx.merge(graphdef, prm, rest)(tokens)[0]  # noqa: E731
    want = forward(finetuned)
    ns = {"pretrained": pretrained, "finetuned": finetuned, "key": key, "forward": forward,
          "val_metric": lambda prm: -float(jnp.mean((forward(prm) - want) ** 2))}
    exec(_block("dl.select_leaves"), ns)
    d, pruned, pruned_q, qs = (dict(named_leaves(ns[k])) if k != "qs" else ns[k]
                               for k in ("D", "pruned", "pruned_q", "qs"))
    pre = dict(named_leaves(pretrained))
    chosen = [k for k, m in named_leaves(ns["mask"]) if m]
    assert chosen and all(re.search(r"(attn|ffn)/w_", k) for k in chosen)
    for k in chosen:
        kept = np.asarray(pruned[k] - pre[k]) != 0
        assert 0 < kept.mean() < 0.05, (k, kept.mean())  # p = 0.99 drops about 99%
        # the per-layer q keeps the same entries, each rescaled by 1/q^l, q^l in [1-p, 1]
        np.testing.assert_array_equal(np.asarray(pruned_q[k] - pre[k]) != 0, kept)
        assert 0.01 <= qs[k] <= 1.0
        np.testing.assert_allclose(np.asarray(pruned_q[k] - pre[k])[kept],
                                   np.asarray(d[k])[kept] / qs[k], rtol=1e-4, atol=1e-6)
    assert 0.01 <= ns["best_q"] <= 0.1  # the geometric grid: 1/q from 1/(1-p) down to 10


def _lm_source(batch_size: int) -> PackedLMBatches:
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, V, rng.integers(4, 30)) for _ in range(40)]
    return PackedLMBatches(pack_documents(docs, 16), batch_size=batch_size)


def test_the_finetuning_and_plain_orbax_blocks(tmp_path):
    model = _lm([DenseFFNConfig(d_hidden=64, activation="swiglu")] * 2)
    run_dir = tmp_path / "ft"
    ns = {"model": model, "source": _lm_source(16)}
    code = _block("adamr(3e-4", {"steps=500": "steps=3", '"runs/ft"': repr(str(run_dir))})
    exec(code, ns)
    assert len(ns["history"]) >= 1 and all(np.isfinite(h["loss"]) for h in ns["history"])
    # the comment's transforms compose with the block's
    dare_line, adamr_line = (ln for ln in code.splitlines() if "inject_hyperparams(" in ln)
    tx = eval(dare_line.split("# ", 1)[1].removesuffix(", and"), ns)
    params = nnx.state(model, nnx.Param)
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params))
    assert 0.05 < float(np.mean([np.mean(np.asarray(u) != 0)
                                 for u in jax.tree.leaves(updates)])) < 0.2  # p = 0.9
    tx = eval(adamr_line.split("# ", 1)[1], ns)
    state = tx.init(params)
    assert abs(float(state.hyperparams["weight_decay"]) - 0.1) < 1e-7
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))

    # the checkpoint it wrote, restored with plain orbax in a process without moejax
    doc = checkpoint_format.__doc__
    start = doc.index("    import os\n")
    assert _block("ocp.CheckpointManager") == textwrap.dedent(
        doc[start:doc.index("\n\n", start)]) + "\n", "the README's copy of the format's snippet"
    restore = _block("ocp.CheckpointManager",
                     {'"RUN_DIR/checkpoints"': repr(str(run_dir / "checkpoints"))})
    assert "moejax" not in restore
    out = tmp_path / "restored.npz"
    restore += (
        "\nimport numpy as np, sys\n"
        "flat = {'/'.join(str(getattr(k, 'key', k)) for k in p): np.asarray(v)\n"
        "        for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}\n"
        f"np.savez({str(out)!r}, **flat)\n"
        "assert 'moejax' not in sys.modules\n"
        "print(step, position)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    r = subprocess.run([sys.executable, "-c", restore], capture_output=True, text=True,
                       cwd=tmp_path, env=dict(env, JAX_PLATFORMS="cpu"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["3", "3"]  # the last step, three batches consumed
    got, want = dict(np.load(out)), _params(model)
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v)


def test_the_distillation_block():
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=16, dispatch="dense")
    student = _lm([DenseFFNConfig(d_hidden=32, activation="swiglu")], seed=2)
    before = _params(student)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, V, rng.integers(1, 5)) for _ in range(16)]
    responses = [rng.integers(3, V, rng.integers(1, 6)) for _ in range(16)]
    ns = {"student": student, "moe_teacher": _lm([moe, moe], seed=1), "train": train,
          "prompt_response_batches": PromptResponseBatches(
              prompt_response_rows(prompts, responses, 8, 6), batch_size=4),
          "tcfg": TrainConfig(steps=2, batch_size=4, lr=1e-2, schedule="constant")}
    exec(_block("distill_pair(", {
        "distill_tx(cfg, tcfg))": "distill_tx(cfg, tcfg), progress=False)"}), ns)
    assert ns["pair"].student is student
    assert any(not np.array_equal(v, before[k]) for k, v in _params(student).items())


HF_CHECK = """
import json, sys
from pathlib import Path
sys.path.insert(0, ROOT)
from flax import nnx
from moejax.pytree import named_leaves
exec(Path(OUT, 'block.py').read_text())
experts = {k: (len(v.sharding.device_set), v.addressable_shards[0].data.shape[0])
           for k, v in named_leaves(nnx.state(model, nnx.Param)) if '/experts/' in k}
saved = sorted(p.name for p in Path(OUT, 'olmoe').iterdir())
kind = json.loads(Path(OUT, 'olmoe', 'config.json').read_text())['model_type']
print(json.dumps({"experts": experts, "saved": saved, "model_type": kind}))
print('OK')
"""


def test_the_hugging_face_block_on_four_devices(tmp_path):
    fixture = ROOT / "tests" / "fixtures" / "hf_moe" / "olmoe"
    code = _block("load_hf_moe(", {
        '"path/to/OLMoE-1B-7B", dispatch': f"{str(fixture)!r}, dispatch",
        '"path/to/OLMoE-1B-7B", shardings': f"{str(fixture)!r}, shardings",
        '"out/olmoe"': repr(str(tmp_path / "olmoe")),
        "expert=8": "expert=4"})  # the fixture has four experts
    (tmp_path / "block.py").write_text(code)
    out = run_on_devices(HF_CHECK.replace("OUT", repr(str(tmp_path))), n_devices=4, timeout=300)
    seen = json.loads(out.strip().splitlines()[-2])
    # the block's sharding: every expert matrix split over the 4 devices, one expert on each
    assert len(seen["experts"]) == 2 * 3  # two layers, gate / up / down
    assert all(tuple(v) == (4, 1) for v in seen["experts"].values()), seen["experts"]
    # and its save: a Hugging Face directory of the model's family
    assert {"config.json", "model.safetensors"} <= set(seen["saved"])
    assert seen["model_type"] == "olmoe"
