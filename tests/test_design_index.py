"""docs/design.md indexes every design note the code defines, in the file that defines it."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A definition: a comment or docstring line that begins with the note's title, alone or followed by its first
# sentence; a citation ("see [Note: ...]", "... [Note: ...] in x.py") does not begin a line that way.
DEFINITION = re.compile(r'^\s*(?:#|//|\*|""")?\s*\[Note: ([^\]]+)\]\s*(.*)$')


def _definitions() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for top in ("infinity", "native", "bench"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix not in (".py", ".cpp", ".hpp", ".h", ".inl", ".sh"):
                continue
            for line in path.read_text(errors="replace").splitlines():
                m = DEFINITION.match(line)
                if m and (not m.group(2).strip() or m.group(2)[:1].isupper()):
                    found.setdefault(m.group(1), set()).add(path.relative_to(ROOT).as_posix())
    return found


def _index() -> dict[str, str]:
    rows = re.findall(r"^\| ([^|]+?) \| \[([^\]]+)\]\(", (ROOT / "docs" / "design.md").read_text(), re.M)
    return {title.strip(): path for title, path in rows}


def test_every_note_is_indexed_where_it_is_defined():
    defined, index = _definitions(), _index()
    assert len(defined) > 50, "the scan must find the notes"
    assert sorted(set(defined) - set(index)) == [], "notes missing from docs/design.md"
    assert sorted(set(index) - set(defined)) == [], "docs/design.md lists notes no file defines"
    moved = {t: (index[t], sorted(defined[t])) for t in index if index[t] not in defined[t]}
    assert moved == {}, "docs/design.md names the wrong file"
