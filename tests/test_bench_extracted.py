"""The extracted-MoE benchmark (experiments.extraction.bench) on tiny settings: it checks its
forwards against memory and refuses a batch the test split cannot fill before it records
anything, and times every layout per batch, on the MoEE plans of a substrate too."""

from types import SimpleNamespace

import numpy as np
import pytest

import moejax.train.budget as budget
from experiments.extraction import bench as bench_extracted
from moejax.extract import ClusterConfig
from moejax.extract.pipeline import ExtractConfig
from moejax.harness.experiment import main, run_experiment
from moejax.substrates.classify import ViTSubstrateConfig
from tests.tiny_substrates import tiny_train


def test_bench_extracted_checks_its_forwards_against_memory_before_they_run(tmp_path,
                                                                           monkeypatch, capsys):
    """Each timed forward is compiled and its estimate compared with the device's memory
    before the first call (the host made 10 kB): exit 2 in one line naming the key, no row."""
    monkeypatch.setattr(budget, "available_bytes", lambda device: (10**4, "this host's memory"))
    code = main("bench_extracted", bench_extracted.make_config, bench_extracted.run,
                ["model=none", "d_model=16", "d_hidden=40", "experts=4", "keep=0.5",
                 "batches=(2,5)", "seq_len=3", "repeats=1", f"out={tmp_path / 'b'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and " forward needs about " in err[-1], err[-3:]
    assert "this host's memory is 10.0 kB" in err[-1]
    assert "lower batches (now (2, 5))" in err[-1]
    assert not (tmp_path / "b" / "ffn_time.csv").exists()


def test_bench_extracted_tiny_times_every_layout_per_batch(tmp_path):
    _, run = run_experiment(
        "bench_extracted", bench_extracted.make_config, bench_extracted.run,
        ["model=none", "d_model=16", "d_hidden=40", "experts=4", "keep=0.5", "batches=(2,5)",
         "seq_len=3", "repeats=1"], out=tmp_path / "bench_extracted")
    import csv

    rows = list(csv.DictReader(open(run.path / "ffn_time.csv")))
    assert [(r["tokens"], r["plan"], r["layout"]) for r in rows[:5]] == [
        ("6", "-", "dense"), ("6", "equal", "masked"), ("6", "equal", "compact"),
        ("6", "skewed", "masked"), ("6", "skewed", "compact")]
    assert {r["tokens"] for r in rows} == {"6", "15"}
    eq = next(r for r in rows if r["plan"] == "equal")
    sk = next(r for r in rows if r["plan"] == "skewed")
    assert float(eq["kept_share"]) == pytest.approx(0.5)  # 20 of 40 neurons per expert
    assert float(eq["padded_share"]) == pytest.approx(0.5)
    assert float(sk["padded_share"]) == pytest.approx(30 / 40)  # the largest: 1.5 x 20
    dense = next(r for r in rows if r["layout"] == "dense")
    assert float(dense["weight_mb"]) == pytest.approx(2 * 16 * 40 * 4 / 1e6)
    for r in (r for r in rows if r["plan"] == "equal" and r["layout"] == "compact"):
        used = int(r["experts_used"])
        assert 1 <= used <= 4  # each used expert's own 20 neurons
        assert float(r["weight_mb"]) == pytest.approx(2 * 16 * 20 * used * 4 / 1e6)
    assert "target (0.8x the MAC saving at 6 tokens)" in (run.path / "summary.md").read_text()
    with pytest.raises(Exception, match="batches"):
        bench_extracted.make_config("quick").replace(batches=())
    with pytest.raises(Exception, match="times nothing"):
        bench_extracted.make_config("quick").replace(model="none", synthetic=False)
    with pytest.raises(Exception, match="grouped_cost"):
        bench_extracted.make_config("quick").replace(grouped_cost=0.5)


@pytest.mark.slow
def test_bench_extracted_times_the_moee_plans_of_a_substrate(tiny_recipes, tmp_path):
    """The MoEE part on the tiny ViT: every extracted layer timed in three layouts on each
    batch (compact outputs checked against the masked layout inside the run), exact MAC
    accounting, the serving layout's shared neurons within the kept ones."""
    import csv

    cfg = bench_extracted.make_config("quick").replace(
        model="vit", synthetic=False, substrate_cache=str(tiny_recipes), record_rows=40,
        eval_rows=100, rows=(4,), repeats=1,
        vit=ViTSubstrateConfig(d_model=16, n_layers=2, n_heads=2, d_hidden=32,
                               train=tiny_train(3)),
        extract=ExtractConfig(n_tokens=300, cluster=ClusterConfig(min_cluster_frac=0.02)))
    _, run = run_experiment("bench_extracted", lambda preset: cfg, bench_extracted.run, [],
                            out=tmp_path / "bx")
    ffn = list(csv.DictReader(open(run.path / "moee_ffn.csv")))
    assert {r["tokens"] for r in ffn} == {"68"}  # (1 + 16 patches) x 4 images
    per_layer = [r for r in ffn if r["layer"] != "all"]
    assert per_layer and ffn[-1]["layer"] == "all" and len(ffn) == len(per_layer) + 1
    for r in per_layer:
        kept, active, F = float(r["kept"]), float(r["active"]), float(r["neurons"])
        assert 0 < active <= kept <= F
        # MACs per token: router C D + experts 2 D active, against the dense 2 D F (D = 16)
        want = 1 - (int(r["experts"]) * 16 + 2 * 16 * active) / (2 * 16 * F)
        assert float(r["mac_saved"]) == pytest.approx(want, rel=1e-6)
        assert 0 <= int(r["shared"]) <= kept and int(r["routed"]) <= kept - int(r["shared"])
    total = ffn[-1]
    assert float(total["dense_ms"]) == pytest.approx(sum(float(r["dense_ms"]) for r in per_layer))
    enc = list(csv.DictReader(open(run.path / "moee_encoder.csv")))
    assert [r["model"] for r in enc] == ["dense", "masked", "compact", "serving"]
    assert "MoEE plans (vit, 68 tokens)" in (run.path / "summary.md").read_text()


def test_bench_extracted_refuses_a_batch_the_test_split_cannot_fill_before_recording(
        monkeypatch):
    """A timed batch takes glosses at least the mean length long, cut to it (every token
    real), or images; a ``rows`` the test set cannot fill is refused with the fix, before the
    substrate's FFNs are recorded and clustered."""
    lengths = np.array([2, 5, 4, 6, 3, 4])  # mean 4: four glosses of at least 4 tokens
    mask = np.arange(8)[None, :] < lengths[:, None]
    data = SimpleNamespace(seq_len=float(lengths.mean()), test={
        "inputs": np.arange(48).reshape(6, 8), "mask": mask})
    batch = bench_extracted._timed_batch(data, 3)
    assert batch["inputs"].shape == (3, 4) and batch["mask"].all()
    np.testing.assert_array_equal(batch["inputs"][:, 0], [8, 16, 24])  # rows 1, 2 and 3

    def record(*args, **kwargs):
        raise AssertionError("recorded before the batch sizes were checked")

    monkeypatch.setattr(bench_extracted, "record_ffn", record)
    cfg = bench_extracted.make_config("quick").replace(rows=(4, 5))
    monkeypatch.setattr(type(cfg), "classifier_data", lambda self, *a: data)
    with pytest.raises(ValueError, match="rows=5: only 4 of the 6 test glosses hold 4 tokens; "
                                         "lower rows or raise eval_rows"):
        bench_extracted.moee_plans_part(cfg, run=None)
    images = SimpleNamespace(seq_len=None, test={"inputs": np.zeros((6, 28, 28, 1))})
    assert bench_extracted._timed_batch(images, 6)["inputs"].shape[0] == 6
    with pytest.raises(ValueError, match="rows=7: the test split holds 6 images"):
        bench_extracted._timed_batch(images, 7)  # not a batch of 6 timed as one of 7
