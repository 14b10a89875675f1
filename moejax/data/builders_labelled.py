"""TFDS builders for the labelled text datasets (array_record, readable without tensorflow).

* ``moejax_wordnet_glosses``: every WordNet 3.0 synset gloss (Debian ``wordnet-base``) labelled
  with its part of speech (4 classes; satellite adjectives count as ``adj``) and its
  lexicographer file / supersense (45 classes, e.g. ``noun.animal``): two GLUE-like
  single-sentence classification tasks. Identical gloss texts are kept together: the split key is
  the gloss text itself, so no input string appears in two splits. Train 80 / validation 10 /
  test 10.
* ``moejax_chitchat``: prompt/response pairs from the Chit-Chat Challenge conversations (PyPI
  ``chitchat-dataset``): for every turn after the first, ``prompt`` is the previous turn,
  ``context`` the up-to-three previous turns (newline-separated), ``response`` the turn itself.
  Split by conversation id (a conversation never spans splits). Train 90 / validation 5 / test 5.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np

from moejax.extras import missing_extra

try:
    import tensorflow_datasets as tfds
except ImportError as _e:
    raise missing_extra(_e, "moejax.data.builders_labelled (the TFDS labelled datasets)") from None

from moejax.data import raw_files
from moejax.data.tfds_base import OfflineBuilder

__all__ = ["MoejaxWordnetGlosses", "MoejaxChitchat", "POS_NAMES", "LEXNAMES", "iter_wordnet"]

GLOSS_SPLITS = {"train": 0.8, "validation": 0.1, "test": 0.1}
CHAT_SPLITS = {"train": 0.9, "validation": 0.05, "test": 0.05}

POS_NAMES = ["noun", "verb", "adj", "adv"]
_POS_OF = {"n": "noun", "v": "verb", "a": "adj", "s": "adj", "r": "adv"}
# lexnames(5WN): lexicographer file number -> name (WordNet 3.0 has 45 files, 00..44).
LEXNAMES = [
    "adj.all",
    "adj.pert",
    "adv.all",
    "noun.Tops",
    "noun.act",
    "noun.animal",
    "noun.artifact",
    "noun.attribute",
    "noun.body",
    "noun.cognition",
    "noun.communication",
    "noun.event",
    "noun.feeling",
    "noun.food",
    "noun.group",
    "noun.location",
    "noun.motive",
    "noun.object",
    "noun.person",
    "noun.phenomenon",
    "noun.plant",
    "noun.possession",
    "noun.process",
    "noun.quantity",
    "noun.relation",
    "noun.shape",
    "noun.state",
    "noun.substance",
    "noun.time",
    "verb.body",
    "verb.change",
    "verb.cognition",
    "verb.communication",
    "verb.competition",
    "verb.consumption",
    "verb.contact",
    "verb.creation",
    "verb.emotion",
    "verb.motion",
    "verb.perception",
    "verb.possession",
    "verb.social",
    "verb.stative",
    "verb.weather",
    "adj.ppl",
]


def iter_wordnet() -> Iterator[dict]:
    """Every synset of WordNet 3.0 as ``{synset, gloss, lemmas, pos, lexname}`` (file order)."""
    root = raw_files.wordnet_dir()
    for file_pos in ("noun", "verb", "adj", "adv"):
        with open(root / f"data.{file_pos}", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("  "):  # licence header
                    continue
                head, _, gloss = line.partition(" | ")
                fields = head.split()
                offset, lex_filenum, ss_type, w_cnt = fields[0], fields[1], fields[2], fields[3]
                n_words = int(w_cnt, 16)
                lemmas = [fields[4 + 2 * i].replace("_", " ") for i in range(n_words)]
                yield {
                    "synset": f"{ss_type}{offset}",
                    "gloss": gloss.strip(),
                    "lemmas": ", ".join(lemmas),
                    "pos": _POS_OF[ss_type],
                    "lexname": LEXNAMES[int(lex_filenum)],
                }


class MoejaxWordnetGlosses(OfflineBuilder):
    """WordNet gloss classification: gloss -> part of speech, gloss -> lexicographer file."""

    name = "moejax_wordnet_glosses"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "All WordNet 3.0 synsets; split by gloss-text hash."}

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "synset": tfds.features.Text(),
                    "gloss": tfds.features.Text(),
                    "lemmas": tfds.features.Text(),
                    "pos": tfds.features.ClassLabel(names=POS_NAMES),
                    "lexname": tfds.features.ClassLabel(names=LEXNAMES),
                }
            ),
            supervised_keys=("gloss", "lexname"),
            homepage="https://wordnet.princeton.edu/",
        )

    def _split_generators(self, dl_manager):
        raw_files.wordnet_dir()
        return {split: self._generate_examples(split) for split in GLOSS_SPLITS}

    def _generate_examples(self, split) -> Iterator[tuple[str, dict]]:
        for ex in iter_wordnet():
            if raw_files.split_of(ex["gloss"], GLOSS_SPLITS) == split:
                yield ex["synset"], ex


def _turn_text(turn: list[dict]) -> str:
    return " ".join(u["text"].strip() for u in turn if u["text"].strip())


def iter_chitchat_pairs() -> Iterator[tuple[str, str, dict]]:
    """``(conversation_id, key, example)`` for every prompt/response pair, in file order."""
    path = raw_files.pip_data_file("chitchat_dataset", "dataset.json", "chitchat-dataset")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for conv_id in sorted(data):
        turns = [t for t in (_turn_text(m) for m in data[conv_id]["messages"]) if t]
        for i in range(1, len(turns)):
            yield (
                conv_id,
                f"{conv_id}/{i}",
                {
                    "conversation_id": conv_id,
                    "turn": i,
                    "context": "\n".join(turns[max(0, i - 3) : i]),
                    "prompt": turns[i - 1],
                    "response": turns[i],
                },
            )


class MoejaxChitchat(OfflineBuilder):
    """Chit-Chat Challenge pairs: the 4017 of 7168 conversations that have two or more turns."""

    name = "moejax_chitchat"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Adjacent-turn pairs; split by conversation id."}

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "conversation_id": tfds.features.Text(),
                    "turn": tfds.features.Scalar(dtype=np.int32),
                    "context": tfds.features.Text(),
                    "prompt": tfds.features.Text(),
                    "response": tfds.features.Text(),
                }
            ),
            supervised_keys=("prompt", "response"),
            homepage="https://github.com/BYU-PCCL/chitchat-dataset",
        )

    def _split_generators(self, dl_manager):
        raw_files.pip_data_file("chitchat_dataset", "dataset.json", "chitchat-dataset")
        return {split: self._generate_examples(split) for split in CHAT_SPLITS}

    def _generate_examples(self, split) -> Iterator[tuple[str, dict]]:
        for conv_id, key, ex in iter_chitchat_pairs():
            if raw_files.split_of(conv_id, CHAT_SPLITS) == split:
                yield key, ex
