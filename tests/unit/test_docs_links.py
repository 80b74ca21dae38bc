"""The docs hold together: every relative Markdown link in README.md and docs/**/*.md resolves, and the
README stays a front door.

A link resolves when its file (or folder) exists relative to the page, and its `#anchor`, if any, is the
slug of a heading in the target page (or the page itself, for `#anchor` alone). Slugs are GitHub's: the
heading's text lowercased, punctuation other than '-' and '_' dropped, each space a '-', and a repeated
heading suffixed -1, -2, ... Links inside code (fenced blocks, `inline`) are not links; http(s) and
mailto links are not checked; a link out of the repo is broken.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150

FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) and ![alt](target), an optional "title" after the target
LINK = re.compile(r"\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = ("http://", "https://", "mailto:")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    in_fence = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield n, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: `The 80 GB line (2 x H200)` -> `the-80-gb-line-2-x-h200`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            if n:
                seen.setdefault(f"{s}-{n}", 1)
    return set(seen)


def broken_links(page: Path) -> list[str]:
    broken = []
    cache: dict[Path, set[str]] = {}
    for n, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not target or target.startswith(EXTERNAL):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}:{n}: ({target})"
            if not dest.is_relative_to(ROOT):
                broken.append(f"{where} points outside the repo")
            elif not dest.exists():
                broken.append(f"{where} no such file {dest.relative_to(ROOT)}")
            elif anchor:
                if dest.suffix != ".md" or dest.is_dir():
                    broken.append(f"{where} an anchor into a file that is not Markdown")
                elif anchor not in cache.setdefault(dest, anchors(dest)):
                    broken.append(f"{where} no heading in {dest.relative_to(ROOT)} has the slug '{anchor}'")
    return broken


def test_slug_is_githubs():
    assert slug("The 80 GB line on 2 x H200 after the compile fix: 1.158x (2026-11-28)") == (
        "the-80-gb-line-on-2-x-h200-after-the-compile-fix-1158x-2026-11-28")
    assert slug("Capping the decode batch: `rollout.max_num_seqs`") == "capping-the-decode-batch-rolloutmax_num_seqs"
    assert slug("Trainer/rollout alignment") == "trainerrollout-alignment"


def test_anchors_count_repeated_headings(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A\n\n```\n# not a heading\n```\n\n## A\n\n    # code, not a heading\n")
    assert anchors(page) == {"a", "a-1"}


def test_every_relative_link_resolves():
    broken = [b for page in pages() for b in broken_links(page)]
    assert not broken, f"{len(broken)} broken links:\n" + "\n".join(broken)


def test_readme_is_a_front_door():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; keep it under {README_MAX_LINES}, move the rest to docs/"
