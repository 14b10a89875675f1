"""Every registered study's and benchmark's full preset, proven here before it meets an
accelerator: as a smoke run, or ahead of time for GPU and TPU. One table each.

    python -m experiments.full_smoke                          # smoke -> runs/full_smoke/
    python -m experiments.full_smoke mode=aot                 # -> runs/full_aot/
    python -m experiments.full_smoke only=moee,lm_demo timeout=1800 out=runs/smoke2
    python -m experiments.full_smoke preset=quick devices=2 out=runs/smoke_devices
    python -m experiments.full_smoke mode=aot only=ders_upcycling \
        "ders_upcycling.sm_rates=(0.999,0.9999)"                # a study's own keys

Each study runs in its own Python, so its peak host memory is its own. ``preset=quick``
smokes the quick presets instead; ``devices=N`` gives each study N CPU devices
(``JAX_NUM_CPU_DEVICES=N``, :func:`moejax.train.distributed.cpu_devices_env`), so every
training loop, evaluator and benchmark runs with its arrays spread over a mesh of several
devices, as on a multi-GPU host (``make smoke-devices``; the devices column says how many
the study saw).

``mode=smoke`` runs it as ``python -m experiments.<paper>.<study> preset=full smoke=true`` would
(:mod:`moejax.harness.smoke`: real model sizes and weights, every training run cut to a couple of
steps of a few rows, evaluations to a couple of batches, plus the study's ``smoke`` cuts).
The table (``full_smoke.md`` / ``.csv``, rewritten after every study) gives per study: the
largest trained model's parameters and its tokens (or rows) per smoke step (read from the
training loop's ``jax.monitoring`` scalars; "-" where the study trains nothing), the peak
resident memory, the wall time, OK or the error's last line, the depth ("full", or the keys
of a study's ``smoke_depth`` where its full preset cannot fit this machine: fewer layers,
every layer's shape kept) and the study's own cuts.

``mode=aot`` runs the recipe with its training runs configured whole but executed as in a
smoke run (:func:`moejax.capture.capture_steps`: 2 steps of 4 rows; evaluations and the
study's counts cut as in a smoke run; substrates cached apart) and proves every distinct
training step it starts at its real shapes (:func:`moejax.train.aot.prove_step`, as
each run starts, so a study stopped by its timeout keeps the rows proven before; runs of one
program, e.g. one distillation method's runs over seeds, are proven once and their steps
summed): parameters, FLOPs per step, weights, optimizer state and activations per device,
whether one H100 80 GB holds it, the cuda and tpu exports with their kernels, and the GPU
hours of all the full preset's runs of that step; and every distinct decode loop it calls
(:func:`moejax.train.aot.prove_decode`, at the shapes the smoke cuts give it); then the full
preset's runs on the real checkpoints a study names (``Study.checkpoint_runs``: e.g.
OLMoE-1B-7B and Qwen1.5-MoE-A2.7B, built from their ``config.json`` alone, no weights). A
study's ``smoke_depth`` applies to the recipe's runs, and the depth column says so
(``full_aot.md``).

A study past ``timeout`` seconds is stopped and reported as such. ``<study>.<key>=<value>``
sets one of that study's own config keys after the cuts (e.g. to prove only some of its
arms again); each is checked against the study's config before anything runs, and the
depth column names it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax

from experiments import load_study
from experiments.main import REGISTRY
from moejax.capture import CapturedStep, capture_steps
from moejax.config import ConfigError
from moejax.config_overrides import apply_overrides
from moejax.files import atomic_write_text
from moejax.harness.cli import asks_help, study_names
from moejax.harness.results import RunDir, RunDirError
from moejax.harness.smoke import SMOKE_ROWS, SMOKE_STEPS, smoke_config
from moejax.harness.study import Study
from moejax.pytree import fmt_count
from moejax.train.aot import prove_decode, prove_step
from moejax.train.distributed import cpu_devices_env
from moejax.train.run_lock import RunLockedError
from moejax.train.run_state import sigterm_as_interrupt, stops_deferred
from moejax.train.scale import measure_scale

__all__ = ["main", "child"]

MODES = {"smoke": "runs/full_smoke", "aot": "runs/full_aot"}


def _error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def _smoke(study: Study, out: Path, overrides=(), preset: str = "full") -> dict:
    """The study's ``preset`` as a smoke run (``overrides``: key=value after the cuts); the
    largest trained model's size and the devices jax saw."""
    result = {"ok": False, "error": "", "devices": jax.device_count()}
    with measure_scale() as scale:
        try:
            study.run_experiment([f"preset={preset}", "smoke=true", *overrides], out=out)
            result["ok"] = True
        except Exception as e:  # reported in the table, and in full in the study's log
            traceback.print_exc()
            result["error"] = _error(e)
    if scale.runs:
        result.update(params=scale.params, tokens=scale.per_step)
    return result


class _Prover:
    """Proves each captured program as the recipe records it (runs of one program, the same
    shapes, once, their steps summed) and rewrites ``report`` after each, so the rows proven
    before a stop (a timeout, running out of memory) are kept."""

    def __init__(self, result: dict, report: Path | None):
        self.result, self.report = result, report
        self.groups: dict = {}  # program key -> (row, its runs)

    def __call__(self, c) -> None:
        key = _shapes(c)
        if key in self.groups:
            row, runs = self.groups[key]
            runs.append(c)
        else:
            try:
                row = prove_step(c) if isinstance(c, CapturedStep) else prove_decode(c)
            except Exception as e:  # one program's failure is a row, the others still count
                traceback.print_exc()
                row = {"error": _error(e)}
            if isinstance(c, CapturedStep) and "error" not in row:
                row["gpu_hours_per_step"] = row["gpu_hours"] / c.cfg.steps
            runs = [c]
            self.groups[key] = (row, runs)
            self.result["rows"].append(row)
        row.update(run=", ".join(sorted({r.label or "train" for r in runs})), runs=len(runs))
        if isinstance(c, CapturedStep) and "error" not in row:
            row["steps"] = sum(r.cfg.steps for r in runs)
            row["gpu_hours"] = row["gpu_hours_per_step"] * row["steps"]
        self.write()

    def write(self) -> None:
        if self.report is not None:
            atomic_write_text(self.report, json.dumps(self.result, default=str) + "\n")


def _aot(study: Study, out: Path, overrides=(), report: Path | None = None) -> dict:
    """The study's training runs captured whole (executed as in a smoke run) and each
    distinct one proven ahead of time as it starts; ``overrides`` (key=value) after the cuts,
    e.g. a reduced depth; ``report``: rewritten with the rows so far after each proof."""
    cfg = apply_overrides(smoke_config(study.make_config("full"), cut_training=False),
                          [*study.smoke_cuts, *overrides])
    result = {"ok": False, "error": "", "rows": []}
    prover = _Prover(result, report)
    run = RunDir.create(out, cfg, name=study.name, lock=True)
    with capture_steps(steps=SMOKE_STEPS, rows=SMOKE_ROWS, on_capture=prover):
        try:
            study.run(cfg, run)
        except Exception as e:  # the runs proven so far are kept
            traceback.print_exc()
            result["error"] = _error(e)
        finally:
            run.close()
    if study.checkpoint_runs is not None:  # real checkpoints, from their config.json alone
        for c in study.checkpoint_runs(cfg):
            prover(c)
    for row in result["rows"]:
        row.pop("gpu_hours_per_step", None)
    result["ok"] = not result["error"] and all("error" not in r for r in result["rows"])
    return result


def _shapes(c) -> tuple:
    """What makes two captured runs or decode calls the same program: the kind, the shapes of
    what it takes, a step's ``program`` (a benchmark's dispatch path) and a decode's static
    arguments and model structure."""
    args = (c.state, c.batch) if isinstance(c, CapturedStep) else c.args
    leaves = [x for x in jax.tree.leaves(args) if isinstance(x, jax.ShapeDtypeStruct)]
    static = (c.program,) if isinstance(c, CapturedStep) else (
        getattr(c.fn, "__name__", ""), sorted(c.static.items(), key=str),
        # the models' structure (graphdefs): e.g. a dense and a chunk-sparse path of one model
        tuple(hash(a) for a in c.args if not jax.tree.leaves(a) or not isinstance(
            jax.tree.leaves(a)[0], jax.ShapeDtypeStruct)))
    return (type(c).__name__, str(static), tuple((x.shape, str(x.dtype)) for x in leaves))


def child(name: str, out: str, report: str, mode: str = "smoke", overrides=(),
          preset: str = "full") -> int:
    """Run ``name``'s ``preset`` (smoke mode; aot proves the full one) in ``mode`` into
    ``out`` (``overrides``: the study's own key=value); write ``report`` (JSON)."""
    study = load_study(name)
    result = (_smoke(study, Path(out), overrides, preset) if mode == "smoke"
              else _aot(study, Path(out), overrides, report=Path(report)))
    atomic_write_text(Path(report), json.dumps(result, default=str) + "\n")
    return 0 if result["ok"] else 1


def _run_child(name: str, out: Path, timeout: float, mode: str, overrides=(),
               preset: str = "full", devices: int = 0) -> tuple[dict, float, float]:
    """One study in its own Python (``devices`` > 0: that many simulated CPU devices,
    :func:`moejax.train.distributed.cpu_devices_env`, so the training loop's mesh, the
    evaluators and the benchmarks span several): its report, wall time and peak resident
    memory (GB)."""
    report = out / f"{name}.{mode}.json"
    report.unlink(missing_ok=True)
    env = dict(os.environ)
    if mode == "aot":  # untrained substrates never enter the shared cache
        env["MOEJAX_SUBSTRATE_DIR"] = str(out / "substrates")
    if devices:
        env = cpu_devices_env(devices, env)
    code = ("import sys; from experiments.full_smoke import child; "
            f"sys.exit(child({name!r}, {str(out / name)!r}, {str(report)!r}, {mode!r}, "
            f"{list(overrides)!r}, {preset!r}))")
    t0, proc = time.time(), None
    with open(out / f"{name}.log", "w") as log:
        try:
            # its own process group, so that a timeout ends the study and every process it
            # started; a stop while it starts comes once the runner holds its process
            with stops_deferred():
                proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, env=env,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.time() - t0 > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    _, status, usage = os.wait4(proc.pid, 0)
                    break
                time.sleep(0.5)
        except BaseException:  # Ctrl-C or SIGTERM here: the study's group ends with this one
            if proc is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                os.wait4(proc.pid, 0)
            raise
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped above
    wall = time.time() - t0
    rec = json.loads(report.read_text()) if report.is_file() else {"ok": False, "error": ""}
    if wall > timeout:
        rec["error"] = f"stopped after the {timeout:.0f} s timeout"
    elif not rec.get("ok") and not rec.get("error"):
        rec["error"] = f"exit code {proc.returncode} (see {name}.log)"
    return rec, wall, usage.ru_maxrss / 2**20  # ru_maxrss: KiB


def _count(n) -> str:
    return "-" if n is None else fmt_count(float(n))


def _depth(study: Study, overrides=()) -> str:
    """The depth column: the study's ``smoke_depth`` keys (or "full") and what was set."""
    return " ".join([*study.smoke_depth, *overrides]) or "full"


def _smoke_rows(name: str, rec: dict, wall: float, peak: float, overrides=()) -> list[dict]:
    study = load_study(name)
    return [{"study": name, "devices": rec.get("devices", "-"),
             "parameters": _count(rec.get("params")),
             "tokens/step (smoke)": _count(rec.get("tokens")),
             "peak host memory (GB)": round(peak, 2), "wall (s)": round(wall, 1),
             "result": "OK" if rec.get("ok") else rec["error"],
             "depth": _depth(study, overrides),
             "study's smoke cuts": " ".join(study.smoke) or "-"}]


def _aot_rows(name: str, rec: dict, wall: float, peak: float, overrides=()) -> list[dict]:
    depth = _depth(load_study(name), overrides)
    return [{"depth": depth, **row} for row in _proven_rows(name, rec)]


def _proven_rows(name: str, rec: dict) -> list[dict]:
    rows = []
    for r in rec.get("rows", []):
        if "error" in r:
            rows.append({"study": name, "run": r["run"], "result": r["error"]})
            continue
        if "flops_per_call" in r:  # a decode loop
            rows.append({"study": name, "run": f"decode: {r['run']}",
                         "parameters": _count(r["params"]),
                         "batch": f"{r['batch']} + {r['new_tokens']} new", "runs": r["runs"],
                         "steps (all runs)": "-",
                         "FLOPs/step": f"{r['flops_per_call']:.3g} per loop body",
                         "weights (GB)": round(r["weights_GB"], 3), "opt state (GB)": "-",
                         "activations (GB)": round(r["activations_GB"], 3),
                         "peak per device (GB)": round(r["peak_GB"], 3),
                         "fits one H100 80GB": "yes" if r["fits_H100_80GB"] else "no",
                         "cuda kernels": r["cuda_kernels"], "tpu kernels": r["tpu_kernels"],
                         "GPU hours at 40% MFU": "-", "result": "OK"})
            continue
        rows.append({"study": name, "run": r["run"], "parameters": _count(r["params"]),
                     "batch": r["batch"], "runs": r.get("runs", 1),
                     "steps (all runs)": r["steps"],
                     "FLOPs/step": f"{r['flops_per_step']:.3g}"
                     + (f" + {r['uncounted_calls']} kernel calls" if r["uncounted_calls"]
                        else ""),
                     "weights (GB)": round(r["weights_GB"], 3),
                     "opt state (GB)": round(r["opt_state_GB"], 3),
                     "activations (GB)": round(r["activations_GB"], 3),
                     "peak per device (GB)": round(r["peak_GB"], 3),
                     "fits one H100 80GB": "yes" if r["fits_H100_80GB"] else "no",
                     "cuda kernels": r["cuda_kernels"], "tpu kernels": r["tpu_kernels"],
                     "GPU hours at 40% MFU": f"{r['gpu_hours']:.3g}"
                     + (" (lower bound)" if r["uncounted_calls"] else ""),
                     "result": "OK"})
    if rec.get("error"):  # where the recipe stopped, with its runs untrained
        rows.append({"study": name, "run": "(rest of the recipe)",
                     "result": f"stopped after {len(rows)} captured runs: {rec['error']}"})
    elif not rows:
        rows.append({"study": name, "run": "(none)", "result": "OK: the recipe ran to its end "
                     "without a training run or decode loop to prove"})
    return rows


def _parse(argv) -> tuple[list[str], Path, float, str, dict[str, list[str]], dict]:
    opts = {"only": "", "out": "", "timeout": "3600", "mode": "smoke", "preset": "full",
            "devices": "0"}
    overrides: dict[str, list[str]] = {}
    for item in argv:
        key, sep, value = item.partition("=")
        study, dot, study_key = key.partition(".")
        if sep and dot and study in REGISTRY and study_key:
            overrides.setdefault(study, []).append(f"{study_key}={value}")
            continue
        if not sep or key not in opts:
            raise ConfigError(f"bad argument {item!r}; allowed: mode=smoke|aot only=a,b "
                              "out=DIR timeout=S preset=full|quick devices=N "
                              "<study>.<key>=<value>")
        if not value.strip():
            raise ConfigError(f"{key}= is empty: give it a value or leave it out")
        opts[key] = value
    if opts["mode"] not in MODES:
        raise ConfigError(f"mode={opts['mode']!r}: expected one of {', '.join(MODES)}")
    if opts["preset"] not in ("full", "quick"):
        raise ConfigError(f"preset={opts['preset']!r}: expected full or quick")
    if opts["mode"] == "aot" and (opts["preset"] != "full" or opts["devices"] != "0"):
        raise ConfigError("mode=aot proves the full presets for cuda and tpu: preset= and "
                          "devices= are for mode=smoke")
    if not opts["devices"].isdigit():
        raise ConfigError(f"devices={opts['devices']!r}: expected a count of CPU devices "
                          "(0: as the environment gives them)")
    names = study_names(opts["only"], REGISTRY) if opts["only"] else list(REGISTRY)
    try:
        timeout = float(opts["timeout"])
    except ValueError:
        timeout = 0.0
    if timeout <= 0:
        raise ConfigError(f"timeout={opts['timeout']!r}: expected seconds > 0")
    for study, items in overrides.items():
        if study not in names:
            raise ConfigError(f"{study}.{items[0]}: {study} is not among the studies to run "
                              f"({', '.join(names)}); add it to only=")
        apply_overrides(load_study(study).make_config(opts["preset"]), items)  # bad key/value
    child = {"preset": opts["preset"], "devices": int(opts["devices"])}
    return (names, Path(opts["out"] or MODES[opts["mode"]]), timeout, opts["mode"], overrides,
            child)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if asks_help(argv):
        print(__doc__)
        return 0
    try:
        names, out, timeout, mode, overrides, child_opts = _parse(argv)
        run = RunDir.create(out, name=f"full_{mode}", lock=True)
    except (ConfigError, RunDirError, RunLockedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows, ok = [], 0
    to_rows = _smoke_rows if mode == "smoke" else _aot_rows
    on = (f" on {child_opts['devices']} CPU devices" if child_opts["devices"] else "")
    title = (f"{child_opts['preset'].capitalize()} presets as smoke runs{on}" if mode == "smoke"
             else "Full presets ahead of time: every training step at its real shapes")
    done = 0
    try:
        with sigterm_as_interrupt("stopped by SIGTERM"):
            for name in names:
                print(f"[full_{mode}] {done + 1}/{len(names)} {name}", flush=True)
                rec, wall, peak = _run_child(name, out, timeout, mode, overrides.get(name, ()),
                                             **child_opts)
                ok += bool(rec.get("ok"))
                rows += to_rows(name, rec, wall, peak, overrides.get(name, ()))
                print(f"    {'OK' if rec.get('ok') else rec.get('error')} in {wall:.1f} s, "
                      f"peak {peak:.2f} GB", flush=True)
                run.tables.clear()
                run.table(f"full_{mode}", rows, title=title)
                done += 1
        run.note(f"Each study ran in its own Python (`python -m experiments.full_smoke "
                 f"{' '.join(argv) or f'mode={mode}'}`); its log is beside this summary "
                 f"({out}/<study>.log).")
        run.finish(f"{ok} of {len(names)} {child_opts['preset']} presets proven ({mode}"
                   f"{on}).")
    except KeyboardInterrupt as e:  # the running study's processes were ended with it
        during = f" during {names[done]}" if done < len(names) else ""
        print(f"[full_{mode}] {str(e) or 'stopped by Ctrl-C'}{during}: the table in {out} holds "
              f"the {done} {'study' if done == 1 else 'studies'} that finished before it",
              file=sys.stderr)
        return 130
    finally:
        run.close()
    print(f"[full_{mode}] wrote {out / 'summary.md'}")
    return 0 if ok == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
