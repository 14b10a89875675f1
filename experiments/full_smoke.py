"""Every registered study's and benchmark's full preset as a smoke run, one table.

    python -m experiments.full_smoke                          # all -> runs/full_smoke/
    python -m experiments.full_smoke only=moee,lm_demo timeout=1800 out=runs/smoke2

Each study runs in its own Python as ``python -m experiments.<study> preset=full smoke=true``
would (:mod:`moejax.smoke`: real model sizes and weights, every training run cut to a couple
of steps of a few rows, evaluations to a couple of batches, plus the study's ``SMOKE`` cuts),
so its peak host memory is its own. The table (``full_smoke.md`` / ``.csv``, rewritten after
every study) gives per study: the largest trained model's parameters and its tokens (or rows)
per smoke step (read from the training loop's ``jax.monitoring`` scalars; "-" where the study
trains nothing), the peak resident memory, the wall time, OK or the error's last line, and
the study's own cuts (a reduced depth among them says the full preset does not fit here).
A study past ``timeout`` seconds is stopped and reported as such.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from experiments.main import REGISTRY
from moejax.config import ConfigError
from moejax.files import atomic_write_text
from moejax.results import RunDir

__all__ = ["main", "child"]

def child(name: str, out: str, report: str) -> int:
    """Run ``name``'s full preset as a smoke run into ``out``; write ``report`` (JSON: ok,
    error, the largest trained model's parameters and its tokens per step)."""
    import jax

    from moejax.experiment import run_experiment

    seen: dict[str, float] = {}
    last_params: list[float] = []

    def listen(event: str, value: float, **_) -> None:  # the loop records params, then tokens
        if event == "/moejax/train/params":
            last_params[:] = [value]
        elif event == "/moejax/train/tokens_per_step" and last_params:
            if last_params[0] >= seen.get("params", -1.0):
                seen.update(params=last_params[0], tokens=value)

    jax.monitoring.register_scalar_listener(listen)
    module = importlib.import_module(f"experiments.{name}")
    result = {"ok": False, "error": ""}
    try:
        run_experiment(name, module.make_config, module.run, ["preset=full", "smoke=true"],
                       out=Path(out), seed_keys=getattr(module, "SEED_KEYS", ()),
                       claims=getattr(module, "claims", None),
                       smoke=getattr(module, "SMOKE", ()))
        result["ok"] = True
    except Exception as e:  # reported in the table, and in full on stderr
        traceback.print_exc()
        lines = str(e).strip().splitlines()
        result["error"] = f"{type(e).__name__}: {lines[-1] if lines else ''}"
    result.update(params=seen.get("params"), tokens=seen.get("tokens"))
    atomic_write_text(Path(report), json.dumps(result) + "\n")
    return 0 if result["ok"] else 1


def _run(name: str, out: Path, timeout: float) -> dict:
    """One study in its own Python: its report, wall time and peak resident memory."""
    report = out / f"{name}.smoke.json"
    report.unlink(missing_ok=True)
    log = open(out / f"{name}.log", "w")
    code = ("import sys; from experiments.full_smoke import child; "
            f"sys.exit(child({name!r}, {str(out / name)!r}, {str(report)!r}))")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    timed_out, status, usage = False, 0, None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.time() - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            timed_out = True
            break
        time.sleep(0.5)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped above
    log.close()
    rec = json.loads(report.read_text()) if report.is_file() else {"ok": False, "error": ""}
    if timed_out:
        rec["error"] = f"stopped after the {timeout:.0f} s timeout"
    elif not rec.get("error") and not rec.get("ok"):
        rec["error"] = f"exit code {proc.returncode} (see {name}.log)"
    module = importlib.import_module(f"experiments.{name}")
    return {"study": name,
            "parameters": _count(rec.get("params")),
            "tokens/step (smoke)": _count(rec.get("tokens")),
            "peak host memory (GB)": round(usage.ru_maxrss / 2**20, 2),  # ru_maxrss: KiB
            "wall (s)": round(time.time() - t0, 1),
            "result": "OK" if rec.get("ok") else rec["error"],
            "study's smoke cuts": " ".join(getattr(module, "SMOKE", ())) or "-"}


def _count(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _parse(argv) -> tuple[list[str], Path, float]:
    opts = {"only": "", "out": "runs/full_smoke", "timeout": "3600"}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in opts:
            raise ConfigError(f"bad argument {item!r}; allowed: only=a,b out=DIR timeout=S")
        opts[key] = value
    names = [n for n in opts["only"].split(",") if n] or list(REGISTRY)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ConfigError(f"only={unknown} not registered; registered: {', '.join(REGISTRY)}")
    try:
        timeout = float(opts["timeout"])
    except ValueError:
        timeout = 0.0
    if timeout <= 0:
        raise ConfigError(f"timeout={opts['timeout']!r}: expected seconds > 0")
    return names, Path(opts["out"]), timeout


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        names, out, timeout = _parse(argv)
        run = RunDir.create(out, name="full_smoke", lock=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    try:
        for i, name in enumerate(names):
            print(f"[full_smoke] {i + 1}/{len(names)} {name}", flush=True)
            rows.append(_run(name, out, timeout))
            print(f"    {rows[-1]['result']} in {rows[-1]['wall (s)']} s, "
                  f"peak {rows[-1]['peak host memory (GB)']} GB", flush=True)
            run.tables.clear()
            run.table("full_smoke", rows, title="Full presets as smoke runs")
        ok = sum(r["result"] == "OK" for r in rows)
        run.note(f"Each study ran as `python -m experiments.<study> preset=full smoke=true`; "
                 f"per-study logs beside this summary ({out}/<study>.log).")
        run.finish(f"{ok} of {len(rows)} full presets ran end to end as smoke runs.")
    finally:
        run.close()
    print(f"[full_smoke] wrote {out / 'summary.md'}")
    return 0 if all(r["result"] == "OK" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
