"""The main job: run a suite of experiments and write one REPORT.md linking their summaries.

    python -m experiments.main                      # suite=demo: the tour, a few minutes
    python -m experiments.main suite=studies        # every registered study (quick presets)
    python -m experiments.main suite=studies preset=full out=runs/full
    python -m experiments.main only=lm_demo,bench_dispatch

Suites: ``demo`` (``make demo``) trains the MoE LM and runs one cheap headline study per
system (``DEMO``: study + overrides); ``studies`` (``make studies``) runs every study in
``REGISTRY`` with its preset, and at the quick preset each study's declared variants after it
(``runs/studies/<study>_<variant>``). A new study registers by adding its name and module (a module
with a :class:`moejax.harness.study.Study` named ``STUDY``) to :data:`experiments.STUDIES`.

A suite stopped by Ctrl-C or SIGTERM ends in one line naming the study it was running (exit
130). That study's run is marked interrupted, so the same command resumes it; ``REPORT.md``
holds the studies run before it and says where the suite stopped.
"""

from __future__ import annotations

import platform
import sys
import time
import traceback
from pathlib import Path

from experiments import STUDIES, load_study
from moejax.config import ConfigError
from moejax.files import UnusableDirError, atomic_write_text, writable_dir
from moejax.harness.cli import PRESETS, asks_help, meant, study_names
from moejax.harness.experiment import STOPPED
from moejax.harness.run_index import entry_name
from moejax.harness.run_record import read_run_record
from moejax.train.run_lock import RunLockedError
from moejax.train.run_state import sigterm_as_interrupt

REGISTRY: tuple[str, ...] = tuple(STUDIES)  # every study, in the order the suite runs them


def entries(names=REGISTRY, accelerator: bool = False) -> list[tuple[str, str, str]]:
    """``(entry, study, variant)`` of every study in ``names`` and its declared variants
    (:attr:`moejax.harness.study.Study.variants`; with ``accelerator``, the
    ``accelerator_variants`` too), in suite order: what ``make studies`` runs and the results
    documents hold, one section each (``entry``: ``study`` or ``study[variant]``; its run
    directory under the suite's ``out`` is :func:`run_dirname`)."""
    out = []
    for name in names:
        out.append((name, name, ""))
        out += [(entry_name(name, v), name, v)
                for v in load_study(name).variant_names(accelerator)]
    return out


def run_dirname(study: str, variant: str = "") -> str:
    return f"{study}_{variant}" if variant else study


# The tour: a trained MoE LM and one headline per system, a few CPU minutes in all.
# Shorter than the studies' quick presets; `make studies` runs those in full.
DEMO: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("lm_demo", ("train.steps=60",)),
    ("darex_controlled", ("ps=(0.9,0.99)", "lora_seeds=1", "l2_sweep=()", "large_lrs=()")),
    # the settings the paper reports for a model upcycled without fine-tuning (its claims)
    ("ders_compression", ("scenarios=(not_finetuned,)", "train.steps=50",
                          "drop_rates=(0.4,0.6)", "bits=(4,2)")),
    ("blockffn_granularity", ("n_experts=(8,32)", "train.steps=100")),
    ("moe_kd", ("model=dense_lm_prose", "student_layers=2", "methods=(kd,)",
                "dense_teacher_methods=()", "teacher_ks=()", "ka_lambdas=()", "ka_ms=()",
                "lr_sweep=()", "router_lr_sweep=()", "seeds=1", "sft.steps=80",
                "distill.steps=20", "distill.eval_every=10", "n_val=8", "n_test=32")),
    ("moee", ("seeds=1", "ablations=()", "stability_tokens=()", "moefication_routers=(param,)",
              "vit.train.steps=200", "kd.steps=15", "extract.n_tokens=2000", "eval_rows=400")),
)
SUITES = ("demo", "studies")


def _parse(argv):
    opts = {"preset": "quick", "out": "runs/report", "only": "", "suite": "demo"}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in opts:
            raise ConfigError(
                f"bad argument {item!r}{meant([key], opts)}; allowed keys: {sorted(opts)} "
                f"(registered experiments: {', '.join(REGISTRY)})"
            )
        if not value.strip():
            raise ConfigError(f"{key}= is empty: give it a value, or leave it out for its "
                              f"default ({opts[key] or 'every study of the suite'})")
        opts[key] = value
    if opts["preset"] not in PRESETS:
        raise ConfigError(f"preset={opts['preset']!r} is not allowed; allowed values: {PRESETS}")
    if opts["suite"] not in SUITES:
        raise ConfigError(f"suite={opts['suite']!r} is not allowed; allowed values: {SUITES}")
    names = study_names(opts["only"], REGISTRY) if opts["only"] else []
    tour = opts["suite"] == "demo" and opts["preset"] == "quick"
    if names:  # a subset; in the tour with the tour's settings
        jobs = [(n, dict(DEMO).get(n, ()) if tour else ()) for n in names]
    elif opts["suite"] == "demo" and opts["preset"] == "quick":
        jobs = list(DEMO)
    else:
        jobs = [(n, ()) for n in REGISTRY]
    return opts["preset"], Path(opts["out"]), jobs, opts["suite"]


def _jobs_with_variants(jobs, preset: str, suite: str):
    """``(study, overrides, variant)``: the suite's jobs, each study of ``suite=studies`` at
    the quick preset followed by its declared variants."""
    for name, overrides in jobs:
        yield name, overrides, ""
        if suite == "studies" and preset == "quick":
            for variant, _ in load_study(name).variants:
                yield name, overrides, variant


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if asks_help(argv):
        print(__doc__)
        return 0
    try:
        preset, out, jobs, suite = _parse(argv)
        writable_dir(out, f"out={out}", "choose a writable directory with out=DIR")
    except (ConfigError, UnusableDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    t_all = time.time()
    sections, failures, skipped, entry, stopped = [], [], [], "", ""
    try:
        with sigterm_as_interrupt(STOPPED.format("SIGTERM")):
            for name, overrides, variant in _jobs_with_variants(jobs, preset, suite):
                entry = entry_name(name, variant)
                section, outcome = _run_job(name, overrides, variant, preset, suite, out,
                                            t_all)
                sections.append(section)
                if outcome == "failed":
                    failures.append(entry)
                elif outcome == "skipped":
                    skipped.append(entry)
                entry = ""
    except KeyboardInterrupt as e:  # the study's run is marked interrupted; it resumes
        where = f"during {entry}" if entry else "between studies"
        stopped = f"stopped {where}: {str(e) or STOPPED.format('Ctrl-C')}"
        n = len(sections)
        print(f"[{suite}] {stopped}; {out / 'REPORT.md'} holds the {n} "
              f"{'study' if n == 1 else 'studies'} run before it", file=sys.stderr, flush=True)

    header = [
        "# moejax report",
        "",
        f"- preset: `{preset}`",
        f"- machine: {platform.machine()}, {platform.system()}, jax {jax.__version__} "
        f"on {jax.devices()[0].platform} x{jax.device_count()}",
        f"- total wall time: {time.time() - t_all:.1f} s",
        f"- studies: {', '.join(n + (' (' + ' '.join(o) + ')' if o else '') for n, o in jobs)}"
        + (f" (FAILED: {', '.join(failures)})" if failures else "")
        + (f" (skipped: {', '.join(skipped)})" if skipped else ""),
        *([f"- **{stopped}**; the studies after it did not run"] if stopped else []),
        "",
    ]
    atomic_write_text(out / "REPORT.md", "\n".join(header) + "\n" + "\n".join(sections))
    print(f"report: {out / 'REPORT.md'}")
    return 130 if stopped else 1 if failures else 0


def _run_job(name, overrides, variant, preset: str, suite: str, out: Path,
             t_all: float) -> tuple[str, str]:
    """One study of the suite into ``out``: its section of the report (its summary, or why
    it failed or was skipped) and ``"ok"``, ``"failed"`` or ``"skipped"``."""
    entry, sub = entry_name(name, variant), run_dirname(name, variant)
    print(f"=== {entry} (preset={preset}{''.join(' ' + o for o in overrides)}) ===",
          flush=True)
    t0 = time.time()
    record = out / sub / "run.json"
    if (record.is_file() and record.stat().st_mtime >= t_all
            and (read_run_record(out / sub) or {}).get("state") == "finished"):
        why = "finished by another process since this suite started"
    else:
        why = ""
        try:
            study = load_study(name)
            summary, run = study.run_experiment([f"preset={preset}", *overrides],
                                                out=out / sub,
                                                repeat_quick=suite == "studies",
                                                variant=variant)
        except RunLockedError as e:  # another suite runs it now: not a failure
            why = f"locked: {e}"
        except Exception:  # keep going: the report says which study failed and why
            tb = traceback.format_exc()
            print(tb, file=sys.stderr)
            return (f"## {entry}\n\n**FAILED** after {time.time() - t0:.1f} s:\n\n```\n"
                    f"{tb}```\n", "failed")
    if why:
        print(f"    skipped ({why})", flush=True)
        return f"## {entry}\n\nSkipped: {why}.\n", "skipped"
    rel = Path(sub) / "summary.md"
    body = (out / rel).read_text()
    # Re-root relative links of the study's summary into the report directory.
    body = _reroot(body, sub)
    print(f"    done in {time.time() - t0:.1f} s", flush=True)
    return body + f"\n(full results: [{rel}]({rel}))\n", "ok"


def _reroot(md: str, sub: str) -> str:
    import re

    def fix(m):
        text, target = m.group(1), m.group(2)
        if "://" in target or target.startswith(("/", "#")):
            return m.group(0)
        return f"{text}({sub}/{target})"

    return re.sub(r"(!?\[[^\]]*\])\(([^)]+)\)", fix, md)


if __name__ == "__main__":
    sys.exit(main())
