"""The results layer every experiment uses: a run directory holding the resolved config, markdown
tables, CSVs and matplotlib PNG plots, plus a ``summary.md`` that the main job links from its
REPORT.md.

    run = RunDir.create("runs/report/lm_demo", cfg)
    run.table("losses", rows, title="Validation loss")      # losses.csv + losses.md
    run.line_plot("loss_curve", {"train": (steps, losses)}, xlabel="step", ylabel="loss")
    run.finish(headline="val loss 2.31 -> 1.52")              # summary.md

Files are written atomically (temp file + rename), so an interrupted run never leaves a
half-written table behind.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moejax.claims import Claim, claims_markdown
from moejax.config import Config, to_dict
from moejax.files import UnusableDirError, atomic_open, atomic_write_text, writable_dir
from moejax.train.run_lock import RunLock

__all__ = ["RunDir", "RunDirError", "read_tables", "markdown_table", "atomic_write_text",
           "format_value", "seed_summary", "merge_seed_tables", "read_csv_rows", "machine_info",
           "write_run_record"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What a result was measured on: CPU model and cores, OS, Python and library versions,
    the accelerator jax sees (``"none"`` on a CPU-only machine) and the load average when
    the record was written (other work on the machine slows timings)."""
    import platform

    import jax
    import jaxlib

    dev = jax.devices()[0]
    accel = "none" if dev.platform == "cpu" else f"{jax.device_count()} x {dev.device_kind}"
    return {"cpu": _cpu_model(), "cores": os.cpu_count(),
            "os": f"{platform.system()} {platform.machine()}",
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "accelerator": accel,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "load_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}


def write_run_record(path: str | os.PathLike, *, study: str, argv: Sequence[str],
                     started: float, repeat: int, seeds: Mapping[str, Sequence[int]]) -> Path:
    """``run.json`` beside a run's ``summary.md``: the command that reproduces it, when it
    ran and for how long, its seeds and the machine, read back by the results document."""
    record = {"study": study,
              "command": " ".join(["python -m experiments." + study, *argv]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
              "wall_s": round(time.time() - started, 1), "repeat": repeat,
              "seeds": {k: list(v) for k, v in seeds.items()}, "machine": machine_info()}
    out = Path(path) / "run.json"
    atomic_write_text(out, json.dumps(record, indent=2) + "\n")
    return out


def format_value(v: Any, floatfmt: str = ".4g") -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return format(v, floatfmt)
    if isinstance(v, np.generic) or (hasattr(v, "shape") and v.shape == ()):  # numpy / jax
        return format_value(v.item(), floatfmt)
    return str(v)


def seed_summary(rows: Sequence[Mapping[str, Any]], keys: Sequence[str],
                 values: Sequence[str]) -> list[dict]:
    """Collapse per-seed rows into one row per distinct ``keys`` tuple (first-seen order):
    the ``keys``, ``n_seeds``, and for each of ``values`` its mean (same name) and sample
    standard deviation (``"<name> std"``, ddof 1; 0.0 for one seed). NaN values are skipped
    per column (the mean of no values is NaN); other columns are dropped."""
    import numpy as np

    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for key, group in groups.items():
        row: dict[str, Any] = dict(zip(keys, key))
        row["n_seeds"] = len(group)
        for v in values:
            x = np.asarray([float(g[v]) for g in group if v in g], np.float64)
            x = x[~np.isnan(x)]
            row[v] = float(x.mean()) if len(x) else float("nan")
            row[f"{v} std"] = float(x.std(ddof=1)) if len(x) > 1 else 0.0
        out.append(row)
    return out


def read_csv_rows(path: str | os.PathLike) -> list[dict]:
    """A CSV written by :meth:`RunDir.table` as rows of floats where a cell parses as one,
    strings elsewhere."""
    with open(path, newline="") as f:
        return [{k: _parse_cell(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _parse_cell(v: str):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def merge_seed_tables(tables: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict] | None:
    """Merge the same table of several seeds' runs row by row (row ``i`` of every run
    describes the same setting): a column equal in every run is kept; a numeric column that
    differs becomes its mean plus ``"<col> std"`` (sample std, ddof 1; present on every row
    when the column varies anywhere; ``"<col> std over runs"`` if the table has a
    ``"<col> std"`` of its own), except a column that is a spread already (its name ends in
    " std" / "_std": the mean of the runs' spreads); a text column that differs lists the
    runs' values joined by " / " (a sign the rows were not aligned). ``None`` when the runs'
    tables differ in row count or columns (e.g. a seed-dependent number of rows)."""
    import numpy as np

    first = tables[0]
    cols = _columns(first, None)
    if any(len(t) != len(first) or _columns(t, None) != cols for t in tables):
        return None
    varies = set()
    merged: list[dict] = []
    for i in range(len(first)):
        row: dict[str, Any] = {}
        for c in cols:
            vals = [t[i].get(c, "") for t in tables]
            same = all(v == vals[0] or (_isnan(v) and _isnan(vals[0])) for v in vals)
            if same:
                row[c] = vals[0]
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
                x = np.asarray(vals, np.float64)
                row[c] = float(np.nanmean(x)) if not np.isnan(x).all() else float("nan")
                if not _is_spread(c):
                    row[_std_name(c, cols)] = float(np.nanstd(x, ddof=1)) \
                        if (~np.isnan(x)).sum() > 1 else 0.0
                    varies.add(c)
            else:
                row[c] = " / ".join(str(v) for v in vals)
        merged.append(row)
    out_cols = []
    for c in cols:
        out_cols.append(c)
        if c in varies:
            out_cols.append(_std_name(c, cols))
    stds = {_std_name(c, cols) for c in varies}  # 0.0 on rows where the column agreed
    return [{c: r.get(c, 0.0 if c in stds else "") for c in out_cols} for r in merged]


def _std_name(column: str, columns) -> str:
    """``"<col> std"``, or ``"<col> std over runs"`` when the table has a ``"<col> std"``
    column of its own (a spread within each run)."""
    return f"{column} std over runs" if f"{column} std" in columns else f"{column} std"


def _is_spread(column: str) -> bool:
    """A column that already is a spread (``"acc std"``, ``acc_std``): merged by its mean
    over the runs, without a std of the std."""
    return column.endswith((" std", "_std"))


def _isnan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None) -> list[str]:
    if columns is not None:
        return list(columns)
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    return cols


def markdown_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, floatfmt=".4g"
) -> str:
    cols = _columns(rows, columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(format_value(r.get(c, ""), floatfmt) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def read_tables(path: str | os.PathLike) -> dict[str, list[dict]]:
    """Every ``<stem>.csv`` of a run directory as rows (:func:`read_csv_rows`), by stem."""
    return {p.stem: read_csv_rows(p) for p in sorted(Path(path).glob("*.csv"))}


class RunDirError(OSError):
    """The run directory cannot be used (a file, not writable); the message says why and
    the fix."""


def _usable_dir(path: Path) -> None:
    """Create ``path`` or explain, in one line, why it cannot be a run directory."""
    try:
        writable_dir(path, f"out={path}", "choose a writable directory with out=DIR")
    except UnusableDirError as e:
        raise RunDirError(str(e)) from None


def _has_checkpoints(path: Path) -> bool:
    return any(p.name.isdigit() for p in path.glob("**/checkpoints/*"))


class RunDir:
    """A directory of one experiment run's outputs."""

    def __init__(self, path: Path, name: str):
        self.path = Path(path)
        self.name = name
        self.tables: list[tuple[str, str, str]] = []  # (title, md file, csv file)
        self.plots: list[tuple[str, str]] = []  # (title, png file)
        self.notes: list[str] = []
        self._t0 = time.time()
        self._lock: RunLock | None = None
        self._pending_config: str | None = None

    @classmethod
    def create(cls, path: str | os.PathLike, cfg: Config | None = None, name: str | None = None,
               *, lock: bool = False):
        """Open ``path`` as a run directory. ``lock``: hold it exclusively until
        :meth:`finish` or :meth:`close` (a second run on it fails before writing anything).
        ``config.json`` is written now, unless the directory holds checkpoints of another
        config: then only when the run finishes, so a resume the training loop refuses
        leaves the old one in place."""
        path = Path(path)
        _usable_dir(path)
        run = cls(path, name or path.name)
        if lock:
            run._lock = RunLock(path).acquire()
        if cfg is not None:
            text = json.dumps(to_dict(cfg), indent=2) + "\n"
            old = path / "config.json"
            if old.is_file() and old.read_text() != text and _has_checkpoints(path):
                run._pending_config = text
            else:
                atomic_write_text(old, text)
        return run

    def close(self) -> None:
        """Release the run directory's lock (idempotent)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- tables ------------------------------------------------------------------------
    def table(
        self,
        stem: str,
        rows: Sequence[Mapping[str, Any]],
        *,
        title: str | None = None,
        columns: Sequence[str] | None = None,
        floatfmt: str = ".4g",
    ) -> str:
        """Write ``<stem>.csv`` (full precision) and ``<stem>.md``; return the markdown."""
        cols = _columns(rows, columns)
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({c: _csv_value(r.get(c, "")) for c in cols})
        atomic_write_text(self.path / f"{stem}.csv", buf.getvalue())
        md = markdown_table(rows, cols, floatfmt)
        title = title or stem
        atomic_write_text(self.path / f"{stem}.md", f"### {title}\n\n{md}")
        self.tables.append((title, f"{stem}.md", f"{stem}.csv"))
        return md

    # -- plots -------------------------------------------------------------------------
    def line_plot(
        self,
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
    ) -> Path:
        """Lines ``series`` (label -> (xs, ys)); ``vlines`` / ``hlines``: labelled dashed
        reference lines (e.g. DARE's 1/(1-p); the unpruned / dense / uncompressed value)."""
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
        for label, (xs, ys) in series.items():
            ax.plot(list(xs), list(ys), label=label, marker="o" if markers else None, ms=3)
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
        ax.set_title(title or stem)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
        fig.tight_layout()
        return self._save_fig(fig, stem, title or stem)

    def bar_plot(
        self,
        stem: str,
        labels: Sequence[str],
        values: Sequence[float],
        *,
        ylabel: str,
        title: str | None = None,
        errors: Sequence[float] | None = None,
        hlines: Mapping[str, float] | None = None,
    ) -> Path:
        """Bars with optional error bars (``errors``: one half-width per bar) and labelled
        horizontal reference lines (``hlines``: e.g. the unpruned / dense / teacher value)."""
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

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
        return self._save_fig(fig, stem, title or stem)

    def heatmap(
        self,
        stem: str,
        matrix,
        *,
        xlabel: str,
        ylabel: str,
        title: str | None = None,
        vmin: float | None = None,
        vmax: float | None = None,
    ) -> Path:
        """A matrix as an image with a colour bar (e.g. a similarity matrix)."""
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 4.2), dpi=110)
        im = ax.imshow(matrix, cmap="viridis", vmin=vmin, vmax=vmax)
        fig.colorbar(im, ax=ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title or stem, fontsize=9)
        fig.tight_layout()
        return self._save_fig(fig, stem, title or stem)

    def _save_fig(self, fig, stem: str, title: str) -> Path:
        import matplotlib.pyplot as plt

        out = self.path / f"{stem}.png"
        with atomic_open(out, "wb") as f:
            fig.savefig(f, format="png")
        plt.close(fig)
        self.plots.append((title, out.name))
        return out

    # -- summary -----------------------------------------------------------------------
    def note(self, text: str) -> None:
        self.notes.append(text)

    def claims(self, claims: Sequence[Claim]) -> None:
        """The paper's claims and whether this run supports each: ``claims.csv`` / ``.md``
        and a section of the summary."""
        if not claims:
            return
        self.table("claims", [{"claim": c.claim, "verdict": c.verdict, "evidence": c.evidence}
                              for c in claims], title="Paper claims")
        self.note("Paper claims:\n\n" + claims_markdown(claims))

    def finish(self, headline: str = "") -> Path:
        """Write ``summary.md`` (headline, notes, every table inline, every plot embedded)."""
        elapsed = time.time() - self._t0
        parts = [f"## {self.name}\n"]
        if headline:
            parts.append(headline + "\n")
        parts.append(f"_wall time: {elapsed:.1f} s_\n")
        parts.extend(n + "\n" for n in self.notes)
        for _title, md, csv_name in self.tables:
            body = (self.path / md).read_text()
            parts.append(body + f"\n([{csv_name}]({csv_name}))\n")
        for title, png in self.plots:
            parts.append(f"![{title}]({png})\n")
        out = self.path / "summary.md"
        if self._pending_config is not None:
            atomic_write_text(self.path / "config.json", self._pending_config)
            self._pending_config = None
        atomic_write_text(out, "\n".join(parts))
        self.close()
        return out


def _csv_value(v):
    import numpy as np

    if isinstance(v, np.generic):  # before float: repr(np.float64(1.0)) is "np.float64(1.0)"
        return repr(v.item())
    if isinstance(v, float):
        return repr(v)
    return v
