"""Pretrained tokenizers (``tokenizers`` library) with the moejax tokenizer interface.

* :func:`tokenizer_from_gguf`: rebuilds a GGUF model's byte-level BPE tokenizer (vocabulary,
  merges, special tokens, bos/eos/pad ids, chat template) from the GGUF metadata alone.
* :func:`tokenizer_from_json`: a HF ``tokenizer.json`` (e.g. MiniLM's WordPiece).
* :func:`tokenizer_from_hf_dir`: a model directory's ``tokenizer.json`` with the special ids
  its ``config.json`` / ``generation_config.json`` name (a Qwen or OLMoE checkpoint).

Both return :class:`HFTokenizer`, which has the interface of
:mod:`moejax.data.tokenizer` (``encode`` -> int32 numpy without specials unless asked,
``encode_batch``, ``decode``, ``vocab_size``, ``fingerprint``) plus ``pad_id``/``bos_id``/
``eos_id``, :meth:`HFTokenizer.encode_padded` (for encoders) and
:meth:`HFTokenizer.apply_chat_template`.

Chat templates are Jinja. ``jinja2`` is used (sandboxed) when installed; otherwise a built-in
renderer handles ChatML templates (``<|im_start|>role\\ncontent<|im_end|>\\n``, SmolLM2/Qwen
style, including a default system prompt written in the template) and anything else raises
an error naming ``pip install jinja2``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moejax.config import is_integer
from moejax.extras import require
from moejax.io._common import WeightFileError, existing_file

__all__ = ["HFTokenizer", "tokenizer_from_gguf", "tokenizer_from_json", "tokenizer_from_hf_dir",
           "render_chat_template"]

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
# llama.cpp's pre-tokenizer types rebuilt here: the GPT-2 byte-level regex, alone or after
# splitting digits one by one (the StarCoder family's rule)
_GGUF_PRE_TOKENIZERS = {"gpt-2": "plain", "smollm": "digits", "starcoder": "digits",
                        "refact": "digits"}


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with moejax's interface and the model's special ids."""

    def __init__(self, tokenizer, *, pad_id: int | None, bos_id: int | None,
                 eos_id: int | None, chat_template: str | None = None,
                 add_special_tokens: bool = False, name: str = ""):
        self.tokenizer = tokenizer
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.chat_template = chat_template
        self.add_special_tokens = add_special_tokens  # e.g. BERT's [CLS] ... [SEP]
        self.name = name

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def fingerprint(self) -> str:
        """Identifies the tokenizer in caches and checkpoints."""
        digest = hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()[:16]
        return f"hf-{digest}"

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> np.ndarray:
        """Token ids (int32). Special-token strings in ``text`` (e.g. ``<|im_start|>``) map to
        their ids; BOS/CLS-style specials are added only if ``add_special_tokens``."""
        add = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=add).ids, np.int32)

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool | None = None):
        add = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        encs = self.tokenizer.encode_batch(list(texts), add_special_tokens=add)
        return [np.asarray(e.ids, np.int32) for e in encs]

    def encode_padded(self, texts: Sequence[str], max_len: int | None = None):
        """``(tokens_BT int32, mask_BT bool)`` right-padded with ``pad_id`` to the longest
        text; specials added as configured. ``max_len`` truncates each text as the
        ``tokenizers`` library does: the text's tokens are cut so that the row, its specials
        included, has at most ``max_len`` (a BERT row still ends with ``[SEP]``)."""
        if not len(texts):
            raise ValueError("encode_padded: no texts; give at least one")
        if max_len is None:
            ids = self.encode_batch(texts)
        else:
            n_special = (self.tokenizer.num_special_tokens_to_add(False)
                         if self.add_special_tokens else 0)
            if not is_integer(max_len) or max_len < n_special + 1:
                raise ValueError(f"encode_padded: max_len={max_len!r}; give an integer >= "
                                 f"{n_special + 1} (the {n_special} special tokens of a row "
                                 "and at least one of its text)")
            ids = []
            for enc in self.tokenizer.encode_batch(list(texts), add_special_tokens=False):
                enc.truncate(max_len - n_special)
                if self.add_special_tokens:
                    enc = self.tokenizer.post_process(enc, add_special_tokens=True)
                ids.append(np.asarray(enc.ids, np.int32))
        T = max(1, max(len(x) for x in ids))
        tokens = np.full((len(ids), T), self.pad_id or 0, np.int32)
        mask = np.zeros((len(ids), T), bool)
        for i, x in enumerate(ids):
            tokens[i, :len(x)], mask[i, :len(x)] = x, True
        return tokens, mask

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids the tokenizer does not know (a model's padded vocabulary) are
        dropped, as the ``tokenizers`` library does. Float or negative ids are refused."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0):
            raise ValueError(f"decode: ids of dtype {ids.dtype} (least {ids.min()}); give "
                             "integer token ids >= 0 (a float would be truncated)")
        return self.tokenizer.decode(ids.astype(np.int64).tolist(),
                                     skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], *,
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``[{"role", "content"}]``) under the model's
        chat template; encode it with :meth:`encode` (specials are recognised)."""
        if not self.chat_template:
            raise ValueError(f"tokenizer {self.name!r} has no chat template")
        return render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt)


def render_chat_template(template: str, messages: Sequence[dict], *,
                         add_generation_prompt: bool = True) -> str:
    """Render a Jinja chat template (see the module docstring for the no-jinja2 fallback)."""
    for m in messages:
        if not {"role", "content"} <= set(m):
            raise ValueError(f"chat message {m!r} needs 'role' and 'content'")
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return _render_chatml(template, messages, add_generation_prompt)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=list(messages),
                                            add_generation_prompt=add_generation_prompt)


def _render_chatml(template: str, messages, add_generation_prompt: bool) -> str:
    if "<|im_start|>" not in template or "<|im_end|>" not in template:
        raise NotImplementedError("this chat template is not ChatML and jinja2 is not "
                                  "installed; fix: pip install jinja2")
    out = []
    default = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, re.S)
    if default and messages and messages[0]["role"] != "system" and "loop.first" in template:
        out.append(f"<|im_start|>system\n{default.group(1)}<|im_end|>\n")
    for m in messages:
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def tokenizer_from_gguf(metadata: dict, source="<gguf>") -> HFTokenizer:
    """Rebuild the tokenizer stored in GGUF ``metadata`` (``tokenizer.ggml.*``).

    Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE). The pre-tokenizer follows
    ``tokenizer.ggml.pre``: ``"smollm"``, ``"starcoder"`` and ``"refact"`` split digits
    individually before the GPT-2 regex; ``"gpt-2"`` (or no such key, as in files older than
    the key) is the plain GPT-2 byte-level regex. Others (``"llama-bpe"``, ``"qwen2"`` ...)
    split text by other rules and are refused: their token ids would differ from the model's.
    Tokens of type CONTROL / USER_DEFINED become special added tokens with their original ids.
    """
    tk = require("tokenizers", "moejax.io.hf_tokenizer")
    AddedToken, Tokenizer, decoders, models, pre_tokenizers = (  # noqa: N806
        tk.AddedToken, tk.Tokenizer, tk.decoders, tk.models, tk.pre_tokenizers)

    def need(key):
        if key not in metadata:
            raise WeightFileError(source, f"GGUF metadata key {key!r} is missing; cannot "
                                  "rebuild the tokenizer", "use a GGUF file with tokenizer "
                                  "metadata (llama.cpp convert_hf_to_gguf.py writes it)")
        return metadata[key]

    kind = need("tokenizer.ggml.model")
    if kind != "gpt2":
        raise WeightFileError(source, f"tokenizer.ggml.model={kind!r} is not supported (only "
                              "byte-level BPE 'gpt2')", "use a BPE-tokenizer model")
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _GGUF_PRE_TOKENIZERS:
        raise WeightFileError(source, f"tokenizer.ggml.pre={pre!r}: its pre-tokenizer splits "
                              "text by rules not rebuilt here (known: "
                              f"{', '.join(sorted(_GGUF_PRE_TOKENIZERS))}), so its token ids "
                              "would differ from the model's", "use a GGUF with one of these")
    tokens = list(need("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in need("tokenizer.ggml.merges")]
    types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens) or any(len(m) != 2 for m in merges):
        raise WeightFileError(source, f"inconsistent tokenizer metadata ({len(tokens)} tokens, "
                              f"{len(types)} token types, malformed merges)", "re-convert")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _GGUF_PRE_TOKENIZERS[pre] == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types) if ty in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
    tok.add_special_tokens(specials)
    moved = [t.content for t in specials if tok.token_to_id(t.content) != vocab[t.content]]
    if moved:
        raise WeightFileError(source, f"special tokens {moved[:5]} did not keep their ids "
                              "(duplicate entries in tokenizer.ggml.tokens?)", "re-convert")

    def opt(key):
        v = metadata.get(key)
        return None if v is None else int(v)

    return HFTokenizer(tok, pad_id=opt("tokenizer.ggml.padding_token_id"),
                       bos_id=opt("tokenizer.ggml.bos_token_id"),
                       eos_id=opt("tokenizer.ggml.eos_token_id"),
                       chat_template=metadata.get("tokenizer.chat_template"),
                       add_special_tokens=False, name=str(metadata.get("general.name", "")))


def tokenizer_from_json(path, *, add_special_tokens: bool = True) -> HFTokenizer:
    """Load a HF ``tokenizer.json``; ids of ``[PAD]``/``<pad>``, ``[CLS]``/``<s>`` and
    ``[SEP]``/``</s>`` become ``pad_id``/``bos_id``/``eos_id``. Its own fixed padding and
    truncation settings are turned off (use :meth:`HFTokenizer.encode_padded`)."""
    Tokenizer = require("tokenizers", "moejax.io.hf_tokenizer").Tokenizer  # noqa: N806
    path = Path(path)
    existing_file(path, "reinstall the package that ships it", "tokenizer file")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise WeightFileError(path, f"malformed tokenizer.json: {e}",
                              "reinstall the package that ships it") from None
    tok.no_padding()
    tok.no_truncation()

    def first(*names):
        for n in names:
            i = tok.token_to_id(n)
            if i is not None:
                return i
        return None

    return HFTokenizer(tok, pad_id=first("[PAD]", "<pad>"), bos_id=first("[CLS]", "<s>"),
                       eos_id=first("[SEP]", "</s>"), add_special_tokens=add_special_tokens,
                       name=path.parent.name)


def tokenizer_from_hf_dir(directory) -> HFTokenizer:
    """A Hugging Face model directory's ``tokenizer.json``, with ``bos_id`` / ``eos_id`` /
    ``pad_id`` from its ``generation_config.json`` or ``config.json`` (``*_token_id``; the
    first of a list) where they are set, else from the token names
    (:func:`tokenizer_from_json`); no pad id: the eos id (padding is masked out). Without
    special tokens added on encode (a decoder's)."""
    directory = Path(directory)
    tok = tokenizer_from_json(directory / "tokenizer.json", add_special_tokens=False)
    ids: dict = {}
    for name in ("config.json", "generation_config.json"):  # the latter wins
        path = directory / name
        if path.is_file():
            try:
                c = json.loads(path.read_text())
            except ValueError as e:
                raise WeightFileError(path, f"unreadable JSON ({e})",
                                      "restore the file from its model") from None
            for key in ("bos", "eos", "pad"):
                v = c.get(f"{key}_token_id")
                v = v[0] if isinstance(v, list) and v else v
                if isinstance(v, int):
                    ids[key] = v
    for key, v in ids.items():
        if not 0 <= v < tok.vocab_size:
            raise WeightFileError(directory, f"{key}_token_id={v} is outside the "
                                  f"tokenizer's {tok.vocab_size} tokens",
                                  "the config and tokenizer.json disagree")
        setattr(tok, f"{key}_id", v)
    if tok.pad_id is None:  # padding is masked out; a decoder's is its eos (as transformers pads)
        tok.pad_id = tok.eos_id
    return tok
