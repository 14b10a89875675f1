"""What the extraction studies share: the scale the paper measured its claims on."""

# the models and data the paper measured its claims on (beside every verdict)
PAPER_SCALE = ("DeiT-T, DeiT-S and DeiT-B trained on ImageNet-1k (MoEE, experiments)")
