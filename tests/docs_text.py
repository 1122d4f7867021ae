"""The documentation as the tests read it: ``README.md`` and every
``docs/*.md``, through one helper, so that a paragraph can move between the
README and ``docs/`` without breaking the tests that read it (imported as a
sibling module, as ``helpers`` is; it imports neither torch nor amp_patch).

- ``docs_text()``: every file, concatenated, each after a marker line naming it;
- ``section(title)``: a heading's text, in whichever file holds it;
- ``doc_files()`` / ``read(path)``: the files one by one, for per-file checks
  (links, anchors, contents lines).
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Dict, List, Tuple

#: the checkout's root, where README.md is
ROOT = Path(__file__).resolve().parent.parent
#: a Markdown heading outside a fenced code block: its level and its title
HEADING = re.compile(r"^(#{1,6}) (.+?)\s*$")


def doc_files() -> List[Path]:
    """README.md first, then every ``docs/*.md`` in name order."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def name(path: Path) -> str:
    """A documentation file's path relative to the root (``docs/guide.md``)."""
    return path.relative_to(ROOT).as_posix()


@functools.lru_cache(maxsize=None)
def _read(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def read(path) -> str:
    """One file's text (``"README.md"``, ``"docs/guide.md"`` or a ``Path``)."""
    p = Path(path)
    return _read(name(p) if p.is_absolute() else p.as_posix())


def docs_text() -> str:
    """Every documentation file, concatenated; each begins with a marker line
    ``<!-- file: docs/guide.md -->``."""
    return "".join(f"\n<!-- file: {name(p)} -->\n{read(p)}" for p in doc_files())


def headings(text: str) -> List[Tuple[int, str, int]]:
    """``(level, title, line index)`` of each heading of one file, code blocks skipped."""
    out, fence = [], False
    for i, line in enumerate(text.split("\n")):
        if line.startswith("```"):
            fence = not fence
            continue
        m = None if fence else HEADING.match(line)
        if m:
            out.append((len(m.group(1)), m.group(2), i))
    return out


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path) -> set:
    """The anchors of one file's headings."""
    return {slug(title) for _, title, _ in headings(read(path))}


def section(title: str, path=None) -> str:
    """The text under the heading ``title`` (any level, in README.md or any
    ``docs/*.md``; only in ``path`` when given), up to the next heading of the
    same or a higher level. Fails naming the files searched when no file has
    that heading, or when several do and ``path`` does not pick one."""
    files = [ROOT / path] if path is not None else doc_files()
    found: Dict[str, str] = {}
    for file in files:
        text = read(file)
        lines = text.split("\n")
        heads = headings(text)
        for k, (level, t, i) in enumerate(heads):
            if t != title:
                continue
            end = next((j for lv, _, j in heads[k + 1:] if lv <= level), len(lines))
            found[name(file)] = "\n".join(lines[i + 1:end])
    if not found:
        raise LookupError(f"no heading {title!r} in {', '.join(name(f) for f in files)}")
    if len(found) > 1:
        raise LookupError(f"the heading {title!r} is in several files ({', '.join(found)}); pass path=")
    return next(iter(found.values()))
