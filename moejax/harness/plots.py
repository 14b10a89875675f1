"""The figures of a run directory's plots (:class:`.results.RunDir` saves them): lines,
bars and heatmaps with labelled reference lines, drawn with matplotlib's Agg backend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from moejax.extras import require

__all__ = ["line_figure", "bar_figure", "heatmap_figure"]



def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only), or one line naming the extra."""
    require("matplotlib", "moejax.harness.plots (the plots)").use("Agg", force=True)
    return require("matplotlib.pyplot", "moejax.harness.plots (the plots)")

def line_figure(
    stem: str,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    logx: bool = False,
    logy: bool = False,
    markers: bool = False,
    vlines: Mapping[str, float] | None = None,
    hlines: Mapping[str, float] | None = None,
):
    """Lines ``series`` (label -> (xs, ys)), each drawn through its points in the order of x
    (a sweep given in any order, e.g. ``n_experts=(32,8,16)``, is one curve, not a zigzag);
    ``vlines`` / ``hlines``: labelled dashed reference lines (e.g. DARE's 1/(1-p); the
    unpruned / dense / uncompressed value)."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for label, (xs, ys) in series.items():
        points = sorted(zip(xs, ys, strict=True), key=lambda p: p[0])
        ax.plot([x for x, _ in points], [y for _, y in points], label=label,
                marker="o" if markers else None, ms=3)
    for label, x in (vlines or {}).items():
        ax.axvline(x, ls="--", color="gray", lw=1)
        ax.text(x, ax.get_ylim()[1], label, rotation=90, va="top", ha="right", fontsize=8)
    for label, y in (hlines or {}).items():
        ax.axhline(y, ls="--", color="gray", lw=1)
        ax.text(ax.get_xlim()[1], y, label, va="bottom", ha="right", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    _plain_log_labels(ax, logx, logy)
    ax.set_title(title or stem)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _plain_log_labels(ax, logx: bool, logy: bool) -> None:
    """A log axis's tick labels as plain numbers ("4", "40", "0.999") instead of
    "4 x 10^0": a sweep's settings read as they were given. matplotlib's LogFormatter still
    decides which ticks get a label (the minor ones only over a few decades)."""
    ticker = require("matplotlib.ticker", "moejax.harness.plots (the plots)")

    class Plain(ticker.LogFormatter):
        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    for axis, log in ((ax.xaxis, logx), (ax.yaxis, logy)):
        if log:
            axis.set_major_formatter(Plain(labelOnlyBase=False))
            axis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def bar_figure(
    stem: str,
    labels: Sequence[str],
    values: Sequence[float],
    *,
    ylabel: str,
    title: str | None = None,
    errors: Sequence[float] | None = None,
    hlines: Mapping[str, float] | None = None,
):
    """Bars with optional error bars (``errors``: one half-width per bar) and labelled
    horizontal reference lines (``hlines``: e.g. the unpruned / dense / teacher value)."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    ax.bar(range(len(values)), list(values),
           yerr=None if errors is None else list(errors), capsize=3)
    for label, y in (hlines or {}).items():
        ax.axhline(y, ls="--", color="gray", lw=1)
        ax.text(len(values) - 0.5, y, label, va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(len(values)), list(labels), rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title or stem)
    fig.tight_layout()
    return fig


def heatmap_figure(
    stem: str,
    matrix,
    *,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
):
    """A matrix as an image with a colour bar (e.g. a similarity matrix)."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(5, 4.2), dpi=110)
    im = ax.imshow(matrix, cmap="viridis", vmin=vmin, vmax=vmax)
    fig.colorbar(im, ax=ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title or stem, fontsize=9)
    fig.tight_layout()
    return fig
