"""Random-access batch sources over in-memory arrays (the ``BatchSource`` protocol of source.py).

Both sources visit their rows epoch by epoch: global row ``g = position * batch_size + j`` is
row ``perm_e[g % n]`` of epoch ``e = g // n``, where ``perm_e`` is a permutation drawn from
``PRNG(seed, e)``. Batch ``position`` is therefore a pure function of ``(seed, position)``, every
row is seen once per epoch, and the data position saved in a checkpoint is one integer.

* :class:`PackedLMBatches`: rows of :class:`~moejax.data.packing.PackedRows`; returns ``inputs``,
  ``targets`` (int32), ``mask`` (float32) like ``lm_batches.WindowBatches``, plus
  ``segment_ids`` and ``positions`` (int32) for models that respect document boundaries.
* :class:`ClassificationBatches`: ``features`` array (token ids padded to a fixed length, or
  images) with integer ``labels``; returns ``inputs``, ``labels`` (int32) and, for token inputs,
  ``mask`` (float32, 1 on real tokens).
* :class:`PairLMBatches`: prompt/response rows (one pair per row) with the loss on responses.
* :class:`ArrayBatches`: rows of any dict of equal-length arrays (e.g. inputs, labels and a
  teacher's logits for distillation), returned under the same keys.
"""

from __future__ import annotations

import functools

import numpy as np

from moejax.data.packing import PackedRows, as_token_ids, lm_example, prompt_response_real
from moejax.data.source import check_source_settings, local_slice, stream_fingerprint

__all__ = [
    "EpochPermutation",
    "PackedLMBatches",
    "ClassificationBatches",
    "PairLMBatches",
    "ArrayBatches",
    "PromptResponseBatches",
    "pad_token_rows",
]


class EpochPermutation:
    """Maps global row numbers to row indices, reshuffling every epoch from ``(seed, epoch)``."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise ValueError("a batch source needs at least one row")
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self._cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) > 4:
                self._cache.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._cache[epoch] = (
                rng.permutation(self.num_rows) if self.shuffle else np.arange(self.num_rows)
            )
        return self._cache[epoch]

    def rows(self, global_rows: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(global_rows, self.num_rows)
        out = np.empty_like(global_rows)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[offsets[sel]]
        return out


class _RowSource:
    batch_size: int
    seed: int
    name: str = ""  # set by the loaders: the dataset, split and tokenizer the rows came from
    _order: EpochPermutation

    def _settle(self, num_rows: int, batch_size: int, seed: int, shuffle: bool) -> None:
        """Validate and set the batch size, seed and row order of ``num_rows`` rows."""
        check_source_settings(batch_size=batch_size, seed=seed)
        self.batch_size, self.seed = batch_size, seed
        self._order = EpochPermutation(num_rows, seed, shuffle)

    def _take(self, index: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _arrays(self) -> dict[str, np.ndarray]:
        """Every array the batches are drawn from."""
        raise NotImplementedError

    @functools.cached_property
    def fingerprint(self) -> str:
        """The stream's identity, stored with each checkpoint (a resumed run must match it):
        the loader's name, batch size, seed, order and a checksum of the rows."""
        return stream_fingerprint(self.name or type(self).__name__, self._arrays(),
                                  batch=self.batch_size, seed=self.seed,
                                  order="shuffled" if self._order.shuffle else "in order")

    def batch(self, position: int) -> dict[str, np.ndarray]:
        """The ``position``-th global batch (deterministic from seed and position)."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        g = position * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        return self._take(self._order.rows(g))

    def local_batch(self, position: int, process_index: int, process_count: int):
        """This process's contiguous slice of batch ``position`` (loads only those rows)."""
        if self.batch_size % process_count:
            local_slice({"x": np.zeros(self.batch_size)}, process_index, process_count)  # raises
        per = self.batch_size // process_count
        g = position * self.batch_size + process_index * per + np.arange(per, dtype=np.int64)
        return self._take(self._order.rows(g))

    def batches_per_epoch(self) -> int:
        """Full batches in one pass over the rows (the last partial one wraps into the next)."""
        return max(1, self._order.num_rows // self.batch_size)


class PackedLMBatches(_RowSource):
    """Shuffled batches of packed LM rows; ``shuffle=False`` reads rows in order (evaluation)."""

    def __init__(self, rows: PackedRows, *, batch_size: int, seed: int = 0, shuffle: bool = True):
        self.rows, self.seq_len = rows, rows.seq_len
        self._settle(rows.num_rows, batch_size, seed, shuffle)

    def _take(self, index):
        return lm_example(self.rows, index)

    def _arrays(self):
        r = self.rows
        return {"tokens": r.tokens, "segment_ids": r.segment_ids, "positions": r.positions}


def pad_token_rows(docs, seq_len: int, *, pad_id: int = 0, bos_id: int | None = None):
    """``(ids [n, seq_len] int32, mask [n, seq_len] float32)``: each doc truncated / right-padded.

    With ``bos_id`` each row starts with it (for a classifier that reads a leading token).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    ids = np.full((len(docs), seq_len), pad_id, np.int32)
    mask = np.zeros((len(docs), seq_len), np.float32)
    for i, d in enumerate(docs):
        d = as_token_ids(d, f"document {i}")
        if bos_id is not None:
            d = np.concatenate([[bos_id], d]).astype(np.int32)
        d = d[:seq_len]
        ids[i, : len(d)] = d
        mask[i, : len(d)] = 1.0
    return ids, mask


class ClassificationBatches(_RowSource):
    """Shuffled batches of ``(inputs, labels[, mask])`` rows."""

    def __init__(
        self,
        inputs: np.ndarray,
        labels: np.ndarray,
        *,
        batch_size: int,
        seed: int = 0,
        mask: np.ndarray | None = None,
        num_classes: int | None = None,
        shuffle: bool = True,
    ):
        inputs, labels = np.asarray(inputs), np.asarray(labels)
        if inputs.shape[0] != labels.shape[0]:
            raise ValueError(f"{inputs.shape[0]} inputs but {labels.shape[0]} labels")
        if mask is not None and np.shape(mask) != inputs.shape:
            raise ValueError(f"mask shape {np.shape(mask)} differs from inputs shape "
                             f"{inputs.shape}")
        if labels.ndim != 1 or not (np.issubdtype(labels.dtype, np.integer)
                                    or labels.dtype == bool):
            raise ValueError(f"labels of shape {labels.shape} and dtype {labels.dtype}; give "
                             "one integer class id a row (a float would be truncated)")
        n = int(num_classes if num_classes is not None else labels.max(initial=0) + 1)
        if labels.size and (labels.min() < 0 or labels.max() >= n):
            raise ValueError(f"labels in [{labels.min()}, {labels.max()}] for num_classes={n}; "
                             "each must be a class id in [0, num_classes)")
        self.inputs, self.labels = inputs, labels.astype(np.int32)
        self.mask = None if mask is None else np.asarray(mask)
        self.num_classes = n
        self._settle(labels.shape[0], batch_size, seed, shuffle)

    def __len__(self) -> int:
        return self.labels.shape[0]

    def _take(self, index):
        out = {"inputs": self.inputs[index], "labels": self.labels[index]}
        if self.mask is not None:
            out["mask"] = self.mask[index].astype(np.float32)
        return out

    def _arrays(self):
        out = {"inputs": self.inputs, "labels": self.labels}
        return out if self.mask is None else {**out, "mask": self.mask}


class ArrayBatches(_RowSource):
    """Shuffled batches of the rows of ``arrays`` (a dict of arrays sharing their first axis);
    each batch is a dict with the same keys."""

    def __init__(self, arrays: dict, *, batch_size: int, seed: int = 0, shuffle: bool = True):
        self.arrays = {k: np.asarray(v) for k, v in arrays.items()}
        lengths = {k: v.shape[0] if v.ndim else "no row axis" for k, v in self.arrays.items()}
        if not lengths or len(set(lengths.values())) != 1 or "no row axis" in lengths.values():
            raise ValueError(f"ArrayBatches needs arrays with one common length, got {lengths}")
        self._settle(next(iter(lengths.values())), batch_size, seed, shuffle)

    def __len__(self) -> int:
        return self._order.num_rows

    def _take(self, index):
        return {k: v[index] for k, v in self.arrays.items()}

    def _arrays(self):
        return self.arrays


class PairLMBatches(_RowSource):
    """Prompt/response rows from :func:`~moejax.data.packing.pack_pairs`; loss on responses only.

    Returns ``inputs``, ``targets``, ``segment_ids``, ``positions`` (int32; one segment per row,
    0 on padding) and ``mask`` (float32, 1 on response targets and the final ``eos``).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        loss: np.ndarray,
        *,
        batch_size: int,
        seed: int = 0,
        pad_id: int = 0,
        shuffle: bool = True,
    ):
        if tokens.shape != loss.shape:
            raise ValueError(f"tokens {tokens.shape} and loss {loss.shape} differ in shape")
        self.tokens, self.loss, self.pad_id = tokens, loss, pad_id
        self.seq_len = tokens.shape[1] - 1
        # row length = up to the last non-pad token (the final eos is never pad)
        nonpad = tokens != pad_id
        self.lengths = np.where(nonpad.any(1), tokens.shape[1] - np.argmax(nonpad[:, ::-1], 1), 0)
        self._settle(tokens.shape[0], batch_size, seed, shuffle)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def _take(self, index):
        tok = self.tokens[index]
        pos = np.arange(self.seq_len, dtype=np.int32)
        seg = (pos[None, :] < self.lengths[index][:, None]).astype(np.int32)
        return {
            "inputs": tok[:, :-1].astype(np.int32),
            "targets": tok[:, 1:].astype(np.int32),
            "mask": self.loss[index][:, 1:].astype(np.float32),
            "segment_ids": seg,
            "positions": np.where(seg > 0, pos[None, :], 0).astype(np.int32),
        }

    def _arrays(self):
        return {"tokens": self.tokens, "loss": self.loss}


class PromptResponseBatches(_RowSource):
    """Shuffled batches of the arrays of :func:`~moejax.data.packing.prompt_response_rows`
    (``prompts``, ``prompt_lens``, ``tokens``, ``response_mask``), plus the teacher-forcing
    view of the dataset responses: ``inputs`` / ``targets`` (``tokens`` shifted by one),
    ``mask`` (1 where the target is a response token) and ``token_mask`` (1 on the real
    inputs, the prompt part and response, 0 on the padding after them:
    :func:`~moejax.data.packing.prompt_response_real`)."""

    def __init__(self, rows: dict, *, batch_size: int, seed: int = 0, shuffle: bool = True):
        self.rows = {k: np.asarray(v) for k, v in rows.items()}
        _check_prompt_response_rows(self.rows)
        self._settle(len(self), batch_size, seed, shuffle)

    def __len__(self) -> int:
        return self.rows["tokens"].shape[0]

    def _take(self, index):
        out = {k: v[index] for k, v in self.rows.items()}
        tok = out["tokens"]
        real = prompt_response_real(out["prompt_lens"], out["response_mask"])
        out.update(inputs=tok[:, :-1], targets=tok[:, 1:],
                   mask=out["response_mask"][:, 1:].astype(np.float32),
                   token_mask=real[:, :-1].astype(np.float32))
        return out

    def _arrays(self):
        return self.rows


def _check_prompt_response_rows(rows: dict) -> None:
    """Refuse, before any batch, rows that are not :func:`~moejax.data.packing.
    prompt_response_rows`' layout: a missing array, arrays of different row counts (a batch
    that drew a row past the shortest would fail mid-run, and rows past it would pair with
    other rows' prompts), token ids that are not integers, a response mask of another shape
    than the tokens, prompt lengths outside ``[1, prompt width]``."""
    missing = [k for k in ("prompts", "prompt_lens", "tokens", "response_mask") if k not in rows]
    if missing:
        raise ValueError(f"PromptResponseBatches: rows lack {missing}; give the arrays of "
                         "moejax.data.packing.prompt_response_rows")
    counts = {k: v.shape[0] if v.ndim else None for k, v in rows.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"PromptResponseBatches: the arrays hold different numbers of rows "
                         f"{counts}; give one entry per row in each")
    prompts, lens, tokens = rows["prompts"], rows["prompt_lens"], rows["tokens"]
    for name, a, ndim in (("prompts", prompts, 2), ("prompt_lens", lens, 1),
                          ("tokens", tokens, 2)):
        if a.ndim != ndim or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"PromptResponseBatches: {name} of shape {a.shape} and dtype "
                             f"{a.dtype}; give integers of {ndim} axes")
    if rows["response_mask"].shape != tokens.shape:
        raise ValueError(f"PromptResponseBatches: response_mask of shape "
                         f"{rows['response_mask'].shape} for tokens of shape {tokens.shape}; "
                         "give one entry per token")
    if lens.size and (lens.min() < 1 or lens.max() > min(prompts.shape[1], tokens.shape[1])):
        raise ValueError(f"PromptResponseBatches: prompt_lens in [{lens.min()}, {lens.max()}] "
                         f"for prompts of width {prompts.shape[1]}; each must be in [1, "
                         f"{min(prompts.shape[1], tokens.shape[1])}]")
