"""MkDocs hook: fill the generated parts of the docs at build time.

* ``<!-- gpufeed:api -->`` in ``api.md`` becomes one mkdocstrings block (``::: name``) for every public
  name of :data:`API` that imports in this checkout, so the API page builds (strictly) whatever subset of
  gpufeed exists, and a name that does not import is listed as such instead of failing the build.
* ``<!-- gpufeed:benchmark-results -->`` in ``benchmarks.md`` becomes the committed result tables,
  ``benchmarks/results/*.md``, each under a heading naming its file (or a line saying there are none yet).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

#: (section title, [dotted names]) in the order they appear on the API page.
API: list[tuple[str, list[str]]] = [
    ("Prefetcher", ["gpufeed.CudaPrefetcher", "gpufeed.PrefetchStats", "gpufeed.StaticBatch"]),
    ("Loading from a source", ["gpufeed.SourceLoader"]),
    ("torchdata nodes", ["gpufeed.nodes.ToDevice"]),
    ("Sources", ["gpufeed.BatchSource", "gpufeed.Field", "gpufeed.sources.RawSource",
                 "gpufeed.sources.H5Source", "gpufeed.sources.GDSSource", "gpufeed.sources.plan_batches"]),
    ("Conversion", ["gpufeed.convert.convert_h5_to_raw"]),
    ("Testing a source", ["gpufeed.testing.SourceContract"]),
    ("Command line", ["gpufeed.cli.main"]),
]


def importable(dotted: str) -> bool:
    """True when ``dotted`` (``package.module.name``) imports in this environment."""
    module, _, name = dotted.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except Exception:  # ImportError, or an optional backend failing at import
        return False


def api_markdown() -> str:
    parts = []
    missing = []
    for title, names in API:
        present = [n for n in names if importable(n)]
        missing += [n for n in names if n not in present]
        if not present:
            continue
        parts.append(f"## {title}\n")
        parts += [f"::: {n}\n    options:\n      heading_level: 3\n" for n in present]
    if missing:
        listed = ", ".join(f"`{n}`" for n in missing)
        parts.append(f"!!! note\n    Not importable in the checkout that built these docs: {listed}.\n")
    return "\n".join(parts)


def results_markdown() -> str:
    files = sorted(RESULTS.glob("*.md")) if RESULTS.is_dir() else []
    if not files:
        return ("*No results are committed yet.* Run the scripts above on a GPU machine; their tables land "
                "in `benchmarks/results/` and appear here on the next docs build.\n")
    parts = []
    for f in files:
        body = _demote(f.read_text().strip(), by=3)
        chart = f.with_suffix(".png")
        if chart.exists():  # drawn by benchmarks/plot_results.py, added to the site by on_files
            body = f"![{f.stem}](results/{chart.name})\n\n{body}"
        # Links between result files point outside the docs: keep the text, name the file.
        body = _RELATIVE_LINK.sub(lambda m: f"{m[1]} (`benchmarks/results/{m[2]}`)", body)
        parts.append(f"### `benchmarks/results/{f.name}`\n\n{body}\n")
    return "\n".join(parts)


_RELATIVE_LINK = re.compile(r"\[([^\]]+)\]\((?!https?:|#|mailto:)([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6}) ")


def _demote(markdown: str, by: int) -> str:
    """Push every heading (outside code fences) ``by`` levels down, so a file's headings nest under ours."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        m = None if fenced else _HEADING.match(line)
        if m:
            line = "#" * min(6, len(m[1]) + by) + line[len(m[1]):]
        out.append(line)
    return "\n".join(out)


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Publish the committed result charts under ``results/`` of the site."""
    from mkdocs.structure.files import File

    for png in sorted(RESULTS.glob("*.png")) if RESULTS.is_dir() else []:
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if "<!-- gpufeed:api -->" in markdown:
        markdown = markdown.replace("<!-- gpufeed:api -->", api_markdown())
    if "<!-- gpufeed:benchmark-results -->" in markdown:
        markdown = markdown.replace("<!-- gpufeed:benchmark-results -->", results_markdown())
    return markdown
