"""ders_upcycling's claim rules (DeRS Sec. 3.4 and 4.4, Tables 1, 4-6): a DeRS variant
matches vanilla upcycling with far fewer added parameters, where a dense control shows that
matching takes the experts; the shared base FFN must train (Table 5); a lower DeRS-SM sparse
rate and a moderate DeRS-LM rank do better (Table 4); DeRS cuts model size, training and
inference memory (Table 6). Each is judged over the seed runs."""

from __future__ import annotations

from moejax.harness.claims import (
    Claim,
    all_hold,
    lookup,
    measured,
    paired_compare,
    per_seed,
    threshold_claim,
    unjudged,
)

__all__ = ["CONTROL", "MATCH_NATS", "PAPER_BEST_RANK", "PAPER_COST_VARIANTS", "claims"]

CONTROL = "dense fine-tuned (control)"  # the dense model trained alike: no added parameters

# "matches vanilla upcycling": validation loss within this many nats per byte
MATCH_NATS = 0.01

# Table 4b's best DeRS-LM rank (Overall 60.9; rank 64: 59.0, "a too high rank degrades")
PAPER_BEST_RANK = 4

# Table 6's DeRS rows: DeRS-SM at sparse rates 0.9 and 0.99, DeRS-LM at rank 4
PAPER_COST_VARIANTS = (("sm", 0.9), ("sm", 0.99), ("lm", 4.0))

# Table 6's costs: the cost table's column for each
_COSTS = (("stored", "model size"), ("peak_train_bytes", "training memory"),
          ("peak_infer_bytes", "inference memory"))


def _matches_vanilla(t: dict, form: str) -> Claim:
    """DeRS-``form`` matches vanilla with >= 10x fewer added parameters: the variant of at
    least 10x fewer added parameters with the lowest mean loss gap to vanilla; "matches": its
    per-seed gap ``val_loss - vanilla`` lies below :data:`MATCH_NATS` nats/byte with 95%
    confidence, widened for the best of the variants
    (:func:`moejax.harness.claims.threshold_claim`; above it: does not hold), and stands
    only with its control (:func:`_controlled`)."""
    claim = (f"DeRS-{form} matches vanilla upcycling with >= 10x fewer added parameters "
             "(Sec. 4.1-4.3, Tables 1-3)")
    ok = [r for r in t.get("upcycling") or [] if str(r["variant"]).startswith(f"DeRS-{form} ")
          and "frozen" not in str(r["variant"]) and float(r["added_vs_vanilla"]) >= 10]
    if not ok:
        return Claim(claim, None, f"no DeRS-{form} row")
    best = min(ok, key=lambda r: float(r["d_loss_vs_vanilla"]))
    c = threshold_claim(claim, _gaps(t, best["variant"]), MATCH_NATS, better="lower",
                        candidates=len(ok))
    c = c._replace(evidence=f"{best['variant']} ({float(best['added_vs_vanilla']):.0f}x "
                            f"fewer added), loss gap to vanilla {c.evidence}")
    return _controlled(c, _gaps(t, CONTROL))


def _gaps(t: dict, variant: str) -> list[float]:
    """``variant``'s loss gap to vanilla in each seed run that measured it."""
    vals = [lookup(r.get("upcycling"), {"variant": variant}, "d_loss_vs_vanilla")
            for r in per_seed(t)]
    return [float(v) for v in vals if measured(v) is not None]


def _controlled(c: Claim, control: list[float]) -> Claim:
    """``c`` with its control: a "holds" stands only where the dense control (trained alike,
    no added parameters; ``control``, its per-seed loss gaps to vanilla) is shown further
    than :data:`MATCH_NATS` from vanilla, so that matching vanilla takes the experts. A
    control that matches too, or is not shown apart, or was not recorded, leaves nothing to
    separate more experts from none."""
    if not control:
        return unjudged(c, "the dense control was not recorded: what the experts add is "
                           "unchecked") if c.holds else c
    cc = threshold_claim("", control, MATCH_NATS, better="lower")
    c = c._replace(evidence=f"{c.evidence}; the dense control (no added parameters): "
                            f"{cc.evidence}")
    if c.holds and cc.holds:
        return unjudged(c, f"both within {MATCH_NATS}: the experts make no measurable "
                           "difference here")
    if c.holds and cc.holds is None:
        return unjudged(c, f"the dense control is not shown further than {MATCH_NATS} from "
                           "vanilla: what the experts add is not shown")
    return c


def _setting(row: dict) -> float | None:
    """A DeRS row's sparse rate or rank, read from its variant name (``DeRS-SM p=0.9``,
    ``DeRS-LM r=4 frozen shared``)."""
    name = str(row.get("variant", ""))
    if not name.startswith("DeRS-") or "=" not in name:
        return None
    return measured(name.split("=", 1)[1].split()[0])


def _loss(form: str, setting: float) -> tuple[str, object]:
    """``(label, value_of)`` of the row of ``form`` at ``setting`` for
    :func:`moejax.harness.claims.paired_compare`: its validation loss in one seed run."""
    name = {"sm": "SM p=", "lm": "LM r=", "sm-frozen": "SM frozen p=",
            "lm-frozen": "LM frozen r="}[form]

    def value_of(run):
        return next((r.get("val_loss") for r in run.get("upcycling") or []
                     if r.get("form") == form and _setting(r) == setting), None)
    return f"DeRS-{name}{setting:g}", value_of


def _settings(t: dict, form: str) -> list[float]:
    """The settings (sparse rates or ranks) the run trained ``form`` at, ascending."""
    return sorted({_setting(r) for r in t.get("upcycling") or []
                   if r.get("form") == form and _setting(r) is not None})


def _shared_trains(t: dict) -> Claim:
    """Table 5: freezing the expert-shared base FFN raises the loss, for each frozen variant
    against its trainable twin (every one must hold)."""
    claim = ("Training the shared base FFN matters: freezing it raises the loss of DeRS-SM "
             "and DeRS-LM (Sec. 4.4, Table 5)")
    parts = [paired_compare("", t, _loss(form, s), _loss(f"{form}-frozen", s), better="lower")
             for form in ("sm", "lm") for s in _settings(t, f"{form}-frozen")]
    if not parts:
        return Claim(claim, None, "no frozen-shared variant")
    return all_hold(claim, parts, "; ".join(c.evidence for c in parts))


def _lower_rate(t: dict) -> Claim:
    """Table 4a: the lowest DeRS-SM sparse rate has a lower loss than the highest."""
    rates = _settings(t, "sm")
    if len(rates) < 2:
        return Claim("A lower DeRS-SM sparse rate gives a lower loss (Table 4a)", None,
                     "fewer than two sparse rates")
    return paired_compare(f"A lower DeRS-SM sparse rate gives a lower loss: p={rates[0]:g} "
                          f"beats p={rates[-1]:g} (Sec. 4.4, Table 4a)", t,
                          _loss("sm", rates[0]), _loss("sm", rates[-1]), better="lower")


def _moderate_rank(t: dict) -> Claim:
    """Table 4b: the paper's best rank (:data:`PAPER_BEST_RANK`) has a lower loss than the
    highest rank trained ("if the rank is set too high (64), it can lead to performance
    degradation")."""
    ranks = _settings(t, "lm")
    if PAPER_BEST_RANK not in ranks or ranks[-1] <= PAPER_BEST_RANK:
        return Claim(f"A too-high DeRS-LM rank degrades: rank {PAPER_BEST_RANK} beats a higher "
                     "one (Table 4b)", None, f"no rank {PAPER_BEST_RANK} and a higher one")
    return paired_compare(f"A too-high DeRS-LM rank degrades: rank {PAPER_BEST_RANK} beats "
                          f"rank {ranks[-1]:g} (Sec. 4.4, Table 4b)", t,
                          _loss("lm", PAPER_BEST_RANK), _loss("lm", ranks[-1]), better="lower")


def _cost(variant: str, column: str) -> tuple[str, object]:
    """``(label, value_of)`` of ``variant``'s ``column`` in a seed run's ``cost`` table, for
    :func:`moejax.harness.claims.paired_compare`."""
    def value_of(run):
        return lookup(run.get("cost"), {"variant": variant}, column)
    return variant, value_of


def _cuts_cost(t: dict, column: str, what: str) -> Claim:
    """Table 6: each of its DeRS variants that ran (:data:`PAPER_COST_VARIANTS`) costs less
    ``what`` (the ``cost`` table's ``column``) than vanilla upcycling, paired over the seed
    runs (a count or a compiled memory analysis: the same in every seed run, so a tie reads
    "does not hold")."""
    claim = f"DeRS upcycling cuts {what} against vanilla upcycling (Sec. 4.4, Table 6)"
    names = {(r.get("form"), _setting(r)): str(r["variant"]) for r in t.get("upcycling") or []}
    variants = [names[k] for k in PAPER_COST_VARIANTS if k in names]
    if not variants:
        return Claim(claim, None, "none of Table 6's DeRS variants ran (DeRS-SM p=0.9 and "
                                  "p=0.99, DeRS-LM r=4)")
    parts = [paired_compare("", t, _cost(v, column), _cost("vanilla", column), better="lower",
                            fmt=".4g") for v in variants]
    return all_hold(claim, parts, "; ".join(c.evidence for c in parts))


def claims(t: dict[str, list[dict]]) -> list[Claim]:
    """DeRS upcycling's claims on the ``upcycling`` table of each seed run: DeRS-SM and
    DeRS-LM match vanilla with >= 10x fewer added parameters (:func:`_matches_vanilla`),
    the shared base FFN must train (:func:`_shared_trains`), a lower sparse rate does better
    (:func:`_lower_rate`), a too-high rank worse (:func:`_moderate_rank`), and Table 6's
    variants cost less model size, training and inference memory (:func:`_cuts_cost`, on
    the ``cost`` table); the comparisons paired over the seeds
    (:func:`moejax.harness.claims.paired_compare`)."""
    return [_matches_vanilla(t, "SM"), _matches_vanilla(t, "LM"), _shared_trains(t),
            _lower_rate(t), _moderate_rank(t),
            *(_cuts_cost(t, column, what) for column, what in _COSTS)]
