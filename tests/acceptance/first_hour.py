"""Reads docs/first-hour.md and follows it: the files it shows, the commands it runs.

Each fenced block of the page is preceded by an HTML comment (invisible once rendered) that
says what to do with it:

- `<!-- first-hour: file PATH -->`: the block is the whole file PATH;
- `<!-- first-hour: append PATH -->`: the block is added at the end of PATH;
- `<!-- first-hour: run -->`: a console block; each `$ command` (with an optional `<<'EOF'`
  here-document) is run with bash, and its output must equal the lines shown after it;
- `<!-- first-hour: background NAME -->`: a console block whose command keeps running (a
  worker, the relay); the lines shown must appear in its output, `...` standing for any lines;
- `<!-- first-hour: more NAME -->`: more lines the background process NAME must print;
- `<!-- first-hour: skip ... -->`: not run (pip install: the test uses the repository's venv).

Outputs are compared after `normalize()`, which blanks what differs from run to run (times,
task ids, host names, durations) and drops the one line Django 5.2's shell adds (4.2 prints
none); `shell_imports()` finds that line, so the test can compare it where it is printed.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import threading
from pathlib import Path

from devtools.process import stop_process
from tests.relay_support import wait_for

PAGE = Path(__file__).resolve().parents[2] / "docs" / "first-hour.md"
MARKER = re.compile(r"^<!-- first-hour: (\w+)(?: (\S+))?.*-->$")
FENCE = "```"
HEREDOC = "<<'EOF'"
ELLIPSIS = "..."
COMMAND_TIMEOUT = 120.0  # seconds; migrate is the slowest step, a few seconds
BACKGROUND_TIMEOUT = 60.0  # seconds for a background process to print what the page shows

_VARYING = [
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), "<uuid>"),
    (re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"), "<time>"),
    (re.compile(r"celery@\S+"), "celery@<host>"),
    (re.compile(r"ForkPoolWorker-\d+"), "ForkPoolWorker-<n>"),
    (re.compile(r"\d+\.\d+(?:e-?\d+)?"), "<number>"),
    # Dead rows: published rows that autovacuum has not removed yet, whenever it last ran (and
    # those of them it had to leave, which depends on when it ran too).
    (re.compile(r"^(dead_rows(?:_held)?\s+)\d+"), r"\1<count>"),
    (re.compile(r"[ \t]+"), " "),
]
# Printed by Django 5.2's `shell` (and not by 4.2), followed by a blank line.
_SHELL_IMPORTS = re.compile(r"^\d+ objects? imported automatically")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
    """One fenced block of the page and what its marker says to do with it."""

    kind: str
    target: str | None
    lines: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    """One `$ command` of a console block and the output the page shows for it."""

    command: str
    output: tuple[str, ...]


def blocks(text: str) -> list[Block]:
    """The page's fenced blocks, each with the marker that precedes it (an error if none)."""
    found: list[Block] = []
    marker: tuple[str, str | None] | None = None
    lines = iter(text.splitlines())
    for line in lines:
        match = MARKER.match(line.strip())
        if match:
            marker = (match.group(1), match.group(2))
        elif line.startswith(FENCE):
            body = []
            for inner in lines:
                if inner.startswith(FENCE):
                    break
                body.append(inner)
            if marker is None:
                raise AssertionError(f"a block of {PAGE.name} has no first-hour marker: {body[:2]}")
            found.append(Block(kind=marker[0], target=marker[1], lines=tuple(body)))
            marker = None
    return found


def steps(lines: tuple[str, ...]) -> list[Step]:
    """Split a console block into commands (here-documents included) and their outputs."""
    result: list[Step] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        assert line.startswith("$ "), f"expected a `$ command` line, got {line!r}"
        command = [line[2:]]
        index += 1
        if line.endswith(HEREDOC):
            while lines[index] != "EOF":
                command.append(lines[index])
                index += 1
            command.append("EOF")
            index += 1
        output = []
        while index < len(lines) and not lines[index].startswith("$ "):
            output.append(lines[index])
            index += 1
        result.append(Step(command="\n".join(command), output=tuple(output)))
    return result


def normalize(lines: list[str] | tuple[str, ...]) -> list[str]:
    """Lines with run-to-run differences blanked, trailing blank lines dropped."""
    result: list[str] = []
    skip_blank = False
    for line in lines:
        if _SHELL_IMPORTS.match(line):
            skip_blank = True
            continue
        if skip_blank and not line.strip():
            skip_blank = False
            continue
        skip_blank = False
        blanked = line
        for pattern, replacement in _VARYING:
            blanked = pattern.sub(replacement, blanked)
        result.append(blanked.rstrip())
    while result and not result[-1]:
        result.pop()
    return result


def shell_imports(lines: list[str] | tuple[str, ...]) -> list[str]:
    """The lines in which Django's shell says how many objects it imported (5.2; 4.2 prints none)."""
    return [line for line in lines if _SHELL_IMPORTS.match(line)]


def groups(lines: tuple[str, ...]) -> list[list[str]]:
    """An excerpt's runs of consecutive lines, split where the page shows `...`."""
    found: list[list[str]] = [[]]
    for line in normalize(lines):
        if line == ELLIPSIS:
            found.append([])
        else:
            found[-1].append(line)
    return [group for group in found if group]


def contains_in_order(output: list[str], expected: list[list[str]]) -> bool:
    """Whether each group appears in `output` as consecutive lines, the groups in order."""
    start = 0
    for group in expected:
        for index in range(start, len(output) - len(group) + 1):
            if output[index : index + len(group)] == group:
                start = index + len(group)
                break
        else:
            return False
    return True


class Background:
    """A long-running command the page starts in another terminal, its output collected."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        self.command = command
        self.process = subprocess.Popen(
            shlex.split(command),
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.append(line.rstrip("\n"))

    def text(self) -> str:
        """Everything printed so far."""
        return "\n".join(self._lines)

    def expect(self, excerpt: tuple[str, ...]) -> None:
        """Wait until the excerpt's lines have been printed (in order, `...` for any lines)."""
        wanted = groups(excerpt)
        wait_for(
            lambda: contains_in_order(normalize(list(self._lines)), wanted),
            timeout=BACKGROUND_TIMEOUT,
            what=f"the output {PAGE.name} shows for `{self.command}`",
            context=lambda: (
                "expected:\n" + "\n".join(map(str, wanted)) + "\nprinted:\n" + self.text()
            ),
        )

    def stop(self) -> None:
        """SIGTERM, as Ctrl-C in its terminal would, then wait for it."""
        stop_process(self.process, timeout=30)
        self._reader.join(timeout=5)
        if self.process.stdout is not None:
            self.process.stdout.close()


def run(step: Step, cwd: Path, env: dict[str, str]) -> list[str]:
    """Run one foreground command with bash; return its output (stdout and stderr)."""
    result = subprocess.run(
        ["bash", "-c", step.command],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, f"`{step.command}` exited {result.returncode}:\n{result.stdout}"
    return result.stdout.splitlines()


def write_file(block: Block, cwd: Path, *, append: bool) -> None:
    """Write (or append) a file block where the page says."""
    assert block.target, "a file block needs a path"
    path = cwd / block.target
    text = "\n".join(block.lines) + "\n"
    if append:
        text = path.read_text() + "\n" + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
