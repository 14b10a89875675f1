"""The one activation table (moejax.kernels.activation_forms): for every activation its jax,
kernel and numpy host forms agree, and the host derivative is jax's gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels.activation_forms import ACTIVATION_FORMS, kernel_activation
from moejax.kernels.moe_ffn.host_act import act_into
from moejax.ops.activations import ACTIVATIONS

X = np.linspace(-9.0, 9.0, 2001, dtype=np.float32)


def test_the_table_covers_every_activation():
    assert set(ACTIVATION_FORMS) == set(ACTIVATIONS)
    assert {n for n, f in ACTIVATION_FORMS.items() if f.gated} == {"swiglu", "geglu"}
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        kernel_activation("tanh")


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_jax_kernel_and_host_forms_agree(name):
    forms = ACTIVATION_FORMS[name]
    want = np.asarray(forms.jax(jnp.asarray(X)))
    np.testing.assert_allclose(np.asarray(forms.kernel(jnp.asarray(X))), want, rtol=1e-5,
                               atol=2e-6)
    a, d, t1, t2 = (np.empty_like(X) for _ in range(4))
    act_into(forms.host, X, a, d, t1, t2)
    np.testing.assert_allclose(a, want, rtol=1e-5, atol=2e-6)
    grad = np.asarray(jax.vmap(jax.grad(forms.jax))(jnp.asarray(X)))
    keep = X != 0  # relu's derivative at 0 is a convention
    # 1e-5: where tanh saturates in float32, jax's gradient of gelu_tanh is 0 and the host's
    # closed form a few 1e-6 (the true value at x = -5 is about -7e-6)
    np.testing.assert_allclose(d[keep], grad[keep], rtol=1e-4, atol=1e-5)
