"""Every reference a reader of a clone follows lands: a `.md` file named in the code, the docs, the
benchmarks or the README exists in the repository, a relative link reaches its file and heading, and
"page.md section N" names a page with a numbered section N.

A reference to a file outside the repository (a design note, a reference page on one machine) cannot
be followed by anyone else, so the fact belongs in a docs/ page and the reference points there.
"""

from __future__ import annotations

import pathlib
import re

from tests.docs_blocks import REPO

SCANNED = ("paxlite", "docs", "benchmarks")
SUFFIXES = frozenset({".py", ".md", ".sh", ".txt", ".toml", ".cfg", ".yaml", ".yml", ".json"})
# Names that the code writes (an output file), not pages a reader is sent to.
WRITTEN_NOT_REFERENCED = frozenset({
    "table.md",  # benchmarks/gpu/bench.py writes its results table into the log directory
})

_MENTION = re.compile(r"(?<![\w./-])((?:\.{1,2}/)*[\w-][\w./-]*\.md)(?![\w-])")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_PATH_LIKE = re.compile(r"^[\w./~%#-]+$")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:")
_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
# "pax.md section 14", "pax.md sections 1-2", "data.md's section 4", "([data.md](data.md) section
# 4)", "gpu_speed.md §1", "interop.md 6": the numbered section a reader must find in that page.
_SECTION = re.compile(
    r"(?:'s)?\s*(?:\]\([^)\s]*\)\)?)?\s*(?:(?:section|sections|§)\s*(\d+)|(\d{1,2})(?![\w.,%]))")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _scanned_files() -> list[pathlib.Path]:
    files = [REPO / "README.md"]
    for top in SCANNED:
        files += sorted(p for p in (REPO / top).rglob("*")
                        if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts)
    return files


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def _headings(page: pathlib.Path) -> list[str]:
    inside_fence = False
    found = []
    for line in page.read_text().splitlines():
        if re.match(r"^ {0,3}(```|~~~)", line):
            inside_fence = not inside_fence
        elif not inside_fence and (match := _HEADING.match(line)):
            found.append(match.group(1))
    return found


def _anchors(page: pathlib.Path) -> set[str]:
    anchors, seen = set(), {}
    for heading in _headings(page):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        anchors.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return anchors


def _numbered_sections(page: pathlib.Path) -> set[str]:
    return {m.group(1) for h in _headings(page) if (m := re.match(r"(\d+)[.)\s]", h))}


def _resolve(source: pathlib.Path, target: str, *, repo: pathlib.Path) -> pathlib.Path | None:
    """The file `target` names, as a reader of `source` would look for it: beside the source, from
    the repository's root, and (code, which writes docs/ pages' text) in docs/."""
    bases = [source.parent, repo]
    if source.suffix != ".md":
        bases.append(repo / "docs")
    for base in bases:
        candidate = (base / target).resolve()
        if candidate.exists() and candidate.is_relative_to(repo):
            return candidate
    return None


def _problems(source: pathlib.Path, *, repo: pathlib.Path = REPO) -> list[str]:
    text = _URL.sub(" ", source.read_text(errors="replace"))
    where = source.relative_to(repo)
    problems = []
    for match in _MENTION.finditer(text):
        name = match.group(1)
        line = text.count("\n", 0, match.start()) + 1
        if name.rsplit("/", 1)[-1] in WRITTEN_NOT_REFERENCED:
            continue
        page = _resolve(source, name, repo=repo)
        if page is None:
            problems.append(f"{where}:{line}: {name} is not a file of the repository")
            continue
        section = _SECTION.match(text, match.end())
        if section and page.suffix == ".md":
            number = section.group(1) or section.group(2)
            if number not in _numbered_sections(page):
                problems.append(f"{where}:{line}: {name} has no section {number}")
    for match in _LINK.finditer(text):
        target = match.group(1).strip("<>")
        if _SCHEME.match(target) or not _PATH_LIKE.match(target):
            continue  # a URL, or code that looks like a link (`f[x](y)` in a .py file)
        line = text.count("\n", 0, match.start()) + 1
        file, _, anchor = target.partition("#")
        page = _resolve(source, file, repo=repo) if file else source
        if page is None:
            problems.append(f"{where}:{line}: link ({target}) does not reach a file")
        elif anchor and page.suffix == ".md" and anchor.lower() not in _anchors(page):
            problems.append(f"{where}:{line}: link ({target}): {page.name} has no such heading")
    return problems


def test_every_reference_lands_in_the_repository():
    problems = [problem for source in _scanned_files() for problem in _problems(source)]
    assert not problems, (
        "references a clone cannot follow (bring the fact into a docs/ page and point there):\n"
        + "\n".join(problems))


def test_the_check_catches_what_it_is_for(tmp_path):
    """The rules above bite: a missing page, a page outside the repository, a missing heading and a
    missing numbered section are each reported; a good link and a URL are not."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "page.md").write_text("# Page\n\n## 2. Numbered\n\n## Some `code` heading\n")
    source = docs / "source.md"
    source.write_text(
        "[ok](page.md#some-code-heading), page.md section 2, https://example.com/README.md\n"
        "[gone](gone.md) ../outside/NOTES.md [bad anchor](page.md#nowhere) page.md section 7\n"
        "[here](#page) pax.md 14\n")
    problems = _problems(source, repo=tmp_path.resolve())
    assert problems == [
        "docs/source.md:2: gone.md is not a file of the repository",
        "docs/source.md:2: ../outside/NOTES.md is not a file of the repository",
        "docs/source.md:2: page.md has no section 7",
        "docs/source.md:3: pax.md is not a file of the repository",
        "docs/source.md:2: link (gone.md) does not reach a file",
        "docs/source.md:2: link (page.md#nowhere): page.md has no such heading",
        "docs/source.md:3: link (#page): source.md has no such heading",
    ], problems
