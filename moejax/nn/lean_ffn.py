"""The lean decode step's FFN slots (:mod:`moejax.nn.lean_decode`): a dense FFN and a BlockFFN
after their RMSNorm, the norm's scale folded into their input products, and a decode step's FFN
input as one GPU kernel where asked (:func:`moejax.kernels.decode_ffn.fused_ffn_in`; BlockFFN's
token-sparse path: :func:`moejax.kernels.decode_route.fused_route`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.kernels import decode_ffn, decode_route
from moejax.kernels.chunk_union.pallas import add_residual
from moejax.nn import axes as ax
from moejax.nn.blockffn import BlockFFN, BlockRoute, block_experts
from moejax.nn.ffn import DenseFFN
from moejax.nn.lean_ops import Residual, bias_of, folded, laid, matvec, on_gpu, pieces, stream
from moejax.nn.norms import RMSNorm, inv_rms
from moejax.ops.activations import activation_fn

__all__ = ["LeanDenseFFN", "LeanBlockFFN"]


def _unfused(ffn, x_BTD, o_BTD):
    """A lean FFN's :meth:`decode_fused` as XLA's step: the stream ``x + o`` with its factor,
    and the FFN's output, not yet summed (a :class:`Residual`) where it is a plain product,
    else summed by the FFN."""
    x_BTD, r_BT1 = stream(add_residual(x_BTD, o_BTD), ffn.eps)
    if ffn.plain_output:
        return Residual(x_BTD, ffn(x_BTD, r_BT1)[0])
    return ffn.with_residual(x_BTD, r_BT1)[0]


class LeanDenseFFN(nnx.Module):
    """A :class:`DenseFFN` after its RMSNorm, gate and up in one product (module docstring);
    ``y, {} = ffn(x_BTD)`` of the block's input."""

    def __init__(self, ffn: DenseFFN, norm: RMSNorm, layout: str = "kn"):
        self.dtype, self.gated, self.eps = ffn.dtype, ffn.gated, norm.eps
        self.activation, self.d_hidden, self.layout = ffn.cfg.activation, ffn.cfg.d_hidden, layout
        ins = (ffn.w_gate, ffn.w_up) if ffn.gated else (ffn.w_up,)
        self.w_in = laid(folded(norm, *ins), layout, ax.EMBED, ax.MLP)
        self.b_in = bias_of(ffn, ("gate", "up"), ax.MLP)
        self.w_down = laid(ffn.w_down, layout, ax.MLP, ax.EMBED)
        self.b_down = getattr(ffn, "b_down", None)

    def __call__(self, x_BTD: jax.Array, r_BT1=None):
        return self._down(self._hidden(x_BTD, r_BT1)), {}

    def _hidden(self, x_BTD, r_BT1=None):
        dt = self.dtype or x_BTD.dtype
        r = (inv_rms(x_BTD, self.eps) if r_BT1 is None else r_BT1).astype(dt)
        h = matvec(x_BTD.astype(dt), self.w_in[...].astype(dt), self.layout) * r
        if self.b_in is not None:
            h = h + self.b_in[...].astype(dt)
        act = activation_fn(self.activation)
        return act(h[..., :self.d_hidden]) * h[..., self.d_hidden:] if self.gated else act(h)

    def _down(self, h):
        y = matvec(h, self.w_down[...].astype(h.dtype), self.layout)
        return y if self.b_down is None else y + self.b_down[...].astype(h.dtype)

    plain_output = True  # __call__ is its output: no kernel sums into the residual

    def fusable_in(self, x_BTD) -> bool:
        """Whether :meth:`decode_fused` takes the residual ``x`` (up to
        :data:`moejax.kernels.decode_ffn.MAX_ROWS` token rows, a call
        :func:`moejax.kernels.decode_ffn.supports`)."""
        B, T, D = x_BTD.shape
        return (self.w_in[...].dtype == x_BTD.dtype and (self.dtype or x_BTD.dtype) ==
                x_BTD.dtype and decode_ffn.supports(D, self.d_hidden, 1, B * T,
                                                    x_BTD.dtype) is None)

    def decode_fused(self, x_BTD, o_BTD, fused) -> Residual:
        """The block's output ``x + o + ffn(x + o)`` as a :class:`Residual`: on a GPU, where
        the kernel takes ``x`` (:meth:`fusable_in`), the residual add, the norm's factor, the
        in product and the activation in one kernel
        (:func:`moejax.kernels.decode_ffn.fused_ffn_in`), then the down product."""
        if not self.fusable_in(x_BTD):
            return _unfused(self, x_BTD, o_BTD)
        b = None if self.b_in is None else self.b_in[...].astype(x_BTD.dtype)  # as XLA's adds
        B, T, D = x_BTD.shape

        def kernel(x, o, w):
            h, x = decode_ffn.fused_ffn_in(
                x.reshape(B * T, D), o.reshape(B * T, D), w, b, d_hidden=self.d_hidden,
                gated=self.gated, activation=self.activation, eps=self.eps,
                layout=self.layout, interpret=fused == "interpret")
            return h.reshape(B, T, -1), x.reshape(B, T, D)

        def xla(x, o, w):
            x, r = stream(add_residual(x, o), self.eps)
            return self._hidden(x, r), x

        h, x_BTD = on_gpu(fused, kernel, xla, x_BTD, o_BTD, self.w_in[...])
        return Residual(x_BTD, self._down(h))

    def with_residual(self, x_BTD: jax.Array, r_BT1=None):
        """``x + ffn(x)``, the block's output, and ``{}``; ``r``: ``x``'s RMS factor, where
        it is at hand."""
        y, aux = self(x_BTD, r_BT1)
        return add_residual(x_BTD, y), aux


class LeanBlockFFN(nnx.Module):
    """A :class:`~moejax.nn.blockffn.BlockFFN` after its RMSNorm with the norm's scale folded
    into the router and the experts' input weights (module docstring); ``y, {} = ffn(x_BTD)``
    of the block's input."""

    def __init__(self, ffn: BlockFFN, norm: RMSNorm, layout: str = "kn"):
        self.cfg, self.dtype, self.eps, self.layout = ffn.cfg, ffn.dtype, norm.eps, layout
        s_D = norm.scale[...].astype(jnp.float32)
        w_router_DE = s_D[:, None] * ffn.router.w[...].astype(jnp.float32)
        self.router_norm = ffn.router_norm if ffn.cfg.rmsnorm else None
        w_up, w_down, w_gate = ffn.experts.weights()
        fold = lambda w: (s_D[None, :, None] * w.astype(jnp.float32)).astype(w.dtype)  # noqa: E731
        dt = jnp.dtype(ffn.dtype or w_up.dtype)
        # on the dense path, the router's product joins the experts' input product where its
        # weights are an exact sum of that product's dtype (pieces)
        router = (pieces(w_router_DE, dt) if ffn.cfg.path == "dense"
                  and dt in (jnp.float32, jnp.bfloat16) else ())
        self.n_pieces = len(router)
        if not router:
            self.w_router = laid(w_router_DE, layout, ax.EMBED, ax.SCORES)
        if ffn.cfg.path == "dense":  # every expert: one product in, one out ([D, E F], [E F, D])
            E, D, F = w_up.shape
            flat = lambda w: fold(w).transpose(1, 0, 2).reshape(D, E * F).astype(dt)  # noqa: E731
            ins = (w_up,) if w_gate is None else (w_gate, w_up)
            self.w_in = laid(jnp.concatenate([flat(w) for w in ins] + list(router), axis=1),
                              layout, ax.EMBED, ax.MLP)
            self.w_out = laid(w_down.reshape(E * F, D), layout, ax.MLP, ax.EMBED)
            return
        up = (ax.EXPERTS, ax.EMBED, ax.MLP)
        self.w_up = ax.param(fold(w_up), *up)
        self.w_down = ax.param(w_down, ax.EXPERTS, ax.MLP, ax.EMBED)
        self.w_gate = None if w_gate is None else ax.param(fold(w_gate), *up)

    def __call__(self, x_BTD: jax.Array, r_BT1=None):
        return self._experts(x_BTD, r_BT1, residual=False), {}

    @property
    def plain_output(self) -> bool:
        """Whether its output is a plain product (the dense path), not a kernel's that sums
        into the residual (:meth:`with_residual`)."""
        return self.cfg.path == "dense"

    def with_residual(self, x_BTD: jax.Array, r_BT1=None):
        """``x + ffn(x)``, the block's output, and ``{}``: the residual goes to the expert
        part, whose GPU decode kernel sums into it (no zeroed output, no add after it)."""
        return self._experts(x_BTD, r_BT1, residual=True), {}

    def _experts(self, x_BTD: jax.Array, r_BT1, residual: bool):
        B, T, D = x_BTD.shape
        dt = self.dtype or x_BTD.dtype
        x_ND = x_BTD.reshape(B * T, D)
        r_N1 = inv_rms(x_ND, self.eps) if r_BT1 is None else r_BT1.reshape(B * T, 1)
        if self.n_pieces:  # the router's product is the experts' input product
            y_ND = self._every_expert(x_ND.astype(dt), r_N1, dt)
        else:
            xe_ND, route = self._routed(x_ND, r_N1, dt)
            if self.cfg.path != "dense":
                return self._sparse(xe_ND, route, x_ND if residual else None).reshape(B, T, D)
            y_ND = self._every_expert(x_ND.astype(dt), r_N1, dt, route.a)
        return (y_ND if not residual else add_residual(x_ND, y_ND)).reshape(B, T, D)

    def _routed(self, x_ND, r_N1, dt) -> tuple[jax.Array, BlockRoute]:
        """The experts' input ``x r`` in ``dt`` and the router's scores of ``x`` (its own
        float32 product, times ``r``)."""
        x32_ND = x_ND.astype(jnp.float32)
        route = self._route(matvec(x32_ND, self.w_router[...], self.layout) * r_N1)
        return (x32_ND * r_N1).astype(dt), route

    def _route(self, a0_NE) -> BlockRoute:
        a1 = jax.nn.relu(a0_NE)
        return BlockRoute(a0_NE, a1, a1 if self.router_norm is None else self.router_norm(a1))

    def _sparse(self, xe_ND, route: BlockRoute, residual_ND=None):
        """The expert part on the module's token-sparse path (:func:`block_experts`), summed
        into ``residual`` where one is given, in its dtype."""
        w_gate = None if self.w_gate is None else self.w_gate[...]
        return block_experts(self.cfg, xe_ND, route, self.w_up[...], self.w_down[...], w_gate,
                             residual_ND)[0]

    def _every_expert(self, x_ND, r_N1, dt, a_NE=None):
        """``sum_e a_e E_e(x r)``: :meth:`_every_expert_hidden`, then the out product."""
        return self._down(self._every_expert_hidden(x_ND, r_N1, dt, a_NE))

    def _every_expert_hidden(self, x_ND, r_N1, dt, a_NE=None):
        """The hidden activations ``[N, E F]`` of ``sum_e a_e E_e(x r)`` (then the out
        product ``[N, E F] x [E F, D]``, :meth:`_down`): ``[N, D] x [D, E F]``, accumulated in
        float32 and rounded to ``dt`` as the experts' own product would be, times ``r`` after
        it; the activation and each expert's weight ``a_e`` on its ``F`` columns. Without
        ``a_NE``, the router's scores are the in product's last ``P E`` columns
        (``[D, E F + P E]``), its ``P`` pieces summed in float32."""
        h_NH = matvec(x_ND, self.w_in[...].astype(dt), self.layout, jnp.float32)
        if a_NE is None:
            E, P = self.cfg.n_experts, self.n_pieces
            H = h_NH.shape[1] - P * E
            a0_NE = sum(h_NH[:, H + i * E:H + (i + 1) * E] for i in range(P)) * r_N1
            h_NH, a_NE = h_NH[:, :H], self._route(a0_NE).a
        N, E = a_NE.shape
        h_NH = h_NH.astype(dt) * r_N1.astype(dt)
        act = activation_fn(self.cfg.activation)
        EF = self._hidden_width()
        h_NH = act(h_NH) if h_NH.shape[1] == EF else act(h_NH[:, :EF]) * h_NH[:, EF:]
        g_NEF = h_NH.reshape(N, E, EF // E) * a_NE.astype(dt)[:, :, None]
        return g_NEF.reshape(N, EF)  # what the out product takes

    def _hidden_width(self) -> int:
        return self.w_out.shape[0 if self.layout == "kn" else 1]

    def _down(self, g_NH):
        return matvec(g_NH, self.w_out[...].astype(g_NH.dtype), self.layout)

    def fusable_in(self, x_BTD) -> bool:
        """Whether :meth:`decode_fused` takes the residual ``x`` into a kernel: on the dense
        path with the router in the in product, up to
        :data:`moejax.kernels.decode_ffn.MAX_ROWS` token rows
        (:func:`moejax.kernels.decode_ffn.supports`); on the token-sparse path, up to
        :data:`moejax.kernels.decode_route.MAX_TOKENS` token rows
        (:func:`moejax.kernels.decode_route.supports`)."""
        (B, T, D), E, dt = x_BTD.shape, self.cfg.n_experts, x_BTD.dtype
        if (self.dtype or dt) != dt:
            return False
        if self.cfg.path != "dense":
            return decode_route.supports(D, E, B * T, dt) is None
        return self.n_pieces > 0 and decode_ffn.supports(D, self._hidden_width() // E, E,
                                                         B * T, dt) is None

    def _router(self) -> decode_ffn.Router:
        norm = self.router_norm
        return decode_ffn.Router(
            self.cfg.n_experts, max(self.n_pieces, 1), None if norm is None else norm.scale[...],
            1e-6 if norm is None else norm.eps,
            jnp.dtype(jnp.float32 if norm is None or norm.dtype is None else norm.dtype))

    def decode_fused(self, x_BTD, o_BTD, fused):
        """The block's output ``x + o + ffn(x + o)``, a :class:`Residual` where a kernel takes
        ``x`` (:meth:`fusable_in`), as one on a GPU: on the dense path the residual add, the
        norm's factor, the in product with the router's scores, the router norm, the
        activation and the experts' weights in one kernel
        (:func:`moejax.kernels.decode_ffn.fused_ffn_in`), then the down product; on the
        token-sparse path the residual add, the norm's factor, the router and the experts'
        input in one kernel (:func:`moejax.kernels.decode_route.fused_route`), then the
        expert part, its output in float32."""
        if not self.fusable_in(x_BTD):
            return _unfused(self, x_BTD, o_BTD)
        if self.cfg.path != "dense":
            return self._sparse_fused(x_BTD, o_BTD, fused)
        E, EF = self.cfg.n_experts, self._hidden_width()
        gated = self.w_in.shape[1 if self.layout == "kn" else 0] - self.n_pieces * E > EF
        router, (B, T, D) = self._router(), x_BTD.shape

        def kernel(x, o, w):
            g, x = decode_ffn.fused_ffn_in(
                x.reshape(B * T, D), o.reshape(B * T, D), w, None, d_hidden=EF // E,
                n_experts=E, gated=gated, activation=self.cfg.activation, eps=self.eps,
                layout=self.layout, router=router, interpret=fused == "interpret")
            return g, x.reshape(B, T, D)

        def xla(x, o, w):
            x, r = stream(add_residual(x, o), self.eps)
            B, T, D = x.shape
            dt = x.dtype
            g = self._every_expert_hidden(x.reshape(B * T, D), r.reshape(B * T, 1), dt)
            return g, x

        g_NH, x_BTD = on_gpu(fused, kernel, xla, x_BTD, o_BTD, self.w_in[...])
        return Residual(x_BTD, self._down(g_NH).reshape(x_BTD.shape))

    def _sparse_fused(self, x_BTD, o_BTD, fused) -> Residual:
        """:meth:`decode_fused` on the token-sparse path: the expert part sums into the
        float32 zeros that the kernel (or XLA's step) writes; the block's output is the
        stream and that sum, not yet added."""
        B, T, D = x_BTD.shape
        dt, router = x_BTD.dtype, self._router()

        def kernel(x, o, w):
            return decode_route.fused_route(
                x.reshape(B * T, D), o.reshape(B * T, D), w, router, eps=self.eps,
                layout=self.layout, interpret=fused == "interpret")

        def xla(x, o, w):
            x, r = stream(add_residual(x, o), self.eps)
            x_ND = x.reshape(B * T, D)
            xe, route = self._routed(x_ND, r.reshape(B * T, 1), dt)
            return xe, route.a, route.a1, x_ND, jnp.zeros(x_ND.shape, jnp.float32)

        xe_ND, a_NE, a1_NE, s_ND, y_ND = on_gpu(fused, kernel, xla, x_BTD, o_BTD,
                                                self.w_router[...])
        y_ND = self._sparse(xe_ND, BlockRoute(None, a1_NE, a_NE), y_ND)  # a0: not read
        return Residual(s_ND.reshape(B, T, D), y_ND.reshape(B, T, D))
