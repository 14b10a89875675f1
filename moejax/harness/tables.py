"""Result tables as rows of dicts: markdown and CSV round trips (:func:`markdown_table`,
:func:`read_csv_rows`, :func:`read_tables`; :func:`changed_cells`, :func:`rewrite_csv_cells`
and :func:`rewrite_markdown_cells` to write again only the cells a rule recomputes), and
statistics over seeds (:func:`seed_summary`: per-seed rows collapsed to mean and sample std;
:func:`merge_seed_tables`: one table per seed run merged the same way)."""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moejax.files import atomic_write_text

__all__ = ["format_value", "seed_summary", "mean_std", "read_csv_rows", "merge_seed_tables",
           "nan_in_some_runs", "markdown_table", "read_tables", "csv_value", "columns_of",
           "changed_cells", "rewrite_csv_cells", "rewrite_markdown_cells"]


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


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; 0.0 for one value) of ``values``, NaNs
    skipped: with no value left both are NaN (a spread of 0 would read as measured)."""
    x = np.asarray([float(v) for v in values], np.float64)
    x = x[~np.isnan(x)]
    if not len(x):
        return float("nan"), float("nan")
    return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else 0.0


def seed_summary(rows: Sequence[Mapping[str, Any]], keys: Sequence[str],
                 values: Sequence[str]) -> list[dict]:
    """Collapse per-seed rows into one row per distinct ``keys`` tuple (first-seen order):
    the ``keys``, ``n_seeds``, and for each of ``values`` its mean (same name) and sample
    standard deviation (``"<name> std"``, ddof 1; 0.0 for one seed). NaN values are skipped
    per column (the mean and spread of no values are NaN); other columns are dropped."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for key, group in groups.items():
        row: dict[str, Any] = dict(zip(keys, key))
        row["n_seeds"] = len(group)
        for v in values:
            row[v], row[f"{v} std"] = mean_std([g[v] for g in group if v in g])
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

    first = tables[0]
    cols = columns_of(first, None)
    if any(len(t) != len(first) or columns_of(t, None) != cols for t in tables):
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
                row[c], sd = mean_std(vals)
                if not _is_spread(c):
                    row[_std_name(c, cols)] = sd
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


def nan_in_some_runs(tables: Sequence[Sequence[Mapping[str, Any]]]) -> list[str]:
    """The cells that :func:`merge_seed_tables` averages over fewer runs than it merges: a
    number in some runs and NaN (not measured) in others, each as ``"row i, <col>: NaN in
    runs [..]"`` (run indices; the merged mean and std are those of the other runs)."""
    out = []
    for i in range(min(len(t) for t in tables)):
        for c in columns_of([t[i] for t in tables], None):
            vals = [t[i].get(c, "") for t in tables]
            nan = [j for j, v in enumerate(vals) if _isnan(v)]
            if nan and len(nan) < len(vals) and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
                out.append(f"row {i}, {c}: NaN in runs {nan}")
    return out


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


def columns_of(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None) -> list[str]:
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
    cols = columns_of(rows, columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(format_value(r.get(c, ""), floatfmt) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def read_tables(path: str | os.PathLike) -> dict[str, list[dict]]:
    """Every ``<stem>.csv`` of a run directory as rows (:func:`read_csv_rows`), by stem."""
    return {p.stem: read_csv_rows(p) for p in sorted(Path(path).glob("*.csv"))}


def csv_value(v):
    if isinstance(v, np.generic):  # before float: repr(np.float64(1.0)) is "np.float64(1.0)"
        return repr(v.item())
    if isinstance(v, float):
        return repr(v)
    return v


def changed_cells(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]],
                  columns: Sequence[str]) -> dict[tuple[int, str], Any]:
    """The cells of ``columns`` where ``new`` differs from ``old`` (the same rows, in the same
    order), ``{(row, column): new value}`` (``""`` where ``new`` has none); two numbers equal
    to 12 significant digits are the same cell."""
    if len(old) != len(new):
        raise ValueError(f"{len(new)} rows derived from a table of {len(old)}")
    out = {}
    for i, (a, b) in enumerate(zip(old, new)):
        for c in columns:
            x, y = a.get(c, ""), b.get(c, "")
            numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool)
                          for v in (x, y))
            if not (x == y or (numbers and (math.isclose(x, y, rel_tol=1e-12)
                                            or (_isnan(x) and _isnan(y))))):
                out[(i, c)] = y
    return out


def rewrite_csv_cells(path: str | os.PathLike, cells: Mapping[tuple[int, str], Any]) -> None:
    """Replace ``cells`` (``{(row, column): value}``) of the CSV at ``path`` (atomically; the
    other cells stay as written, to the character)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        cols, rows = list(reader.fieldnames or ()), list(reader)
    for (i, c), v in cells.items():
        rows[i][c] = csv_value(v)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def rewrite_markdown_cells(md: str, cells: Mapping[tuple[int, str], Any],
                           floatfmt: str = ".4g") -> str:
    """``md``, a table as :func:`markdown_table` writes it (a header, its rule and a line per
    row), with ``cells`` (``{(row, column): value}``) written again; the other cells stay as
    they were."""
    lines = md.rstrip("\n").split("\n")
    cols = lines[0][2:-2].split(" | ")
    rows = [line[2:-2].split(" | ") for line in lines[2:]]
    for (i, c), v in cells.items():
        rows[i][cols.index(c)] = format_value(v, floatfmt)
    return "\n".join(lines[:2] + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
