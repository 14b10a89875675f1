"""What the darex studies share: the scale the paper measured its claims on."""

# the models and data the paper measured its claims on (beside every verdict)
PAPER_SCALE = ("BERT-base and RoBERTa-base fine-tuned on CoLA, SST-2, MRPC and STS-B; "
               "Qwen2-0.5B fine-tuned on MetaMath, and Llama2-7B math models, on GSM8K (DAREx, "
               "experimental setup)")
