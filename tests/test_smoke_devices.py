"""``python -m experiments.full_smoke preset=quick devices=2`` (``make smoke-devices``): each
study in its own Python with 2 CPU devices, so its training loop's mesh spans both. Here one
study; the sweep over all of them is the make target (too long for the suite)."""

import csv

import pytest

from experiments.full_smoke import main


@pytest.mark.slow
def test_a_study_smokes_on_two_cpu_devices_and_the_table_says_so(tmp_path):
    out = tmp_path / "smoke"
    code = main(["only=lm_demo", "preset=quick", "devices=2", f"out={out}", "timeout=600",
                 "lm_demo.model.n_layers=1"])
    log = (out / "lm_demo.log").read_text()
    assert code == 0, log[-3000:]
    (row,) = list(csv.DictReader((out / "full_smoke.csv").open()))
    assert row["devices"] == "2" and row["result"] == "OK", row
    assert row["depth"] == "model.n_layers=1"
    summary = (out / "summary.md").read_text()
    assert "Quick presets as smoke runs on 2 CPU devices" in summary
    assert "1 of 1 quick presets proven (smoke on 2 CPU devices)" in summary
    # the study's own run: quick preset, smoke, in the child's out directory
    assert "preset=quick" in (out / "lm_demo" / "run.json").read_text()
