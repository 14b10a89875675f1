"""A run directory, what every experiment writes its results into: the resolved config,
markdown tables and CSVs (:mod:`.tables`), PNG plots (:mod:`.plots`), notes and
claims, and a ``summary.md`` that the main job links from its REPORT.md. The run's record
(``run.json``) is :mod:`moejax.harness.run_record`.

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
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moejax.config import Config, to_dict
from moejax.extras import require
from moejax.files import UnusableDirError, atomic_open, atomic_write_text, writable_dir
from moejax.harness.claims import Claim, claims_markdown, claims_scale
from moejax.harness.plots import bar_figure, heatmap_figure, line_figure
from moejax.harness.tables import columns_of, csv_value, markdown_table
from moejax.train.run_lock import RunLock

__all__ = ["RunDir", "RunDirError"]


class RunDirError(OSError):
    """The run directory cannot be used (a file, not writable); the message says why and
    the fix."""


def _usable_dir(path: Path) -> None:
    """Create ``path`` or explain, in one line, why it cannot be a run directory."""
    try:
        writable_dir(path, f"out={path}", "choose a writable directory with out=DIR")
    except UnusableDirError as e:
        raise RunDirError(str(e)) from None


# a finished run's outcome beside its files (a seed run's: kept when its repeat resumes)
OUTCOME = "outcome.json"


def _json_exact(x) -> bool:
    """Whether ``x`` comes back from JSON as it is (plain numbers, strings, lists and
    string-keyed dicts; not tuples or numpy scalars, which would come back as other types)."""
    if x is None or type(x) in (bool, int, float, str):
        return True
    if type(x) is list:
        return all(_json_exact(v) for v in x)
    return type(x) is dict and all(type(k) is str and _json_exact(v) for k, v in x.items())


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
        self.scale = ""  # what the run trained (moejax.train.scale.RunScale.text)
        self._t0 = time.time()
        self._lock: RunLock | None = None
        self._pending_config: str | None = None

    @staticmethod
    def check_usable(path: str | os.PathLike) -> None:
        """Create ``path`` or raise :class:`RunDirError` saying in one line why it cannot be
        a run directory."""
        _usable_dir(Path(path))

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
        try:  # a failure here (a full disk) must not leave the directory locked
            if cfg is not None:
                text = json.dumps(to_dict(cfg), indent=2) + "\n"
                old = path / "config.json"
                if old.is_file() and old.read_text() != text and _has_checkpoints(path):
                    run._pending_config = text
                else:
                    atomic_write_text(old, text)
        except BaseException:
            run.close()
            raise
        return run

    def save_outcome(self, cfg_hash: str, summary: Mapping[str, Any], headline: str) -> bool:
        """Record this finished run's outcome (the study's summary values, headline, tables,
        plots, notes and scale) for :meth:`reopen`, under ``cfg_hash``, the hash of the config
        it ran; False, writing nothing, where the summary would not come back from JSON as it
        is (:meth:`reopen` then finds nothing, and the run is made again)."""
        record = {"config_hash": cfg_hash, "summary": dict(summary), "headline": headline,
                  "name": self.name, "scale": self.scale, "notes": self.notes,
                  "tables": [list(t) for t in self.tables],
                  "plots": [list(p) for p in self.plots]}
        if not _json_exact(record):
            return False
        atomic_write_text(self.path / OUTCOME, json.dumps(record, indent=2) + "\n")
        return True

    @classmethod
    def reopen(cls, path: str | os.PathLike, cfg_hash: str):
        """``(run, summary, headline)`` of the finished run :meth:`save_outcome` recorded in
        ``path`` under ``cfg_hash``, or None: no record, another config's, an unreadable one,
        or one naming a file that is gone."""
        path = Path(path)
        try:
            rec = json.loads((path / OUTCOME).read_text())
            if rec["config_hash"] != cfg_hash:
                return None
            run = cls(path, rec["name"])
            run.tables = [tuple(t) for t in rec["tables"]]
            run.plots = [tuple(p) for p in rec["plots"]]
            run.notes, run.scale = list(rec["notes"]), rec["scale"]
            files = [f for _, md, c in run.tables for f in (md, c)] + [p for _, p in run.plots]
            summary, headline = dict(rec["summary"]), str(rec["headline"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not all((path / f).is_file() for f in [*files, "summary.md"]):
            return None
        return run, summary, headline

    @staticmethod
    def forget_outcome(path: str | os.PathLike) -> None:
        """Remove the outcome recorded in ``path``: a run about to be made again there."""
        (Path(path) / OUTCOME).unlink(missing_ok=True)

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
        """Write ``<stem>.csv`` (full precision) and ``<stem>.md``; return the markdown.
        Writing a stem again replaces its files and its entry in the summary (a table
        rewritten as rows arrive is listed once)."""
        cols = columns_of(rows, columns)
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({c: csv_value(r.get(c, "")) for c in cols})
        atomic_write_text(self.path / f"{stem}.csv", buf.getvalue())
        md = markdown_table(rows, cols, floatfmt)
        title = title or stem
        atomic_write_text(self.path / f"{stem}.md", f"### {title}\n\n{md}")
        entry = (title, f"{stem}.md", f"{stem}.csv")
        at = next((i for i, t in enumerate(self.tables) if t[1] == entry[1]), None)
        if at is None:
            self.tables.append(entry)
        else:
            self.tables[at] = entry
        return md

    # -- plots -------------------------------------------------------------------------
    def line_plot(self, stem: str, series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                  *, title: str | None = None, **kw) -> Path:
        """Lines ``series`` (label -> (xs, ys)) as ``stem.png`` (:func:`moejax.harness.plots.
        line_figure`: axis labels, log axes, markers, labelled reference lines)."""
        return self._save_fig(line_figure(stem, series, title=title, **kw), stem, title or stem)

    def bar_plot(self, stem: str, labels: Sequence[str], values: Sequence[float], *,
                 title: str | None = None, **kw) -> Path:
        """Bars as ``stem.png`` (:func:`moejax.harness.plots.bar_figure`: error bars, reference
        lines)."""
        return self._save_fig(bar_figure(stem, labels, values, title=title, **kw), stem,
                              title or stem)

    def heatmap(self, stem: str, matrix, *, title: str | None = None, **kw) -> Path:
        """A matrix as ``stem.png`` (:func:`moejax.harness.plots.heatmap_figure`)."""
        return self._save_fig(heatmap_figure(stem, matrix, title=title, **kw), stem,
                              title or stem)

    def _save_fig(self, fig, stem: str, title: str) -> Path:
        plt = require("matplotlib.pyplot", "moejax.harness.results (a run's plots)")
        out = self.path / f"{stem}.png"
        with atomic_open(out, "wb") as f:
            fig.savefig(f, format="png")
        plt.close(fig)
        self.plots.append((title, out.name))
        return out

    # -- summary -----------------------------------------------------------------------
    def note(self, text: str) -> None:
        self.notes.append(text)

    def claims(self, claims: Sequence[Claim], paper_scale: str = "") -> None:
        """The paper's claims and whether this run supports each: ``claims.csv`` / ``.md``
        and a section of the summary; every verdict beside the scale it was reached at
        (:attr:`scale`, what the run trained) and ``paper_scale`` (the paper's)."""
        if not claims:
            return
        scale = claims_scale(self.scale, paper_scale)
        self.table("claims", [{"claim": c.claim, "verdict": c.verdict, "evidence": c.evidence,
                               **({"scale": scale} if scale else {})} for c in claims],
                   title="Paper claims")
        self.note("Paper claims:\n\n" + claims_markdown(claims, scale))

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


