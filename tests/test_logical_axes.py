"""Logical axis names (moejax.nn.axes) and the one rules table (moejax.train.mesh.RULES):
every parameter of every moejax model kind carries one name per dimension; the rules cover
every name; a leaf is sharded by its names only (an unnamed one replicated); a moejax
parameter without names is refused on a mesh of more than one device, a user's is listed;
the training loop on an 8-device mesh records its parameters' names, specs and the
replicated unnamed ones in the run's ``sharding.json``."""

import json

import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from moejax.ders_compress.synth import SynthMoEConfig
from moejax.extract.pipeline import MLPRouterNet
from moejax.nn import axes as ax
from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ders_moe import DeRSMoEConfig
from moejax.nn.encoder import SequenceClassifier, ViT, ViTConfig, bert_encoder_config
from moejax.nn.extracted import ExtractedFFNConfig
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.grin import GRINConfig
from moejax.nn.lean_decode import lean_decoder
from moejax.nn.moe import MoEConfig
from moejax.nn.remoe import ReMoEConfig
from moejax.substrates.mlp import MLPClassifier
from moejax.train import mesh as mesh_lib
from tests.devices import run_on_devices

MOE = MoEConfig(n_experts=4, top_k=2, d_expert=8, n_shared_experts=1, shared_gate=True,
                universal_ffn=True)
SLOTS = {
    "dense": DenseFFNConfig(d_hidden=16, activation="swiglu", use_bias=True),
    "moe": MOE,
    "noisy moe": MoEConfig(n_experts=4, top_k=2, d_expert=8, router="noisy"),
    "ders sm": DeRSMoEConfig(moe=MOE, form="sm"),
    "ders lm frozen": DeRSMoEConfig(moe=MOE, form="lm", lm_rank=2, freeze_shared=True),
    "blockffn": BlockFFNConfig(n_experts=4, d_expert=8),
    "grin": GRINConfig(moe=MoEConfig(n_experts=4, top_k=2, d_expert=8, renormalize=False)),
    "remoe": ReMoEConfig(n_experts=4, d_expert=8),
    "extracted": ExtractedFFNConfig(d_hidden=16, n_experts=4),
    "extracted compact": ExtractedFFNConfig(d_hidden=16, n_experts=4, layout="compact",
                                            d_expert=4, d_shared=4),
    "synth": SynthMoEConfig(moe=MoEConfig(n_experts=4, top_k=2, d_expert=8)),
}


def _decoder(slot, **kw):
    cfg = DecoderConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                        ffn_slots=(slot,), max_seq_len=16, **kw)
    return DecoderLM(cfg, rngs=nnx.Rngs(0))


def _params(model):
    return [(p, v) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]


MODELS = {
    **{f"decoder, {k}": (lambda s=s: _decoder(s)) for k, s in SLOTS.items()},
    "decoder, biases, qk norm, untied": lambda: _decoder(
        SLOTS["dense"], qkv_bias=True, qk_norm="head", tie_embeddings=False),
    "lean decoder": lambda: lean_decoder(_decoder(SLOTS["dense"], qkv_bias=True)),
    "lean blockffn decoder": lambda: lean_decoder(_decoder(SLOTS["blockffn"])),
    "bert classifier": lambda: SequenceClassifier(
        bert_encoder_config(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_hidden=32,
                            max_position=16, pooling="pooler"), 3, rngs=nnx.Rngs(0)),
    "vit": lambda: ViT(ViTConfig(image_size=8, patch_size=4, n_channels=1, d_model=16,
                                 n_layers=1, n_heads=2, n_classes=3,
                                 ffn_slots=(SLOTS["moe"],)), rngs=nnx.Rngs(0)),
    "mlp substrate": lambda: MLPClassifier(12, 16, 3),
    "moefication mlp router": lambda: MLPRouterNet(jnp.ones((4, 16))),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_moejax_parameter_names_each_dimension(name):
    model = MODELS[name]()
    params = _params(model)
    assert params
    assert mesh_lib.unnamed_params(model) == []
    for path, v in params:
        names = ax.logical_axes(v)
        assert len(names) == v[...].ndim and set(names) <= ax.NAMES, (path, names)
    assert mesh_lib.check_named(model, 8) == []


def test_the_rules_table_covers_every_name_and_experts_alone_take_the_expert_axis():
    assert set(mesh_lib.RULES) == ax.NAMES
    assert [n for n, roles in mesh_lib.RULES.items() if "expert" in roles] == [ax.EXPERTS]


@pytest.mark.parametrize("names,shape,fsdp,want", [
    ((ax.EXPERTS, ax.EMBED, ax.MLP), (8, 16, 32), False, P("expert")),
    ((ax.EXPERTS, ax.EMBED, ax.MLP), (8, 16, 32), True, P("expert", None, "data")),
    ((ax.EXPERTS, ax.EMBED, ax.MLP), (6, 16, 32), False, P()),  # 6 experts over 4: none
    ((ax.EMBED, ax.SCORES), (16, 8), False, P()),  # a router's scores: never the expert axis
    ((ax.EMBED, ax.SCORES), (16, 8), True, P(("data", "expert"))),
    ((ax.VOCAB, ax.EMBED), (30, 16), True, P(None, ("data", "expert"))),  # the largest divisible
    ((ax.VOCAB, ax.EMBED), (15, 6), True, P(None, "data")),  # only the data axis divides
    (None, (8, 16, 32), True, P()),  # unnamed: replicated
    ((), (), True, P()),  # a scalar
])
def test_a_leaf_is_sharded_by_its_names(names, shape, fsdp, want):
    assert mesh_lib.leaf_spec(names, shape, expert_size=4, data_size=2, fsdp=fsdp) == want


class _Ours(nnx.Module):
    __module__ = "moejax.nn.example"  # stands for a moejax module that forgot its names

    def __init__(self):
        self.w = nnx.Param(jnp.ones((4, 4)))


class _Users(nnx.Module):
    def __init__(self):
        self.named = ax.param(jnp.ones((4, 4)), ax.EMBED, ax.MLP)
        self.bare = nnx.Param(jnp.ones((4,)))
        self.layer = nnx.Linear(4, 4, rngs=nnx.Rngs(0))


def test_a_moejax_parameter_without_names_is_refused_on_more_than_one_device():
    with pytest.raises(ValueError, match=r"w \(moejax.nn.example._Ours\).*axes.param"):
        mesh_lib.check_named(_Ours(), 2)
    assert mesh_lib.check_named(_Ours(), 1) == ["w"]


def test_a_users_parameters_without_names_are_listed_not_refused():
    assert sorted(mesh_lib.check_named(_Users(), 8)) == ["bare", "layer/bias", "layer/kernel"]


def test_bad_names_are_refused_when_the_parameter_is_made():
    with pytest.raises(ValueError, match="one name per dimension"):
        ax.param(jnp.ones((4, 4)), ax.EMBED)
    with pytest.raises(ValueError, match="one name per dimension"):
        ax.param(jnp.ones((4,)), "width")


_SCRIPT = r"""
import sys, json, os
sys.path.insert(0, ROOT)
import jax
from flax import nnx
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train
from moejax.train import mesh as mesh_lib
from tests.toy_models import TinyMoELM, ToySource

assert jax.device_count() == 8
run_dir = RUN_DIR
cfg = TrainConfig(steps=2, batch_size=16, lr=1e-2, warmup_steps=0, schedule="constant",
                  mesh_data=2, mesh_expert=4, fsdp=True)
hist = train(TinyMoELM(nnx.Rngs(0)), ToySource(batch_size=16), cfg, run_dir=run_dir,
             progress=False)
summary = json.load(open(os.path.join(run_dir, "sharding.json")))
print("RESULT", json.dumps({"history": list(hist.replicated_unnamed), "summary": summary}))
print("OK")
"""


@pytest.mark.slow
def test_the_loop_records_names_specs_and_the_replicated_unnamed_parameters(tmp_path):
    out = run_on_devices(_SCRIPT.replace("RUN_DIR", repr(str(tmp_path / "run"))), 8)
    got = json.loads(out.split("RESULT", 1)[1].rsplit("OK", 1)[0])
    summary = got["summary"]
    assert summary["mesh"] == {"data": 2, "expert": 4} and summary["fsdp"] is True
    params = summary["params"]
    w_up = next(v for k, v in params.items() if "w_up" in k)
    assert w_up == {"logical_axes": ["experts", "embed", "mlp"],
                    "spec": ["expert", None, "data"]}
    kernel = next(v for k, v in params.items() if "head" in k and "kernel" in k)
    assert kernel == {"logical_axes": None, "spec": []}
    assert "head/kernel" in summary["replicated_unnamed"] and "experts/w_up" not in (
        summary["replicated_unnamed"])
    assert got["history"] == summary["replicated_unnamed"]


_TENSOR_SCRIPT = r"""
import sys, json
sys.path.insert(0, ROOT)
import jax, numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from moejax.nn.decoder import DecoderLM
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_lm import MoELMConfig
from moejax.train import mesh as mesh_lib
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train
from tests.toy_models import ToySource

assert jax.device_count() == 8
MODEL = MoELMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=16,
                    moe=MoEConfig(n_experts=4, top_k=2, d_expert=32))
cfg = TrainConfig(steps=3, batch_size=8, lr=1e-2, warmup_steps=0, schedule="constant")
one = train(DecoderLM(MODEL.decoder_config(), rngs=nnx.Rngs(0)), ToySource(batch_size=8), cfg,
            mesh=mesh_lib.make_mesh(1, 1, devices=jax.devices()[:1]), progress=False)
for fsdp in (False, True):
    tcfg = cfg.replace(mesh_data=2, mesh_expert=2, mesh_tensor=2, fsdp=fsdp)
    model = DecoderLM(MODEL.decoder_config(), rngs=nnx.Rngs(0))
    mesh = mesh_lib.make_mesh(2, 2, tensor=2)
    assert dict(mesh.shape) == {"data": 2, "expert": 2, "tensor": 2}
    hist = train(model, ToySource(batch_size=8), tcfg, progress=False)
    np.testing.assert_allclose([h["loss"] for h in hist], [h["loss"] for h in one], rtol=2e-5)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    specs = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(
        mesh_lib.tree_shardings(params, mesh, fsdp))}
    get = lambda part: next(v for k, v in specs.items() if part in k)
    data = ("data", "expert")
    want = {"experts']['w_up": P("expert", "data" if fsdp else None, "tensor"),
            "experts']['w_down": P("expert", "tensor", "data") if fsdp else P("expert", "tensor"),
            "attn']['w_q": P(data, "tensor") if fsdp else P(None, "tensor"),
            "attn']['w_o": P("tensor", data) if fsdp else P("tensor"),
            "'embed'": P(None, data) if fsdp else P()}
    for part, spec in want.items():
        assert get(part) == spec, (fsdp, part, get(part), spec)
    print("fsdp", fsdp, "losses", [round(h["loss"], 5) for h in hist])
print("OK")
"""


@pytest.mark.slow
def test_a_tensor_axis_splits_ffn_widths_and_heads_and_trains_as_one_device():
    """An 8-device mesh of data 2 x expert 2 x tensor 2 (with and without FSDP): experts'
    hidden widths and attention's heads over the tensor axis, the experts over the expert
    axis, the model width over the data axes with FSDP; three training steps give one
    device's losses."""
    out = run_on_devices(_TENSOR_SCRIPT, 8)
    assert out.count("losses") == 2


@pytest.mark.parametrize("data,expert,name", [(-1, 0, "mesh_expert=0"), (0, -1, "mesh_data=0"),
                                              (-2, 1, "mesh_data=-2"), (2, -3, "mesh_expert=-3")])
def test_a_mesh_axis_neither_minus_one_nor_positive_is_refused_naming_it(data, expert, name):
    """``make_mesh`` / ``resolve_mesh_shape`` called directly (a config refuses these
    itself): one ValueError naming the axis, not a division by zero or a negative device
    count."""
    with pytest.raises(ValueError, match=f"mesh: {name} must be -1 \\(all remaining devices\\) "
                                         "or >= 1"):
        mesh_lib.resolve_mesh_shape(data, expert, 8)
    with pytest.raises(ValueError, match=name):
        mesh_lib.make_mesh(data, expert)
    assert mesh_lib.resolve_mesh_shape(-1, 1, 8) == (8, 1)
