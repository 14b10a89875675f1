"""What the ders studies share: the scale the paper measured its claims on."""

# the models and data the paper measured its claims on (beside every verdict)
PAPER_SCALE = ("MoE-LLaVA upcycled from StableLM-2-1.6B, Qwen-1.8B and Phi-2-2.7B (4 "
               "experts, top-2, in every other block), plus medical multi-modal and "
               "code-generation upcycled MoEs (DeRS Sec. 4)")
