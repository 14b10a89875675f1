"""Data for moejax: offline datasets, tokenizers, packing and random-access batch sources.

Modules (imported explicitly; this package imports nothing so ``moejax.data.source`` stays light):

* ``source``: the ``BatchSource`` protocol (``batch(position)``; the data position is one int).
* ``raw_files``: raw-data locations, data dir (``$MOEJAX_DATA_DIR``), stable document splits,
  ``MissingDataError``.
* ``datasets``: ``load(name, split)`` of the TFDS array_record builders (``builders_text``,
  ``builders_labelled``, ``builders_images``), built on first use.
* ``tokenizer``: ``ByteTokenizer``, ``BpeTokenizer``, ``train_bpe``.
* ``packing``: ``pack_documents`` (fixed-length rows with segment ids and positions).
* ``batches``: ``PackedLMBatches``, ``ClassificationBatches``.
* ``loader``: ``lm_batches``, ``classification_batches``, ``image_batches``, ``bpe_for``,
  ``BatchIterator`` (checkpointable position).
* ``cards``: ``python -m moejax.data.cards`` regenerates ``third_party/*/DATA_CARD.md``.
* ``stdlib_corpus``, ``lm_batches``: the CPython standard-library byte corpus and window batches.
"""
