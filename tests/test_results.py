"""Results layer and experiment runner: files written, CSV full precision, CLI fails fast."""

import csv
from typing import Literal

import numpy as np
import pytest

from moejax.config import Config, ConfigError, config
from moejax.experiment import parse_cli, run_experiment
from moejax.results import RunDir, markdown_table


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


def test_markdown_table_column_order():
    assert markdown_table([{"b": 1, "a": 2}], columns=["a", "b"]).splitlines()[2] == "| 2 | 1 |"


@config
class _ExpCfg(Config):
    steps: int = 3
    mode: Literal["a", "b"] = "a"


def _make(preset):
    return _ExpCfg(steps=3 if preset == "quick" else 100)


def test_cli_presets_and_fail_fast(tmp_path):
    cfg, out = parse_cli("e", _make, ["preset=full", "mode=b", f"out={tmp_path}"])
    assert cfg == _ExpCfg(steps=100, mode="b") and out == tmp_path
    calls = []
    with pytest.raises(ConfigError, match="allowed keys: steps, mode"):
        run_experiment("e", _make, lambda c, r: calls.append(c), ["stepz=3"], out=tmp_path / "x")
    with pytest.raises(ConfigError, match="allowed values"):
        parse_cli("e", _make, ["preset=medium"])
    assert calls == [] and not (tmp_path / "x").exists()  # nothing ran, nothing written


def test_run_experiment_writes_config_and_summary(tmp_path):
    def run(cfg, rundir):
        rundir.table("t", [{"steps": cfg.steps}])
        return {"headline": f"ran {cfg.steps} steps", "value": 1}

    summary, rundir = run_experiment("e", _make, run, ["steps=7"], out=tmp_path / "e")
    assert summary["value"] == 1 and "wall_s" in summary
    assert '"steps": 7' in (tmp_path / "e" / "config.json").read_text()
    assert "ran 7 steps" in (tmp_path / "e" / "summary.md").read_text()
