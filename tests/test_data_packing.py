"""Packing vs a naive oracle, and batch sources: determinism, epochs, resume, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.data.batches import (
    ArrayBatches,
    ClassificationBatches,
    PackedLMBatches,
    PairLMBatches,
    PromptResponseBatches,
    pad_token_rows,
)
from moejax.data.lm_batches import WindowBatches
from moejax.data.loader import BatchIterator
from moejax.data.packing import (
    lm_example,
    pack_documents,
    pack_pairs,
    prompt_response_real,
    prompt_response_rows,
)
from moejax.data.source import BatchSource

BOS, EOS, PAD = 1, 2, 0


def _docs(seed, n=9, max_len=23):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 50, size=rng.integers(0, max_len)).astype(np.int32) for _ in range(n)]


def _oracle(docs, seq_len):
    """Token-by-token reference: stream, rows with one-token overlap, segment ids, positions."""
    stream = []  # (token, doc index, position in doc)
    for d_i, d in enumerate(docs):
        full = [BOS, *map(int, d), EOS]
        stream += [(t, d_i, p) for p, t in enumerate(full)]
    rows, r = [], 0
    while r * seq_len < len(stream) - 1:
        toks, segs, poss, seg_of, first_pos = [], [], [], {}, {}
        for j in range(seq_len + 1):
            k = r * seq_len + j
            if k >= len(stream):
                toks.append(PAD), segs.append(0), poss.append(0)
                continue
            t, d_i, p = stream[k]
            seg_of.setdefault(d_i, len(seg_of) + 1)
            first_pos.setdefault(d_i, p)
            toks.append(t), segs.append(seg_of[d_i]), poss.append(p - first_pos[d_i])
        rows.append((toks, segs, poss))
        r += 1
    return rows


@pytest.mark.parametrize("seed,seq_len", [(0, 1), (1, 4), (2, 7), (3, 16), (4, 300)])
def test_pack_matches_oracle(seed, seq_len):
    docs = _docs(seed)
    packed = pack_documents(docs, seq_len, bos_id=BOS, eos_id=EOS, pad_id=PAD)
    ref = _oracle(docs, seq_len)
    assert packed.num_rows == len(ref) and packed.seq_len == seq_len
    for r, (toks, segs, poss) in enumerate(ref):
        assert packed.tokens[r].tolist() == toks
        assert packed.segment_ids[r].tolist() == segs
        assert packed.positions[r].tolist() == poss


def test_lm_example_covers_every_in_document_transition_once():
    docs, seq_len = _docs(5, n=15), 8
    ex = lm_example(pack_documents(docs, seq_len), np.arange(len(_oracle(docs, seq_len))))
    pairs = list(zip(ex["inputs"][ex["mask"] > 0].tolist(), ex["targets"][ex["mask"] > 0].tolist()))
    expected = []
    for d in docs:
        full = [BOS, *map(int, d), EOS]
        expected += list(zip(full[:-1], full[1:]))
    assert pairs == expected
    assert ex["inputs"].dtype == np.int32 and ex["mask"].dtype == np.float32


def _source(seed=3, batch_size=4):
    return PackedLMBatches(pack_documents(_docs(7, n=40), 8), batch_size=batch_size, seed=seed)


def test_packed_batches_deterministic_and_epoch_complete():
    a, b = _source(), _source()
    assert isinstance(a, BatchSource)
    for pos in (0, 1, 17):
        for k, v in a.batch(pos).items():
            np.testing.assert_array_equal(v, b.batch(pos)[k])
    assert not np.array_equal(a.batch(0)["inputs"], _source(seed=4).batch(0)["inputs"])
    n = a.rows.num_rows
    # the first n global rows are a permutation of all rows (one full epoch)
    seen = np.concatenate([a._order.rows(np.arange(p * 4, p * 4 + 4)) for p in range(n // 4)])
    assert len(set(seen.tolist())) == len(seen)


def test_resume_from_checkpointed_position():
    run = BatchIterator(_source(), fingerprint="lm/x")
    straight = [next(run) for _ in range(7)]
    first = BatchIterator(_source(), fingerprint="lm/x")
    for _ in range(3):
        next(first)
    state = first.state_dict()
    assert state == {"position": 3, "fingerprint": "lm/x"}
    resumed = BatchIterator(_source(), fingerprint="lm/x")
    resumed.load_state_dict(state)
    for want in straight[3:]:
        got = next(resumed)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    other = BatchIterator(_source(), fingerprint="lm/y")
    with pytest.raises(ValueError, match="lm/x"):
        other.load_state_dict(state)


def test_local_batch_is_a_slice_of_the_global_batch():
    src = _source(batch_size=6)
    full = src.batch(5)
    parts = [src.local_batch(5, i, 3) for i in range(3)]
    for k in full:
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), full[k])
    with pytest.raises(ValueError, match="divisible"):
        src.local_batch(0, 0, 4)


def test_classification_batches():
    ids, mask = pad_token_rows([[5, 6, 7], [8], list(range(3, 20))], 5, bos_id=BOS)
    assert ids.tolist()[0] == [BOS, 5, 6, 7, 0] and mask.tolist()[1] == [1, 1, 0, 0, 0]
    assert ids[2].tolist() == [BOS, 3, 4, 5, 6]
    src = ClassificationBatches(ids, np.array([0, 1, 2]), mask=mask, batch_size=2, seed=1)
    b = src.batch(0)
    assert b["inputs"].shape == (2, 5) and b["labels"].dtype == np.int32
    labels = np.concatenate([src.batch(p)["labels"] for p in range(3)])  # 2 epochs of 3
    assert sorted(labels[:3].tolist()) == [0, 1, 2] and sorted(labels[3:].tolist()) == [0, 1, 2]
    again = ClassificationBatches(ids, np.array([0, 1, 2]), mask=mask, batch_size=2, seed=1)
    for pos in range(3):  # a fresh source with the same seed serves the same batches
        np.testing.assert_array_equal(src.batch(pos)["inputs"], again.batch(pos)["inputs"])
    # labels that are not one class id a row: refused (float labels 0.5, 1.7 were truncated
    # to classes 0 and 1; an id past num_classes or below 0 trained on another class)
    for bad, match in ((np.array([0.5, 1.7, 2.0]), "dtype float64; give one integer class"),
                       (np.array([[0], [1], [2]]), r"labels of shape \(3, 1\)"),
                       (np.array([0, -1, 2]), r"labels in \[-1, 2\]")):
        with pytest.raises(ValueError, match=match):
            ClassificationBatches(ids, bad, mask=mask, batch_size=2)
    with pytest.raises(ValueError, match=r"labels in \[0, 2\] for num_classes=2"):
        ClassificationBatches(ids, np.array([0, 1, 2]), batch_size=2, num_classes=2)
        np.testing.assert_array_equal(src.batch(pos)["labels"], again.batch(pos)["labels"])


def test_pack_pairs_and_pair_batches():
    prompts = [np.array([10, 11, 12]), np.arange(20, 40), np.array([], np.int32)]
    responses = [np.array([50, 51]), np.array([60, 61, 62]), np.arange(70, 90)]
    tokens, loss = pack_pairs(prompts, responses, 11)
    assert tokens[0].tolist() == [BOS, 10, 11, 12, EOS, BOS, 50, 51, EOS, 0, 0, 0]
    assert loss[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    # long prompt: its beginning is dropped, the response survives whole
    assert tokens[1].tolist() == [BOS, 35, 36, 37, 38, 39, EOS, BOS, 60, 61, 62, EOS]
    assert loss[1].sum() == 4
    # response longer than the row: truncated at its end
    assert tokens[2].tolist() == [BOS, EOS, BOS, *range(70, 78), EOS]
    src = PairLMBatches(tokens, loss, batch_size=3, seed=0, shuffle=False)
    b = src.batch(0)
    np.testing.assert_array_equal(b["targets"], tokens[:, 1:])
    np.testing.assert_array_equal(b["mask"], loss[:, 1:])
    assert b["segment_ids"][0].tolist() == [1] * 9 + [0] * 2
    assert b["positions"][0].tolist() == list(range(9)) + [0, 0]


def test_prompt_response_batches_mark_their_real_tokens():
    prompts, responses = [[5, 6], [7], [8, 9, 10, 11, 12, 13]], [[3], [4, 4, 4, 4], [6, 6]]
    rows = prompt_response_rows(prompts, responses, prompt_len=6, response_len=4)
    # [bos] + prompt (cut to its last 3 tokens) + [eos, bos], then response[:3] + [eos]
    n_real = [2 + 3 + 2, 1 + 3 + 4, 3 + 3 + 3]
    want = np.arange(10)[None, :] < np.asarray(n_real)[:, None]
    np.testing.assert_array_equal(prompt_response_real(rows["prompt_lens"],
                                                       rows["response_mask"]), want)
    assert np.all(rows["tokens"][~want] == 0) and np.all(rows["tokens"][want] > 0)
    # a long prompt loses its beginning: its last 3 tokens stay, then the response
    np.testing.assert_array_equal(rows["tokens"][2, :9], [1, 11, 12, 13, 2, 1, 6, 6, 2])
    np.testing.assert_array_equal(rows["prompts"][2], [1, 11, 12, 13, 2, 1])
    traced = jax.jit(prompt_response_real)(jnp.asarray(rows["prompt_lens"]),
                                           jnp.asarray(rows["response_mask"]))
    np.testing.assert_array_equal(np.asarray(traced), want)
    b = PromptResponseBatches(rows, batch_size=3, shuffle=False).batch(0)
    np.testing.assert_array_equal(b["token_mask"] > 0, want[:, :-1])


def test_prompt_response_rows_that_do_not_line_up_are_refused_before_a_batch():
    """Arrays of different row counts failed mid-run (a batch drawing a row past the shortest
    raised IndexError at position 1 here) and paired rows past it with other rows' prompts;
    they, a missing array, float ids, a mask of another shape and prompt lengths past the
    prompt block are refused when the source is made."""
    prompts = [np.arange(3, 3 + n) for n in (2, 3, 4, 5)]
    rows = prompt_response_rows(prompts, [np.array([6, 7])] * 4, 6, 4)
    PromptResponseBatches(rows, batch_size=2)  # as built: fine

    def refused(match, **change):
        bad = {**rows, **change}
        with pytest.raises(ValueError, match=match):
            PromptResponseBatches({k: v for k, v in bad.items() if v is not None},
                                  batch_size=2)

    refused("different numbers of rows", prompts=rows["prompts"][:3],
            prompt_lens=rows["prompt_lens"][:3])
    refused(r"lack \['prompt_lens'\]", prompt_lens=None)
    refused("tokens of shape .* and dtype float", tokens=rows["tokens"] + 0.5)
    refused("response_mask of shape", response_mask=rows["response_mask"][:, :-1])
    refused(r"prompt_lens in \[0, ", prompt_lens=rows["prompt_lens"] * 0)
    refused("each must be in", prompt_lens=rows["prompt_lens"] + 7)


def _sources(docs, **kw):
    """One source of each kind over the same documents (``kw``: batch_size, seed)."""
    ids, mask = pad_token_rows(docs, 12, pad_id=PAD, bos_id=BOS)
    tokens, loss = pack_pairs(docs[:6], docs[6:], 16, bos_id=BOS, eos_id=EOS, pad_id=PAD)
    pairs = prompt_response_rows(docs[:6], docs[6:], 6, 8, bos_id=BOS, eos_id=EOS, pad_id=PAD)
    labels = np.array([len(d) % 3 for d in docs])
    return [
        PackedLMBatches(pack_documents(docs, 8, bos_id=BOS, eos_id=EOS, pad_id=PAD), **kw),
        ClassificationBatches(ids, labels, mask=mask, num_classes=3, **kw),
        ArrayBatches({"inputs": ids, "labels": labels}, **kw),
        PairLMBatches(tokens, loss, pad_id=PAD, **kw),
        PromptResponseBatches(pairs, **kw),
        WindowBatches(np.concatenate(docs), seq_len=8, **kw),
    ]


def test_every_source_names_its_stream_by_its_rows_and_order():
    """The fingerprint a checkpoint stores (a resumed run must match it) is equal for equal
    rows and settings, and differs with other tokens, the batch size or the seed."""
    docs = _docs(5, n=12)
    base = [s.fingerprint for s in _sources(docs, batch_size=2, seed=0)]
    assert base == [s.fingerprint for s in _sources(_docs(5, n=12), batch_size=2, seed=0)]
    edited = [d.copy() for d in docs]
    for d in edited[6:]:  # the responses' first tokens, which every source keeps
        d[:1] += 1
    for other in (_sources(edited, batch_size=2, seed=0), _sources(docs, batch_size=4, seed=0),
                  _sources(docs, batch_size=2, seed=1)):
        for a, b in zip(base, (s.fingerprint for s in other)):
            assert a != b, a
    assert len(set(base)) == len(base)  # each names its kind
    ordered = PackedLMBatches(pack_documents(docs, 8, bos_id=BOS, eos_id=EOS, pad_id=PAD),
                              batch_size=2, shuffle=False)
    assert ordered.fingerprint != base[0] and "order=in order" in ordered.fingerprint


def test_float_negative_or_nested_token_ids_are_refused_not_cast():
    """Every packer cast documents to int32: float ids 3.7, 4.2 became the tokens 3, 4, and a
    negative id went into the rows; an empty document stays an empty document."""
    floats = [np.array([3.7, 4.2, 5.9]), np.array([6.5, 7.1])]
    packers = (lambda d: pad_token_rows(d, 4), lambda d: pack_documents(d, 4),
               lambda d: pack_pairs(d, d, 8), lambda d: prompt_response_rows(d, d, 6, 4))
    for pack in packers:
        with pytest.raises(ValueError, match="dtype float64; give a 1-D sequence of integer"):
            pack(floats)
        with pytest.raises(ValueError, match="token id -1"):
            pack([np.array([5, -1]), np.array([3])])
        with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
            pack([np.ones((2, 2), int), np.array([3])])
        pack([[], np.array([3, 4], np.uint8)])  # an empty list, any integer dtype: taken
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        pad_token_rows([[3]], 0)
    with pytest.raises(ValueError, match="bos_id=-1, eos_id=2"):  # was packed as is
        pack_documents([np.array([3])], 4, bos_id=-1)
    ids, mask = pad_token_rows([[], [3, 4]], 3, bos_id=BOS)
    assert ids.tolist() == [[BOS, 0, 0], [BOS, 3, 4]] and mask.sum() == 4



def test_a_source_refuses_bad_settings_when_it_is_made():
    """A batch size of 0 or -2 served empty batches; floats failed at the first batch deep in
    numpy, and a window source truncated float tokens 3.5 to 3."""
    docs = _docs(2, n=12)
    for bad, match in ((dict(batch_size=0), "batch_size=0"), (dict(batch_size=-2), "batch_size"),
                       (dict(batch_size=2.5), "batch_size=2.5"), (dict(batch_size=True), "True"),
                       (dict(batch_size=2, seed=1.5), "seed=1.5"),
                       (dict(batch_size=2, seed=-1), "seed=-1")):
        for make in (lambda kw: _sources(docs, **kw)[0], lambda kw: _sources(docs, **kw)[2],
                     lambda kw: WindowBatches(np.arange(40), seq_len=4, **kw)):
            with pytest.raises(ValueError, match=match):
                make(bad)
    with pytest.raises(ValueError, match="seq_len=0"):
        WindowBatches(np.arange(40), batch_size=2, seq_len=0)
    with pytest.raises(ValueError, match="dtype float64"):
        WindowBatches(np.arange(40) + 0.5, batch_size=2, seq_len=4)
    with pytest.raises(ValueError, match="position must be >= 0"):
        WindowBatches(np.arange(40), batch_size=2, seq_len=4).batch(-1)
    with pytest.raises(ValueError, match=r"corpus of 5 tokens .* at least seq_len \+ 2 = 6"):
        WindowBatches(np.arange(5), batch_size=2, seq_len=4)  # one window, no offset to draw
    assert WindowBatches(np.arange(6), batch_size=2, seq_len=4).batch(3)["inputs"].shape == (2, 4)
    with pytest.raises(ValueError, match="no row axis"):
        ArrayBatches({"x": np.float32(3)}, batch_size=2)
    for source in _sources(docs, batch_size=np.int64(2), seed=np.int32(3)):  # numpy ints
        assert len(next(iter(source.batch(0).values()))) == 2
