"""The layering the codebase promises, read from the source (imports at any depth, function
bodies included): ops (pure jnp) -> kernels -> nn -> train / io -> experiments. A layer imports
only layers below it and the foundation modules (configs, the capture context, atomic file
writes, XLA flags and compile options checked against the running XLA, pytree paths and
counts, how a module imports an optional dependency), never a layer above;
and no module name is shared between ``ops`` and ``kernels``, so a kernel family's package is
the one place its reference, backends and layout live."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "moejax"
BELOW = {"ops": {"ops"}, "kernels": {"ops", "kernels"}, "nn": {"ops", "kernels", "nn"}}
# no moejax layer
FOUNDATION = {"config", "config_names", "config_overrides", "capture", "cpu_pool", "extras",
              "files", "xla_flags", "pytree"}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _violations(layer: str, root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / layer).rglob("*.py")):
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] == "experiments" or (parts[0] == "moejax" and len(parts) > 1 and (
                    parts[1] not in BELOW[layer] | FOUNDATION)):
                bad.append(f"{path.relative_to(root)} imports {mod}")
    return bad


@pytest.mark.parametrize("layer", sorted(BELOW))
def test_a_layer_imports_only_the_layers_below_it(layer):
    assert _violations(layer) == []


def test_the_foundation_modules_import_no_layer():
    for name in FOUNDATION:
        mods = {m.split(".")[1] for m in _imports(ROOT / f"{name}.py")
                if m.startswith("moejax.")}
        assert mods <= FOUNDATION, (name, mods)


def test_the_checker_sees_an_upward_import_even_inside_a_function(tmp_path):
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "bad.py").write_text("def f():\n    from moejax.nn.moe import MoE\n")
    assert _violations("ops", tmp_path) == ["ops/bad.py imports moejax.nn.moe"]


def test_no_module_name_is_shared_between_ops_and_kernels():
    def names(layer):
        return {p.stem for p in (ROOT / layer).rglob("*.py") if p.stem != "__init__"} | {
            p.name for p in (ROOT / layer).rglob("*") if p.is_dir() and p.name != "__pycache__"}

    assert names("ops") & names("kernels") == set()


def test_no_module_name_is_shared_between_two_packages():
    """Every module and package of moejax has its own name: one name, one home (a reader
    searching for ``reference`` or ``attention`` finds one file)."""
    homes: dict[str, list[str]] = {}
    for p in sorted(ROOT.rglob("*")):
        if p.name in ("__init__.py", "__pycache__") or "__pycache__" in p.parts:
            continue
        if p.is_dir() or p.suffix == ".py":
            homes.setdefault(p.stem, []).append(str(p.relative_to(ROOT)))
    assert {k: v for k, v in homes.items() if len(v) > 1} == {}


def test_the_library_never_imports_the_studies():
    """Shared helpers live in the library; ``experiments/`` is the top layer."""
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in sorted(ROOT.rglob("*.py"))
           for m in _imports(p) if m.split(".")[0] == "experiments"]
    assert bad == []


def test_the_library_below_the_harness_never_imports_it():
    """The study harness (moejax/harness: run directories, the index, claims, tables, plots,
    the runner) sits above the library: only the substrate cache, which names a smoke run's
    substrates by the harness's smoke cuts, reaches into it."""
    allowed = {"substrates/registry.py"}
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in sorted(ROOT.rglob("*.py"))
           if p.relative_to(ROOT).parts[0] != "harness"
           and str(p.relative_to(ROOT)) not in allowed
           for m in _imports(p) if m.startswith("moejax.harness")]
    assert bad == []
