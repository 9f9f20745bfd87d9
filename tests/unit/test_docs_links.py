"""The README and docs/ point only inside the repository (issue 17: the README linked to files
outside it), every link resolves to a file (and heading) that exists, and the README links the
configuration reference and the operations guide."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def links(path: Path) -> list[str]:
    return _LINK.findall(path.read_text())


def slugs(path: Path) -> set[str]:
    """GitHub's anchors of the file's headings."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_links_stay_inside_the_repository_and_resolve(doc: Path) -> None:
    text = doc.read_text()
    assert "../shared" not in text and "/work/" not in text
    for target in links(doc):
        assert "://" not in target and not target.startswith(("/", "mailto:")), (
            f"{doc.name} links outside the repository: {target}"
        )
        file, _, anchor = target.partition("#")
        resolved = (doc.parent / file).resolve() if file else doc
        assert resolved.is_relative_to(REPO), f"{doc.name}: {target} leaves the repository"
        assert resolved.exists(), f"{doc.name}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in slugs(resolved), f"{doc.name}: no heading #{anchor} in {file}"


def test_the_readme_links_the_reference_and_the_operations_guide() -> None:
    readme = set(links(REPO / "README.md"))
    for doc in ("docs/CONFIG.md", "docs/OPERATIONS.md", "docs/API.md", "docs/ARCHITECTURE.md"):
        assert doc in readme, doc
