"""moejax modules under a mesh of explicit axes (``jax.make_mesh``'s default).

The modules leave their shardings to XLA's propagation: an embedding's gather by token ids,
the routing's scatters and the expert-parallel ``shard_map`` have no output sharding that
explicit sharding can type, so under a mesh with explicit axes they fail at trace time.
:func:`call_with_auto_axes` runs a module's method there with the mesh's axes automatic
(:func:`jax.sharding.auto_axes`), its variables passed in:

* an output whose leading axis has the batch's size (logits, hidden states, a KV cache's
  keys and values, per-token expert ids) keeps the sharding of the batch input's first axis;
  every other output (losses, per-expert loads, a cache's lengths) comes back replicated;
* variables other than parameters that the call changes (an rng stream's count, a norm's
  statistics) are written back to the module, with the shardings they had.

Values and gradients are those of the same call without a mesh; under no mesh, or one whose
axes are all automatic, the method runs as it is. A decoding loop's entry point runs the same
way (:func:`run_for_mesh`), and a new KV cache is placed as its steps return it
(:func:`like_batch`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

__all__ = ["explicit_mesh", "run_with_auto_axes", "call_with_auto_axes", "run_for_mesh",
           "batch_specs", "like_batch"]


def explicit_mesh() -> bool:
    """Whether the mesh set for tracing (``jax.set_mesh``) has explicit axes."""
    return bool(jax.sharding.get_abstract_mesh().explicit_axes)


def _is_array(v) -> bool:
    return isinstance(v, (jax.Array, np.ndarray))


def run_with_auto_axes(fn: Callable, x, args: tuple = (), kwargs: dict | None = None, *,
                       out_specs: Callable | None = None):
    """``fn(x, *args, **kwargs)`` under the context mesh with its axes automatic. ``x``: the
    batch input (its first axis is the batch); ``args`` and array keyword arguments are
    passed in (pytrees of arrays), the other keyword arguments (flags, ``None``) are held
    fixed. ``out_specs(shapes) -> specs`` gives the outputs' partition specs from their
    shapes; default :func:`batch_specs` (the module docstring's rule)."""
    kwargs = kwargs or {}
    arrays = {k: v for k, v in kwargs.items() if _is_array(v)}
    fixed = {k: v for k, v in kwargs.items() if not _is_array(v)}

    def run(x, args, arrays):
        return fn(x, *args, **arrays, **fixed)

    shapes = jax.eval_shape(jax.sharding.auto_axes(run, out_sharding=P()), x, args, arrays)
    specs = batch_specs(shapes, x) if out_specs is None else out_specs(shapes)
    return jax.sharding.auto_axes(run, out_sharding=specs)(x, args, arrays)


def batch_specs(tree, x):
    """The partition spec of each leaf of ``tree`` (arrays or shapes) as the module
    docstring says: ``x``'s first-axis sharding on a leaf with two or more axes whose first
    has ``x``'s batch size, replicated elsewhere."""
    batch, x_spec = np.shape(x)[0], jax.typeof(x).sharding.spec
    lead = x_spec[0] if len(x_spec) else None

    def spec(leaf) -> P:
        shape = getattr(leaf, "shape", ())
        if len(shape) >= 2 and shape[0] == batch:
            return P(lead, *([None] * (len(shape) - 1)))
        return P()

    return jax.tree.map(spec, tree)


def like_batch(tree, x):
    """``tree`` resharded by :func:`batch_specs` under a mesh of explicit axes (e.g. a new
    KV cache placed as the decode steps will return it, so its buffers can be donated);
    as it is elsewhere."""
    return jax.sharding.reshard(tree, batch_specs(tree, x)) if explicit_mesh() else tree


def call_with_auto_axes(module: nnx.Module, method: Callable, x, *args, **kwargs):
    """``method(module, x, *args, **kwargs)`` by :func:`run_with_auto_axes`, the module's
    variables passed in; those other than parameters that the call changes are written back
    with the shardings they had."""
    graphdef, state = nnx.split(module)
    rest_specs = jax.tree.map(lambda v: jax.typeof(v).sharding.spec,
                              nnx.state(module, nnx.Not(nnx.Param)))

    def run(x, state, *args, **kwargs):
        m = nnx.merge(graphdef, state)
        return method(m, x, *args, **kwargs), nnx.state(m, nnx.Not(nnx.Param))

    out, rest = run_with_auto_axes(run, x, (state, *args), kwargs,
                                   out_specs=lambda s: (batch_specs(s[0], x), rest_specs))
    nnx.update(module, rest)
    return out


def run_for_mesh(fn: Callable, x, *args):
    """``fn(x, *args)`` (``x`` the batch input): by :func:`run_with_auto_axes` under a mesh
    of explicit axes, else as it is (a decoding loop's entry point)."""
    return run_with_auto_axes(fn, x, args) if explicit_mesh() else fn(x, *args)
