"""Packing tokenised documents into fixed-length rows, with document boundaries recorded.

Every document becomes ``[bos] + tokens + [eos]``; the documents are concatenated into one stream
in order, and row ``r`` is the window ``stream[r * seq_len : r * seq_len + seq_len + 1]`` (rows
overlap by one token, so every next-token transition of the stream is a target exactly once);
the tail is padded with ``pad_id``. A document may continue into the next row.

Per token of a row (``seq_len + 1`` long):

* ``segment_ids``: 1, 2, ... numbering the documents present in the row in order; 0 is padding.
* ``positions``: position of the token within its segment in this row (0 at a document's first
  token, or at the row start for a document continued from the previous row).

:func:`lm_example` turns a row into ``inputs``/``targets``/``mask`` (plus ``segment_ids`` and
``positions`` of the inputs); ``mask`` is 1 only where input and target belong to the same
document, so no loss is taken on predicting across a document boundary or on padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PackedRows", "pack_documents", "lm_example", "pack_pairs", "prompt_response_rows",
           "prompt_response_real", "as_token_ids"]


def as_token_ids(doc, what: str = "a document") -> np.ndarray:
    """``doc`` as a 1-D int32 array of token ids; an empty sequence is an empty document.
    Refuses float ids (a cast would truncate 3.7 to the token 3), negative ids and nested
    sequences, naming ``what``."""
    a = _integer_ids(doc, what)
    if a.size and a.min() < 0:
        raise ValueError(f"{what} holds the token id {a.min()}; token ids are >= 0")
    return a


def _integer_ids(doc, what: str) -> np.ndarray:
    """:func:`as_token_ids` less the sign check (which a packer does once on its stream)."""
    a = np.asarray(doc)
    if a.size == 0:
        return np.zeros(0, np.int32)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"{what} of shape {a.shape} and dtype {a.dtype}; give a 1-D sequence "
                         "of integer token ids (a float would be truncated to another token)")
    return a.astype(np.int32, copy=False)


@dataclass(frozen=True)
class PackedRows:
    """``tokens``, ``segment_ids``, ``positions``: int32 arrays of shape ``[rows, seq_len + 1]``."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1] - 1


def pack_documents(
    docs: Sequence[np.ndarray],
    seq_len: int,
    *,
    bos_id: int = 1,
    eos_id: int = 2,
    pad_id: int = 0,
) -> PackedRows:
    """Pack token-id documents (in the given order) into rows of ``seq_len + 1`` tokens."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if len(docs) == 0:
        raise ValueError("no documents to pack")
    lengths = np.array([len(d) + 2 for d in docs], dtype=np.int64)
    pieces = []
    for i, d in enumerate(docs):
        pieces += [
            np.array([bos_id], np.int32),
            _integer_ids(d, f"document {i}"),
            np.array([eos_id], np.int32),
        ]
    stream = np.concatenate(pieces)
    if stream.min() < 0:  # one pass over the stream, not one per document
        for i, d in enumerate(docs):
            as_token_ids(d, f"document {i}")  # raises, naming the first with one
        raise ValueError(f"bos_id={bos_id}, eos_id={eos_id}: token ids are >= 0")
    n = stream.shape[0]
    itype = np.int32 if n + seq_len < 2**31 else np.int64  # halves peak memory on big corpora
    doc_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(itype)
    doc_of = np.repeat(np.arange(len(docs), dtype=itype), lengths)

    rows = max(1, -(-(n - 1) // seq_len))  # enough rows that every transition is covered
    idx = (
        np.arange(rows, dtype=itype)[:, None] * itype(seq_len)
        + np.arange(seq_len + 1, dtype=itype)[None, :]
    )
    valid = idx < n
    safe = np.minimum(idx, n - 1)
    tokens = np.where(valid, stream[safe], pad_id).astype(np.int32)
    row_doc = doc_of[safe]
    seg = row_doc - row_doc[:, :1] + 1  # documents are contiguous, so this numbers them 1, 2, ...
    segment_ids = np.where(valid, seg, 0).astype(np.int32)
    row_start = (np.arange(rows, dtype=itype) * itype(seq_len))[:, None]
    positions = np.where(valid, idx - np.maximum(doc_start[row_doc], row_start), 0).astype(np.int32)
    return PackedRows(tokens=tokens, segment_ids=segment_ids, positions=positions)


def lm_example(rows: PackedRows, index) -> dict[str, np.ndarray]:
    """Next-token-prediction arrays for the rows ``index`` (an int array)."""
    tok = rows.tokens[index]
    seg = rows.segment_ids[index]
    same_doc = (seg[..., 1:] == seg[..., :-1]) & (seg[..., 1:] > 0)
    return {
        "inputs": tok[..., :-1].astype(np.int32),
        "targets": tok[..., 1:].astype(np.int32),
        "mask": same_doc.astype(np.float32),
        "segment_ids": seg[..., :-1].astype(np.int32),
        "positions": rows.positions[index][..., :-1].astype(np.int32),
    }


def pack_pairs(
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    seq_len: int,
    *,
    bos_id: int = 1,
    eos_id: int = 2,
    pad_id: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """One row per prompt/response pair, for supervised fine-tuning.

    Row = ``[bos] + prompt + [eos, bos] + response + [eos]``, right-padded to ``seq_len + 1``.
    When too long, the response is kept (truncated at its end if it alone does not fit) and the
    prompt loses its *beginning*. Returns ``(tokens [n, seq_len + 1] int32, loss [n, seq_len + 1]
    float32)`` where ``loss[i, t] = 1`` if token ``t`` is a response token or the final ``eos``
    (i.e. a target the model is trained to produce).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    width = seq_len + 1
    if width < 6:
        raise ValueError(f"seq_len={seq_len} leaves no room for prompt and response (need >= 5)")
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    loss = np.zeros((len(prompts), width), np.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        r = as_token_ids(r, f"response {i}")[: width - 4]
        room = width - 4 - len(r)
        p = as_token_ids(p, f"prompt {i}")
        p = p[len(p) - room :] if room > 0 else p[:0]
        row = np.concatenate([[bos_id], p, [eos_id, bos_id], r, [eos_id]]).astype(np.int32)
        tokens[i, : len(row)] = row
        loss[i, len(row) - len(r) - 1 : len(row)] = 1.0
    return tokens, loss


def prompt_response_rows(
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    prompt_len: int,
    response_len: int,
    *,
    bos_id: int = 1,
    eos_id: int = 2,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Pairs laid out for generation and distillation (the row format of :func:`pack_pairs`).

    Prompt part ``[bos] + prompt + [eos, bos]`` (the prompt loses its beginning when longer
    than ``prompt_len``), response part ``response[:response_len - 1] + [eos]``. Returns
    ``prompts`` ``[n, prompt_len]`` (right-padded), ``prompt_lens`` ``[n]``, ``tokens``
    ``[n, prompt_len + response_len]`` (each row's prompt part directly followed by its
    response, then padding) and ``response_mask`` (1 on the response tokens and final eos).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if prompt_len < 4 or response_len < 2:
        raise ValueError(f"prompt_len={prompt_len} must be >= 4 and response_len="
                         f"{response_len} >= 2")
    n, width = len(prompts), prompt_len + response_len
    out = {"prompts": np.full((n, prompt_len), pad_id, np.int32),
           "prompt_lens": np.zeros((n,), np.int32),
           "tokens": np.full((n, width), pad_id, np.int32),
           "response_mask": np.zeros((n, width), np.float32)}
    for i, (p, r) in enumerate(zip(prompts, responses)):
        p = as_token_ids(p, f"prompt {i}")
        p = p[max(0, len(p) - (prompt_len - 3)):]
        head = np.concatenate([[bos_id], p, [eos_id, bos_id]]).astype(np.int32)
        tail = np.concatenate([as_token_ids(r, f"response {i}")[: response_len - 1], [eos_id]])
        out["prompts"][i, : len(head)] = head
        out["prompt_lens"][i] = len(head)
        out["tokens"][i, : len(head)] = head
        out["tokens"][i, len(head): len(head) + len(tail)] = tail
        out["response_mask"][i, len(head): len(head) + len(tail)] = 1.0
    return out


def prompt_response_real(prompt_lens_B, response_mask_BS):
    """``[B, S]`` bool: True on each row's real tokens, its prompt part and its response, False
    on the padding after them (the layout of :func:`prompt_response_rows` and of sampled rows,
    :mod:`moejax.nn.sample`). Numpy in, numpy out; jax arrays (also traced) in, jax out."""
    n_B = prompt_lens_B + (response_mask_BS > 0).sum(-1)
    return n_B[:, None] > np.arange(response_mask_BS.shape[-1])[None, :]
