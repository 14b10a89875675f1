"""Smoke test: the decoder DAREx study (byte LM, prose -> code) runs tiny and writes its tables."""

import csv

from moejax.experiment import run_experiment


def test_darex_decoder_tiny(tmp_path):
    from experiments import darex_decoder as mod

    summary, run = run_experiment(
        mod.NAME, mod.make_config, mod.run,
        ["d_model=32", "n_layers=1", "seq_len=16", "batch_size=4", "pretrain_steps=30",
         "finetune_steps=20", "corpus_bytes=60000", "eval_batches=2", "ps=(0.99,)", "q_num=4",
         "methods=(DARE,DAREx-q (q_v),DAREx-q (q_e),DAREx-q (per-layer q_e))"],
        out=tmp_path / "dec",
    )
    rows = list(csv.DictReader(open(run.path / "pruned.csv")))
    assert len(rows) == 2 * 4  # 2 fine-tunings x 4 methods x 1 drop rate
    by = {(r["fine-tuning"], r["method"]): r for r in rows}
    for r in rows:
        assert 0.0 < float(r["test_loss"]) < 10.0
    assert float(by["AdamW", "DARE"]["q"]) == 0.01
    assert float(by["AdamW", "DAREx-q (q_v)"]["q"]) >= 0.01
    assert ".." in by["AdamW", "DAREx-q (per-layer q_e)"]["q"]  # one q per layer: a range
    base = list(csv.DictReader(open(run.path / "finetuned.csv")))
    assert [r["fine-tuning"] for r in base] == ["AdamW", "AdamR-L2"]
    # 30 pre-training steps already beat the uniform byte model (ln 256 = 5.55)
    assert summary["pretrained_loss"] < 5.5
    assert "p=0.99" in (run.path / "pruned_wide.md").read_text()
