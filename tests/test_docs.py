"""The docs a user reads: a short README that starts with the two commands and
shows the tab, and links and paths that lead somewhere.

The README is also the package page, so it stays short (at most 150 lines);
the guides, the reference and the design notes are under docs/. Every
relative link in README.md, CONTRIBUTING.md and docs/**/*.md must name a file
that exists (and, for a link to a heading, a heading of that page), and every
path of the repository a page names in code (`record/stats/xla.py`,
`bench/rewind_cost.py`) must exist: a moved module shows as a failing test,
not as a stale page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 150
README_COMMANDS = ["bash scripts/demo.sh", "bash scripts/test.sh"]
MAX_SCREENSHOT_BYTES = 400 * 1024
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
# Paths of this repository that a page may name in code: the first part says
# where they are (a package part is under tb_nanwatch/).
PACKAGE_PARTS = ("evidence", "record", "board", "compat")
ROOT_PARTS = ("tb_nanwatch", "bench", "scripts", "demo", "tests", "frontend", "docs")
REPO_PATH = re.compile("^(?:" + "|".join(PACKAGE_PARTS + ROOT_PARTS) + r")/[\w./-]*$")


def markdown_pages() -> list[Path]:
    return [README, ROOT / "CONTRIBUTING.md", *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """``text`` without fenced code blocks (links and headings there are not ones)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for match in HEADING.finditer(prose(page.read_text())):
        base = slug(match.group(2))
        name, n = base, 0
        while name in found:
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def relative_links(page: Path) -> list[str]:
    """The targets of the page's links that are not URLs."""
    text = CODE_SPAN.sub("", prose(page.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def broken_links(page: Path) -> list[str]:
    """``target: why`` for each relative link of ``page`` that leads nowhere."""
    broken = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {resolved.name}")
    return broken


def named_paths(page: Path) -> list[str]:
    """The repository paths the page names in code spans (outside fenced blocks)."""
    words = []
    for match in CODE_SPAN.finditer(prose(page.read_text())):
        words += [w.strip("(),;:") for w in match.group(2).split()]
    return [w for w in words if REPO_PATH.match(w) and "*" not in w]


def missing_paths(page: Path) -> list[str]:
    missing = []
    for name in named_paths(page):
        base = ROOT / "tb_nanwatch" if name.split("/")[0] in PACKAGE_PARTS else ROOT
        if not (base / name).exists():
            missing.append(name)
    return missing


# -- the README ---------------------------------------------------------------


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_the_readme_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    first_code = [line.strip() for line in lines[:12] if line.startswith("    ")]
    assert first_code == README_COMMANDS
    before = lines[: lines.index("    " + README_COMMANDS[0])]
    assert not any(line.startswith(("    ", "```", "## ")) for line in before)


def test_the_readme_shows_a_screenshot_of_the_tab():
    images = [t for t in relative_links(README) if t.lower().endswith(".png")]
    assert images, "README.md shows no PNG"
    for target in images:
        path = (README.parent / target).resolve()
        assert path.is_relative_to(DOCS / "images"), target
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC), f"{target} is not a PNG"
        assert len(data) <= MAX_SCREENSHOT_BYTES, f"{target}: {len(data)} bytes"


def test_the_readme_says_how_to_install_without_a_public_index():
    text = README.read_text()
    assert "pip install" in text and "python -m build" in text
    assert "not on a public index" in text


def test_the_readme_says_how_a_teammate_installs_with_and_without_tensorflow():
    """Issue 56: from a wheel built here (or a checkout), the wheel alone for the
    tab and ``report``, with the TensorFlow extra for ``replay``."""
    from tb_nanwatch import __version__

    section = README.read_text().split("## Install\n", 1)[1].split("\n## ", 1)[0]
    assert "pip wheel . --no-deps" in section and "python -m build" in section
    wheel = f"tb_nanwatch-{__version__}-py3-none-any.whl"
    plain = next(line for line in section.splitlines() if line.startswith(f"pip install {wheel}"))
    assert "report" in plain
    extra = f'pip install "{wheel}[tensorflow-cpu]"'
    assert any(line.startswith(extra) and "replay" in line for line in section.splitlines())
    assert "needs no TensorFlow" in section


# -- every page -----------------------------------------------------------------


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_named_in_code_exists(page):
    assert missing_paths(page) == []


def test_the_docs_index_links_every_page():
    index = DOCS / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in relative_links(index)}
    pages = {p.resolve() for p in DOCS.rglob("*.md") if p != index}
    assert sorted(map(str, pages - linked)) == []


def test_the_checks_find_a_broken_link_a_missing_heading_and_a_moved_module(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# There\n\n## A `code` heading: yes\n")
    page.write_text(
        "[ok](there.md#a-code-heading-yes) [gone](nowhere.md) [bad](there.md#nope)\n"
        "[web](https://example.com) `[not a link](nowhere.md)`\n\n"
        "```\n[in a block](nowhere.md)\n```\n\n"
        "`record/stats/xla.py` and `record/rewind.py`, `python bench/gone.py --x`\n"
    )
    assert broken_links(page) == [
        "nowhere.md: no such file",
        "there.md#nope: no heading #nope in there.md",
    ]
    assert missing_paths(page) == ["record/rewind.py", "bench/gone.py"]


# -- the reference against the code --------------------------------------------


def test_every_cause_and_remedy_is_in_the_reference():
    from tb_nanwatch.evidence.vocabulary import vocabulary

    page = (DOCS / "reference" / "causes-and-remedies.md").read_text()
    rows = set(re.findall(r"^\s*\| `(\w+)` \|", page, flags=re.MULTILINE))
    words = vocabulary()
    assert sorted(set(words["causes"]) - rows) == []
    assert sorted(r for r in words["remedies"] if f"`{r}`" not in page) == []


def undescribed_modules(design: str, package: Path) -> list[str]:
    """The package's modules (paths below ``package``) that ``design``'s
    module table names neither by their path nor by their folder; an
    ``__init__.py`` counts only when it holds more than a docstring."""
    rows = set(re.findall(r"^\| `([^`]+)` \|", design, re.MULTILINE))
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if path.name == "__init__.py" and len(path.read_text().splitlines()) <= 1:
            continue
        folders = {p.as_posix() + "/" for p in Path(relative).parents if p != Path(".")}
        if relative not in rows and not folders & rows:
            missing.append(relative)
    return missing


def test_the_design_notes_describe_every_module():
    design = (DOCS / "design.md").read_text()
    assert undescribed_modules(design, ROOT / "tb_nanwatch") == []


def test_the_module_check_finds_a_module_the_table_does_not_name(tmp_path):
    (tmp_path / "part").mkdir()
    (tmp_path / "part" / "named.py").write_text("x = 1\n")
    (tmp_path / "part" / "new.py").write_text("x = 1\n")
    (tmp_path / "part" / "__init__.py").write_text("")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "inside.py").write_text("x = 1\n")
    design = "| module | role |\n|---|---|\n| `part/named.py` | one |\n| `folder/` | all |\n"
    assert undescribed_modules(design, tmp_path) == ["part/new.py"]
