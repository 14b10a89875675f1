"""Expert extraction from trained dense MLPs (MoEE, Berisha et al. 2025) against MoEfication
(``moee``)."""

# the models and data the paper measured its claims on (beside every verdict)
PAPER_SCALE = ("DeiT-T, DeiT-S and DeiT-B trained on ImageNet-1k (MoEE, experiments)")
