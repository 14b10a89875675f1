"""moejax.bench.resume: measurements kept under their basis read back as written, and any
file measured under another basis, damaged or hand-edited is set aside, never reused."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moejax
from moejax.bench.resume import (
    MeasurementStore,
    device_basis,
    jsonable,
    source_fingerprint,
    weights_fingerprint,
)

BASIS = {"config": {"n": 4, "dims": (2, 3)}, "device": {"platform": "cpu"}}


def test_measurements_read_back_as_written_under_the_same_basis(tmp_path):
    path = tmp_path / "m.json"
    store = MeasurementStore(path, BASIS)
    assert store.entries == {} and store.dropped == ""
    value = {"row": {"tokens_per_s": np.float32(12.5), "same": np.bool_(True), "n": 3,
                     "draft": "", "nan": float("nan")},
             "tokens": jnp.arange(6).reshape(2, 3), "kernels": []}
    kept = store.put("AR dense", value)
    assert kept["tokens"] == [[0, 1, 2], [3, 4, 5]] and kept["row"]["tokens_per_s"] == 12.5
    again = MeasurementStore(path, BASIS)
    assert again.dropped == "" and "AR dense" in again and "spec" not in again
    got = again.get("AR dense")
    assert got["row"]["same"] is True and got["row"]["n"] == 3 and np.isnan(got["row"]["nan"])
    assert got["tokens"] == kept["tokens"]


@pytest.mark.parametrize("damage, why", [
    (lambda p: p.write_text('{"format": 1, "entries": {'), "cannot be read back"),
    (lambda p: p.write_text(p.read_text().replace("12.5", "99.0")), "not a measurement store"),
    (lambda p: p.write_text(json.dumps([1, 2])), "not a measurement store"),
])
def test_a_damaged_or_edited_file_is_set_aside(tmp_path, damage, why):
    path = tmp_path / "m.json"
    MeasurementStore(path, BASIS).put("a", {"v": 12.5})
    damage(path)
    foreign = path.read_bytes()
    store = MeasurementStore(path, BASIS)
    assert store.entries == {} and why in store.dropped and str(path) in store.dropped
    aside = tmp_path / "m.json.foreign"
    assert aside.read_bytes() == foreign and "m.json.foreign" in store.dropped  # kept aside
    store.put("b", 1)  # measuring again writes a new store, the foreign file untouched
    assert MeasurementStore(path, BASIS).entries == {"b": 1} and aside.read_bytes() == foreign


def test_another_config_device_code_or_weights_is_measured_again(tmp_path):
    path = tmp_path / "m.json"
    MeasurementStore(path, BASIS).put("a", 1)
    for other in ({**BASIS, "config": {"n": 5, "dims": (2, 3)}},
                  {**BASIS, "device": {"platform": "gpu"}}, {**BASIS, "weights": "0a1b2c3d"},
                  {**BASIS, "code": "1f2e3d4c"}):
        store = MeasurementStore(path, other)
        assert store.entries == {} and "another config, device, code or weights" in store.dropped
    assert MeasurementStore(path, BASIS).entries == {"a": 1}  # the file was not rewritten


def test_the_device_basis_names_the_flags_and_kernel_table_a_lowering_reads(tmp_path,
                                                                          monkeypatch):
    base = device_basis()
    assert base["platform"] == "cpu" and base["jax"]
    monkeypatch.setenv("XLA_FLAGS", base["xla_flags"] + " --xla_gpu_enable_command_buffer=")
    flagged = device_basis()
    assert flagged["xla_flags"] != base["xla_flags"]
    table = tmp_path / "table.json"
    monkeypatch.setenv("MOEJAX_KERNEL_TABLE", str(table))
    assert device_basis()["kernel_table"] == "none"
    table.write_text("{}")
    empty = device_basis()["kernel_table"]
    table.write_text('{"NVIDIA H200": {}}')
    assert device_basis()["kernel_table"] not in {"none", empty}


def test_the_basis_changes_with_the_source_a_time_was_measured_with(tmp_path, monkeypatch):
    """moejax's source is in the device basis, and a package's fingerprint sees every file
    under it (by its path in the package), a module's its own file."""
    assert device_basis()["moejax"] == source_fingerprint(moejax)
    pkg = tmp_path / "bench_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "timing.py").write_text("N = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "decode.py").write_text("M = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import bench_pkg
    import bench_pkg.timing

    whole, module = source_fingerprint(bench_pkg), source_fingerprint(bench_pkg.timing)
    assert whole != module and source_fingerprint(bench_pkg) == whole
    (pkg / "sub" / "decode.py").write_text("M = 3\n")  # a file below the package's own
    assert source_fingerprint(bench_pkg) != whole
    assert source_fingerprint(bench_pkg.timing) == module
    (pkg / "sub" / "decode.py").rename(pkg / "sub" / "decode2.py")  # the same bytes, renamed
    renamed = source_fingerprint(bench_pkg)
    (pkg / "sub" / "decode2.py").rename(pkg / "sub" / "decode.py")
    assert renamed != source_fingerprint(bench_pkg)


def test_weights_fingerprint_sees_every_weight_and_its_dtype():
    lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    same = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    fp = weights_fingerprint(lin)
    assert fp == weights_fingerprint(same)
    same.bias[...] = same.bias[...].at[1].add(1e-3)
    assert weights_fingerprint(same) != fp
    assert weights_fingerprint({"w": jnp.ones(3, jnp.bfloat16)}) != weights_fingerprint(
        {"w": jnp.ones(3, jnp.float16)})


def test_only_json_values_are_kept():
    assert jsonable({"a": (1, np.int64(2)), 3: None}) == {"a": [1, 2], "3": None}
    with pytest.raises(TypeError, match="set"):
        jsonable({"a": {1, 2}})
