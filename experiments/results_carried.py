"""A previous results document's sections, carried into its rebuild for the studies with no
readable run here (a GPU run made on a machine since given back, one being rerun): the
document read back by study (:func:`previous`), a section's claims judged again by its study's
current rules (:func:`rejudge`) and its derived columns computed again by today's rule
(:func:`rederive`), both on the tables carried with it (:func:`carried_tables`)."""

from __future__ import annotations

import re
from pathlib import Path

from experiments import study_module
from moejax.harness.claims import SEED_TABLES, Claim, claims_markdown
from moejax.harness.tables import (
    changed_cells,
    read_csv_rows,
    rewrite_csv_cells,
    rewrite_markdown_cells,
)

__all__ = ["OVERVIEW", "carried_tables", "has_claims", "previous", "rederive", "rejudge"]

OVERVIEW = "Paper claims at a glance"  # the heading of the document's table of verdicts
_SECTION = re.compile(r"^## (.+)$", re.M)
_CLAIMS = re.compile(r"^Paper claims:\n\n((?:- \*\*.*\n)+)", re.M)
_SCALE = re.compile(r" \[scale (.*)\]$")


def has_claims(section: str) -> bool:
    """Whether a document's ``section`` lists paper claims."""
    return _CLAIMS.search(section) is not None


def carried_tables(folder: Path) -> dict[str, list[dict]]:
    """The tables carried with a section (its claims' table aside), by stem."""
    return {p.stem: read_csv_rows(p) for p in sorted(folder.glob("*.csv")) if p.stem != "claims"}


def rejudge(study: str, section: str, folder: Path,
            tables: dict[str, list[dict]]) -> tuple[str, list[Claim] | None]:
    """A carried section with its claims judged again by the study's current rules on the
    ``tables`` carried with it in ``folder`` (its seed runs' too, for a repeated run);
    ``(section, None)`` unchanged where those tables are not all there (a repeated run
    documented before its seed runs' tables were carried)."""
    fn = getattr(study_module(study), "claims", None)
    block = _CLAIMS.search(section)
    if fn is None or block is None or not folder.is_dir():
        return section, None
    tables = dict(tables)
    repeated = re.search(r"^- seeds: \S+ = ", section, re.M) is not None
    seeds = sorted((p for p in folder.glob("seed_*") if p.is_dir()),
                   key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else -1)
    if repeated and not seeds:
        return section, None
    if seeds:
        tables[SEED_TABLES] = [{p.stem: read_csv_rows(p) for p in sorted(d.glob("*.csv"))}
                               for d in seeds]
    try:
        claims = list(fn(tables))
    except (KeyError, ValueError, TypeError):
        return section, None
    first = block.group(1).splitlines()[0]
    scale = _SCALE.search(first)
    text = claims_markdown(claims, scale.group(1) if scale else "")
    return section[:block.start(1)] + text + section[block.end(1):], claims


def rederive(study: str, section: str, folder: Path, tables: dict[str, list[dict]]
              ) -> tuple[str, dict[str, list[dict]], bool]:
    """A carried section with the columns its study derives from what it measured (the
    module's ``derived_tables``) computed again by today's rule, in ``tables`` (those carried
    with it in ``folder``), in their CSVs there and in the section's inline tables (the
    measured cells stay, to the character); the tables as their CSVs now read; and whether
    the rule was applied (False: all as it was, the rule cannot read the tables)."""
    fn = getattr(study_module(study), "derived_tables", None)
    if fn is None or not folder.is_dir():
        return section, tables, False
    try:
        derived = fn(tables)
        cells = {stem: changed_cells(tables[stem], rows, list(tables[stem][0]))
                 for stem, rows in derived.items() if tables.get(stem)}
    except (KeyError, ValueError, TypeError):  # a table of another layout
        return section, tables, False
    tables = dict(tables)
    for stem, changed in ((s, c) for s, c in cells.items() if c):
        rewrite_csv_cells(folder / f"{stem}.csv", changed)
        tables[stem] = [{c: r.get(c, "") for c in tables[stem][0]} for r in derived[stem]]
        inline = re.search(rf"^((?:\|.*\|\n)+)\n\(\[{re.escape(stem)}\.csv\]\(", section,
                           re.M)
        if inline and inline.group(1).count("\n") == len(tables[stem]) + 2:
            section = (section[:inline.start(1)] + rewrite_markdown_cells(inline.group(1),
                                                                          changed)
                       + section[inline.end(1):])
    return section, tables, True


def previous(out: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The document at ``out`` (if any): its sections by study name, and its claims-overview
    rows by study name."""
    if not out.is_file():
        return {}, {}
    text = out.read_text()
    heads = [(m.start(), m.group(1).strip()) for m in _SECTION.finditer(text)]
    sections = {name: text[start:end].rstrip("\n") + "\n" for (start, name), (end, _) in
                zip(heads, heads[1:] + [(len(text), "")])}
    rows: dict[str, list[str]] = {}
    for line in sections.pop(OVERVIEW, "").splitlines():
        if line.startswith("| ") and line.count(" | ") >= 2:
            rows.setdefault(line[2:].split(" | ", 1)[0], []).append(line)
    return sections, rows
