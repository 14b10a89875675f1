"""The slow, obvious side of the token-run quantities (BlockFFN's chunk losses and sparsity
metrics): the runs of a batch found token by token, and a hypothesis strategy drawing batches
of activation patterns with padding and document boundaries."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


def runs(mask, seg):
    """``[(row, [token indices])]``: the maximal stretches of consecutive real tokens of one
    document, row by row."""
    out = []
    for b in range(mask.shape[0]):
        cur = []
        for t in range(mask.shape[1]):
            if mask[b, t] and cur and seg[b, t] == seg[b, cur[-1]] and cur[-1] == t - 1:
                cur.append(t)
            else:
                if cur:
                    out.append((b, cur))
                cur = [t] if mask[b, t] else []
        if cur:
            out.append((b, cur))
    return out


@st.composite
def token_batches(draw, max_rows: int = 3, max_tokens: int = 10, max_experts: int = 5):
    """``(active_BTE bool, mask_BT bool, segment_ids_BT int32)``: any activation pattern, any
    padding, a new document wherever one is drawn (the ids count up along a row)."""
    B = draw(st.integers(1, max_rows))
    T = draw(st.integers(1, max_tokens))
    E = draw(st.integers(1, max_experts))

    def bools(n):
        return np.asarray(draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)

    active = bools(B * T * E).reshape(B, T, E)
    mask = bools(B * T).reshape(B, T)
    segments = np.cumsum(bools(B * T).reshape(B, T), axis=1).astype(np.int32)
    return active, mask, segments
