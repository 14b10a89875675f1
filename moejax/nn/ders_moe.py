"""DeRS upcycling slots (DeRS paper, Huang et al.
2025, Sec. 3.4 and App. A).

Each expert weight is *synthesised* inside the forward pass from one expert-shared weight and a
light expert-specific increment, for every FFN matrix ``W`` in ``{w_gate, w_up, w_down}``::

    W_i = W_shared + F_pre(Delta_i),   i = 1..N

* DeRS-SM (``form="sm"``, sparse rate ``p``): ``F_pre(Delta_i) = scatter(I_i, V_i)``, ``I_i`` a
  fixed vector of ``K = max(1, round(d d_h (1 - p)))`` unique flat positions of the
  ``[d_in, d_out]`` matrix (drawn once from a key, stored as a non-trainable
  :class:`DeRSIndex` variable, never trained), ``V_i`` a trainable value vector initialised
  to zero. The N dense expert copies are never parameters; they exist only as activations.
* DeRS-LM (``form="lm"``, rank ``r``): ``F_pre(Delta_i) = A_i B_i``, ``A_i: [d_in, r] ~
  N(0, lm_init_std^2)`` (default ``lm_init_std = d_in^-1/2``), ``B_i: [r, d_out] = 0``.

Both equal the dense model at step 0 (zero value vector / zero ``B``). ``W_shared`` is an
``nnx.Param`` (trainable, as in the paper) unless ``freeze_shared`` (Table 5 ablation), in which
case it is a :class:`DeRSFrozen` variable: it travels in ``TrainState.rest`` and gets neither a
gradient nor weight decay. ``extended=True`` (App. A) also writes the universal FFN as
``W_shared + F_pre(Delta_{N+1})``; otherwise the universal FFN (if any) is a full FFN.

Parameter paths of :class:`DeRSMoE` (``E`` = n_experts; ``w`` in ``gate`` (gated only), ``up``,
``down``; ``[d_in, d_out]`` = ``[D, F]`` for gate/up and ``[F, D]`` for down):

* ``router/w_g [D, E]`` (``w_noise`` for the noisy router)
* ``base/w_gate``, ``base/w_up [D, F]``, ``base/w_down [F, D]``: ``W_shared``
* SM: ``experts/v_{w} [E, K]`` (Param) and ``experts/idx_{w} [E, K]`` (int32 DeRSIndex)
* LM: ``experts/a_{w} [E, d_in, r]``, ``experts/b_{w} [E, r, d_out]``
* extended universal: ``universal/...`` like ``experts`` with leading dim 1; otherwise
  ``universal/w_*`` (a full FFN, MoE naming); ``shared/w_*`` DeepSeekMoE shared experts.

Trainable expert parameters per matrix (paper 3.4): SM ``(1 + N(1-p)) d d_h``, LM
``d d_h + N r (d + d_h)``; :func:`ders_param_counts` gives the exact counts per layer.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import config
from moejax.kernels.moe_ffn.jnp_paths import capacity_apply, ffn_apply
from moejax.nn import axes as ax
from moejax.nn.moe import MoEConfig, MoESkeleton, add_always_on, make_router
from moejax.nn.slots import FFNSlotConfig
from moejax.ops.activations import is_gated
from moejax.ops.ders_apply import ders_experts, ders_streamed, synthesize_one

__all__ = ["DeRSIndex", "DeRSFrozen", "DeRSMoEConfig", "DeRSMoE", "DeltaStack",
           "sm_num_kept", "draw_sm_indices", "matrix_shapes", "ders_param_counts",
           "expert_bytes_per_token", "lm_a_std", "check_lm_rank"]


class DeRSIndex(nnx.Variable):
    """Fixed (never trained) DeRS-SM index vectors; not an ``nnx.Param``."""


class DeRSFrozen(nnx.Variable):
    """A frozen expert-shared weight (``freeze_shared=True``); not an ``nnx.Param``."""


def lm_a_std(lm_init_std: float | None, d_in: int) -> float:
    """The std of a DeRS-LM ``A`` at initialisation: ``lm_init_std``, else ``d_in^-1/2``."""
    return lm_init_std if lm_init_std is not None else d_in ** -0.5


def check_lm_rank(rank: int, name: str, d_in: int, d_out: int) -> None:
    """Refuse a DeRS-LM rank past ``min(d_in, d_out)``: ``A B`` can be no richer there, and
    its factors outgrow the matrix they decompose (the added parameters, DeRS's point,
    grow past a full copy)."""
    if rank > min(d_in, d_out):
        raise ValueError(f"lm_rank={rank} exceeds min(d_in, d_out) = {min(d_in, d_out)} of "
                         f"the {name} matrix [{d_in}, {d_out}]; a rank up to "
                         f"{min(d_in, d_out)} is full rank already")


@config
class DeRSMoEConfig(FFNSlotConfig):
    """A top-k MoE slot whose experts are DeRS-synthesised.

    moe: the MoE hyper-parameters (router, top_k, dispatch, universal / shared FFNs, balance
        loss); ``moe.d_expert`` is the expert width ``d_h`` (= the dense FFN width when
        upcycling).
    form: ``"sm"`` (sparse matrix) or ``"lm"`` (low rank).
    sm_rate: the DeRS-SM sparse rate ``p`` (fraction of positions WITHOUT a trainable value).
    lm_rank / lm_init_std: DeRS-LM rank ``r`` and std of ``A`` (None -> ``d_in ** -0.5``).
    freeze_shared: keep ``W_shared`` fixed (Table 5 ablation).
    extended: decompose the universal FFN together with the experts (App. A; needs
        ``moe.universal_ffn`` and ``moe.d_universal`` None or equal to ``d_expert``).
    synthesis: ``"all"`` synthesises every expert's weights and runs ``moe.dispatch``;
        ``"selected"`` never builds an expert's weights: the shared product once per token
        plus each selected expert's increment product (:mod:`moejax.ops.ders_apply`; dropless,
        same values), the serving path (weights read per token: ``W_shared`` + ``k``
        increments); ``"stream"`` (training at capacity) runs the capacity dispatch
        (``moe.capacity``, ``moe.capacity_priority``: the same drops) with the experts one at
        a time, each expert's weights synthesised inside its step and again in the backward,
        so one expert's weights exist at a time instead of all ``N``.
    """

    moe: MoEConfig = MoEConfig()
    form: Literal["sm", "lm"] = "sm"
    sm_rate: float = 0.99
    lm_rank: int = 4
    lm_init_std: float | None = None
    freeze_shared: bool = False
    extended: bool = False
    synthesis: Literal["all", "selected", "stream"] = "all"

    def validate(self) -> None:
        self._require(0.0 <= self.sm_rate < 1.0,
                      f"sm_rate={self.sm_rate} must be in [0, 1) (fraction of positions "
                      "dropped; e.g. 0.99)")
        self._require(self.lm_rank >= 1, f"lm_rank={self.lm_rank} must be >= 1")
        self._require(self.lm_init_std is None or self.lm_init_std > 0,
                      f"lm_init_std={self.lm_init_std} must be > 0 (or None for 1/sqrt(d_in))")
        self._require(not self.extended or self.moe.universal_ffn,
                      "extended=True decomposes the universal FFN but moe.universal_ffn=False; "
                      "set moe.universal_ffn=True or extended=False")
        self._require(not self.extended or self.moe.d_universal in (None, self.moe.d_expert),
                      f"extended=True needs d_universal == d_expert ({self.moe.d_universal} != "
                      f"{self.moe.d_expert}); leave moe.d_universal=None")

    def build(self, d_model: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        return DeRSMoE(self, d_model, rngs=rngs, dtype=dtype,
                       param_dtype=param_dtype or jnp.float32)


def matrix_shapes(d_model: int, d_hidden: int, gated: bool) -> dict[str, tuple[int, int]]:
    """``{"gate": (D, F), "up": (D, F), "down": (F, D)}`` (no gate when not gated)."""
    shapes = {"up": (d_model, d_hidden), "down": (d_hidden, d_model)}
    if gated:
        shapes = {"gate": (d_model, d_hidden), **shapes}
    return shapes


MATRIX_AXES = {"gate": (ax.EMBED, ax.MLP), "up": (ax.EMBED, ax.MLP), "down": (ax.MLP, ax.EMBED)}


def sm_num_kept(d_in: int, d_out: int, rate: float) -> int:
    """``K = max(1, round(d_in d_out (1 - p)))`` trainable positions per expert and matrix."""
    return max(1, int(round(d_in * d_out * (1.0 - rate))))


def draw_sm_indices(key: jax.Array, n: int, size: int, k: int) -> jax.Array:
    """``[n, k]`` int32: per row ``k`` unique sorted flat positions in ``[0, size)``."""
    if not 1 <= k <= size:
        raise ValueError(f"draw_sm_indices: k={k} must be in [1, size={size}]")
    keys = jax.random.split(key, n)
    pick = lambda kk: jnp.sort(jax.random.choice(kk, size, (k,), replace=False))
    return jax.vmap(pick)(keys).astype(jnp.int32)


class DeltaStack(nnx.Module):
    """``n`` DeRS increments per FFN matrix (see the module docstring for the paths)."""

    def __init__(self, n: int, shapes: dict, cfg: DeRSMoEConfig, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        self.form, self.n = cfg.form, n
        self.shape_items = tuple(shapes.items())  # hashable static metadata
        for name, (d_in, d_out) in shapes.items():
            if cfg.form == "sm":
                k = sm_num_kept(d_in, d_out, cfg.sm_rate)
                setattr(self, f"idx_{name}",
                        DeRSIndex(draw_sm_indices(rngs.params(), n, d_in * d_out, k)))
                setattr(self, f"v_{name}",
                        ax.param(jnp.zeros((n, k), param_dtype), ax.EXPERTS, ax.KEPT))
            else:
                check_lm_rank(cfg.lm_rank, name, d_in, d_out)
                a = (jax.random.normal(rngs.params(), (n, d_in, cfg.lm_rank), param_dtype)
                     * lm_a_std(cfg.lm_init_std, d_in))
                d_in_axis, d_out_axis = MATRIX_AXES[name]
                setattr(self, f"a_{name}", ax.param(a, ax.EXPERTS, d_in_axis, ax.RANK))
                setattr(self, f"b_{name}",
                        ax.param(jnp.zeros((n, cfg.lm_rank, d_out), param_dtype),
                                 ax.EXPERTS, ax.RANK, d_out_axis))

    def deltas(self) -> dict[str, dict]:
        """Per matrix the increments as arrays: ``{"idx", "v"}`` (SM) or ``{"a", "b"}`` (LM)."""
        keys = ("idx", "v") if self.form == "sm" else ("a", "b")
        return {name: {k: getattr(self, f"{k}_{name}")[...] for k in keys}
                for name, _ in self.shape_items}

    def synthesize(self, name: str, base_IO: jax.Array, delta: dict | None = None
                   ) -> jax.Array:
        """``[n, d_in, d_out]``: ``W_i = W_shared + F_pre(Delta_i)`` for every increment
        (``delta``: ``name``'s increments, :meth:`deltas`' entry, read when not given)."""
        delta = self.deltas()[name] if delta is None else delta
        return jax.vmap(lambda e: synthesize_one(self.form, base_IO, delta, e))(
            jnp.arange(self.n))


class _Base(nnx.Module):
    """The expert-shared weights ``W_shared`` (Param, or DeRSFrozen when frozen)."""

    def __init__(self, shapes: dict, *, frozen: bool, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kind = DeRSFrozen if frozen else nnx.Param
        for name, shape in shapes.items():
            w = jax.random.normal(rngs.params(), shape, param_dtype) * shape[0] ** -0.5
            setattr(self, f"w_{name}", ax.named(kind, w, *MATRIX_AXES[name]))

    def get(self, name: str) -> jax.Array:
        return getattr(self, f"w_{name}")[...]


class DeRSMoE(MoESkeleton):
    """DeRS-upcycled top-k MoE slot (module docstring): the MoE skeleton whose expert part
    synthesises the stacked weights from ``W_shared`` and the increments; same call contract
    and ``aux`` as :class:`moejax.nn.moe.MoE`."""

    def __init__(self, cfg: DeRSMoEConfig, d_model: int, *, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32):
        m = cfg.moe
        self.cfg, self.moe_cfg, self.dtype, self.d_model = cfg, m, dtype, d_model
        self.top_k = m.top_k
        self.gated = is_gated(m.activation)
        self.router = make_router(m, d_model, rngs=rngs, param_dtype=param_dtype)
        shapes = matrix_shapes(d_model, m.d_expert, self.gated)
        self.base = _Base(shapes, frozen=cfg.freeze_shared, rngs=rngs, param_dtype=param_dtype)
        self.experts = DeltaStack(m.n_experts, shapes, cfg, rngs=rngs, param_dtype=param_dtype)
        add_always_on(self, m, d_model, gated=self.gated, rngs=rngs, param_dtype=param_dtype,
                      universal=not cfg.extended)
        if m.universal_ffn and cfg.extended:
            self.universal = DeltaStack(1, shapes, cfg, rngs=rngs, param_dtype=param_dtype)

    def experts_out(self, x_ND, r, mask_N):
        if self.cfg.synthesis == "all":
            return self.dispatch_experts(x_ND, r, mask_N, self.expert_weights(after=x_ND))
        stack, m = self.experts, self.moe_cfg
        base = {name: self.base.get(name) for name, _ in stack.shape_items}
        if self.cfg.synthesis == "stream":
            out = capacity_apply(
                x_ND, r.ids_NK, r.weights_NK, m.n_experts,
                functools.partial(ders_streamed, base=base, deltas=stack.deltas(),
                                  form=self.cfg.form, activation=m.activation),
                capacity_factor=m.capacity, valid_N=mask_N, priority=m.capacity_priority)
            return out.y_ND, out.dropped_fraction
        y = ders_experts(x_ND, r.ids_NK, r.weights_NK, base, stack.deltas(),
                         form=self.cfg.form, activation=m.activation)
        return y, jnp.zeros((), jnp.float32)

    def expert_weights(self, stack: DeltaStack | None = None, *, after: jax.Array | None = None):
        """Synthesised ``(w_up [n, D, F], w_down [n, F, D], w_gate [n, D, F] or None)``.

        ``after``: the layer's input; the synthesis then waits for it
        (``jax.lax.optimization_barrier``). The copies depend on the parameters alone, so a
        compiler may otherwise synthesise every layer's at the start of the forward and hold
        them all at once: each layer's ``N`` full copies beside the stored model, more than
        vanilla upcycling's weights, where DeRS's synthesis on the fly holds one layer's."""
        stack = self.experts if stack is None else stack
        base = {name: self.base.get(name) for name, _ in stack.shape_items}
        deltas = stack.deltas()
        if after is not None:
            _, base, deltas = jax.lax.optimization_barrier((after, base, deltas))
        w = {name: stack.synthesize(name, base[name], deltas[name])
             for name, _ in stack.shape_items}
        return w["up"], w["down"], w.get("gate")

    def universal_ffn(self, x_ND):
        if not self.cfg.extended:
            return super().universal_ffn(x_ND)
        u_up, u_down, u_gate = self.expert_weights(self.universal, after=x_ND)
        return ffn_apply(x_ND, u_up[0], u_down[0], None if u_gate is None else u_gate[0],
                         activation=self.moe_cfg.activation)


def ders_param_counts(cfg: DeRSMoEConfig, d_model: int) -> dict[str, int]:
    """Exact per-layer counts of the expert part (router, shared experts excluded):

    * ``shared``: ``sum_W d_in d_out`` (W_shared; trainable unless frozen)
    * ``increments``: SM ``n sum_W K_W`` values, LM ``n r sum_W (d_in + d_out)``, with
      ``n = N (+1 extended)``
    * ``index``: SM index entries ``n sum_W K_W`` (stored, never trained; 0 for LM)
    * ``trainable``: ``increments (+ shared unless frozen)``
    * ``vanilla``: ``n sum_W d_in d_out`` (the N (+1) dense copies of vanilla upcycling)
    """
    m = cfg.moe
    shapes = matrix_shapes(d_model, m.d_expert, is_gated(m.activation))
    n = m.n_experts + (1 if cfg.extended else 0)
    dense = sum(a * b for a, b in shapes.values())
    if cfg.form == "sm":
        inc = n * sum(sm_num_kept(a, b, cfg.sm_rate) for a, b in shapes.values())
        index = inc
    else:
        inc = n * cfg.lm_rank * sum(a + b for a, b in shapes.values())
        index = 0
    return {"shared": dense, "increments": inc, "index": index,
            "trainable": inc + (0 if cfg.freeze_shared else dense), "vanilla": n * dense}


def expert_bytes_per_token(cfg: DeRSMoEConfig | MoEConfig, d_model: int, *,
                           value_bytes: int = 4) -> int:
    """Expert weight bytes one layer reads for one token at batch 1 (router excluded):

    * vanilla (a :class:`MoEConfig`): the ``k`` selected experts' full matrices;
    * DeRS, ``synthesis="selected"``: ``W_shared`` once plus ``k`` increments (SM: ``K``
      values and ``K`` int32 positions per matrix; LM: ``r (d_in + d_out)`` per matrix);
    * DeRS, ``synthesis="all"`` (or ``"stream"``): ``W_shared`` and all ``N`` increments
      read, the ``N`` synthesised copies written and read back.
    """
    m = cfg if isinstance(cfg, MoEConfig) else cfg.moe
    shapes = matrix_shapes(d_model, m.d_expert, is_gated(m.activation))
    dense = sum(a * b for a, b in shapes.values()) * value_bytes
    if isinstance(cfg, MoEConfig):
        return m.top_k * dense
    if cfg.form == "sm":
        inc = sum(sm_num_kept(a, b, cfg.sm_rate) for a, b in shapes.values()) * (value_bytes + 4)
    else:
        inc = cfg.lm_rank * sum(a + b for a, b in shapes.values()) * value_bytes
    if cfg.synthesis == "selected":
        return dense + m.top_k * inc
    return dense + m.n_experts * inc + 2 * m.n_experts * dense
