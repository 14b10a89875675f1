"""What the kd studies share: the scale the paper measured its claims on."""

# the models and data the paper measured its claims on (beside every verdict)
PAPER_SCALE = ("Llama-MoE-3.5B teachers (e.g. 4 of 16 experts), a Sheared-Llama-2.7B dense "
               "teacher and a Sheared-Llama-1.3B student (Every Expert Matters, experimental "
               "setup)")
