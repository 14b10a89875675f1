"""Loaders: batch sources built from the array_record datasets, and a resumable iterator.

    tok = ByteTokenizer()                               # or bpe_for("prose/pydoc", 4096)
    src = lm_batches("stdlib_code", "train", tok, seq_len=256, batch_size=32, seed=0)
    it = BatchIterator(src, fingerprint=src.fingerprint)
    batch = next(it)                                    # src.batch(it.position) then position += 1
    ckpt["data"] = it.state_dict()                      # {"position": int, "fingerprint": str}
    it.load_state_dict(ckpt["data"])                    # resume: the same batches follow

Documents are read from the TFDS data source in its stored (deterministic) order, tokenised
(BPE results cached by :mod:`moejax.data.token_cache`), and packed (see
:mod:`moejax.data.packing`). All randomness is ``(seed, position)``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from moejax.data import datasets, raw_files
from moejax.data.batches import (
    ClassificationBatches,
    PackedLMBatches,
    PairLMBatches,
    PromptResponseBatches,
    pad_token_rows,
)
from moejax.data.builders_labelled import LEXNAMES, POS_NAMES
from moejax.data.packing import pack_documents, pack_pairs, prompt_response_rows
from moejax.data.token_cache import tokenized_docs
from moejax.data.tokenizer import BpeTokenizer, train_bpe
from moejax.files import move_aside

__all__ = [
    "read_texts",
    "lm_batches",
    "classification_batches",
    "image_batches",
    "chat_batches",
    "chat_prompt_response",
    "bpe_for",
    "BatchIterator",
    "TEXT_FIELD",
    "LABELS",
]

log = logging.getLogger(__name__)

TEXT_FIELD = {
    "stdlib_code": "text",
    "prose/pydoc": "text",
    "prose/kjv": "text",
    "wordnet_glosses": "gloss",
    "chitchat": "response",
}
LABELS = {"pos": POS_NAMES, "lexname": LEXNAMES}
_IMAGE_SCALE = {"mnist5k": 255.0, "digits": 16.0}


def read_texts(name: str, split: str, field: str | None = None, **ds_kwargs) -> list[str]:
    """The ``field`` texts of every example of a split, in the data source's order."""
    field = field or TEXT_FIELD[name]
    ds = datasets.load(name, split, **ds_kwargs)
    return [datasets.decode_text(ex[field]) for ex in datasets.read_all(ds)]


def lm_batches(
    name: str,
    split: str,
    tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    shuffle: bool | None = None,
    **ds_kwargs,
) -> PackedLMBatches:
    """Packed next-token batches of a text dataset; shuffled by default only for ``train``."""
    docs = tokenized_docs(name, split, tokenizer, TEXT_FIELD[name], **ds_kwargs)
    rows = pack_documents(
        docs, seq_len, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id
    )
    src = PackedLMBatches(
        rows,
        batch_size=batch_size,
        seed=seed,
        shuffle=(split == "train") if shuffle is None else shuffle,
    )
    src.name = _name("lm", name, split, tokenizer.fingerprint, f"seq{seq_len}")
    return src


def classification_batches(
    split: str,
    tokenizer,
    *,
    task: str = "lexname",
    seq_len: int = 64,
    batch_size: int,
    seed: int = 0,
    shuffle: bool | None = None,
    **ds_kwargs,
) -> ClassificationBatches:
    """WordNet gloss classification: ``task="pos"`` (4 classes) or ``"lexname"`` (45 classes).

    ``inputs`` are ``[bos] + gloss tokens`` truncated / padded to ``seq_len``, ``mask`` marks
    real tokens, ``labels`` the class ids (names in ``LABELS[task]``).
    """
    if task not in LABELS:
        raise ValueError(f"task={task!r}; allowed: {sorted(LABELS)}")
    ds = datasets.load("wordnet_glosses", split, **ds_kwargs)
    examples = datasets.read_all(ds)
    docs = tokenizer.encode_batch([datasets.decode_text(e["gloss"]) for e in examples])
    ids, mask = pad_token_rows(docs, seq_len, pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id)
    labels = np.array([int(e[task]) for e in examples], np.int32)
    src = ClassificationBatches(
        ids,
        labels,
        mask=mask,
        batch_size=batch_size,
        seed=seed,
        num_classes=len(LABELS[task]),
        shuffle=(split == "train") if shuffle is None else shuffle,
    )
    src.name = _name("cls", task, split, tokenizer.fingerprint, f"seq{seq_len}")
    return src


def image_batches(
    name: str,
    split: str,
    *,
    batch_size: int,
    seed: int = 0,
    shuffle: bool | None = None,
    **ds_kwargs,
) -> ClassificationBatches:
    """``mnist5k`` / ``digits`` batches: ``inputs`` float32 in [0, 1] ``[B, H, W]``, ``labels``."""
    if name not in _IMAGE_SCALE:
        raise ValueError(f"name={name!r}; image datasets: {sorted(_IMAGE_SCALE)}")
    ds = datasets.load(name, split, **ds_kwargs)
    examples = datasets.read_all(ds)
    images = np.stack([e["image"] for e in examples]).astype(np.float32) / _IMAGE_SCALE[name]
    labels = np.array([int(e["label"]) for e in examples], np.int32)
    src = ClassificationBatches(
        images,
        labels,
        batch_size=batch_size,
        seed=seed,
        num_classes=10,
        shuffle=(split == "train") if shuffle is None else shuffle,
    )
    src.name = _name("img", name, split)
    return src


def chat_batches(
    split: str,
    tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    prompt_field: str = "prompt",
    shuffle: bool | None = None,
    **ds_kwargs,
) -> PairLMBatches:
    """Chit-chat prompt/response rows (loss on the response); ``prompt_field="context"`` gives
    the model up to three previous turns instead of one."""
    if prompt_field not in ("prompt", "context"):
        raise ValueError(f"prompt_field={prompt_field!r}; allowed: 'prompt', 'context'")
    examples = datasets.load_split("chitchat", split, **ds_kwargs)
    prompts = [datasets.decode_text(e[prompt_field]) for e in examples]
    responses = [datasets.decode_text(e["response"]) for e in examples]
    tokens, loss = pack_pairs(
        tokenizer.encode_batch(prompts),
        tokenizer.encode_batch(responses),
        seq_len,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
    )
    src = PairLMBatches(
        tokens,
        loss,
        batch_size=batch_size,
        seed=seed,
        pad_id=tokenizer.pad_id,
        shuffle=(split == "train") if shuffle is None else shuffle,
    )
    src.name = _name("chat", prompt_field, split, tokenizer.fingerprint, f"seq{seq_len}")
    return src


def chat_prompt_response(split: str, tokenizer, *, prompt_len: int, response_len: int,
                         batch_size: int, seed: int = 0, limit: int = 0,
                         prompt_field: str = "prompt", shuffle: bool | None = None,
                         **ds_kwargs) -> PromptResponseBatches:
    """Chit-chat pairs as :class:`PromptResponseBatches` (prompts kept apart from responses,
    for sampling from a student and for distillation); ``limit`` > 0 keeps the first
    ``limit`` pairs of the split."""
    if prompt_field not in ("prompt", "context"):
        raise ValueError(f"prompt_field={prompt_field!r}; allowed: 'prompt', 'context'")
    examples = datasets.load_split("chitchat", split, limit=limit, **ds_kwargs)
    rows = prompt_response_rows(
        tokenizer.encode_batch([datasets.decode_text(e[prompt_field]) for e in examples]),
        tokenizer.encode_batch([datasets.decode_text(e["response"]) for e in examples]),
        prompt_len, response_len, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id)
    src = PromptResponseBatches(rows, batch_size=batch_size, seed=seed,
                                shuffle=(split == "train") if shuffle is None else shuffle)
    src.name = _name("chat-pairs", prompt_field, split, tokenizer.fingerprint,
                     f"prompt{prompt_len}", f"response{response_len}")
    return src


def bpe_for(
    name: str, vocab_size: int, *, data_dir=None, max_examples_per_split: int | None = None
) -> BpeTokenizer:
    """A BPE trained on the ``train`` split of ``name``, cached as ``tokenizer.json``.

    Cached at ``<data dir>/tokenizers/<name>-bpe<vocab_size>/tokenizer.json`` (written
    atomically); later calls load it. A cached file that cannot be read back as a moejax BPE
    is moved aside (``tokenizer.json.corrupt-<time>``, with a warning) and trained again.
    """
    root = raw_files.data_dir(data_dir)
    if max_examples_per_split is not None:
        root = root / "_slices" / f"max{int(max_examples_per_split)}"
    path = (
        Path(root) / "tokenizers" / f"{name.replace('/', '-')}-bpe{vocab_size}" / "tokenizer.json"
    )
    if path.exists():
        try:
            return BpeTokenizer.load(path)
        except ValueError as e:  # unreadable, or not one of ours: set aside and trained again
            log.warning("%s; moved to %s and trained again", e, move_aside(path))
    texts = read_texts(
        name, "train", data_dir=data_dir, max_examples_per_split=max_examples_per_split
    )
    return train_bpe(texts, vocab_size, path=path)


def _name(*parts) -> str:
    return "/".join(str(p) for p in parts)


class BatchIterator:
    """Iterates ``source.batch(position)``; its state is ``{"position", "fingerprint"}``.

    Save ``state_dict()`` in the run's checkpoint; ``load_state_dict`` restores the position and
    refuses a state written for a source of another fingerprint (other rows, batch size, seed
    or order), which would silently change the data stream.
    """

    def __init__(self, source, *, position: int = 0, fingerprint: str | None = None):
        self.source = source
        self.position = int(position)
        self.fingerprint = (
            fingerprint
            if fingerprint is not None
            else getattr(source, "fingerprint", type(source).__name__)
        )

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = self.source.batch(self.position)
        self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"position": self.position, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"data state was saved for source {state.get('fingerprint')!r} but this run uses "
                f"{self.fingerprint!r}; resume with the original data settings or start at "
                "position 0"
            )
        self.position = int(state["position"])
