"""moejax as a dependency: the wheel holds ``moejax`` alone and requires the core alone
(jax, jaxlib, flax, optax, orbax-checkpoint, chex, numpy); every core module imports where
every extra's package is missing, and a module that needs an extra says which in one line;
the README's "MoE in your own model" block runs there too."""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy"}
# every extra's top-level packages (and what would pull them in), absent below
BLOCKED = ("tqdm", "matplotlib", "tensorflow_datasets", "tensorflow", "array_record",
           "sklearn", "scipy", "gguf", "safetensors", "tokenizers", "rouge_score", "nltk",
           "torch", "tensorboardX", "grain", "transformers", "tokamax", "triton",
           "jax_triton", "hdbscan", "pandas")
# the study stack: these modules need an extra and must say which when imported
NEEDS_AN_EXTRA = re.compile(
    r"^moejax\.(data\.(builders_\w+|cards|corpora|datasets|loader|tfds_base|token_cache)"
    r"|evaluate_generation|extract\.(finetune|start)"
    r"|io\.(hf_moe|hf_moe_save|minilm|safetensors_io)|sparse_lm|substrates(\..*)?)$")



def _without_extras(tmp: Path) -> Path:
    """A site-packages of links to this environment's packages, the extras' left out: a
    process run with ``python -S`` and it on ``PYTHONPATH`` sees only the core (its
    ``importlib.util.find_spec`` of an extra's package returns None, as where it was never
    installed)."""
    site = Path(sysconfig.get_paths()["purelib"])
    overlay = tmp / "site"
    overlay.mkdir()
    blocked = {b.lower() for b in (*BLOCKED, "scikit_learn", "mpl_toolkits", "pylab")}
    for entry in site.iterdir():
        top = re.split(r"[.-]", entry.name)[0].lower()
        if top in blocked or entry.suffix == ".pth" or top == "__editable__":
            continue
        (overlay / entry.name).symlink_to(entry)
    return overlay


SWEEP = """
import importlib, json, pkgutil
import moejax
out = {}
for m in pkgutil.walk_packages(moejax.__path__, "moejax."):
    try:
        importlib.import_module(m.name)
        out[m.name] = None
    except Exception as e:
        out[m.name] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


def _readme_block(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    after = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def _python(code: str, tmp: Path, name: str, site: Path):
    script = tmp / f"{name}.py"
    script.write_text(code)
    # a user's process: no suite flags, no persistent compilation cache, no extras
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_FLAGS" and not k.startswith(("JAX_", "PYTHONWARNINGS"))}
    env["PYTHONPATH"] = f"{site}{os.pathsep}{ROOT}"
    return subprocess.run([sys.executable, "-S", str(script)], capture_output=True,
                          text=True, cwd=tmp, env=env, timeout=600)


def _wheel(tmp: Path) -> Path:
    """The wheel built from a copy of the checkout's packaging inputs (a build writes its
    ``build/`` folder beside the sources, which must not land in the checkout)."""
    src = tmp / "src"
    shutil.copytree(ROOT / "moejax", src / "moejax",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp / "dist").glob("moejax-*.whl")
    return wheel


@pytest.mark.slow
def test_core_without_extras_and_the_wheel(tmp_path):
    site = _without_extras(tmp_path)
    example = _readme_block("### MoE in your own model")
    with ThreadPoolExecutor(3) as pool:
        sweep = pool.submit(_python, SWEEP, tmp_path, "sweep", site)
        readme = pool.submit(_python, example, tmp_path, "readme", site)
        wheel = pool.submit(_wheel, tmp_path)
        sweep, readme, wheel = sweep.result(), readme.result(), wheel.result()
    # every core module imports; each study module names its extra in one line
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    results = json.loads(sweep.stdout.strip().splitlines()[-1])
    assert len(results) > 100
    for module, error in results.items():
        if NEEDS_AN_EXTRA.match(module):
            assert error is not None and error[0] == "MissingExtraError", (module, error)
            assert "pip install 'moejax[" in error[1] and "\n" not in error[1], error
        else:
            assert error is None, (module, error)
    # the README's own-model block: MoELayer, AdamR in nnx.Optimizer, DARE, orbax round trip
    assert readme.returncode == 0, readme.stderr[-3000:]
    assert re.search(r"^mse \d", readme.stdout, re.M)
    # the wheel: moejax alone, the core alone required
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"moejax"}, tops
    assert any(n.endswith("moejax/kernels/chunk_union/tuned/NVIDIA_H200.json") for n in names)
    required = {re.split(r"[<>=!\[; ]", line[len("Requires-Dist: "):])[0].lower()
                for line in meta.splitlines()
                if line.startswith("Requires-Dist: ") and "extra ==" not in line}
    assert required == CORE, required
    extras = set(re.findall(r"^Provides-Extra: (\S+)$", meta, re.M))
    assert {"io", "studies", "gpu", "tpu", "dev"} <= extras
