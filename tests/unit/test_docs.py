"""The documentation: the generated reference pages are current, the README stays short,
run figures stay in the pages that carry them, and every link between pages resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgefleet import docgen
from edgefleet.config import FleetConfig

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Figures of a run (dated, or "on this machine") live in these two only; the others
# point at bench/RESULTS.md.
FIGURE_PAGES = {REPO / "bench" / "RESULTS.md", REPO / "docs" / "architecture.md"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("rel", sorted(docgen.pages(REPO)), ids=str)
def test_generated_page_is_current(rel):
    expected = docgen.pages(REPO)[rel]
    path = REPO / rel
    assert path.is_file(), f"{rel} is missing: run `{docgen.COMMAND}`"
    assert path.read_text() == expected, f"{rel} is out of date: run `{docgen.COMMAND}`"


def test_check_says_whether_the_pages_are_current(tmp_path, capsys):
    (tmp_path / "configs").mkdir()
    reference = REPO / docgen.REFERENCE_YAML
    (tmp_path / docgen.REFERENCE_YAML).write_text(reference.read_text())
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 1
    assert "docs/metrics.md is out of date" in capsys.readouterr().err
    assert docgen.main(["--root", str(tmp_path)]) == 0
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 0
    page = tmp_path / docgen.METRICS
    page.write_text(page.read_text().replace("gauge", "counter", 1))
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 1


def test_every_config_key_has_a_description():
    assert docgen.undocumented(FleetConfig) == []


def test_readme_is_at_most_300_lines():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"


def test_run_figures_stay_in_results_and_architecture():
    for page in PAGES:
        if page in FIGURE_PAGES:
            continue
        for n, line in enumerate(page.read_text().splitlines(), 1):
            assert "on this machine" not in line.lower(), (
                f"{page.relative_to(REPO)}:{n} narrates a run; figures of a run belong in "
                "bench/RESULTS.md or docs/architecture.md"
            )


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _outside_code(text: str) -> str:
    """``text`` without its fenced code blocks and inline code."""
    return re.sub(r"`[^`\n]*`", "", _without_fences(text))


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", _without_fences(page.read_text()), re.M)
    return {docgen.slug(h) for h in headings}


def test_links_between_pages_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_outside_code(page.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(REPO)} -> {target}"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no such heading")
    assert broken == []
