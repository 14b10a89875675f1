"""DeRS (Huang et al. 2025): upcycling with decomposed, replaced and synthesised experts, and
compressing the experts' delta weights (``compression``, ``upcycling``),
and DeRS experts at decode (``bench``); ``common``: what they share."""
