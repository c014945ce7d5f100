"""The README is the front door and docs/ the manual: every relative link resolves, to a file and to a heading, and
the tables that describe code are derived from it."""

from __future__ import annotations

import re

import pytest

from trl_dppo.corrections import CORRECTIONS
from trl_dppo.trust_regions import SHARED_SETTINGS, TRUST_REGIONS

from .conftest import REPO


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def relative_links(page):
    for target in LINK.findall(page.read_text()):
        if not re.match(r"[a-z]+:", target):
            yield target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves_to_a_file_and_heading(page):
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor:
            assert anchor in anchors(resolved.read_text()), f"{page.name}: no heading #{anchor} in {path or page.name}"


def test_the_readme_shows_install_usage_and_the_options_in_its_first_100_lines():
    head = "\n".join((REPO / "README.md").read_text().splitlines()[:100])
    for needed in (
        "bash scripts/main_job.sh",
        "bash scripts/test.sh",
        "pip install",
        "DPPOTrainer(",
        "divergence_delta",
    ):
        assert needed in head, needed
    assert "| `stop_on_non_finite` |" in head  # the last row of the options table


def test_every_docs_page_is_linked_from_the_readme():
    linked = {target.partition("#")[0] for target in relative_links(REPO / "README.md")}
    assert {f"docs/{page.name}" for page in (REPO / "docs").glob("*.md")} <= linked


def test_the_trust_region_table_is_the_registry_of_methods_and_corrections():
    page = (REPO / "docs" / "trust_regions.md").read_text()
    header, *rows = [line for line in page.splitlines() if line.startswith("| `") or line.startswith("| name |")]
    assert header == "| name | chosen by | source | w_t | own settings (defaults) | logs |"
    assert rows == docs_table_rows()


def docs_table_rows() -> list[str]:
    """docs/trust_regions.md's table, from the registries of trust regions and corrections."""

    def settings(pairs):
        return ", ".join(f"`{s}={d!r}`" for s, d in pairs) or "none"

    methods = [
        f"| `{name}` | `trust_region` | {m.source} | `{m.equation}` | "
        f"{settings((s, d) for s, d in m.settings.items() if s not in SHARED_SETTINGS)} | "
        "`trust_region/masked_fraction` (`_pos_adv`, `_neg_adv`) |"
        for name, m in TRUST_REGIONS.items()
    ]
    corrections = [
        f"| `{name}` | `trust_region_corrections` | {c.source} | `{c.equation}` | {settings(c.settings.items())} | "
        + ", ".join(f"`corrections/{name}/{metric}`" for metric in c.metrics)
        + " |"
        for name, c in CORRECTIONS.items()
    ]
    return methods + corrections
