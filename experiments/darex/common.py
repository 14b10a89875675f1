"""What the darex studies share: the scale the paper measured its claims on, and the check
that a pruned delta's "small loss" is not the loss of a delta worth nothing."""

from __future__ import annotations

from moejax.harness.claims import Claim, unjudged

# the models and data the paper measured its claims on (beside every verdict)
PAPER_SCALE = ("BERT-base and RoBERTa-base fine-tuned on CoLA, SST-2, MRPC and STS-B; "
               "Qwen2-0.5B fine-tuned on MetaMath, and Llama2-7B math models, on GSM8K (DAREx, "
               "experimental setup)")


def worth_checked(c: Claim, worths: list[float | None], tolerance: float) -> Claim:
    """``c``, a claim that pruning a delta loses at most ``tolerance``, with its control:
    ``worths`` is what the delta is worth in each seed run (the fine-tuned model's metric over
    the pre-trained one's; None: not recorded). A "holds" stands only where every delta is
    worth more than ``tolerance``: a delta worth less loses "within the tolerance" even when
    dropped whole. A "does not hold" stands either way."""
    known = bool(worths) and None not in worths
    if c.holds and not known:
        return unjudged(c, "what the delta is worth over the pre-trained model was not "
                           "recorded: unchecked")
    if c.holds and min(worths) <= tolerance:
        return unjudged(c, f"the delta is worth only {min(worths):.3f} over the pre-trained "
                           f"model, within the {tolerance:g} tolerance: dropping it whole "
                           "would count")
    if not known:
        return c
    return c._replace(evidence=f"{c.evidence}; the delta is worth {min(worths):.3f} or more "
                               "over the pre-trained model")
