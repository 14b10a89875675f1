"""bench_speculative's tables: the decode table's ratios, derived from what was measured (one rule
for a run and for a results document carrying an older run's table), its title, its plots and
the notes on the best decodings."""

from __future__ import annotations

from moejax.harness.results import RunDir

__all__ = ["RATIOS", "ratio_columns", "derived_tables", "DECODE_TITLE", "decode_table",
           "best_notes"]


RATIOS = ("speedup_vs_AR_token_sparse", "sparse_gain", "gain_bound")


def ratio_columns(rows: list[dict]) -> list[dict]:
    """The decode table's ``rows`` with its ratios (:data:`RATIOS`) computed from the measured
    columns, per target: tokens/s over its AR token-sparse decoding's; ``sparse_gain``, tokens/s
    over the dense path of the same decoding (same draft and draft length: only the first
    draft also verifies dense, and another draft's acceptance is not the sparse path's gain),
    absent where that decoding was not timed dense; ``gain_bound`` = 1 / ffn_fraction_bound
    (what the sparse path would gain if the experts were all the time). Reads rows as a run
    writes them or as :func:`moejax.harness.tables.read_csv_rows` reads them back."""
    out = [{k: v for k, v in r.items() if k not in RATIOS} for r in rows]
    for r in out:
        mine = [x for x in out if x["model"] == r["model"]]
        ar_sparse = [x for x in mine if x["mode"] == "AR token-sparse"]
        if ar_sparse:
            r["speedup_vs_AR_token_sparse"] = (float(r["tokens_per_s"])
                                               / float(ar_sparse[0]["tokens_per_s"]))
        if float(r["ffn_fraction_bound"]) < 1:  # the sparse path against the dense one
            dense = [x for x in mine if x["draft_len"] == r["draft_len"]
                     and x["draft"] == r["draft"] and x["mode"] == (
                         "AR dense" if r["mode"].startswith("AR") else "spec dense")]
            if dense:
                r["sparse_gain"] = float(r["tokens_per_s"]) / float(dense[0]["tokens_per_s"])
            r["gain_bound"] = 1 / float(r["ffn_fraction_bound"])
    return out


def derived_tables(tables: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The tables whose columns this benchmark derives from what it measured, derived again
    (:func:`ratio_columns`): a results document recomputes them in a carried section."""
    return {"decode": ratio_columns(tables["decode"])} if tables.get("decode") else {}


DECODE_TITLE = (
    "Batch-1 greedy decoding: tokens/s, acceptance, TLS and CLS of the verified blocks "
    "(ffn_fraction_bound = the share of expert work the sparse path needs: 1 - TLS per token,"
    " 1 - CLS per verified block; expert_path = what the target's BlockFFN layers computed a "
    "token or a verified block with on this device; sparse_gain = tokens/s over the dense "
    "path of the same decoding, same draft and draft length (blank for the drafts verified "
    "chunk-sparse only), gain_bound = the paper's bound 1 / ffn_fraction_bound, "
    "reached only if the experts were all the time; on a GPU or TPU, kernels_per_token and "
    "device_busy from one profiled decode: the device's kernels per generated token and their"
    " time over the wall time)")


def decode_table(run: RunDir, rows: list[dict]) -> None:
    """Every decoding's row, and per target a bar plot against AR dense and 1.5x the faster
    AR decoding (the serving claim's bar)."""
    run.table("decode", rows, title=DECODE_TITLE)
    for name in ("trained", "grown"):
        sel = [r for r in rows if r["model"] == name]
        if not sel:
            continue
        labels = [r["mode"] + (f" {r['draft']} n={r['draft_len']}" if r["draft_len"] else "")
                  for r in sel]
        ar = {r["mode"]: r["tokens_per_s"] for r in sel if not r["draft_len"]}
        run.bar_plot(f"tokens_per_s_{name}", labels, [r["tokens_per_s"] for r in sel],
                     ylabel="tokens / s", title=f"Decode speed, {name} target",
                     hlines={"AR dense": ar["AR dense"],
                             "1.5x the faster AR": 1.5 * max(ar.values())})


def best_notes(run: RunDir, rows: list[dict]) -> dict:
    """Per target and draft, the best speculative + chunk-sparse decoding as a note; the best
    row per target."""
    best = {}
    for name in ("trained", "grown"):
        for dname in dict.fromkeys(r["draft"] for r in rows if r["draft"]):
            sel = [r for r in rows if r["model"] == name and r["draft"] == dname
                   and r["mode"] == "spec chunk-sparse"]
            if not sel:
                continue
            b = max(sel, key=lambda r: r["tokens_per_s"])
            if name not in best or b["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = b
            run.note(f"- {name} ({b['params'] / 1e6:.2f}M params), {dname} draft "
                     f"(argmax agreement {b['agreement']:.3f}): best speculative + "
                     f"chunk-sparse n={b['draft_len']}: {b['tokens_per_s']:.1f} tokens/s, "
                     f"{b['speedup_vs_AR_dense']:.2f}x AR dense, "
                     f"{b['speedup_vs_AR_token_sparse']:.2f}x AR token-sparse, mean accepted "
                     f"length {b['mean_accepted_length']:.2f}, CLS_{b['draft_len'] + 1} "
                     f"{b['CLS_block']:.3f}, expert path: {b['expert_path']}")
    return best
