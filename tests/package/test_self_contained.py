"""The repository is self-contained: code and documents cite the official documentation,
AWS's kernels or files of this repository, never notes that are not in it (the team's
``hw_cost_facts.md``, API specs, ``../shared/``) nor issue numbers; and every citation key
the code uses (S1, STUB-NL, LG, ...) is defined in ``docs/design.md``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATTERNS = (
    "nki_rmsnorm/**/*.py",
    "simulate/**/*.py",
    "tests/**/*.py",
    "scripts/*.py",
    "examples/*.py",
    "docs/*.md",
    "*.md",
    "Makefile",
    "pyproject.toml",
)
FORBIDDEN = {
    "a team note outside the repository": re.compile(
        r"hw_cost_facts|nki06_api_spec|nki_api_spec\.md|compile_audit|\.\./shared/|anchors\.md"
    ),
    "an issue number": re.compile(r"\bissues? #?\d+\b", re.I),
}
#: ``design.md`` named without its folder (the documents in docs/ link it relatively).
BARE_DESIGN = re.compile(r"(?<![/\w])design\.md")
#: Citation keys the code uses; each needs a row in docs/design.md's Sources.
KEYS = (
    *(f"S{n}" for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14)),
    *("STUB-NKI", "STUB-NL", "STUB-ISA", "LG", "ABOUT", "APS", "SIM", "MIG", "RN", "NKILIB"),
)


def _lines():
    this = Path(__file__).resolve()
    for pattern in PATTERNS:
        for path in ROOT.glob(pattern):
            if path.resolve() == this:
                continue
            text = path.read_text(errors="replace")
            for number, line in enumerate(text.splitlines(), 1):
                yield path, number, line


def test_no_citation_of_files_outside_the_repository():
    found = []
    for path, number, line in _lines():
        what = [name for name, pattern in FORBIDDEN.items() if pattern.search(line)]
        if path.parent.name != "docs" and BARE_DESIGN.search(line):
            what.append("design.md without docs/")
        found += [f"{path.relative_to(ROOT)}:{number}: {w}: {line.strip()}" for w in what]
    assert not found, "\n".join(found)


def test_every_citation_key_is_defined_in_docs_design_md():
    design = (ROOT / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| ([A-Za-z0-9, -]+?) \|", design, flags=re.M)
    defined = {name.strip() for row in rows for name in row.split(",")}
    assert set(KEYS) <= defined, sorted(set(KEYS) - defined)
