"""DAREx (Deng et al. 2025): delta pruning beyond DARE's rescaling (DAREx-q, AdamR), on a
controlled MLP, a decoder LM and encoders, and what the pruned deltas cost to store
(``controlled``, ``decoder``, ``encoder``, ``storage``)."""

# the models and data the paper measured its claims on (beside every verdict)
PAPER_SCALE = ("BERT-base and RoBERTa-base fine-tuned on CoLA, SST-2, MRPC and STS-B; "
               "Qwen2-0.5B fine-tuned on MetaMath, and Llama2-7B math models, on GSM8K (DAREx, "
               "experimental setup)")
