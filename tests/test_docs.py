"""The docs: the generated pages (docs/params.md, docs/models.md) are what `diffusion-pipe docs` makes from the code
now, every relative link in README.md and docs/*.md reaches a file (and its `#anchor` a heading), and the README
stays short enough to read."""

import dataclasses
import re
from pathlib import Path
from typing import ClassVar, Literal

import pytest
from click.testing import CliRunner

from diffusion_pipe.cli import main
from diffusion_pipe.config import Range
from diffusion_pipe.docs import field_comments, generated_pages, params_page, stale_pages

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)\)")  # [text](target), text may hold `[]`


def test_generated_pages_are_up_to_date():
    stale = stale_pages(REPO)
    assert not stale, f"stale: {', '.join(stale)} (the code documents something else now); run `diffusion-pipe docs`"


def test_docs_check_command():
    result = CliRunner().invoke(main, ["docs", "--check"])
    assert result.exit_code == 0, result.output


def test_docs_check_names_a_stale_page(monkeypatch):
    monkeypatch.setattr("diffusion_pipe.docs.stale_pages", lambda root=None: ["docs/params.md"])
    result = CliRunner().invoke(main, ["docs", "--check"])
    assert result.exit_code == 1
    assert "docs/params.md is stale: run `diffusion-pipe docs`" in result.output


def test_every_param_is_on_the_params_page():
    """Each key of every section has a row with a description (its comment in params.py, or the fallback)."""
    page = generated_pages(REPO)["docs/params.md"]
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert rows and all(not line.rstrip().endswith("|  |") for line in rows), [
        line for line in rows if line.rstrip().endswith("|  |")]
    assert "| `learning_rate` | float | `0.0001` | (0, 1] |" in page
    assert "| `lr_scheduler` | string | `constant` | `constant`, `linear`, `cosine` |" in page
    assert "| `seed` | int | `0` | [0, 4294967295] |" in page


SOURCE = '''
@dataclass(frozen=True)
class P:
    RANGES: ClassVar[dict] = {}

    a: int = 1  # the inline comment
    # a block above,
    # on two lines
    b: str = ""
    c: float = 0.5
'''


def test_field_comments_reads_inline_then_block_comments():
    assert field_comments(SOURCE) == {"P.a": "the inline comment", "P.b": "a block above, on two lines"}


def test_a_new_param_changes_the_params_page():
    @dataclasses.dataclass(frozen=True)
    class Section:
        RANGES: ClassVar[dict[str, Range]] = {"rate": Range(0, 1, hi_open=True)}

        rate: float = 0.5
        mode: Literal["a", "b"] = "a"

    @dataclasses.dataclass(frozen=True)
    class Root:
        section: Section

    page = params_page(Root, {"Section.rate": "how fast"}, {})
    assert "| `rate` | float | `0.5` | [0, 1) | how fast |" in page
    assert "| `mode` | string | `a` | `a`, `b` |  |" in page

    @dataclasses.dataclass(frozen=True)
    class Grown(Section):
        extra: int = 3

    @dataclasses.dataclass(frozen=True)
    class GrownRoot:
        section: Grown

    assert params_page(GrownRoot, {}, {}) != params_page(Root, {}, {})


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path) -> list[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())  # links inside code blocks are not links
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def test_every_docs_page_is_in_the_index():
    index = (REPO / "docs" / "README.md").read_text()
    missing = [p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md" and f"]({p.name}" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


def test_readme_stays_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines < 220, f"README.md has {lines} lines; move detail to a page under docs/ and link it"
