"""One home per equation: every paper equation a moejax docstring cites ("Eq. 5", "Eqs. 1-2")
is cited in exactly one module of its paper's home (the README's "Each paper's home"), where
it is implemented; a citation elsewhere names its paper ("BlockFFN Eq. 7") and points there."""

import ast
import pathlib
import re
from collections import defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# each paper's home, as the README lists it: packages and modules under moejax/
HOMES = {
    "DeRS": ("ders_compress/", "upcycle.py", "nn/ders_moe.py"),
    "DAREx": ("delta/", "optim/"),
    "BlockFFN": ("chunk_sparse/", "nn/blockffn.py", "kernels/chunk_union/",
                 "ops/chunk_sparsity.py"),
    "MoE KD": ("distill/", "ops/distill_losses.py"),
    "MoEE": ("extract/", "nn/extracted.py"),
}
# how a citation outside the paper's home names it
ALIASES = {"DeRS": ("DeRS",), "DAREx": ("DAREx", "DARE paper"), "BlockFFN": ("BlockFFN",),
           "MoE KD": ("MoE KD", "Every Expert Matters"), "MoEE": ("MoEE",)}
CITATION = re.compile(r"Eqs?\.\s?(\d+)(?:\s?[-\u2013]\s?(\d+))?")


def _home(rel: str) -> str | None:
    return next((p for p, homes in HOMES.items()
                 if any(rel == h or (h.endswith("/") and rel.startswith(h)) for h in homes)),
                None)


def _docstrings(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc


def _paper_named(before: str) -> str | None:
    """The paper a citation's sentence names before the equation, if any."""
    sentence = re.split(r"[.;:]\s|\n\s*\n|^\s*\*", before)[-1]
    named = [(sentence.rfind(a), p) for p, aliases in ALIASES.items() for a in aliases
             if a in sentence]
    return max(named)[1] if named else None


def citations():
    """``{(paper, eq): {module path: home?}}`` and the citations no paper could be found for."""
    found: dict = defaultdict(dict)
    orphans = []
    for path in sorted((ROOT / "moejax").rglob("*.py")):
        rel = path.relative_to(ROOT / "moejax").as_posix()
        home = _home(rel)
        for doc in _docstrings(path):
            for m in CITATION.finditer(doc):
                paper = _paper_named(doc[max(0, m.start() - 120):m.start()]) or home
                if paper is None:
                    orphans.append(f"{rel}: {doc[max(0, m.start() - 40):m.end()]!r}")
                    continue
                lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
                for eq in range(lo, hi + 1):
                    found[(paper, eq)][rel] = _home(rel) == paper
    return found, orphans


def test_the_library_cites_equations_of_every_paper():
    found, _ = citations()
    assert {paper for paper, _ in found} >= {"DeRS", "DAREx", "BlockFFN", "MoE KD"}, found


def test_every_citation_names_its_paper_or_sits_in_its_home():
    _, orphans = citations()
    assert not orphans, orphans


@pytest.mark.parametrize("paper", sorted(HOMES))
def test_each_cited_equation_has_exactly_one_module_in_its_papers_home(paper):
    found, _ = citations()
    for (p, eq), modules in sorted(found.items()):
        if p != paper:
            continue
        in_home = sorted(m for m, home in modules.items() if home)
        assert len(in_home) == 1, (f"{paper} Eq. {eq} is cited in {len(in_home)} modules of its "
                                   f"home: {in_home} (all citing: {sorted(modules)})")
