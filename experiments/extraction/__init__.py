"""Expert extraction from trained dense MLPs (MoEE, Berisha et al. 2025) against MoEfication
(``moee``), and the extracted experts' layouts at inference (``bench``); ``common``: what
they share."""
