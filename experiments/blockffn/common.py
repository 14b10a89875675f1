"""What the blockffn studies share: the scale the paper measured its claims on."""

# the models and data the paper measured its claims on (beside every verdict)
PAPER_SCALE = ("BlockFFN and baseline LMs of 0.1B, 0.5B, 0.8B and 1.2B parameters at close "
               "total and active parameters and training tokens (BlockFFN Sec. 4.1); decoding "
               "on an NVIDIA Jetson Orin NX (Table 6)")
