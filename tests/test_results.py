"""Results layer and experiment runner: files written, CSV full precision, CLI fails fast."""

import csv
from typing import Literal

import numpy as np
import pytest

from moejax.config import Config, ConfigError, config
from moejax.harness import results
from moejax.harness.cli import parse_cli
from moejax.harness.experiment import run_experiment
from moejax.harness.plots import line_figure
from moejax.harness.results import RunDir
from moejax.harness.tables import (
    markdown_table,
    mean_std,
    merge_seed_tables,
    nan_in_some_runs,
    seed_summary,
)
from moejax.train.hparams import TrainConfig
from moejax.train.run_lock import is_held


def test_markdown_table_and_csv(tmp_path):
    run = RunDir.create(tmp_path / "r", name="r")
    rows = [{"p": 0.9, "loss": 1.23456789}, {"p": 0.99, "loss": 2.0, "extra": "x"},
            {"p": np.float64(0.5), "loss": np.float32(0.25)}]
    md = run.table("t", rows, title="T")
    assert md.splitlines()[0] == "| p | loss | extra |"
    assert "| 0.9 | 1.235 |  |" in md
    with open(tmp_path / "r" / "t.csv") as f:
        back = list(csv.DictReader(f))
    assert float(back[0]["loss"]) == 1.23456789  # CSV keeps full precision
    assert back[1]["extra"] == "x"
    assert (back[2]["p"], back[2]["loss"]) == ("0.5", "0.25")  # numpy scalars as numbers
    run.heatmap("sim", np.eye(3), xlabel="i", ylabel="j")
    assert (tmp_path / "r" / "sim.png").read_bytes()[:4] == b"\x89PNG"
    run.line_plot("curve", {"a": ([0, 1, 2], [3.0, 2.0, 1.0])}, xlabel="x", ylabel="y")
    png = (tmp_path / "r" / "curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    summary = run.finish("headline!").read_text()
    assert (
        "headline!" in summary
        and "![curve](curve.png)" in summary
        and "| 0.99 | 2 | x |" in summary
    )
    assert not [p for p in (tmp_path / "r").iterdir() if p.name.endswith(".tmp")]


def test_a_line_runs_through_its_points_in_the_order_of_x():
    """A sweep given in any order (``n_experts=(32,8,16)``) is drawn as one curve, each y
    still beside its own x; the reference lines are drawn and labelled, and a log axis reads
    in plain numbers."""
    fig = line_figure("g", {"TLS": ((32, 8, 16), (0.7, 0.8, 0.9)), "one": ([2], [1.0])},
                      xlabel="N", ylabel="s", logx=True, vlines={"paper's N=40": 40},
                      hlines={"level 0.8": 0.8})
    ax = fig.axes[0]
    tls, one, vline, hline = ax.lines
    assert list(tls.get_xdata()) == [8, 16, 32] and list(tls.get_ydata()) == [0.8, 0.9, 0.7]
    assert list(one.get_xdata()) == [2]
    assert list(vline.get_xdata()) == [40, 40] and list(hline.get_ydata()) == [0.8, 0.8]
    assert {t.get_text() for t in ax.texts} == {"paper's N=40", "level 0.8"}
    fig.canvas.draw()  # the log axis labelled in plain numbers, not "2 x 10^1"
    labels = {t.get_text() for t in ax.get_xticklabels(which="both")} - {""}
    assert {"10", "20"} <= labels and not [t for t in labels if "times" in t], labels
    with pytest.raises(ValueError):  # an x without its y is refused, not cut
        line_figure("g", {"a": ([1, 2], [1.0])}, xlabel="x", ylabel="y")


def test_markdown_table_column_order():
    assert markdown_table([{"b": 1, "a": 2}], columns=["a", "b"]).splitlines()[2] == "| 2 | 1 |"


@config
class _ExpCfg(Config):
    steps: int = 3
    mode: Literal["a", "b"] = "a"


def _make(preset):
    return _ExpCfg(steps=3 if preset == "quick" else 100)


def test_seed_summary_mean_std_per_group():
    rng = np.random.default_rng(0)
    rows = []
    truth = {}
    for model in ("b", "a"):
        vals = rng.normal(size=4)
        truth[model] = vals
        for seed, v in enumerate(vals):
            rows.append({"model": model, "size": "s", "seed": seed, "ppl": v, "other": 1})
    rows.append({"model": "c", "size": "s", "seed": 0, "ppl": float("nan")})
    rows.append({"model": "c", "size": "s", "seed": 1, "ppl": 2.5})
    out = seed_summary(rows, ["model", "size"], ["ppl"])
    assert [r["model"] for r in out] == ["b", "a", "c"]  # first-seen order
    for r in out[:2]:
        assert r["n_seeds"] == 4 and "other" not in r and "seed" not in r
        np.testing.assert_allclose(r["ppl"], truth[r["model"]].mean())
        np.testing.assert_allclose(r["ppl std"], truth[r["model"]].std(ddof=1))
    assert out[2]["n_seeds"] == 2 and out[2]["ppl"] == 2.5 and out[2]["ppl std"] == 0.0
    rows.append({"model": "d", "size": "s", "seed": 0, "ppl": float("nan")})  # unmeasured
    rows.append({"model": "d", "size": "s", "seed": 1, "ppl": float("nan")})
    d = seed_summary(rows, ["model", "size"], ["ppl"])[3]
    assert d["n_seeds"] == 2 and np.isnan(d["ppl"]) and np.isnan(d["ppl std"])


def test_cli_presets_and_fail_fast(tmp_path):
    cfg, out = parse_cli("e", _make, ["preset=full", "mode=b", f"out={tmp_path}"])
    assert cfg == _ExpCfg(steps=100, mode="b") and out == tmp_path
    calls = []
    with pytest.raises(ConfigError, match="allowed keys: steps, mode"):
        run_experiment("e", _make, lambda c, r: calls.append(c), ["stepz=3"], out=tmp_path / "x")
    with pytest.raises(ConfigError, match="allowed values"):
        parse_cli("e", _make, ["preset=medium"])
    assert calls == [] and not (tmp_path / "x").exists()  # nothing ran, nothing written


def test_the_full_preset_on_a_cpu_says_it_is_sized_for_an_accelerator(tmp_path, capsys):
    def run(cfg, rundir):
        return {"headline": "ran"}

    run_experiment("e", _make, run, ["preset=full"], out=tmp_path / "f")
    assert "[e] preset=full runs on this CPU: it is sized for a GPU or TPU" in \
        capsys.readouterr().err
    for i, argv in enumerate(([], ["preset=full", "smoke=true"])):  # the CPU's; a smoke run
        run_experiment("e", _make, run, argv, out=tmp_path / str(i))
        assert "sized for a GPU" not in capsys.readouterr().err


def test_run_experiment_writes_config_and_summary(tmp_path):
    def run(cfg, rundir):
        rundir.table("t", [{"steps": cfg.steps}])
        return {"headline": f"ran {cfg.steps} steps", "value": 1}

    summary, rundir = run_experiment("e", _make, run, ["steps=7"], out=tmp_path / "e")
    assert summary["value"] == 1 and "wall_s" in summary
    assert '"steps": 7' in (tmp_path / "e" / "config.json").read_text()
    assert "ran 7 steps" in (tmp_path / "e" / "summary.md").read_text()


@config
class _SeedCfg(Config):
    seed: int = 0
    n: int = 2


@pytest.mark.slow
def test_repeat_runs_seeds_and_merges_tables(tmp_path):
    """repeat=3 offsets the declared seed key by 0, 1, 2, runs each into seed_<i>/, and the
    top-level table holds the mean and sample std of what varies, keys kept as they are."""
    seen = []

    def run(cfg, rundir):
        seen.append(cfg.seed)
        rng = np.random.default_rng(cfg.seed)
        rundir.table("acc", [{"method": m, "p": 0.9, "acc": float(rng.random())}
                             for m in ("dare", "wanda")])
        rundir.table("ragged", [{"i": i} for i in range(cfg.seed + 1)])  # not mergeable
        rundir.line_plot("curve", {"a": ([0, 1], [0, cfg.seed])}, xlabel="x", ylabel="y")
        return {"headline": f"seed {cfg.seed}", "acc": float(cfg.seed), "tag": "x",
                "best_n": cfg.seed}

    make = lambda preset: _SeedCfg(seed=5)  # noqa: E731
    summary, top = run_experiment("s", make, run, ["repeat=3"], out=tmp_path / "s",
                                  seed_keys=("seed",))
    assert seen == [5, 6, 7]
    rows = list(csv.DictReader(open(tmp_path / "s" / "acc.csv")))
    for j, m in enumerate(("dare", "wanda")):
        vals = [np.random.default_rng(s).random(2)[j] for s in (5, 6, 7)]
        assert rows[j]["method"] == m and float(rows[j]["p"]) == 0.9
        np.testing.assert_allclose(float(rows[j]["acc"]), np.mean(vals))
        np.testing.assert_allclose(float(rows[j]["acc std"]), np.std(vals, ddof=1))
    assert not (tmp_path / "s" / "ragged.csv").exists()
    text = (tmp_path / "s" / "summary.md").read_text()
    assert "`ragged` differs in shape" in text and "seed_0/curve.png" in text
    assert all(f"seed run {i} ([summary](seed_{i}/summary.md)): seed {5 + i}" in text
               for i in range(3))
    assert summary["acc"] == 6.0 and summary["tag"] == ["x", "x", "x"]
    assert summary["best_n"] == [5, 6, 7]  # an int is a choice: listed, not averaged
    assert all((tmp_path / "s" / f"seed_{i}" / "acc.csv").exists() for i in range(3))
    # the quick preset's default repeat; the full preset runs once; bad values fail first
    seen.clear()
    run_experiment("s", make, run, [], out=tmp_path / "q", seed_keys=("seed",), quick_repeat=2)
    assert seen == [5, 6]
    seen.clear()
    run_experiment("s", make, run, ["preset=full"], out=tmp_path / "f", seed_keys=("seed",),
                   quick_repeat=2)
    assert seen == [5] and (tmp_path / "f" / "acc.csv").exists()
    for argv, keys, match in ((["repeat=0"], ("seed",), "repeat"),
                              (["repeat=2"], (), "seed_keys"),
                              (["repeat=2"], ("sed",), "sed")):
        with pytest.raises(ConfigError, match=match):
            run_experiment("s", make, run, argv, out=tmp_path / "bad", seed_keys=keys)
    assert not (tmp_path / "bad").exists()


def test_merge_seed_tables_rules():
    a = [{"m": "x", "v": 1.0, "w": float("nan"), "k": 3.0, "v std": 0.5}]
    b = [{"m": "y", "v": 3.0, "w": float("nan"), "k": 3.0, "v std": 1.5}]
    (r,) = merge_seed_tables([a, b])
    assert r["m"] == "x / y" and r["v"] == 2.0 and r["k"] == 3.0 and "k std" not in r
    # a spread within each run: averaged; the spread of the runs' means gets its own name
    assert r["v std"] == 1.0 and "v std std" not in r
    assert r["v std over runs"] == np.std([1.0, 3.0], ddof=1)
    assert np.isnan(r["w"]) and "w std" not in r  # NaN in every run: not measured, no spread
    assert merge_seed_tables([a, a + a]) is None
    assert merge_seed_tables([a, [{"m": "x", "v": 1.0}]]) is None
    (r,) = merge_seed_tables([[{"v": 1.0}], [{"v": 3.0}]])
    np.testing.assert_allclose(r["v std"], np.sqrt(2.0))
    # a column that varies on one row only: its spread column is 0.0 on the other rows
    rows = merge_seed_tables([[{"v": 1.0, "v std": 0.1}, {"v": 5.0, "v std": 0.1}],
                              [{"v": 3.0, "v std": 0.1}, {"v": 5.0, "v std": 0.1}]])
    assert rows[1]["v std over runs"] == 0.0 and rows[0]["v std over runs"] > 0
    # a spread named with an underscore (rouge_l_std) is a spread too: its mean, no std of it
    (r,) = merge_seed_tables([[{"acc_std": 0.2}], [{"acc_std": 0.4}]])
    assert r == {"acc_std": pytest.approx(0.3)}


def test_mean_std_is_the_sample_statistics_of_the_values_that_are_numbers():
    rng = np.random.default_rng(0)
    for _ in range(200):  # random lengths, scales and NaN positions
        x = rng.normal(rng.uniform(-5, 5), rng.uniform(0.01, 10), size=rng.integers(1, 9))
        x[rng.random(len(x)) < 0.3] = np.nan
        kept = x[~np.isnan(x)]
        mean, sd = mean_std(list(x))
        if len(kept) == 0:
            assert np.isnan(mean) and np.isnan(sd)  # nothing measured: no spread either
            continue
        assert mean == pytest.approx(kept.mean(), rel=1e-12, abs=1e-12)
        assert sd == (pytest.approx(kept.std(ddof=1), rel=1e-12, abs=1e-12) if len(kept) > 1
                      else 0.0)
        assert mean_std(list(x + 3.0))[1] == pytest.approx(sd, rel=1e-9, abs=1e-9)  # shift


def test_a_table_written_again_is_replaced_not_listed_twice(tmp_path):
    run = RunDir.create(tmp_path / "r", name="r")
    run.table("first", [{"a": 1}], title="First")
    run.table("rows", [{"n": 1}], title="Rows")
    run.table("rows", [{"n": 1}, {"n": 2}], title="Rows")
    assert [t[1] for t in run.tables] == ["first.md", "rows.md"]
    assert (tmp_path / "r" / "rows.csv").read_text().splitlines() == ["n", "1", "2"]
    summary = run.finish("h").read_text()
    assert summary.count("### Rows") + summary.count("#### Rows") == 1


def test_cells_a_run_could_not_measure_are_named_beside_the_merged_mean():
    nan = float("nan")
    runs = [[{"m": "a", "acc": 0.5, "loss": nan}, {"m": "b", "acc": nan, "loss": nan}],
            [{"m": "a", "acc": 0.7, "loss": nan}, {"m": "b", "acc": 0.9, "loss": nan}],
            [{"m": "a", "acc": nan, "loss": nan}, {"m": "b", "acc": 0.8, "loss": nan}]]
    merged = merge_seed_tables(runs)
    assert merged[0]["acc"] == pytest.approx(0.6) and merged[1]["acc"] == pytest.approx(0.85)
    # NaN in every run is a column no run measured: not a partial average, so not listed
    assert nan_in_some_runs(runs) == ["row 0, acc: NaN in runs [2]", "row 1, acc: NaN in runs [0]"]
    assert nan_in_some_runs([[{"m": "a", "acc": 0.5}], [{"m": "a", "acc": 0.6}]]) == []


def test_a_merged_run_names_what_a_seed_run_could_not_measure(tmp_path):
    def run(cfg, rundir):
        acc = float("nan") if cfg.seed == 6 else 0.5
        rundir.table("acc", [{"method": "dare", "acc": acc}])
        return {"headline": f"seed {cfg.seed}", "acc": acc}

    run_experiment("s", lambda preset: _SeedCfg(seed=5), run, ["repeat=2"],
                   out=tmp_path / "s", seed_keys=("seed",))
    text = (tmp_path / "s" / "summary.md").read_text()
    assert "Table `acc` averages some cells over fewer runs" in text
    assert "row 0, acc: NaN in runs [1]" in text
    assert "acc 0.5 +/- 0 (1 of 2 runs measured it)" in text


def test_a_run_directory_whose_config_cannot_be_written_is_not_left_locked(tmp_path,
                                                                          monkeypatch):
    import errno

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(results, "atomic_write_text", full)
    with pytest.raises(OSError, match="No space left"):
        RunDir.create(tmp_path / "r", TrainConfig(), lock=True)
    assert not is_held(tmp_path / "r")
    monkeypatch.undo()
    RunDir.create(tmp_path / "r", TrainConfig(), lock=True).close()  # at once, same process
