"""The docs run: every shell block of README.md and docs/*.md is executed here, or marked as needing what
this machine lacks, and every output the docs show is what the command prints today.

Conventions (the fence's info string, visible in the Markdown):

* ```` ```sh ```` is a shell block that :func:`test_the_shell_blocks_run` executes, command by command, in a
  fresh temporary folder (with ``examples/`` linked in), in order within each doc; each must exit 0.
* ```` ```sh gpu ````, ``slurm``, ``machines`` or ``long`` marks a block that needs a CUDA GPU, a Slurm
  cluster, several machines, or a long run (minutes, or a server that runs until stopped): not run here.
* ```` ```text ```` is output, a diagram or a synopsis; ```` ```python ```` and ```` ```json ```` are code.
* An output block right after ``<!-- output of: COMMAND; varies: RULE -->`` is what COMMAND (a command of an
  earlier ```` ```sh ```` block of the same doc) prints on stdout, compared after the named normalisation:
  ``seconds`` turns every "N s" into "# s" (a solver's time); ``numbers`` turns every number into "#" and
  ignores table borders and spacing (measured figures, whose widths move the columns).
* An image right after ``<!-- image from: FILE -->`` is the FILE an earlier ```` ```sh ```` block wrote.

``DEEPPOOL_UPDATE_DOCS=1 python -m pytest tests/test_docs.py -m slow`` runs the same commands and rewrites
the output blocks and images with what they print and draw today, instead of comparing.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from deeppool.docregions import PENDING_PREFIX, STAMP_PREFIX, regions

REPO = Path(__file__).resolve().parent.parent
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
SHELL = "sh"
KINDS = {SHELL, "text", "python", "json"}
MARKS = {"gpu": "needs a CUDA GPU", "slurm": "needs a Slurm cluster", "machines": "needs several machines",
         "long": "a long run", "operator": "an operator's set-up, as root on the server's machine (it creates "
         "accounts and starts a server that runs until stopped; tests/coordinator/test_isolation.py does the same)"}
_FENCE = re.compile(r"^```(?P<info>.*)$")
_OUTPUT = re.compile(r"<!-- output of: (?P<command>.+?); varies: (?P<varies>[\w, ]+) -->")
_NUMBER = re.compile(r"\d[\d,]*(\.\d+)?(e[-+]?\d+)?")
_IMAGE = re.compile(r"<!-- image from: (\S+) -->\n!\[[^\]]*\]\(([^)]+)\)")
UPDATE = "DEEPPOOL_UPDATE_DOCS"
_BORDERS = re.compile(r"[─━│┃┏┓┗┛┡┩└┘┳┻╇┼╋┬┴├┤┌┐]")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    kind: str
    marks: tuple[str, ...]
    text: str
    above: str
    """The line just above the opening fence (an output block's ``<!-- output of: ... -->``)."""

    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    def runnable(self) -> bool:
        return self.kind == SHELL and not self.marks

    def commands(self) -> list[str]:
        """The block's commands: continuation lines joined, comments and blank lines dropped."""
        joined = self.text.replace("\\\n", " ")
        return [_without_comment(line) for line in joined.splitlines() if _without_comment(line)]


def blocks(doc: Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
        words = opening["info"].split()
        found.append(Block(doc=doc, line=index + 1, kind=words[0] if words else "", marks=tuple(words[1:]),
                           text="\n".join(lines[index + 1:end]), above=lines[index - 1] if index else ""))
        index = end + 1
    return found


ALL = [block for doc in DOCS for block in blocks(doc)]


def test_every_block_says_what_it_is() -> None:
    wrong = [f"{b.where()}: '{b.kind}'" for b in ALL if b.kind not in KINDS]
    wrong += [f"{b.where()}: marks {b.marks}" for b in ALL
              if (b.kind == SHELL and not set(b.marks) <= set(MARKS)) or (b.kind != SHELL and b.marks)]
    assert wrong == [], f"fences need one of {sorted(KINDS)} (a shell block optionally one of {sorted(MARKS)})"


def test_every_output_shown_comes_from_a_command_that_runs() -> None:
    shown = [block for block in ALL if _OUTPUT.match(block.above)]
    assert shown, "README.md shows the output of its commands"
    for block in shown:
        tied = _OUTPUT.match(block.above)
        assert tied is not None and block.kind == "text"
        assert set(tied["varies"].replace(" ", "").split(",")) <= {"seconds", "numbers"}, block.where()
        runs = [command for other in ALL if other.doc == block.doc and other.runnable() for command in other.commands()]
        assert tied["command"] in runs, f"{block.where()}: '{tied['command']}' is in no runnable block of the doc"


def test_generated_regions_are_stamped_by_a_script_here() -> None:
    for doc in DOCS:
        for name, body in regions(doc.read_text()).items():
            stamp = body.strip().splitlines()[0] if body.strip() else ""
            prefix = next((p for p in (STAMP_PREFIX, PENDING_PREFIX) if stamp.startswith(p)), None)
            assert prefix is not None, f"{doc.name}: region '{name}' has no stamp line"
            script = shlex.split(stamp.removeprefix(prefix).partition("`")[0])[1]
            assert (REPO / script).is_file() and "--write-docs" in (REPO / script).read_text(), (doc.name, name)


RUNNABLE_DOCS = [doc for doc in DOCS if any(block.runnable() for block in blocks(doc))]


@pytest.mark.slow
@pytest.mark.parametrize("doc", [doc if doc.name == "README.md" else pytest.param(doc, marks=pytest.mark.heavy)
                                 for doc in RUNNABLE_DOCS], ids=[doc.name for doc in RUNNABLE_DOCS])
def test_the_shell_blocks_run(doc: Path, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(REPO / "examples")
    outputs = {}
    for block in blocks(doc):
        if block.runnable():
            for command in block.commands():
                outputs[command] = _run(command, tmp_path, block)
    if os.environ.get(UPDATE) == "1":
        _update(doc, outputs, tmp_path)
    for block in blocks(doc):
        tied = _OUTPUT.match(block.above)
        if tied is not None:
            rules = tied["varies"].replace(" ", "").split(",")
            assert _normal(outputs[tied["command"]], rules) == _normal(block.text, rules), (
                f"{block.where()} is not what `{tied['command']}` prints today:\n{outputs[tied['command']]}")
    for written, shown in _IMAGE.findall(doc.read_text()):
        assert (tmp_path / written).is_file() and (REPO / shown).is_file(), (doc.name, written, shown)


def _update(doc: Path, outputs: dict[str, str], folder: Path) -> None:
    """Rewrite the doc's output blocks and images with today's (``DEEPPOOL_UPDATE_DOCS=1``)."""
    text = doc.read_text()
    for block in reversed(blocks(doc)):
        tied = _OUTPUT.match(block.above)
        if tied is not None:
            lines = text.split("\n")
            lines[block.line:block.line + len(block.text.split("\n"))] = outputs[tied["command"]].rstrip("\n").split("\n")
            text = "\n".join(lines)
    doc.write_text(text)
    for written, shown in _IMAGE.findall(text):
        shutil.copyfile(folder / written, REPO / shown)


def _run(command: str, folder: Path, block: Block) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{block.where()}: `{command}` exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


def _normal(text: str, rules: list[str]) -> list[str]:
    lines = [line.rstrip() for line in text.strip().splitlines()]
    if "seconds" in rules:
        lines = [re.sub(r"\d+(\.\d+)? s\b", "# s", line) for line in lines]
    if "numbers" in rules:
        lines = [" ".join(_NUMBER.sub("#", _BORDERS.sub(" ", line)).split()) for line in lines]
        lines = [line for line in lines if line]
    return lines


def _without_comment(line: str) -> str:
    """A command without its trailing ``# comment`` (a '#' after whitespace, outside quotes: enough here)."""
    if line.lstrip().startswith("#"):
        return ""
    return re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
