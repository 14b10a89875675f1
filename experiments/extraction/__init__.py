"""Expert extraction from trained dense MLPs (MoEE, Berisha et al. 2025) against MoEfication
(``moee``)."""
