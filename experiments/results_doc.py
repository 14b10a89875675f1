"""The results document of a machine class: every study's newest run, read back from its run
directory.

    python -m experiments.results_doc              # this machine's class: CPU -> docs/results.md
    python -m experiments.results_doc machine=gpu  # -> docs/results_gpu.md
    python -m experiments.results_doc runs=runs/studies out=/tmp/r.md   # one directory's runs

By default the runs come from the run indexes (:mod:`moejax.harness.run_index`: every finished study
run, wherever its directory lives, indexed beside it; ``index=FILE`` reads one index): per
study the newest preset run on ``machine`` (cpu, gpu or tpu; by default the class of the
machine it runs on). A trial run (a config key overridden, a repeat changed) is never
published: the document lists the newest trials apart, by command, and keeps the preset
run's section. ``runs=DIR`` reads ``DIR/<study>`` instead.

For each registered study that has a finished run (``run.json`` beside ``summary.md``): the
command that reproduces it, preset, seeds, date, wall time and machine; one line per paper
claim, judged by the study's ``claims`` function on the run's tables; the headline; the tables
(means and spreads over seeds for the studies that ran several) and the plots. Tables and
plots are copied next to the document (``<out stem>/<study>/``), so it stands alone; nothing
in it is typed by hand.

A study with no readable run here (a GPU run made on a machine since given back, or one
being rerun) keeps its section and its tables from the document being replaced, listed as
carried over: each such section still names the command, date and machine of the run it came
from. Its claims are judged again by the study's current rules on the tables carried with it
(a repeated run's seed runs' tables are carried too); where those tables are not all there,
its claims stay as its run judged them, and the document says which. The columns a study
derives from what it measured (its module's ``derived_tables``, e.g. a ratio of two measured
speeds) are computed again by today's rule too, in the carried tables and the section's inline
ones, and the document names those sections. A study never
documented is listed as not run, as is a carried-over one named in ``forget=`` (its run no
longer describes the code, or holds a row that does not stand: it goes until a new run
brings it back).

The assets folder is the generator's own: it carries a marker file, and a rebuild replaces
only a folder that has it. A folder of that name without the marker, or one that holds the
runs, is refused before anything is written. A run whose directory is locked by a live run is
being written: it is listed as running and not read.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from experiments import study_module
from experiments.main import REGISTRY, entries, run_dirname
from experiments.results_carried import (
    OVERVIEW,
    carried_tables,
    has_claims,
    previous,
    rederive,
    rejudge,
)
from moejax.config import ConfigError
from moejax.files import UnusableDirError, atomic_write_text, writable_dir
from moejax.harness import run_index
from moejax.harness.claims import SEED_TABLES, Claim, claims_markdown, claims_scale
from moejax.harness.cli import asks_help
from moejax.harness.run_record import machine_info, read_run_record
from moejax.harness.tables import (
    read_csv_rows,
)
from moejax.train.run_lock import is_held

__all__ = ["build", "main"]

MAX_INLINE_ROWS = 40  # longer tables are linked, not inlined
ASSETS_MARKER = ".moejax-results-assets"  # marks a folder this generator wrote
_TABLE_LINK = re.compile(r"^\(\[([\w.-]+\.csv)\]\([\w.-]+\.csv\)\)$", re.M)
_PER_RUN = re.compile(r"^- seed run (\d+) \(\[summary\]\([\w./-]+\)\): (.*)$", re.M)
_PLOT = re.compile(r"^!\[([^\]]*)\]\(([\w./-]+\.png)\)$", re.M)


def _parse(argv) -> tuple[dict[str, Path], Path, str, tuple[str, ...], dict[str, Path], bool]:
    """``({study: run directory}, out, where the runs came from, studies to forget,
    {study: newest trial run}, whether the document is an accelerator's)``."""
    opts = {"runs": "", "machine": run_index.machine_class(machine_info()), "index": "",
            "out": "", "forget": ""}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in opts or not value:
            raise ConfigError(f"bad argument {item!r}; allowed: machine=cpu|gpu|tpu "
                              "index=FILE runs=DIR out=FILE.md forget=STUDY[,STUDY]")
        opts[key] = value
    forget = tuple(n for n in opts["forget"].split(",") if n)
    accelerator = opts["machine"] != "cpu"
    known = [entry for entry, _, _ in entries(REGISTRY, accelerator)]
    if unknown := [n for n in forget if n not in known]:
        raise ConfigError(f"forget={opts['forget']}: {', '.join(unknown)} is no study; "
                          f"one of {', '.join(known)}")
    out = Path(opts["out"] or ("docs/results.md" if opts["machine"] == "cpu"
                               else f"docs/results_{opts['machine']}.md"))
    if out.suffix != ".md":
        raise ConfigError(f"out={out}: the results document is markdown; name it *.md")
    if out.is_dir():
        raise ConfigError(f"out={out} is a directory; name the document's file, *.md")
    try:  # its folder, where its tables and plots go beside it
        writable_dir(out.parent, f"out={out}", "name a *.md file in a writable folder")
    except UnusableDirError as e:
        raise ConfigError(str(e)) from None
    if opts["runs"]:
        runs = Path(opts["runs"])
        if not runs.is_dir():
            raise ConfigError(f"runs={runs} is not a directory; run the studies first "
                              "(make studies), or point runs= at their output")
        paths = {entry: runs / run_dirname(study, variant)
                 for entry, study, variant in entries(REGISTRY, accelerator)}
        source, trials = f"runs={runs}", {}
    else:
        if opts["machine"] not in ("cpu", "gpu", "tpu"):
            raise ConfigError(f"machine={opts['machine']}: one of cpu, gpu, tpu")
        if opts["index"] and not Path(opts["index"]).is_file():
            raise ConfigError(f"index={opts['index']} is no file; name a run index "
                              "(runs/index.jsonl), or leave index= out to read every index "
                              "under runs/")
        index = [Path(opts["index"])] if opts["index"] else run_index.index_paths()
        paths, skipped = run_index.newest(opts["machine"], index)
        trials, _ = run_index.newest(opts["machine"], index, kind="trial")
        if skipped:
            print(f"results_doc: skipped {skipped} malformed line(s) of "
                  f"{', '.join(map(str, index))}", file=sys.stderr)
        source = f"machine={opts['machine']}" + (f" index={opts['index']}" if opts["index"]
                                                 else "")
    _check_assets(list(paths.values()), out)
    return (paths, out, source + (f" forget={','.join(forget)}" if forget else ""), forget,
            trials, accelerator)


def _check_assets(runs: Sequence[Path], out: Path) -> Path:
    """The document's assets folder (``out`` without its suffix), refused unless replacing
    it can only remove what this generator wrote: it holds none of the ``runs``."""
    assets = out.with_suffix("")
    a = assets.resolve()
    for run in runs:
        r = run.resolve()
        if a == r or a in r.parents:
            raise ConfigError(f"out={out} would put the document's assets in {assets}, which "
                              f"holds the runs ({run}); name the document elsewhere, e.g. "
                              "out=docs/results.md")
    if assets.exists() and not (assets / ASSETS_MARKER).is_file():
        raise ConfigError(f"out={out}: {assets} exists and was not written by results_doc "
                          f"(no {ASSETS_MARKER} in it), and rebuilding the document would "
                          "replace it; move it away or choose another out=")
    return assets


def _finished(path: Path) -> bool:
    """A finished run is there: its record says so (a record from before states were kept
    counts) and its summary was written; a running or interrupted run is never shown."""
    record = read_run_record(path)
    return (record is not None and "unreadable" not in record
            and record.get("state") == "finished" and (path / "summary.md").is_file())


def _machine(m: dict) -> str:
    gpu = m.get("accelerator", "none")
    return (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('os', '')}; "
            f"jax {m.get('jax', '?')}; accelerator: {gpu}"
            + (f"; XLA_FLAGS `{m['xla_flags']}`" if m.get("xla_flags") else "")
            + (f"; load {m['load_1min']} when it finished" if m.get("load_1min") else ""))


def _seeds(record: dict, cfg: dict) -> str:
    seeds = {k: v for k, v in record.get("seeds", {}).items() if len(v) > 1}
    if seeds:
        return "; ".join(f"{k} = {', '.join(map(str, v))}" for k, v in seeds.items())
    n = cfg.get("seeds")
    return f"{n} (the study's own `seeds` loop)" if isinstance(n, int) and n > 1 else "1"


def _recorded_tables(path: Path, stems: Sequence[str] | None) -> dict[str, list[dict]]:
    """The tables a run recorded as its own (``stems`` from its ``run.json``; a record from
    before they were kept: the tables its ``summary.md`` links), never the other CSVs of its
    directory; claims aside."""
    if stems is None:
        summary = path / "summary.md"
        text = summary.read_text() if summary.is_file() else ""
        stems = [c[:-len(".csv")] for c in _TABLE_LINK.findall(text)]
    return {s: read_csv_rows(path / f"{s}.csv") for s in stems
            if s != "claims" and (path / f"{s}.csv").is_file()}


def _seed_runs(record: dict) -> dict[str, list[str] | None]:
    """A repeated run's seed runs, ``{directory: its table stems}`` (a record from before
    they were kept: its ``repeat`` seed runs, stems unknown)."""
    seed_runs = record.get("seed_runs")
    if seed_runs is None:
        n = int(record.get("repeat", 1))
        seed_runs = {f"seed_{i}": None for i in range(n)} if n > 1 else {}
    return seed_runs


def _claims(name: str, path: Path, record: dict) -> list[Claim]:
    module = study_module(name)
    fn = getattr(module, "claims", None)
    if fn is None:
        return []
    tables = _recorded_tables(path, record.get("tables"))
    seed_runs = _seed_runs(record)
    if seed_runs:  # a repeated run: its claims pair its own seed runs, as when it was judged
        tables[SEED_TABLES] = [_recorded_tables(path / d, stems)
                               for d, stems in seed_runs.items()]
    try:
        return list(fn(tables))
    except (KeyError, ValueError, TypeError) as e:  # a table of another layout
        return [Claim("the study's claims", None, f"tables not readable: {e!r}")]


def _notes(summary: str) -> list[str]:
    """The run's notes: the paragraphs of its summary after the wall time and before the
    first table, without the claims (the section lists them from the tables)."""
    out, started, in_claims = [], False, False
    for para in (p.strip() for p in summary.split("\n\n")):
        if para.startswith("_wall"):
            started = True
        elif started and para.startswith("### "):
            break
        elif started and para.startswith("Paper claims:"):
            in_claims = True
        elif started and para and not (in_claims and para.startswith("- **")):
            in_claims = False
            out.append(para)
    return out


def _resumed(record: dict) -> str:
    """What a resumed run's wall time leaves out (``run.json``'s ``resumed``), else ``""``."""
    if not record.get("resumed"):
        return ""
    if int(record.get("repeat", 1)) > 1:
        return " (resumed a stopped run: its time on the seed runs it had not finished is left out)"
    return " (resumed a stopped run: its time is left out)"


def _section(name: str, study: str, variant: str, path: Path, assets: Path,
             rel: str) -> tuple[str, list[Claim]]:
    """The section of ``name`` (a study, or ``study[variant]``) from its run in ``path``."""
    record = json.loads((path / "run.json").read_text())
    cfg = json.loads((path / "config.json").read_text())
    summary = (path / "summary.md").read_text()
    module = study_module(study)
    what = (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    head = summary.split("\n\n")[1].strip() if summary.count("\n\n") > 1 else ""
    claims = _claims(study, path, record)
    parts = [f"## {name}\n", f"{what}\n",
             f"- command: `{record['command']}`",
             f"- seeds: {_seeds(record, cfg)}",
             f"- ran: {record['started']}, {record['wall_s']:.0f} s"
             + _resumed(record),
             f"- machine: {_machine(record.get('machine', {}))}", ""]
    if claims:
        declared = getattr(module, "STUDY", None)
        here = record.get("scale", "not recorded by this run")  # runs before it was measured
        scale = claims_scale(here, getattr(declared, "paper_scale", ""))
        parts += ["Paper claims:", "", claims_markdown(claims, scale)]
    if head and not head.startswith("_wall"):
        parts += [f"Headline: {head}", ""]
    runs = _PER_RUN.findall(summary)  # repeated runs: each one's headline
    if runs:
        parts += ["Per-run headlines:", "", *(f"- run {i}: {text}" for i, text in runs), ""]
    first = path / "seed_0" / "summary.md"  # repeated runs: the notes of the first one
    notes = _notes(first.read_text() if first.is_file() else summary)
    if notes and first.is_file():
        parts += ["Notes of seed run 0:", ""]
    for para in notes:
        parts += [para, ""]
    folder = run_dirname(study, variant)
    dest = assets / folder
    dest.mkdir(parents=True, exist_ok=True)
    for d, tables in _seed_runs(record).items():  # kept, so a carried section is re-judged
        for stem in _recorded_tables(path / d, tables):
            (dest / d).mkdir(exist_ok=True)
            shutil.copyfile(path / d / f"{stem}.csv", dest / d / f"{stem}.csv")
    for csv_name in _TABLE_LINK.findall(summary):
        if csv_name == "claims.csv":
            continue
        shutil.copyfile(path / csv_name, dest / csv_name)
        link = f"[{csv_name}]({rel}/{folder}/{csv_name})"
        if csv_name == "summary.csv":  # its markdown was replaced by the run's summary
            parts += [f"Table: {link}", ""]
            continue
        md = (path / csv_name.replace(".csv", ".md")).read_text().strip()
        rows = md.count("\n") - 3
        if rows <= MAX_INLINE_ROWS:
            parts += [md.replace("### ", "#### ", 1), "", f"({link})", ""]
        else:
            title = md.split("\n", 1)[0].lstrip("# ")
            parts += [f"#### {title}", "", f"{rows} rows: {link}", ""]
    for title, png in _PLOT.findall(summary):
        target = dest / png.replace("/", "_")
        shutil.copyfile(path / png, target)
        parts += [f"![{title}]({rel}/{folder}/{target.name})", ""]
    return "\n".join(parts), claims


def build(runs: Path | dict[str, Path], out: Path, source: str = "",
          forget: Sequence[str] = (), trials: dict[str, Path] | None = None,
          accelerator: bool = False) -> Path:
    """Write the results document for the runs ``{study: run directory}`` (or those under
    one directory, ``runs/<study>``); return its path. A study of ``forget`` without a run
    here is not carried over from the previous document; ``trials`` (``{study: run}``) are
    listed by command, never published (module docstring); ``accelerator``: a GPU's or TPU's
    document, which holds the studies' accelerator variants too."""
    if isinstance(runs, Path):
        source = source or f"runs={runs}"
        runs = {entry: runs / run_dirname(study, variant)
                for entry, study, variant in entries(REGISTRY, accelerator)}
    assets = _check_assets(list(runs.values()), out)
    old_sections, old_rows = previous(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the new assets are built beside the old ones and swapped in once the document is
    # written, so a failed rebuild leaves the previous document and its assets whole
    fresh = Path(tempfile.mkdtemp(prefix=f".{assets.name}.", dir=out.parent))
    fresh.chmod(0o755)
    try:
        (fresh / ASSETS_MARKER).write_text("written by python -m experiments.results_doc; "
                                           "replaced whole on every rebuild\n")
        sections, overview, missing, running, carried = [], [], [], [], []
        rejudged, kept, rederived = [], [], []
        for name, study, variant in entries(REGISTRY, accelerator):
            path = runs.get(name)
            held = path is not None and is_held(path)
            if held:
                running.append(name)
            if path is None or held or not _finished(path):
                if name in old_sections and name not in forget:
                    folder = assets / run_dirname(study, variant)
                    if folder.is_dir():
                        shutil.copytree(folder, fresh / folder.name)
                    here = fresh / folder.name
                    tables = carried_tables(here) if here.is_dir() else {}
                    text, tables, redone = rederive(study, old_sections[name], here, tables)
                    text, claims = rejudge(study, text, here, tables)
                    if redone:
                        rederived.append(name)
                    sections.append(text)
                    overview += ([f"| {name} | {c.claim} | {c.verdict} |" for c in claims]
                                 if claims is not None else old_rows.get(name, []))
                    carried.append(name)
                    if has_claims(old_sections[name]):
                        (rejudged if claims is not None else kept).append(name)
                elif not held:
                    missing.append(name)
                continue
            text, claims = _section(name, study, variant, path, fresh, assets.name)
            sections.append(text)
            overview += [f"| {name} | {c.claim} | {c.verdict} |" for c in claims]
        head = ["# moejax results", "",
                f"Generated by `python -m experiments.results_doc {source} out={out}` on "
                f"{time.strftime('%Y-%m-%d')} from each study's newest run; regenerate it after "
                "`make studies` (or `make results`). Every number below was written by a run; "
                "each study's section says how to reproduce it and on what machine.", ""]
        if missing:
            head += [f"Not run: {', '.join(missing)}.", ""]
        if running:
            head += [f"Running when this was generated (not read): {', '.join(running)}.", ""]
        if carried:
            head += [f"Carried over from the previous document, their runs not being readable "
                     f"here (each section names where and when it ran): {', '.join(carried)}.", ""]
        if rejudged:
            head += ["Their claims judged again by today's claim rules on the tables carried "
                     f"with them: {', '.join(rejudged)}.", ""]
        if rederived:
            head += ["Their columns derived from what was measured computed again by today's "
                     f"rules: {', '.join(rederived)}.", ""]
        if kept:
            head += ["Their claims as their runs judged them (the tables that would judge them "
                     f"again were not carried: rerun them): {', '.join(kept)}.", ""]
        head += _trial_lines(trials or {}, runs)
        if overview:
            head += [f"## {OVERVIEW}", "", "| study | claim | verdict |",
                     "|---|---|---|", *overview, ""]
        atomic_write_text(out, "\n".join(head + sections) + "\n")
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    stale = out.parent / f"{fresh.name}.old"
    if assets.exists():
        assets.rename(stale)
    fresh.rename(assets)
    shutil.rmtree(stale, ignore_errors=True)
    return out


def _trial_lines(trials: dict[str, Path], runs: dict[str, Path]) -> list[str]:
    """The newest trial run of each study newer than its published run, by command: listed,
    never published (their configs are not the presets')."""
    lines = []
    for name, path in sorted(trials.items()):
        record = read_run_record(path) or {}
        published = runs.get(name)
        if published is not None and (read_run_record(published) or {}).get(
                "started", "") > record.get("started", ""):
            continue
        lines.append(f"- {name}: `{record.get('command', '?')}` ({record.get('started', '?')}"
                     f", {path})")
    if not lines:
        return []
    return ["Trial runs, not published here (a config key overridden or a repeat changed; "
            "each study's section is its newest preset run):", "", *lines, ""]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if asks_help(argv):
        print(__doc__)
        return 0
    try:
        runs, out, source, forget, trials, accelerator = _parse(argv)
        print(f"wrote {build(runs, out, source, forget, trials, accelerator)}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
