"""The batch-source protocol the training loop consumes.

A batch source is *random access*: ``source.batch(position)`` returns the ``position``-th
global batch as a dict of numpy arrays, deterministically from the source's seed. The training
loop's data position is therefore one integer (the number of batches consumed), saved in every
checkpoint; resuming at position ``n`` continues with exactly the batches an uninterrupted run
would have seen.

The protocol, for any source a study or a user writes: ``batch_size`` (rows per global batch)
and ``batch(position) -> dict of numpy arrays`` (or any pytree of arrays), a pure function of
the source's seed and ``position``; sources over a finite row set visit the rows epoch by
epoch in an order drawn from ``(seed, epoch)`` (:class:`moejax.data.batches.EpochPermutation`)
and expose ``__len__`` (rows) and ``batches_per_epoch``; window sources over a token stream
(:class:`moejax.data.lm_batches.WindowBatches`) draw offsets from ``(seed, position)``. The
training loop also accepts a plain ``position -> batch`` callable.

For multi-process runs, ``source.local_batch(position, process_index, process_count)`` returns
this process's contiguous slice of the global batch along axis 0 (the default implementation
slices ``batch``; sources may override it to load only their shard).

A source may name its stream by a ``fingerprint`` string; the training loop stores it with
each checkpoint and refuses to resume from a source of another. moejax.data's sources derive
theirs from their settings and a checksum of their rows (:func:`stream_fingerprint`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from moejax.config import check_count
from moejax.integrity import array_checksum, json_checksum

__all__ = ["BatchSource", "local_slice", "stream_fingerprint", "check_source_settings"]


@runtime_checkable
class BatchSource(Protocol):
    batch_size: int

    def batch(self, position: int) -> dict[str, np.ndarray]: ...


def local_slice(batch: dict[str, np.ndarray], process_index: int, process_count: int):
    """This process's contiguous share of a global batch (axis 0)."""
    out = {}
    for name, arr in batch.items():
        n = arr.shape[0]
        if n % process_count:
            raise ValueError(
                f"global batch of {n} rows in {name!r} is not divisible by {process_count} "
                "processes; choose batch_size as a multiple of the process count"
            )
        per = n // process_count
        out[name] = arr[process_index * per : (process_index + 1) * per]
    return out


def stream_fingerprint(name: str, arrays: dict, **settings) -> str:
    """``"<name>/<key>=<value>/.../rows <crc>"``: a data stream's identity from the settings
    that order its batches and a CRC-32 over every array it draws from, so that any other data
    (another file, tokenizer, slice or packing) gets another fingerprint."""
    rows = json_checksum({k: array_checksum(v) for k, v in arrays.items()})
    return "/".join([name, *(f"{k}={v}" for k, v in settings.items()), f"rows {rows}"])


def check_source_settings(*, batch_size, seed, **counts) -> None:
    """Refuse, when a source is made, a batch size or another count (``seq_len``) that is not
    an integer >= 1, and a seed that is not an integer >= 0: a batch size of 0 served empty
    batches, and a float failed at the first batch, deep in numpy."""
    for name, v in {"batch_size": batch_size, **counts}.items():
        check_count(name, v, 1)
    check_count("seed", seed, 0)
