"""Generated regions: a script's table replaces exactly its region, under a stamp; a missing region is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.table import Table

from deeppool.docregions import STAMP_PREFIX, Stamp, markdown, regions, write_region
from deeppool.errors import DeeppoolError

DOC = """# Title

before
<!-- generated:speed begin -->
old figures
<!-- generated:speed end -->
after
<!-- generated:other begin -->
kept
<!-- generated:other end -->
"""


def table() -> Table:
    out = Table(title="speed [bold]now[/bold]")
    out.add_column("model")
    out.add_column("ms | p50", justify="right")
    out.add_row("resnet50", "1.5")
    out.add_row("gpt2", "[red]2.25[/red]")
    return out


def test_markdown_keeps_every_cell_as_plain_text() -> None:
    assert markdown(table()) == ("**speed now**\n\n| model | ms \\| p50 |\n|---|---|\n| resnet50 | 1.5 |\n"
                                 "| gpt2 | 2.25 |")


def test_a_region_is_replaced_under_a_stamp_and_nothing_else_changes(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(DOC)
    write_region(doc, "speed", markdown(table()), Stamp.started("python benchmarks/speed.py --write-docs"))
    text = doc.read_text()
    body = regions(text)["speed"]
    stamp = body.splitlines()[0]
    assert stamp.startswith(f"{STAMP_PREFIX}python benchmarks/speed.py --write-docs` at commit ")
    assert "CPU cores" in stamp and "load average" in stamp
    assert "| gpt2 | 2.25 |" in body and "old figures" not in text
    assert regions(text)["other"] == "kept\n"
    assert text.startswith("# Title\n\nbefore\n") and text.endswith("after\n<!-- generated:other begin -->\nkept\n"
                                                                    "<!-- generated:other end -->\n")


def test_a_region_that_is_not_there_is_refused(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(DOC)
    with pytest.raises(DeeppoolError, match="0 regions named 'missing'"):
        write_region(doc, "missing", "x", Stamp.started("python benchmarks/x.py --write-docs"))
    assert doc.read_text() == DOC
