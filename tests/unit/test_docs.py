"""The documentation holds together: README.md and docs/ link only to what exists.

Every Markdown link in README.md, CHANGELOG.md and docs/**/*.md is either absolute (https, http,
mailto) or relative to its file and names a file or folder inside the repository; an `#anchor`
names a heading of the page it points at (GitHub's heading ids). Every docs/ page can be reached
from the README by following links, the README stays a front door (under 300 lines), and no
README line carries a date: dated measurements live in docs/benchmarks.md and CHANGELOG.md.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300
ABSOLUTE_SCHEMES = ("https://", "http://", "mailto:")

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target ends at the first space or closing bracket.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


class Link(NamedTuple):
    """One Markdown link: the page it is on, its line, and its target as written."""

    page: Path
    line: int
    target: str

    def where(self) -> str:
        """`path:line` for messages."""
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _pages() -> list[Path]:
    """README.md, CHANGELOG.md and every Markdown page under docs/."""
    pages = [README, ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]
    return [page for page in pages if page.is_file()]


def _prose_lines(page: Path) -> Iterator[tuple[int, str]]:
    """The page's lines outside fenced code blocks, with inline code spans blanked."""
    in_fence = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield number, CODE_SPAN.sub("", line)


def _links(page: Path) -> list[Link]:
    """Every inline link and image on the page, outside code."""
    return [Link(page, number, match.group(1))
            for number, line in _prose_lines(page) for match in LINK.finditer(line)]


def _slug(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts as its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """The ids of the page's headings, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    in_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match is None:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _resolve(link: Link) -> tuple[Path, str]:
    """The file a relative link points at and its anchor ('' if none)."""
    path, _, anchor = link.target.partition("#")
    target = link.page if not path else (link.page.parent / path).resolve()
    return target, anchor


def _all_links() -> list[Link]:
    return [link for page in _pages() for link in _links(page)]


def _relative(links: list[Link]) -> list[Link]:
    return [link for link in links if not link.target.startswith(ABSOLUTE_SCHEMES)]


def test_the_pages_have_links_to_check():
    links = _all_links()
    assert len(_pages()) >= 3 and len(links) > 20, "no Markdown pages or links found"


def test_relative_links_point_at_files_inside_the_repository():
    broken = []
    for link in _relative(_all_links()):
        if link.target.startswith(("/", "file:")) or re.match(r"^[a-z][a-z0-9+.-]*:", link.target):
            broken.append(f"{link.where()}: {link.target} (neither relative nor https)")
            continue
        target, _ = _resolve(link)
        if not target.is_relative_to(ROOT):
            broken.append(f"{link.where()}: {link.target} leaves the repository")
        elif not target.exists():
            broken.append(f"{link.where()}: {link.target} does not exist")
    assert not broken, "Broken links:\n" + "\n".join(broken)


def test_anchors_name_headings_that_exist():
    broken = []
    for link in _relative(_all_links()):
        target, anchor = _resolve(link)
        if not anchor or target.suffix != ".md" or not target.is_file():
            continue
        if anchor not in _anchors(target):
            broken.append(f"{link.where()}: {link.target}: no heading "
                          f"#{anchor} in {target.relative_to(ROOT)}")
    assert not broken, "Links to missing headings:\n" + "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    reached = {README}
    queue = [README]
    while queue:
        page = queue.pop()
        for link in _relative(_links(page)):
            target, _ = _resolve(link)
            if target.suffix == ".md" and target.is_file() and target not in reached:
                reached.add(target)
                queue.append(target)
    orphans = sorted(str(page.relative_to(ROOT)) for page in DOCS.rglob("*.md")
                     if page.resolve() not in reached)
    assert not orphans, f"docs pages no link from README.md leads to: {orphans}"


def test_the_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it under {README_MAX_LINES} and move the "
        "rest to a docs/ page")


def test_no_readme_line_carries_a_date():
    dated = [f"README.md:{number}: {line.strip()}"
             for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1)
             if DATE.search(line)]
    assert not dated, ("Dated measurements belong in docs/benchmarks.md (the current figure) "
                       "and CHANGELOG.md (the history):\n" + "\n".join(dated))


@pytest.mark.parametrize(("heading", "slug"), [
    ("How `shoal.<layer>` resolves", "how-shoallayer-resolves"),
    ("3. Train the main job: a small GPT", "3-train-the-main-job-a-small-gpt"),
    ("The cost model for many hosts (`bench/scale_model.py`)",
     "the-cost-model-for-many-hosts-benchscale_modelpy"),
    ("Reference: [core](core.md)", "reference-core"),
])
def test_heading_ids_follow_github(heading, slug):
    assert _slug(heading) == slug
