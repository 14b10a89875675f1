"""DeRS step 3 (Synthesis): inference from base + compact deltas, one expert at a time.

:class:`SynthMoE` is an FFN slot holding, for each matrix ``w``, the expert-shared ``W_base``
and the N (+1) compact deltas as fixed buffers (:class:`DeRSBuffer`, not ``nnx.Param``):

* ``"sparse"``: ``idx_w [n, K]`` int32 flat positions (padded with ``d_in d_out``, dropped by
  the scatter) and ``val_w [n, K]``: ``W~_i = W_base + scatter(idx_i, val_i)``;
* ``"quant"``: ``codes_w [n, ceil(d_in d_out k / 8)]`` bit-packed (LSB first) codes, ``step_w``
  / ``offset_w [n, G, d_out]`` (one scale per group of ``d_in / G`` input rows of each column;
  ``G = 1``: per column): ``W~_i = W_base + offset_i + code_i * step_i``;
* ``"dense"``: ``d_w [n, d_in, d_out]`` (float16 / float32): ``W~_i = W_base + Delta_i``.

The forward routes as the trained MoE (same router) and then scans over the experts: expert
``i``'s weight is synthesised only inside its scan step, and only if some token was routed
to it (``lax.cond``), so at most ONE synthesised expert weight exists at a time, never all N
of every layer. Each used expert runs on all tokens with its combine weight (zero for tokens
not routed to it): dropless, exactly ``sum_k g_k E~_{id_k}(x)``. The extended universal FFN
is delta ``n - 1``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import config
from moejax.delta.quant import num_levels
from moejax.ders_compress.compress import CompressedDeRS
from moejax.kernels.moe_ffn.jnp_paths import ffn_apply
from moejax.nn.ders_moe import matrix_shapes
from moejax.nn.moe import MoEConfig, MoESkeleton, add_always_on, make_router
from moejax.nn.slots import FFNSlotConfig
from moejax.nn.surgery import build_from_pure
from moejax.ops.activations import is_gated

__all__ = ["DeRSBuffer", "SynthMoEConfig", "SynthMoE", "unpack_codes", "synth_decoder_config",
           "synth_variables", "build_synth_model"]


class DeRSBuffer(nnx.Variable):
    """Fixed buffers of a compressed model (base weights, compact deltas)."""


@config
class SynthMoEConfig(FFNSlotConfig):
    """On-the-fly synthesis slot: ``moe`` the trained MoE's config; ``kind`` the delta form;
    ``k_max`` sparse entries per delta (padded); ``bits`` (quant), ``quant_group`` (input
    rows per scale; 0 = the whole column), ``levels`` (0 = the legacy symmetric count);
    ``delta_dtype`` (dense); ``extended``: the universal FFN is delta ``n - 1``."""

    moe: MoEConfig = MoEConfig()
    kind: Literal["sparse", "quant", "dense"] = "sparse"
    k_max: int = 1
    bits: int = 8
    quant_group: int = 0
    levels: int = 0
    delta_dtype: Literal["float16", "float32"] = "float16"
    extended: bool = False

    def validate(self) -> None:
        self._require(self.k_max >= 1, f"k_max={self.k_max} must be >= 1")
        self._require(1 <= self.bits <= 8, f"bits={self.bits} must be in 1..8 (quant codes)")
        self._require(self.quant_group >= 0 and self.levels >= 0,
                      f"quant_group={self.quant_group} and levels={self.levels} must be >= 0")
        self._require(not self.extended or self.moe.universal_ffn,
                      "extended=True needs moe.universal_ffn=True")

    def build(self, d_model: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        return SynthMoE(d_model, self, rngs=rngs, dtype=dtype,
                        param_dtype=param_dtype or jnp.float32)


def unpack_codes(packed_B: jax.Array, bits: int, count: int) -> jax.Array:
    """jnp inverse of ``moejax.delta.storage.pack_bits``: ``count`` int32 codes. Code ``j``
    occupies bits ``[j k, (j+1) k)`` of the little-endian bit stream."""
    pos = jnp.arange(count, dtype=jnp.int32) * bits
    byte, shift = pos // 8, pos % 8
    p = jnp.concatenate([packed_B.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    word = p[byte] | (p[byte + 1] << 8)
    return (word >> shift) & ((1 << bits) - 1)


class SynthMoE(MoESkeleton):
    """See the module docstring: the MoE skeleton whose expert part synthesises one expert at a
    time; same call contract and ``aux`` as the MoE slot."""

    def __init__(self, d_model: int, cfg: SynthMoEConfig, *, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32):
        m = cfg.moe
        self.cfg, self.moe_cfg, self.dtype, self.d_model = cfg, m, dtype, d_model
        self.top_k = m.top_k
        gated = is_gated(m.activation)
        self.shape_items = tuple(matrix_shapes(d_model, m.d_expert, gated).items())
        n = m.n_experts + (1 if cfg.extended else 0)
        self.n = n
        self.router = make_router(m, d_model, rngs=rngs, param_dtype=param_dtype)
        add_always_on(self, m, d_model, gated=gated, rngs=rngs, param_dtype=param_dtype,
                      universal=not cfg.extended)
        z = lambda shape, dt=param_dtype: DeRSBuffer(jnp.zeros(shape, dt))  # noqa: E731
        for name, (di, do) in self.shape_items:
            setattr(self, f"base_{name}", z((di, do)))
            if cfg.kind == "sparse":
                setattr(self, f"idx_{name}", z((n, cfg.k_max), jnp.int32))
                setattr(self, f"val_{name}", z((n, cfg.k_max)))
            elif cfg.kind == "quant":
                setattr(self, f"codes_{name}", z((n, math.ceil(di * do * cfg.bits / 8)),
                                                 jnp.uint8))
                groups = di // min(cfg.quant_group or di, di)  # quantize's group rule
                setattr(self, f"step_{name}", z((n, groups, do), jnp.float32))
                setattr(self, f"offset_{name}", z((n, groups, do), jnp.float32))
            else:
                setattr(self, f"d_{name}", z((n, di, do), jnp.dtype(cfg.delta_dtype)))

    def synthesize(self, name: str, i) -> jax.Array:
        """``W~_i = W_base + F(Delta_i)`` for matrix ``name`` and delta ``i`` (traced ok)."""
        base = getattr(self, f"base_{name}")[...]
        di, do = dict(self.shape_items)[name]
        kind = self.cfg.kind
        if kind == "sparse":
            idx = getattr(self, f"idx_{name}")[...][i]
            val = getattr(self, f"val_{name}")[...][i].astype(base.dtype)
            return base.reshape(-1).at[idx].add(val, mode="drop").reshape(di, do)
        if kind == "quant":
            codes = unpack_codes(getattr(self, f"codes_{name}")[...][i], self.cfg.bits, di * do)
            rows = di // getattr(self, f"step_{name}").shape[1]  # input rows per scale
            step = jnp.repeat(getattr(self, f"step_{name}")[...][i], rows, axis=0)
            off = jnp.repeat(getattr(self, f"offset_{name}")[...][i], rows, axis=0)
            return base + (off + codes.reshape(di, do).astype(jnp.float32)
                           * step).astype(base.dtype)
        return base + getattr(self, f"d_{name}")[...][i].astype(base.dtype)

    def _ffn(self, x_ND, i):
        w = {name: self.synthesize(name, i) for name, _ in self.shape_items}
        return ffn_apply(x_ND, w["up"], w["down"], w.get("gate"),
                         activation=self.cfg.moe.activation)

    def experts_out(self, x_ND, r, mask_N):
        """Dropless: a scan over the experts, each synthesised only if a token chose it."""
        N = x_ND.shape[0]
        comb_NE = jnp.zeros((N, self.moe_cfg.n_experts), jnp.float32).at[
            jnp.arange(N)[:, None], r.ids_NK].add(r.weights_NK)

        def body(y_ND, i):
            c_N = comb_NE[:, i]
            run = lambda y: y + (c_N[:, None] * self._ffn(x_ND, i)).astype(y.dtype)  # noqa
            return jax.lax.cond(jnp.any(c_N != 0), run, lambda y: y, y_ND), None

        y_ND, _ = jax.lax.scan(body, jnp.zeros_like(x_ND), jnp.arange(self.moe_cfg.n_experts))
        return y_ND, jnp.zeros((), jnp.float32)

    def universal_ffn(self, x_ND):
        if self.cfg.extended:
            return self._ffn(x_ND, self.n - 1)
        return super().universal_ffn(x_ND)


def _leaf_index(c: CompressedDeRS) -> dict[str, int]:
    return {m["path"]: j for j, m in enumerate(c.stored.meta["leaves"])}


def synth_decoder_config(moe_cfg, c: CompressedDeRS):
    """The trained MoE decoder config with the compressed layers' slots replaced by
    :class:`SynthMoEConfig` (``k_max`` = largest stored delta)."""
    method, ext = c.meta["method"], c.meta["extended"]
    k_max = max([int(a.size) for k, a in c.stored.arrays.items() if k.endswith(".values")]
                + [1]) if method == "sparse" else 1
    kind = {"sparse": "sparse", "quant": "quant" if c.meta["bits"] <= 8 else "dense",
            "none": "dense"}[method]
    dd = "float16" if method == "quant" else "float32"
    group, levels = 0, 0
    if kind == "quant":
        leaf = c.stored.meta["leaves"][0]
        if leaf["granularity"] == "tensor":
            raise ValueError("synthesis supports per-column or per-group delta scales; "
                             "quantise with granularity='channel' or 'group'")
        group = leaf["group_size"] if leaf["granularity"] == "group" else 0
        levels = leaf.get("levels") or num_levels(leaf["bits"], leaf["symmetric"])
    slots = list(moe_cfg.ffn_slots)
    for i in c.meta["layers"]:
        slots[i] = SynthMoEConfig(moe=slots[i], kind=kind, k_max=k_max,
                                  bits=min(c.meta["bits"], 8), quant_group=group, levels=levels,
                                  delta_dtype=dd, extended=ext)
    return dataclasses.replace(moe_cfg, ffn_slots=tuple(slots))


def synth_variables(c: CompressedDeRS) -> dict:
    """Pure variable dict of the synthesis model (``rest`` + base + compact delta buffers)."""
    out = jax.tree.map(lambda x: x, c.rest)
    where, arrays = _leaf_index(c), c.stored.arrays
    method, bits = c.meta["method"], c.meta["bits"]
    n = c.meta["n"]
    k_max = max([int(a.size) for k, a in arrays.items() if k.endswith(".values")] + [1])
    for i in c.meta["layers"]:
        key = i if i in out["blocks"] else str(i)
        ffn = out["blocks"][key]["ffn"]
        for w, base in c.base[key].items():
            name = w[2:]
            ffn[f"base_{name}"] = jnp.asarray(base)
            leaves = [where[f"{i}/{w}/e{j}"] for j in range(n)]
            pre = [f"leaf{j}." for j in leaves]
            if method == "sparse":
                size = base.size
                idx = np.full((n, k_max), size, np.int32)
                val = np.zeros((n, k_max), np.float32)
                for e, p in enumerate(pre):
                    ii, vv = arrays[p + "index"], arrays[p + "values"]
                    idx[e, :ii.size], val[e, :vv.size] = ii.astype(np.int32), vv
                ffn[f"idx_{name}"], ffn[f"val_{name}"] = jnp.asarray(idx), jnp.asarray(val)
            elif method == "quant" and bits <= 8:
                metas = [c.stored.meta["leaves"][j] for j in leaves]
                if any(not m["symmetric"] for m in metas):
                    raise ValueError("synthesis needs centred (midrise or symmetric) codes")
                levels = metas[0].get("levels") or num_levels(bits, True)
                d_out = base.shape[1]
                step = np.stack([arrays[p + "step"].reshape(-1, d_out) for p in pre])
                ffn[f"codes_{name}"] = jnp.asarray(np.stack([arrays[p + "codes"] for p in pre]))
                ffn[f"step_{name}"] = jnp.asarray(step, jnp.float32)
                ffn[f"offset_{name}"] = jnp.asarray(-(levels - 1) / 2.0 * step, jnp.float32)
            else:
                d = np.stack([arrays[p + "values"].reshape(base.shape) for p in pre])
                ffn[f"d_{name}"] = jnp.asarray(d)
    return out


def build_synth_model(model_cls, moe_cfg, c: CompressedDeRS):
    """A ``model_cls`` (e.g. DecoderLM) running the compressed model by synthesis; no
    parameter of the N dense experts is ever built (abstract init + pure variable dict)."""
    cfg = synth_decoder_config(moe_cfg, c)
    return build_from_pure(lambda: model_cls(cfg, rngs=nnx.Rngs(0)), synth_variables(c))
