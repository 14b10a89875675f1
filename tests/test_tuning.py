"""Kernel launch configurations (moejax.kernels.tuning): the search keeps the fastest
configuration per kernel, dtype and shape bucket (skipping one that cannot run, and one whose
output the autotune timer found unlike its slow float32 oracle, however fast); the table
merges per device kind and reads back; a lowering for a device reads its entry, and one
without an entry gets the anchors' H100 defaults, both visible in the exported Triton call;
the Mosaic GPU kernels run with the blocks their configuration names; the autotune entry point
tunes each kernel over its own space and refuses a machine without a GPU before writing
anything."""

import json
import re

import jax
import jax.export as je
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarks import autotune
from moejax.kernels import tuning
from moejax.kernels.chunk_union.decode_gpu import TUNED_ROWS, chunk_union_decode_gpu, supports
from moejax.kernels.chunk_union.pairs import GPU_INTERPRET, pair_up, union_pairs
from moejax.kernels.chunk_union.reference import dense_experts
from moejax.kernels.grouped.pallas_gmm import gmm
from moejax.kernels.targets import TARGETS, lowering_target

H100 = TARGETS["cuda"].device_kind
TRITON = "__gpu$xla.gpu.triton"


def test_the_search_keeps_the_fastest_per_case_and_skips_what_cannot_run():
    space = [tuning.TritonConfig(64, 32, 64), tuning.TritonConfig(128, 64, 128, 8, 3),
             tuning.TritonConfig(128, 128, 256, 8, 3)]
    cost = {space[0]: 3.0, space[1]: 1.0}

    def time_fn(kernel, dtype, k, n, c):
        if c not in cost:
            raise RuntimeError("out of shared memory")
        return cost[c] * (2.0 if dtype == "float32" and c.tm == 128 else 1.0) * 1e-3

    got = tuning.tune([("gmm", "bfloat16", 2048, 1408), ("gmm", "float32", 256, 704)],
                      space, time_fn).entries
    assert got["gmm"]["bfloat16"]["k2048_n2048"] == {**space[1]._asdict(), "ms": 1.0}
    assert got["gmm"]["float32"]["k256_n1024"] == {**space[1]._asdict(), "ms": 2.0}
    none = tuning.tune([("tgmm", "bfloat16", 8, 8)], space[2:], time_fn)
    assert none.entries == {}
    assert [t["outcome"] for t in none.trials] == ["cannot run: out of shared memory"]


def test_a_wrong_configuration_is_never_kept_however_fast():
    space = [tuning.TritonConfig(64, 32, 64), tuning.TritonConfig(128, 64, 128, 8, 3)]

    def time_fn(kernel, dtype, k, n, c):
        if c == space[0] and dtype == "bfloat16":
            raise tuning.WrongResult("error 0.5 of the oracle's largest value")
        return (1.0 if c == space[0] else 2.0) * 1e-3

    got = tuning.tune([("gmm", "bfloat16", 256, 256), ("gmm", "float32", 256, 256)],
                      space, time_fn)
    assert got.entries["gmm"]["bfloat16"]["k256_n256"]["tm"] == 128  # the fast one was wrong
    assert got.entries["gmm"]["float32"]["k256_n256"]["tm"] == 64
    assert [(t["dtype"], t["tm"], t["ms"], t["outcome"].split(":")[0]) for t in got.trials] == [
        ("bfloat16", 64, None, "wrong"), ("bfloat16", 128, 2.0, "ok"),
        ("float32", 64, 1.0, "ok"), ("float32", 128, 2.0, "ok")]


def test_check_close_refuses_an_output_past_the_dtypes_tolerance():
    want = np.linspace(-4.0, 4.0, 64, dtype=np.float32).reshape(8, 8)
    assert tuning.check_close(want.astype(jnp.bfloat16), want, jnp.bfloat16) <= 2.0 ** -8
    assert tuning.check_close(want + 0.01, want, jnp.float32) <= 2.0 ** -7
    for bad in (want * 1.1, np.roll(want, 1, 0), np.where(want > 3, np.nan, want), want[:4]):
        with pytest.raises(tuning.WrongResult):
            tuning.check_close(bad, want, jnp.float32)


def test_the_autotune_timer_checks_each_candidate_against_a_slow_oracle(monkeypatch):
    """On the CPU the kernels run interpreted: the timer's oracle agrees with the real
    kernels, and refuses a kernel whose output is wrong before timing it."""
    cfg = autotune.AutotuneConfig(rows=64, groups=4, iters=1, repeats=1, l2_flush_mb=0)
    timed = []

    def timer(fn, *args, **kw):
        timed.append(fn)
        assert kw["profile"]  # the kernels' own time decides where there is a trace
        return {"median_s": 1e-3, "kernel_s": None}

    time_fn = autotune._timer(cfg, timer)
    candidate = tuning.TritonConfig(64, 32, 64)
    for kernel in ("gmm", "tgmm"):
        assert time_fn(kernel, "float32", 32, 24, candidate) == 1e-3  # no trace: the median
    assert len(timed) == 2
    # with a device trace, the kernels' time, not a wall time less a noisy L2 rewrite's
    assert autotune._decisive({"median_s": -2e-6, "kernel_s": 5e-5}) == 5e-5
    monkeypatch.setattr(autotune, "gmm", lambda x, w, s: gmm(x, w, s) * 1.05)
    with pytest.raises(tuning.WrongResult):
        time_fn("gmm", "float32", 32, 24, candidate)
    assert len(timed) == 2


def test_the_autotune_oracles_are_the_products_they_stand_for():
    key = jax.random.key(3)
    x, w = jax.random.normal(key, (10, 6)), jax.random.normal(jax.random.key(4), (3, 6, 5))
    dy = jax.random.normal(jax.random.key(5), (10, 5))
    sizes = jnp.array([4, 0, 6], jnp.int32)
    gid = np.repeat(np.arange(3), np.asarray(sizes))
    xn, wn, dyn = (np.asarray(z, np.float64) for z in (x, w, dy))
    np.testing.assert_allclose(autotune._gmm_oracle(x, w, sizes),
                               np.stack([xn[i] @ wn[g] for i, g in enumerate(gid)]),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(autotune._tgmm_oracle(x, dy, sizes),
                               np.stack([xn[gid == g].T @ dyn[gid == g] for g in range(3)]),
                               rtol=1e-5, atol=1e-5)
    pairs = union_pairs(jnp.array([[2, 0], [1, 1]], jnp.int32), jnp.array([2, 1], jnp.int32), 3)
    xs = jax.random.normal(key, (2, 4, 6))
    want = [np.asarray(xs[s], np.float64) @ wn[e] * v
            for s, e, v in zip(pairs.src, pairs.expert, pairs.valid)]
    np.testing.assert_allclose(autotune._pairs_oracle(xs, w, pairs), np.stack(want),
                               rtol=1e-5, atol=1e-5)


def test_the_table_merges_per_device_and_reads_back(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    monkeypatch.setenv("MOEJAX_KERNEL_TABLE", str(path))
    a = {"gmm": {"bfloat16": {"k2048_n2048": {**tuning.TritonConfig(128, 64, 256, 8, 3)
                                               ._asdict(), "ms": 1.5}}}}
    b = {"tgmm": {"float32": {"k256_n1024": {**tuning.TritonConfig(64, 64, 128, 4, 2)
                                              ._asdict(), "ms": 0.5}}}}
    tuning.write_entries(H100, a)
    tuning.write_entries(H100, b)
    tuning.write_entries("NVIDIA B200", a)
    table = json.loads(path.read_text())
    assert set(table) == {H100, "NVIDIA B200"} and set(table[H100]) == {"gmm", "tgmm"}
    assert tuning.config_for("gmm", jnp.bfloat16, 1500, 2000, H100) == (128, 64, 256, 8, 3, 0, 1)
    assert tuning.config_for("tgmm", jnp.float32, 200, 1000, H100) == (64, 64, 128, 4, 2, 0, 1)
    # no entry for the bucket, the dtype or the device: the defaults
    assert tuning.config_for("gmm", jnp.bfloat16, 64, 64, H100) == tuning.DEFAULTS[
        ("gmm", "bfloat16")]
    assert tuning.config_for("gmm", jnp.float16, 1500, 2000, H100) == tuning.DEFAULTS[
        ("gmm", "float16")]
    assert tuning.config_for("gmm", jnp.bfloat16, 1500, 2000, "NVIDIA A100") == (
        tuning.DEFAULTS[("gmm", "bfloat16")])
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a kernel table"):
        tuning.config_for("gmm", jnp.bfloat16, 8, 8, H100)


def test_each_ops_entries_live_with_it_one_file_per_device(tmp_path, monkeypatch):
    monkeypatch.delenv("MOEJAX_KERNEL_TABLE", raising=False)
    monkeypatch.setattr(tuning, "_KERNELS_DIR", tmp_path)
    cfg = {**tuning.TritonConfig(128, 64, 256, 8, 3)._asdict(), "ms": 1.5}
    dec = {**tuning.TritonConfig(256, 64, 256, 4, 4, 2, 2)._asdict(), "ms": 0.1}
    written = tuning.write_entries(H100, {"gmm": {"bfloat16": {"k2048_n2048": cfg}},
                                          "decode_mgpu": {"bfloat16": {"k2048_n256": dec}}})
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == [
        "chunk_union/tuned/NVIDIA_H100_80GB_HBM3.json", "grouped/tuned/NVIDIA_H100_80GB_HBM3.json"]
    doc = json.loads((tmp_path / "grouped/tuned/NVIDIA_H100_80GB_HBM3.json").read_text())
    assert doc["device_kind"] == H100 and set(doc["kernels"]) == {"gmm"}
    assert tuning.config_for("gmm", jnp.bfloat16, 1500, 2000, H100) == (128, 64, 256, 8, 3, 0, 1)
    assert tuning.config_for("decode_mgpu", jnp.bfloat16, 2048, 256, H100) == (
        256, 64, 256, 4, 4, 2, 2)
    # a kernel filed under another op's tuned/ is refused, naming where it belongs
    (tmp_path / "chunk_union/tuned/x.json").write_text(json.dumps(
        {"device_kind": "NVIDIA B200", "kernels": {"gmm": {"bfloat16": {"k8_n8": cfg}}}}))
    with pytest.raises(ValueError, match=r"\['gmm'\] belong in their own op"):
        tuning.read_table()


def test_the_shipped_tables_are_each_ops_own():
    files = tuning.table_files()
    assert files and all(p.parent.name == "tuned" for p in files)
    table = tuning.read_table()  # every entry checked, each in its op's file
    assert "decode_mgpu" in table["NVIDIA H200"]


def _triton_launches(dtype, k=256, n=384):
    f = jax.jit(lambda x, w, g: gmm(x, w, g))
    S = jax.ShapeDtypeStruct
    with lowering_target("cuda"):
        text = je.export(f, platforms=("cuda",),
                         disabled_checks=[je.DisabledSafetyCheck.custom_call(TRITON)])(
            S((512, k), dtype), S((8, k, n), dtype), S((8,), jnp.int32)).mlir_module()
    return [(int(gx), int(w)) for gx, w in re.findall(
        r"grid_x = (\d+) : i32.*?num_warps = (\d+) : i32", text)]


def test_a_lowering_reads_its_devices_entry_else_the_defaults(tmp_path, monkeypatch):
    (tmp_path / "none.json").write_text("{}")  # an empty table: the defaults everywhere
    monkeypatch.setenv("MOEJAX_KERNEL_TABLE", str(tmp_path / "none.json"))
    # the launch: (512 / tm + 8 groups) row-tile visits x 384 / tn column blocks
    # defaults: bf16 128 x 64 x 128 with 8 warps -> (4 + 8) x 3
    assert _triton_launches(jnp.bfloat16) == [(12 * 3, 8)]
    assert _triton_launches(jnp.float32) == [(16 * 6, 4)]  # f32: 64 x 32 x 64, 4 warps
    table = tmp_path / "tuned.json"
    monkeypatch.setenv("MOEJAX_KERNEL_TABLE", str(table))
    tuning.write_entries(H100, {"gmm": {"bfloat16": {tuning.bucket(256, 384): {
        **tuning.TritonConfig(64, 32, 32, 4, 2)._asdict(), "ms": 1.0}}}})
    assert _triton_launches(jnp.bfloat16) == [(16 * 12, 4)]  # 64-row tiles, 32 columns
    with tuning.forced(tuning.TritonConfig(128, 64, 128, 8, 3)):
        assert _triton_launches(jnp.bfloat16) == [(12 * 3, 8)]


def test_autotune_refuses_a_machine_without_a_gpu_before_writing(tmp_path, capsys):
    assert autotune.cli([f"out={tmp_path / 'run'}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: autotune times GPU kernels; this machine lowers for cpu")
    assert not (tmp_path / "run").exists()


def _cuda_text(x, a, wu, wd):
    """The decode kernel's ``cuda`` export (Mosaic GPU's lowering checks the blocks' layouts,
    which the interpreter does not)."""
    with lowering_target("cuda"):
        return je.export(jax.jit(lambda *z: chunk_union_decode_gpu(*z, activation="relu")),
                         platforms=("cuda",))(x, a, a > 0, wu, wd).mlir_module()


def test_the_mosaic_gpu_kernels_take_their_configuration():
    """Blocks other than the defaults (a forced configuration, as a tuned one is read): the
    decode kernel with 128-wide F and 256-wide D blocks, and with one 256-column D step (which
    lowers for cuda), and the pair product with 64-column output blocks and 2 stages still
    equal their oracles; a shape off the blocks is not taken; float32 has no configuration."""
    k = jax.random.split(jax.random.key(0), 4)
    bf = jnp.bfloat16
    x = jax.random.normal(k[0], (3, 256)).astype(bf)
    a = jnp.where(jax.random.uniform(k[1], (3, 4)) < 0.5, 1.0, 0.0)
    wu = (jax.random.normal(k[2], (4, 256, 128)) / 16).astype(bf)
    wd = (jax.random.normal(k[3], (4, 128, 256)) / 11).astype(bf)
    f32 = [z.astype(jnp.float32) for z in (x, wu, wd)]
    want = dense_experts(f32[0], a, f32[1], f32[2], None, "relu")
    with tuning.forced(tuning.TritonConfig(64, 128, 256, 4, 2)):
        assert supports(x, wu) and not supports(x[:, :128], wu[:, :128])
        y = chunk_union_decode_gpu(x, a, a > 0, wu, wd, activation="relu", interpret=True)
    np.testing.assert_allclose(np.asarray(y, np.float32), want,
                               atol=2 * 2.0 ** -8 * float(jnp.abs(want).max()))
    with tuning.forced(tuning.TritonConfig(256, 64, 128, 4, 3)):  # one 256-column D step
        y = chunk_union_decode_gpu(x, a, a > 0, wu, wd, activation="relu", interpret=True)
        assert "mosaic_gpu_v2" in _cuda_text(x, a, wu, wd)
    np.testing.assert_allclose(np.asarray(y, np.float32), want,
                               atol=2 * 2.0 ** -8 * float(jnp.abs(want).max()))
    ids = jnp.array([[0, 2], [3, 1]], jnp.int32)
    pairs = union_pairs(ids, jnp.array([2, 1], jnp.int32), 4)
    xs = x[None, :2].repeat(2, 0)  # both tiles the same rows
    with tuning.forced(tuning.TritonConfig(64, 64, 64, 4, 2)):
        up = pair_up(xs, wu, pairs, interpret=GPU_INTERPRET)
    for p, (_, e, v) in enumerate(zip(pairs.src, pairs.expert, pairs.valid)):
        ref = (f32[0][:2] @ f32[1][int(e)]) * int(v)
        np.testing.assert_allclose(np.asarray(up[p], np.float32), ref,
                                   atol=2 * 2.0 ** -8 * float(np.abs(ref).max() + 1e-9))
    with pytest.raises(ValueError, match="takes bfloat16 / float16, not float32"):
        tuning.config_for("decode_mgpu", jnp.float32, 256, 128)


@pytest.mark.slow
def test_autotune_times_the_decode_kernel_on_quarter_unions_and_a_full_one():
    """One launch configuration serves every union size: the decode case calls the kernel on
    four unions of a quarter of the experts and on one of all of them (weights of their own),
    so each size counts alike against its floor; every call is checked against the float32
    oracle, which the interpreted kernel equals."""
    fn, args, oracle = autotune._call("decode_mgpu", autotune.AutotuneConfig(groups=8),
                                      jnp.bfloat16, 256, 128, jax.random.key(0))
    x, *unions = args
    assert x.shape == (TUNED_ROWS, 256) and len(unions) == 15
    a_s, wu_s, wd_s = unions[0::3], unions[1::3], unions[2::3]
    assert {a.shape for a in a_s} == {(TUNED_ROWS, 8)}
    assert {w.shape for w in wu_s} == {(8, 256, 128)} and {w.shape for w in wd_s} == {
        (8, 128, 256)}
    assert [int(jnp.sum(jnp.any(a > 0, axis=0))) for a in a_s] == [2, 2, 2, 2, 8]
    assert len({np.asarray(w).tobytes() for w in wu_s}) == 5  # weights of its own
    want = np.asarray(oracle(*args))
    assert want.shape == (5, TUNED_ROWS, 256)
    for a, wu, wd, want_nD in zip(a_s, wu_s, wd_s, want):
        tuning.check_close(chunk_union_decode_gpu(x, a, a > 0, wu, wd, activation="relu",
                                                  interpret=True), want_nD, "bfloat16")
    with lowering_target("cuda"):
        text = je.export(fn, platforms=("cuda",))(*args).mlir_module()
    assert re.findall(r"custom_call @([\w$.]+)", text) == ["mosaic_gpu_v2"] * 5
    assert "moejax_chunk_union_decode" in text
    # each launch waits for the one before it (a barrier on its output), so a GPU cannot run
    # them side by side and time the five as less than the calls
    starts = [m.start() for m in re.finditer(r"custom_call @mosaic_gpu_v2", text)]
    for first, second in zip(starts, starts[1:]):
        assert first < text.index("optimization_barrier", first) < second


def test_autotune_tunes_each_kernel_over_its_space_for_the_dtypes_it_takes(monkeypatch):
    seen, shapes = [], set()

    def time_fn(kernel, dtype, k, n, c):
        seen.append((kernel, dtype, c))
        shapes.add((kernel == "decode_mgpu", k, n))
        return 1e-3

    cfg = autotune.AutotuneConfig(dtypes=("bfloat16", "float32"), shapes=((256, 128),))
    kept = []
    got = autotune.tune_all(cfg, time_fn, keep=kept.append).entries
    assert set(got) == {"gmm", "tgmm"}  # no Hopper GPU here: the Mosaic GPU kernels wait
    assert [set(k) for k in kept] == [{"gmm"}, {"tgmm"}]  # handed over kernel by kernel
    monkeypatch.setattr(autotune, "hopper_target", lambda: True)
    seen.clear()
    got = autotune.tune_all(cfg, time_fn).entries
    assert set(got) == set(tuning.KERNELS) and set(got["decode_mgpu"]) == {"bfloat16"}
    assert {c for kn, _, c in seen if kn == "pairs_mgpu"} == set(tuning.SPACES["pairs_mgpu"])
    assert shapes == {(False, 256, 128), (True, 2048, 256)}  # the decode kernel's own shapes
    assert {(kn, dt) for kn, dt, _ in seen} == {
        ("gmm", "bfloat16"), ("gmm", "float32"), ("tgmm", "bfloat16"), ("tgmm", "float32"),
        ("gmm_mgpu", "bfloat16"), ("tgmm_mgpu", "bfloat16"),
        ("pairs_mgpu", "bfloat16"), ("decode_mgpu", "bfloat16")}
