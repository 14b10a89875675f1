"""Command-line runner shared by every study module (``experiments/<paper>/<study>.py``).

An experiment module defines

* ``make_config(preset: str) -> Config``: the frozen config of a preset (``"quick"`` for CPU
  minutes, ``"full"`` for GPU and real pretrained weights);
* ``run(cfg, run: RunDir) -> dict``: the study; writes tables/plots into ``run`` and returns a
  small dict of headline numbers;

and ends with its declaration, a :class:`moejax.harness.study.Study` named ``STUDY``, and
``if __name__ == "__main__": raise SystemExit(STUDY.main())``, so that

    python -m experiments.<paper>.<study> preset=full model.d_model=512 out=runs/mine

works. ``preset``, ``out`` and ``repeat`` are the runner's own keys; every other ``key=value``
goes through :func:`moejax.config_overrides.apply_overrides`, so an unknown key or a bad
value fails before any compute with a message naming the key and the allowed keys/values (the
command line's parsing: :mod:`moejax.harness.cli`).

``smoke=true`` runs the preset as a smoke run (:mod:`moejax.harness.smoke`): real model sizes and
weights, every training run cut to a couple of steps of a few rows, evaluations to a couple of
batches, plus the study's own ``smoke`` overrides for what else it counts; once, not over
seeds (``python -m experiments.<paper>.<study> preset=full smoke=true``).

``repeat=N`` runs the study ``N`` times with its ``seed_keys`` (the config keys that seed a
run: init, data order, masks) offset by ``0 .. N-1``, each run in ``out/seed_<i>/``, and
writes every table again in ``out/`` as the mean and sample std over the runs
(:func:`moejax.harness.results.merge_seed_tables`), with the runs' headlines and plots linked. A
study declares its seed keys and how many runs its quick preset makes by default
(``Study(name, make_config, run, seed_keys=("train.seed",), quick_repeat=5)``).
"""

from __future__ import annotations

import errno
import gc
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from moejax.config import Config, ConfigError, find_configs, to_dict
from moejax.config_overrides import apply_overrides
from moejax.data.raw_files import DataDirError, MissingDataError
from moejax.harness import run_index
from moejax.harness.claims import SEED_TABLES, Claim, unjudged
from moejax.harness.cli import (
    PRESETS,
    asks_help,
    expand_variant,
    flag,
    parse_runner,
    preset_of,
    run_module,
    split_overwrite,
    usage,
)
from moejax.harness.results import RunDir, RunDirError
from moejax.harness.run_record import (
    RunOwnerError,
    claim_run_dir,
    config_hash,
    mark_run_state,
    read_run_record,
    write_run_record,
)
from moejax.harness.tables import mean_std, merge_seed_tables, nan_in_some_runs, read_csv_rows
from moejax.io._common import WeightFileError
from moejax.nn.moe import MoEConfig
from moejax.train.checkpoint import CheckpointWriteError, ForeignCheckpointError
from moejax.train.checkpoint_format import CheckpointMismatchError
from moejax.train.distributed import (
    EXIT_PEER_LOST,
    PeerLostError,
    PeerWatch,
    initialize_from_env,
)
from moejax.train.hparams import TrainConfig
from moejax.train.mesh import check_devices, resolve_mesh_shape
from moejax.train.run_lock import RunLock, RunLockedError
from moejax.train.run_state import ResumeError, sigterm_as_interrupt
from moejax.train.scale import measure_scale
from moejax.train.step import NonFiniteError

__all__ = ["run_experiment", "seed_offset", "main"]

ClaimsFn = Callable[[dict[str, list[dict]]], list[Claim]]

# a Ctrl-C or SIGTERM outside a training loop (whose own stop names its step and checkpoint)
STOPPED = ("interrupted by {}; the same command continues the run (its trainings from their "
           "checkpoints)")

# what a smoke run's summary says first, and why its claims are left unjudged
SMOKE_NOTE = ("**Smoke run**: every training run cut to a couple of steps of a few rows, every "
              "evaluation to a couple of batches (where no key on the command line sets them); "
              "its numbers test the pipeline, not the paper, and its claims are not judged.")
SMOKE_WHY = "a smoke run (training cut to a couple of steps) tests the pipeline, not the claim"


def _smoke_study(run_fn, claims: ClaimsFn | None):
    """``run_fn`` and ``claims`` for a smoke run: the run's summary opens with
    :data:`SMOKE_NOTE`, and every claim is still computed (its rule runs on the run's tables)
    but left inconclusive, so no verdict of a two-step run reads as the paper's."""
    def run_smoke(cfg, run):
        run.note(SMOKE_NOTE)
        return run_fn(cfg, run)

    def claims_smoke(tables):
        return [unjudged(c, SMOKE_WHY) for c in claims(tables)]

    return run_smoke, None if claims is None else claims_smoke


def _check_devices(cfg: Config) -> None:
    """Every training run's mesh and batch against this machine's devices and processes,
    before the run directory is written or anything compiles."""
    moes = find_configs(cfg, MoEConfig)
    for key, train_cfg in find_configs(cfg, TrainConfig):
        key = key or "train"
        check_devices(train_cfg, jax.device_count(), jax.process_count(), key)
        _, n_ep = resolve_mesh_shape(train_cfg.mesh_data, train_cfg.mesh_expert,
                                     jax.device_count(), train_cfg.mesh_tensor)
        for moe_key, moe in moes:
            if n_ep > 1 and moe.n_experts % n_ep:
                raise ConfigError(
                    f"{key}.mesh_expert={train_cfg.mesh_expert}: the expert axis ({n_ep} "
                    f"devices) does not divide {moe_key or 'moe'}.n_experts={moe.n_experts}; "
                    "choose an expert axis that divides the expert count")


def _get(cfg: Config, key: str):
    value = cfg
    for part in key.split("."):
        if not isinstance(value, Config) or not hasattr(value, part):
            raise ConfigError(f"seed key {key!r} is not a key of {type(cfg).__name__}")
        value = getattr(value, part)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"seed key {key!r} is not an int field (got {value!r})")
    return value


def seed_offset(cfg: Config, seed_keys: Sequence[str], i: int) -> Config:
    """``cfg`` with every key of ``seed_keys`` (dotted, e.g. ``train.seed``) raised by
    ``i``."""
    if not seed_keys:
        raise ConfigError("repeat > 1 needs the study's seed_keys (none declared)")
    return apply_overrides(cfg, [f"{k}={_get(cfg, k) + i}" for k in seed_keys])


def run_experiment(
    name: str,
    make_config: Callable[[str], Config],
    run_fn: Callable[[Config, RunDir], dict[str, Any]],
    argv: Sequence[str] = (),
    *,
    out: Path | None = None,
    seed_keys: Sequence[str] = (),
    quick_repeat: int = 1,
    claims: ClaimsFn | None = None,
    smoke: Sequence[str] = (),
    paper_scale: str = "",
    variants: Mapping[str, Sequence[str]] | None = None,
    derived_keys: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], RunDir]:
    """Run a study once or over seeds (module docstring); ``claims(tables) -> [Claim]`` judges
    the paper's claims from a run's tables (every run's and the merged ones) into its
    summary, each beside the scale the run trained at (:func:`moejax.train.scale.
    measure_scale`) and ``paper_scale``, the paper's; ``smoke``: the study's own overrides
    for ``smoke=true``; ``variants``: the study's declared variants by name, which
    ``variant=NAME`` on the command line selects (its overrides before the line's other keys;
    its own run directory ``runs/<name>_<variant>``; the run index and the results documents
    keep its newest run apart from the study's own); ``derived_keys``: the config keys the
    recipe sets itself (key -> what sets it), refused on the command line."""
    given = list(argv)
    argv, overwrite = split_overwrite(argv)
    argv, variant = expand_variant(name, argv, variants or {})
    variant_overrides = tuple((variants or {}).get(variant, ()))
    cfg, default_out, repeat = parse_runner(name, make_config, argv, quick_repeat, smoke,
                                            derived_keys, variant_overrides)
    if variant and not any(a.startswith("out=") for a in argv):  # the variant's own default
        default_out = default_out.with_name(f"{default_out.name}_{variant}")
    _check_devices(cfg)
    cfgs = [cfg]
    if repeat > 1:  # fail before any compute on a bad seed key
        cfgs = [seed_offset(cfg, seed_keys, i) for i in range(repeat)]
    out = out or default_out
    started = time.time()
    h = config_hash(to_dict(cfg))
    study_fn, judge = (_smoke_study(run_fn, claims) if flag(argv, "smoke")
                       else (run_fn, claims))
    RunDir.check_usable(out)
    lock = RunLock(out).acquire()  # the directory is this run's until it ends
    try:
        prior = read_run_record(out)  # a stopped run of this config keeps its finished seeds
        stopped = prior is not None and prior.get("state") in ("running", "interrupted")
        resuming = stopped and prior.get("config_hash") == h  # its finished seed runs kept
        claim_run_dir(out, study=name, variant=variant, cfg_hash=h, argv=given,
                      module=run_module(name, run_fn),
                      overwrite=overwrite, resume_force=any(
                          t.resume == "force" for _, t in find_configs(cfg, TrainConfig)))
        if stopped:  # whatever it saved (checkpoints, measurements) is taken up again
            print(f"[{name}] resuming the stopped run in {out}", flush=True)
        if preset_of(argv) == "full" and not flag(argv, "smoke") and jax.default_backend() == "cpu":
            print(f"[{name}] preset=full runs on this CPU: it is sized for a GPU or TPU and "
                  "runs far slower here (preset=quick is the CPU's)", file=sys.stderr, flush=True)
        try:
            if repeat == 1:
                summary, run = _run_once(name, cfg, study_fn, out, judge, paper_scale,
                                         lock=False, resumed=stopped)[:2]
                seed_runs = {}
            else:
                summary, run, runs = _run_repeat(name, cfg, cfgs, seed_keys, study_fn, out,
                                                 judge, paper_scale, keep_finished=resuming,
                                                 resumed=stopped)
                seed_runs = {r.path.name: _stems(r) for r in runs}
        except BaseException:
            mark_run_state(out, "interrupted")  # never shown as finished
            raise
        write_run_record(run.path, study=name, argv=given, started=started, repeat=repeat,
                         seeds={k: [_get(c, k) for c in cfgs] for k in seed_keys},
                         scale=run.scale, variant=variant, cfg_hash=h, tables=_stems(run),
                         seed_runs=seed_runs, preset=preset_of(argv),
                         smoke=flag(argv, "smoke"), module=run_module(name, run_fn),
                         resumed=stopped, kind=_run_kind(
                             name, make_config, argv, h, repeat, quick_repeat, smoke,
                             variant_overrides))
    finally:
        lock.release()
    run_index.record(run.path)  # the results documents read the newest run from the index
    return summary, run


def _run_kind(name, make_config, argv, cfg_hash: str, repeat: int, quick_repeat: int,
              smoke: Sequence[str], variant_overrides: Sequence[str] = ()) -> str:
    """``"preset"`` when the run's config is its preset's (with its variant's overrides) and it
    ran the preset's default number of seed runs; else ``"trial"`` (a key overridden, a
    repeat changed): the results documents publish preset runs only."""
    runner = [a for a in argv if a.partition("=")[0] in ("preset", "smoke")]
    preset_cfg, _, preset_repeat = parse_runner(name, make_config, runner, quick_repeat, smoke,
                                                variant_overrides=variant_overrides)
    same = config_hash(to_dict(preset_cfg)) == cfg_hash
    return "preset" if same and repeat == preset_repeat else "trial"


def _stems(run: RunDir) -> list[str]:
    """The CSV stems a run wrote (its own, not whatever else is in its directory)."""
    return [csv_name[:-len(".csv")] for _, _, csv_name in run.tables]


def _run_repeat(name, cfg, cfgs, seed_keys, run_fn, out, claims, paper_scale="",
                keep_finished: bool = False, resumed: bool = False):
    """Every seed run, then their merge; ``keep_finished`` (the repeat resumes a stopped run
    of its config): a seed run that finished before the stop is kept, not made again;
    ``resumed``: it continues a stopped run in ``out``, of its config or not."""
    repeat = len(cfgs)
    runs, summaries, heads, kept_runs, kept_s = [], [], [], [], 0.0
    t0 = time.time()
    for i, c in enumerate(cfgs):
        seeds = ", ".join(f"{k}={_get(c, k)}" for k in seed_keys)
        seed_dir, seed_hash = out / f"seed_{i}", config_hash(to_dict(c))
        kept = RunDir.reopen(seed_dir, seed_hash) if keep_finished else None
        if kept is not None:
            print(f"[{name}] seed run {i + 1}/{repeat}: {seeds}: finished before the stop, "
                  "kept", flush=True)
            run, summary, head = kept
            kept_runs.append(i)
            kept_s += float(summary.get("wall_s", 0.0))
        else:
            print(f"[{name}] seed run {i + 1}/{repeat}: {seeds}", flush=True)
            RunDir.forget_outcome(seed_dir)  # never kept half made again
            summary, run, head = _run_once(name, c, run_fn, seed_dir, claims, paper_scale)
            run.save_outcome(seed_hash, summary, head)
            _release_compiled()
        runs.append(run)
        summaries.append(summary)
        heads.append(head)
    summary, top = _merge_runs(name, cfg, seed_keys, runs, summaries, heads, out,
                               time.time() - t0 + kept_s, claims, paper_scale, kept_runs,
                               resumed=resumed)
    return summary, top, runs


def _release_compiled() -> None:
    """Drop the run's compiled executables before the next seed: XLA's CPU JIT maps about 3
    code sections per executable, a process may hold ``vm.max_map_count`` (65530 here) maps,
    and a repeat compiles every study function once per seed (a `darex_controlled` repeat
    that also re-traced a loop on every call died with ``LLVM ERROR: Unable to allocate
    section memory``)."""
    jax.clear_caches()
    gc.collect()


def _tables(run: RunDir) -> dict:
    """The tables ``run`` wrote (never another run's files left in its directory)."""
    return {stem: read_csv_rows(run.path / f"{stem}.csv") for stem in _stems(run)
            if stem != "claims"}


def _judge(run: RunDir, claims: ClaimsFn | None, seed_runs: Sequence[RunDir] = (),
           paper_scale: str = "") -> None:
    """The run's claims from its tables; a repeated study's merged run also hands each seed
    run's tables (:data:`moejax.harness.claims.SEED_TABLES`), so that its claims pair the seeds."""
    if claims is not None:
        tables = _tables(run)
        if seed_runs:
            tables[SEED_TABLES] = [_tables(r) for r in seed_runs]
        run.claims(claims(tables), paper_scale=paper_scale)


def _plain(summary: Mapping[str, Any]) -> dict[str, Any]:
    """A study's summary values with every numpy or jax scalar as the Python number it
    holds: averaged over seed runs as floats are, and recorded for a resume as they are."""
    return {k: v.item() if getattr(v, "shape", None) == () and hasattr(v, "item") else v
            for k, v in summary.items()}


# what a resumed run's summary says of its wall time (``run.json`` records ``resumed``)
RESUMED_NOTE = ("Resumed: this run continued a stopped run in this directory from "
                "whatever that run had saved (e.g. training checkpoints or "
                "kept measurements); the wall time is this invocation's alone.")
RESUMED_REPEAT_NOTE = ("Resumed: this run continued a stopped run in this directory from "
                       "whatever that run had saved; the wall time leaves out the stopped "
                       "run's time on the seed runs it had not finished.")


def _run_once(name, cfg, run_fn, out: Path, claims=None, paper_scale: str = "",
              lock: bool = True, resumed: bool = False) -> tuple[dict[str, Any], RunDir, str]:
    """One run of the study into ``out``; ``resumed``: it continues a stopped run there,
    which its summary says (:data:`RESUMED_NOTE`)."""
    run = RunDir.create(out, cfg, name=name, lock=lock)
    if resumed:
        run.note(RESUMED_NOTE)
    try:
        t0 = time.time()
        with measure_scale() as scale:
            summary = _plain(run_fn(cfg, run) or {})
        run.scale = scale.text()
        summary.setdefault("wall_s", round(time.time() - t0, 1))
        headline = str(summary.pop("headline", ""))
        _judge(run, claims, paper_scale=paper_scale)
        run.finish(headline)
    finally:
        run.close()
    return summary, run, headline


def _headline_keys(summaries: Sequence[dict], limit: int = 4) -> list[str]:
    """The first ``limit`` summary values every seed run reported as a float (not its wall
    time): what a repeated study's headline gives as mean +/- std."""
    keys = [k for k, v in summaries[0].items() if type(v) is float and k != "wall_s"
            and all(type(s.get(k)) is float for s in summaries)]
    return keys[:limit]


def _spread(key: str, vals: Sequence[float]) -> str:
    mean, sd = mean_std(vals)
    measured = sum(not math.isnan(v) for v in vals)
    of = f" ({measured} of {len(vals)} runs measured it)" if measured < len(vals) else ""
    return f"{key} {mean:.4g} +/- {sd:.2g}{of}"


def _merge_runs(name, cfg, seed_keys, runs, summaries, heads, out, wall_s, claims=None,
                paper_scale="", kept: Sequence[int] = (), resumed: bool = False):
    """The top-level run of a ``repeat``: every table merged over the seed runs, the
    numeric summary values averaged, each run's headline, notes and plots linked; ``kept``:
    the seed runs a stopped run had finished, said so; ``resumed``: the repeat continues a
    stopped run (:data:`RESUMED_REPEAT_NOTE`)."""
    top = RunDir.create(out, cfg, name=name)  # run_experiment holds its lock
    if resumed:
        top.note(RESUMED_REPEAT_NOTE)
    if kept:
        top.note(f"Seed run(s) {', '.join(map(str, kept))} finished before the run was "
                 "stopped and were kept when it resumed; the wall time adds theirs.")
    try:
        return _merge_into(top, seed_keys, runs, summaries, heads, wall_s, claims,
                           paper_scale)
    finally:
        top.close()


def _merge_into(top, seed_keys, runs, summaries, heads, wall_s, claims, paper_scale=""):
    n = len(runs)
    top.scale = runs[0].scale  # every seed run trains the same models
    top._t0 = time.time() - wall_s  # the summary's wall time covers every run
    top.note(f"{n} runs with {', '.join(seed_keys)} offset by 0..{n - 1}; tables: mean over "
             "the runs, with a sample std column for every value that varies "
             "(per-run results in `seed_<i>/`).")
    for title, md, csv_name in runs[0].tables:
        if csv_name == "claims.csv":  # judged again below, on the merged tables
            continue
        stem = csv_name[:-len(".csv")]
        tables = [read_csv_rows(r.path / csv_name) for r in runs]
        merged = merge_seed_tables(tables)
        if merged is None:
            top.note(f"Table `{stem}` differs in shape between runs and is not merged: "
                     + ", ".join(f"[seed {i}](seed_{i}/{md})" for i in range(n)) + ".")
            continue
        top.table(stem, merged, title=f"{title} (mean over {n} seed runs)")
        partial = nan_in_some_runs(tables)
        if partial:
            top.note(f"Table `{stem}` averages some cells over fewer runs: a run could not "
                     "measure them (NaN; see its `seed_<i>/` table): " + "; ".join(partial[:8])
                     + (f"; and {len(partial) - 8} more" if len(partial) > 8 else "") + ".")
    summary: dict[str, Any] = {}
    for key in summaries[0]:  # float values averaged; counts, choices and labels listed
        vals = [s.get(key) for s in summaries]
        summary[key] = (sum(vals) / n if all(type(v) is float for v in vals) else vals)
    lines = [f"- seed run {i} ([summary](seed_{i}/summary.md)): {head}"  # + shape verdicts
             + "".join(f" {note}" for note in runs[i].notes if "shape" in note)
             for i, head in enumerate(heads)]
    top.notes.insert(0, "Per-run headlines:\n\n" + "\n".join(lines) + "\n")
    for title, png in runs[0].plots:
        top.plots.append((f"{title} (seed run 0)", f"seed_0/{png}"))
    summary["wall_s"] = round(wall_s, 1)
    _judge(top, claims, runs, paper_scale)
    top.finish(f"Mean over {n} seed runs ({', '.join(seed_keys)})"
               + (": " + "; ".join(_spread(k, [s[k] for s in summaries])
                                   for k in _headline_keys(summaries)) + "."
                  if _headline_keys(summaries) else "."))
    return summary, top


def main(name: str, make_config: Callable[[str], Config],
         run_fn: Callable[[Config, RunDir], dict[str, Any]], argv: Sequence[str] | None = None,
         **study) -> int:
    """A study's command line: ``argv`` (default ``sys.argv[1:]``) run through
    :func:`run_experiment` with ``study``, its keywords (``seed_keys``, ``quick_repeat``,
    ``claims``, ``smoke``, ``paper_scale``, ``variants``, ``derived_keys``); the exit code
    (2: the user's to fix, one line)."""
    if "out" in study:
        raise TypeError("main() takes the output directory from the command line (out=...)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if asks_help(argv):
        preset = next((a.split("=", 1)[1] for a in argv if a.startswith("preset=")), "quick")
        print(usage(name, make_config, preset if preset in PRESETS else "quick",
                    study.get("variants"), module=run_module(name, run_fn),
                    derived=study.get("derived_keys")))
        return 0
    try:
        peers = initialize_from_env()  # one of several processes (SLURM, TPU pod, MOEJAX_*)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    code = _run_main(name, make_config, run_fn, argv, **study)
    if code and isinstance(peers, PeerWatch):  # failed: leave now, not waiting on the others
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # an orderly exit would wait on the distributed runtime's peers
    return code


def _run_main(name, make_config, run_fn, argv, **kw) -> int:
    try:
        with sigterm_as_interrupt(STOPPED.format("SIGTERM")):
            summary, run = run_experiment(name, make_config, run_fn, argv, **kw)
    except PeerLostError as e:  # exit now: the distributed runtime would abort the process
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_PEER_LOST)
    except (ConfigError, RunDirError, RunLockedError, RunOwnerError, ResumeError,
            CheckpointMismatchError, WeightFileError, DataDirError, MissingDataError,
            ForeignCheckpointError) as e:  # the user's to fix: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM: one line, the shell's code for it
        print(f"[{name}] stopped: {str(e) or STOPPED.format('Ctrl-C')}", file=sys.stderr)
        return 130
    except (CheckpointWriteError, NonFiniteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        print(f"error: disk full writing {e.filename or 'a file'} ({e.strerror}); nothing "
              "partial was kept (writes are atomic). Fix: free disk space (substrates: "
              "MOEJAX_SUBSTRATE_DIR names their cache) and run the same command again",
              file=sys.stderr)
        return 1
    except MemoryError:
        print(f"error: {name} ran out of host memory. Fix: lower the batch size or the model "
              "size (e.g. train.batch_size=...), or run on a machine with more memory",
              file=sys.stderr)
        return 1
    print(f"[{name}] wrote {run.path / 'summary.md'}")
    for k, v in summary.items():
        print(f"  {k}: {v}")
    return 0
