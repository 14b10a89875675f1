"""DAREx (Deng et al. 2025): delta pruning beyond DARE's rescaling (DAREx-q, AdamR), on a
controlled MLP, a decoder LM and encoders, and what the pruned deltas cost to store
(``controlled``, ``decoder``, ``encoder``, ``storage``); ``common``: what they share."""
