"""Every CUDA-, NCCL- and MPS-specific call is behind the device seam (``deeppool/device/``).

Outside it no module imports ``torch.cuda`` or touches ``torch.cuda.*``, names the NCCL backend in a
string, or names the MPS control or its environment. Prose (docstrings, messages) may mention them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import deeppool

PACKAGE = Path(deeppool.__file__).parent
SEAM = PACKAGE / "device"
NAMES = ("nccl", "nvidia-cuda-mps-control", "cuda_mps_")


def _offences(path: Path, root: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name) \
                and node.value.id == "torch":
            found.append(f"{where}: torch.cuda")
        elif isinstance(node, ast.Import) and any(a.name.startswith("torch.cuda") for a in node.names):
            found.append(f"{where}: import torch.cuda")
        elif isinstance(node, ast.ImportFrom) and (
                (node.module or "").startswith("torch.cuda")
                or (node.module == "torch" and any(a.name == "cuda" for a in node.names))):
            found.append(f"{where}: from torch import cuda")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.strip().lower()
            if text in NAMES or text.startswith(NAMES[2]):
                found.append(f"{where}: the string {node.value!r}")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def test_nothing_outside_the_seam_calls_cuda_nccl_or_mps() -> None:
    files = [p for p in PACKAGE.rglob("*.py") if SEAM not in p.parents]
    offences = [line for path in sorted(files) for line in _offences(path, PACKAGE.parent)]
    assert not offences, "\n".join(offences)


def test_the_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('import torch\nfrom torch import cuda\nx = torch.cuda.Stream()\nb = "nccl"\n'
                      'e = "CUDA_MPS_PIPE_DIRECTORY"\n"""docstrings may say nccl"""\n')
    found = [line.split(": ", 1)[1] for line in _offences(sample, tmp_path)]
    assert found == ["from torch import cuda", "torch.cuda", "the string 'nccl'",
                     "the string 'CUDA_MPS_PIPE_DIRECTORY'"]
