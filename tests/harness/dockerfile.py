"""The Dockerfile and .dockerignore, read statically (no Docker needed).

``parse(text)`` gives the stages of a Dockerfile, each with its instructions
(continuation lines joined, comment lines dropped, ``${ARG}`` in ``FROM`` resolved
from the global ``ARG`` defaults); ``Instruction.exec_form`` decodes a JSON array
form.  ``DockerIgnore`` answers whether a context path is left out of the build
context, following Docker's rules: patterns in order, the last one that matches
wins, ``!`` re-includes, a pattern that matches a directory matches what is in it,
``*`` and ``?`` stay within one path segment, ``**`` spans any number of them.
This covers the forms our files use; it is not a complete reimplementation.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

__all__ = ["DockerIgnore", "Instruction", "Stage", "parse", "read"]


@dataclasses.dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    flags: dict[str, str]  # --from=builder, --interval=10s, ...
    rest: str  # the text after the keyword and its flags
    line: int  # where it starts in the file (1-based)

    @property
    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction, or None (shell form)."""
        text = self.rest.strip()
        if not text.startswith("["):
            return None
        value = json.loads(text)
        assert isinstance(value, list), f"line {self.line}: not a JSON array"
        assert all(isinstance(item, str) for item in value), f"line {self.line}: not strings"
        return value


@dataclasses.dataclass
class Stage:
    base: str  # FROM's image, ARG defaults substituted
    name: str | None  # FROM ... AS name
    instructions: list[Instruction]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def args(self) -> dict[str, str]:
        """The ARG defaults declared in this stage."""
        found = {}
        for instruction in self.all("ARG"):
            name, _, default = instruction.rest.partition("=")
            found[name.strip()] = default.strip()
        return found

    def env(self) -> dict[str, str]:
        """The ENV values set in this stage (KEY=VALUE form)."""
        found = {}
        for instruction in self.all("ENV"):
            for word in shlex.split(instruction.rest):
                key, sep, value = word.partition("=")
                assert sep, f"line {instruction.line}: ENV {word!r} is not KEY=VALUE"
                found[key] = value
        return found


FLAG = re.compile(r"--([a-z-]+)=(\S+)\s*")
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, joined text) of each instruction."""
    lines: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # comments vanish, even inside a continuation (Docker's rule)
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        lines.append((start, " ".join(part for part in pending if part)))
        pending = []
    assert not pending, "the Dockerfile ends inside a continuation line"
    return lines


def _instruction(number: int, text: str) -> Instruction:
    keyword, _, rest = text.partition(" ")
    rest = rest.strip()
    flags = {}
    # Only RUN, COPY, ADD, FROM and HEALTHCHECK take --flags before their arguments.
    if keyword.upper() in {"COPY", "ADD", "FROM", "HEALTHCHECK", "RUN"}:
        while match := FLAG.match(rest):
            flags[match.group(1)] = match.group(2)
            rest = rest[match.end() :]
    return Instruction(keyword.upper(), flags, rest, number)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """The global ARG defaults and the stages of a Dockerfile."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for number, line in _logical_lines(text):
        instruction = _instruction(number, line)
        if instruction.keyword == "FROM":
            words = instruction.rest.split()
            base = VARIABLE.sub(lambda m: global_args[m.group(1) or m.group(2)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base, name, []))
        elif not stages:
            assert instruction.keyword == "ARG", f"line {number}: {line!r} before FROM"
            name, _, default = instruction.rest.partition("=")
            global_args[name.strip()] = default.strip()
        else:
            stages[-1].instructions.append(instruction)
    return global_args, stages


def read(path: Path) -> tuple[dict[str, str], list[Stage]]:
    return parse(path.read_text())


def _pattern(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


class DockerIgnore:
    def __init__(self, text: str) -> None:
        self.rules: list[tuple[bool, re.Pattern[str]]] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            pattern = line[1:].strip() if negate else line
            self.rules.append((negate, _pattern(pattern.strip("/"))))

    def excluded(self, path: str) -> bool:
        """Is the context path (relative, with /) left out of the build context?"""
        parts = path.strip("/").split("/")
        candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        result = False
        for negate, pattern in self.rules:
            if any(pattern.fullmatch(candidate) for candidate in candidates):
                result = not negate
        return result
