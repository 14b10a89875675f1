import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402


@pytest.fixture()
def tiny_recipes(monkeypatch, tmp_path):
    """Tiny substrate recipes in the registry (tests/tiny_substrates.py); returns a fresh
    cache directory."""
    from moejax.substrates import registry
    from tests.tiny_substrates import tiny_registry

    monkeypatch.setattr(registry, "SUBSTRATES", tiny_registry())
    return tmp_path / "subs"
