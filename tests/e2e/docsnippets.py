"""Extract the fenced code blocks of a Markdown page and run them the way a reader would.

Every ```python, ```bash / ```sh and ```json block of README.md and docs/*.md is checked; ```text
blocks and blocks with no language are output or illustrations and are left alone. The blocks of one
page run in order in one scratch directory (``examples``, ``benchmarks``, ``src`` and ``.venv`` there
point at the checkout and the running Python's environment), so a page can write a file and then
launch it:

- python: the block is a script, run with the test's Python; it must exit 0;
- bash / sh: the block runs with ``bash -e``; every command must exit 0;
- json: the block must parse.

A page changes how a block runs with an HTML comment on the line(s) right above it (invisible when
rendered), so every exception is deliberate and visible in the page's source:

- ``<!-- doctest: skip REASON -->``: not run (REASON is required: a signature, needs a GPU, ...);
- ``<!-- doctest: file NAME -->``: written to NAME in the scratch directory instead of being run;
- ``<!-- doctest: replace OLD => NEW -->``: run with OLD replaced by NEW (to shorten a long run);
  OLD must occur in the block, so a replacement cannot silently stop applying;
- ``<!-- doctest: continues -->`` above a python block: it runs after the page's previous python
  block, in the same script (a page that builds an example step by step).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

RUNNABLE = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash", "json": "json"}
FENCE = re.compile(r"^```(\S*)\s*$")
MARK = re.compile(r"^<!--\s*doctest:\s*(\w+)\s*(.*?)\s*-->\s*$")
KINDS = ("skip", "file", "replace", "continues")


@dataclass
class Snippet:
    """One fenced block: where it is, its language, its text and the doctest marks above it."""

    page: str
    line: int
    lang: str
    code: str
    marks: list[tuple[str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def mark(self, kind: str) -> str | None:
        return next((arg for k, arg in self.marks if k == kind), None)

    def runnable_code(self) -> str:
        """The block's text with its ``replace`` marks applied (each must match)."""
        code = self.code
        for kind, arg in self.marks:
            if kind != "replace":
                continue
            old, sep, new = arg.partition(" => ")
            if not sep or old not in code:
                raise ValueError(f"{self.where}: 'doctest: replace {arg}' does not match the block; write "
                                 "'replace OLD => NEW' with OLD copied from the block")
            code = code.replace(old, new)
        return code


def parse_page(text: str, page: str) -> list[Snippet]:
    """Every fenced block of ``text`` with its marks; a mark that is not right above a block, or an
    unknown mark, is an error (so a typo cannot disable a check)."""
    lines = text.splitlines()
    out: list[Snippet] = []
    pending: list[tuple[str, str]] = []
    i = 0
    while i < len(lines):
        mark, fence = MARK.match(lines[i]), FENCE.match(lines[i])
        if mark:
            if mark[1] not in KINDS:
                raise ValueError(f"{page}:{i + 1}: unknown doctest mark {mark[1]!r}; use one of {KINDS}")
            if mark[1] == "skip" and not mark[2]:
                raise ValueError(f"{page}:{i + 1}: 'doctest: skip' needs a reason")
            pending.append((mark[1], mark[2]))
        elif fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise ValueError(f"{page}:{i + 1}: code block is never closed")
            out.append(Snippet(page, i + 1, fence[1].lower(), "\n".join(lines[i + 1:end]) + "\n", pending))
            pending, i = [], end
        elif lines[i].strip() and pending:
            raise ValueError(f"{page}:{i + 1}: doctest mark {pending[0][0]!r} is not right above a code block")
        i += 1
    return out


def kind_of(snippet: Snippet) -> str:
    """What to do with a block: 'skip', 'file', 'python', 'bash', 'json' or 'none' (text, output)."""
    if snippet.mark("skip") is not None:
        return "skip"
    if snippet.mark("file") is not None:
        return "file"
    return RUNNABLE.get(snippet.lang, "none")


def check_json(snippet: Snippet) -> None:
    """A json block must parse as written."""
    try:
        json.loads(snippet.runnable_code())
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{snippet.where}: json block does not parse: {exc}") from exc
