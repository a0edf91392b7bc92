"""The recipes of docs/integrations.md, as the tests run them, and how a delivered batch is compared."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
_BLOCK = re.compile(r"```python\n# recipe: ([\w-]+)\n(.*?)```", re.S)


def recipes() -> dict[str, str]:
    """Each ``# recipe: NAME`` code block of the page, by name."""
    return {name: code for name, code in _BLOCK.findall(DOC.read_text())}


def load(*names: str) -> dict[str, Any]:
    """The namespace after running the named recipes in order (a later one may use an earlier one's names)."""
    found = recipes()
    ns: dict[str, Any] = {"__name__": "recipe_" + "_".join(n.replace("-", "_") for n in names)}
    for name in names:
        exec(compile(found[name], f"{DOC}:{name}", "exec"), ns)
    return ns


def same_bytes(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same structure of tensors, dtype, shape and every byte alike."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(_bytes(a), _bytes(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same_bytes(x, y) for x, y in zip(a, b, strict=True)))
    return a == b


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same_batches(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected), (len(got), len(expected))
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert same_bytes(g, e), f"batch {i} differs"


def rows(t: torch.Tensor) -> list[bytes]:
    """Each row of ``t`` as bytes: a delivered row is looked up among the dataset's rows."""
    t = t.detach().cpu().contiguous()
    return [bytes(_bytes(r).numpy()) for r in t]
