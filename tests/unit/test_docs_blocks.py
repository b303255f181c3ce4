"""Every code block of the documentation (docs/ and README.md) runs in a test, or says
why it cannot: a new block that no test reads fails here, before it can go stale."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

from tests.docblocks import ROOT, Block, blocks, pages

# Output shown on a page (what a command prints) is no code to run.
OUTPUT = "text"
# Who reads the blocks: not a test that runs one.
READERS = {ROOT / "tests" / "docblocks.py", Path(__file__).resolve()}


def _test_sources() -> str:
    files = sorted((ROOT / "tests").rglob("*.py"))
    return "\n".join(f.read_text() for f in files if f.resolve() not in READERS)


def problems(found: list[Block], tests: str) -> list[str]:
    """What is wrong with these blocks, given the text of the tests that may run them."""
    said = []
    for b in found:
        if b.lang == OUTPUT:
            continue
        if b.mark is None:
            kind = f"```{b.lang} block" if b.lang else "code block without a language"
            said.append(
                f"{b.where()}: a {kind} that no test runs: put <!-- example: NAME --> on "
                f"the line above it and run example(NAME) in a test, or <!-- not-run: REASON "
                f"-->; output a command prints is a ```{OUTPUT} block"
            )
        elif b.mark == "not-run" and len(b.value.split()) < 3:
            said.append(f"{b.where()}: not-run needs its reason, got {b.value!r}")
        elif b.mark == "example" and f'"{b.value}"' not in tests:
            said.append(f'{b.where()}: example "{b.value}" is run by no test (none names it)')
    names = Counter(b.value for b in found if b.mark == "example")
    said += [f"example {name!r} is named {n} times" for name, n in names.items() if n > 1]
    return said


def test_every_block_of_the_docs_is_run_by_a_test_or_says_why_not() -> None:
    found = [b for page in pages() for b in blocks(page)]
    assert len(found) > 30  # the pages were read
    said = problems(found, _test_sources())
    assert not said, "\n".join(said)


def test_a_block_that_no_test_runs_is_named(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n"
        "```python\nprint('new and untested')\n```\n\n"
        "<!-- example: runs -->\n```bash\nscaletrain env\n```\n\n"
        "<!-- example: nobody-reads-it -->\n```python\nprint(1)\n```\n\n"
        "<!-- not-run: -->\n```bash\nsrun true\n```\n\n"
        "    indented = 'code'\n\n"
        "```text\nwhat a command printed\n```\n"
    )
    # Blocks outside docs/ are named by their path as given.
    found = [replace(b, page=ROOT / b.page.name) for b in blocks(page)]
    said = problems(found, 'example("runs")')
    assert [s.split(": ", 1)[0] for s in said] == [
        "page.md:3", "page.md:13", "page.md:18", "page.md:22",
    ]  # fmt: skip
    assert "a ```python block that no test runs" in said[0]
    assert 'example "nobody-reads-it" is run by no test' in said[1]
    assert "not-run needs its reason" in said[2]
    assert "code block without a language" in said[3]


def test_the_readmes_links_lead_to_files_and_headings_that_exist() -> None:
    """The README is read on the forge, outside the site's strict build: its links to the
    pages (and to a heading of one) are checked here."""
    from markdown.extensions.toc import slugify

    readme = ROOT / "README.md"
    links = re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", readme.read_text())
    assert len(links) > 10
    for path, anchor in links:
        target = ROOT / path
        assert target.exists(), f"README.md links to {path}, which is not there"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            slugs = {slugify(h.replace("`", ""), "-") for h in headings}
            assert anchor in slugs, f"README.md links to {path}#{anchor}: no such heading"
