"""The docs hang together: every page is in the index, every relative link lands on a file, and the
experiment catalogue (docs/experiments.md) is what the registry says today."""

from __future__ import annotations

import difflib
import re

import pytest

from tests.docs_blocks import REPO, doc_files, prose

DOCS = REPO / "docs"
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _relative_links(path) -> list[str]:
    return [target for target in _LINK.findall(re.sub(r"`[^`\n]*`", "", prose(path)))
            if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", target)]


def test_every_page_is_in_the_index():
    index = DOCS / "README.md"
    listed = {link.split("#", 1)[0] for link in _relative_links(index)}
    missing = sorted(
        p.name for p in DOCS.glob("*.md") if p.name != "README.md" and p.name not in listed
    )
    assert not missing, f"docs/README.md does not list {missing}: add a line for each page"


def test_relative_links_resolve():
    broken = []
    for path in doc_files():  # docs/*.md includes the index, docs/README.md
        for target in _relative_links(path):
            file = target.split("#", 1)[0]
            resolved = (path.parent / file).resolve()
            if resolved.exists():
                continue
            broken.append(f"{path.relative_to(REPO)}: ({target})")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


@pytest.mark.slow
def test_experiment_catalogue_is_current(capsys):
    from paxlite.__main__ import main
    from paxlite.cli.catalogue import CATALOGUE_COMMAND

    assert main(["list", "--format=markdown"]) == 0  # the command in CATALOGUE_COMMAND, in process
    expected = capsys.readouterr().out
    actual = (DOCS / "experiments.md").read_text()
    diff = "".join(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True),
                                        "docs/experiments.md", "the registry now", n=0))
    assert actual == expected, (
        f"docs/experiments.md is stale; regenerate it with `{CATALOGUE_COMMAND}`:\n{diff[:4000]}")


def test_catalogue_names_every_experiment_and_alias_with_pax_s_numbers():
    """Independent of the generator: the registry's names, and GPT-126M as Pax states it (125M
    parameters, ICI [8,1,1] x DCN [8,1,1] = 64 GPUs, PERCORE_BATCH_SIZE 4 -> a global batch of 256,
    2048 tokens)."""
    from paxlite.experiments import EXPERIMENTS

    text = (DOCS / "experiments.md").read_text()
    missing = [n for n in [*EXPERIMENTS, *EXPERIMENTS.aliases] if f"`{n}`" not in text]
    assert not missing, f"docs/experiments.md lacks {missing}"
    row = next(line for line in text.splitlines() if line.startswith("| `GPT126M` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:7] == ["125,262,336", "", "`[8, 1, 1]` x `[8, 1, 1]` (64)", "2,048", "256"], (
        cells
    )
    glam = next(line for line in text.splitlines() if line.startswith("| `GLaM126M64E` |"))
    # the active parameters, for MoE
    assert "`GLaM126M64EBase`" in glam and "| 166,354,176 |" in glam
    tiny = next(line for line in text.splitlines() if line.startswith("| `TinySynthetic` |"))
    # ICI_MESH_SHAPE=None
    assert "| `None` (data: all devices) x `[1, 1, 1]` | 64 | 2 x devices |" in tiny
