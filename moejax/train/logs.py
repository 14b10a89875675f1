"""What the training loop writes while it runs: ``metrics.csv`` / ``eval.csv`` (append-only,
trimmed back to the resumed step on resume, nothing lost) and TensorBoard event files."""

from __future__ import annotations

import csv
import io
import logging
import os
import shutil
import time

from moejax.files import atomic_write_text, unused_name

__all__ = ["CsvLog", "TensorBoardLog", "read_csv", "FIRST_COLS", "eval_numbers"]

log = logging.getLogger(__name__)

FIRST_COLS = ["step", "loss", "lr", "grad_norm", "tokens_per_s"]


def eval_numbers(result, step: int) -> dict[str, float]:
    """An ``eval_fn``'s result as the row ``eval.csv`` gets: a dict of numbers (Python, numpy
    or 0-d jax scalars). Anything else is refused in one line naming the key and the step."""
    if not hasattr(result, "items"):
        raise TypeError(f"eval_fn returned {type(result).__name__} at step {step}; it must "
                        "return a dict of numbers, e.g. {'accuracy': 0.93}")
    out = {}
    for k, v in result.items():
        out[k] = _number(v)
        if out[k] is None:
            shape = getattr(v, "shape", ())
            what = f"an array of shape {shape}" if shape != () else repr(v)[:60]
            raise TypeError(f"eval_fn returned {k}={what} at step {step}; each value must be "
                            "one number (reduce an array, leave text out of the dict)")
    return out


def _number(v) -> float | None:
    """``v`` as a float where it is one number, else None."""
    if getattr(v, "shape", ()) != ():
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


class CsvLog:
    """Append-only CSV whose columns are fixed by the first row; on resume rows past the
    resumed step (written after the last checkpoint of a crashed run) are dropped."""

    def __init__(self, path: str, resume_step: int):
        self.path, self.cols = path, None
        if os.path.exists(path):
            with open(path, newline="") as f:
                text = f.read()
            # a line without its newline was cut off by a kill or a full disk: "1" of "13,..."
            # would read as a row of step 1
            whole = text[:text.rfind("\n") + 1]
            all_rows = list(csv.DictReader(io.StringIO(whole)))
            rows = [r for r in all_rows if int(float(r["step"])) <= resume_step]
            if len(rows) < len(all_rows) or whole != text:  # keep what is dropped
                backup = unused_name(f"{path}.before-resume-at-{resume_step}")
                shutil.copyfile(path, backup)
                log.warning("%s: dropped %d rows past the resumed step %d%s (a copy of the old "
                            "file is in %s)", path, len(all_rows) - len(rows), resume_step,
                            " and a line cut off before its end" if whole != text else "",
                            backup)
            if rows:
                self.cols = list(rows[0].keys())
            buf = io.StringIO()  # rewritten whole or not at all: a crash keeps the old file
            if self.cols:
                w = csv.DictWriter(buf, self.cols)
                w.writeheader()
                w.writerows(rows)
            atomic_write_text(path, buf.getvalue())

    def write(self, rows: list[dict]) -> None:
        if not rows:
            return
        new = self.cols is None
        if new:
            row = rows[0]
            self.cols = [c for c in FIRST_COLS if c in row] + sorted(
                c for c in row if c not in FIRST_COLS
            )
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, self.cols, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerows(rows)


class TensorBoardLog:
    """Scalars to TensorBoard event files (tensorboardX, the ``tb`` extra). ``purge_step``: a
    resumed run's first step; TensorBoard drops the earlier run's events from it on, as the
    metrics CSV drops its rows past the resumed step, so the steps between the checkpoint and
    a crash are not drawn twice. Each run writes its own file."""

    def __init__(self, logdir: str, purge_step: int | None = None):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "train.tensorboard=True needs tensorboardX: pip install -e '.[tb]' "
                "(or set train.tensorboard=False)"
            ) from e
        # tensorboardX names its file by the second and opens it for writing: a run resumed
        # within the second of the last would overwrite the last one's events
        self.writer = SummaryWriter(logdir, purge_step=purge_step,
                                    filename_suffix=f".{time.time_ns()}")

    def write(self, rows: list[dict], prefix: str = "") -> None:
        for row in rows:
            for k, v in row.items():
                if k != "step":
                    self.writer.add_scalar(prefix + k, v, int(row["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_csv(path: str) -> list[dict]:
    """Rows of a metrics CSV as dicts of strings."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
