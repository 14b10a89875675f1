"""The README's shape-letter table is the one the code uses: every shape suffix of every
identifier in the library and the studies (``x_BTD``, ``ids_CU``, ``a_Pn``) is made of letters
the table defines."""

import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUFFIX = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*_([A-Z][A-Zn]*)$")


def _table_letters() -> set[str]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| letter | axis |"):].split("\n\n")[0]
    letters = set()
    for line in table.splitlines()[2:]:
        letters.update(re.findall(r"`([A-Za-z])`", line.split("|")[1]))
    return letters


def _suffixes(path: pathlib.Path):
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    for tok in tokens:
        if tok.type == tokenize.NAME and (m := SUFFIX.match(tok.string)):
            yield tok.string, m.group(1)


def test_every_shape_suffix_in_the_code_uses_the_readmes_letters():
    letters = _table_letters()
    assert {"B", "T", "D", "E", "C", "U", "n", "P"} <= letters  # the table was read
    files = [*(ROOT / "moejax").rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]
    seen, unknown = 0, {}
    for f in files:
        for name, suffix in _suffixes(f):
            seen += 1
            for ch in set(suffix) - letters:
                unknown.setdefault(ch, f"{name} in {f.relative_to(ROOT)}")
    assert seen > 500, seen  # the scan found the code's shape-suffixed names
    assert not unknown, f"shape letters missing from the README's table: {unknown}"
