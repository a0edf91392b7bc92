"""The documentation builds with ``mkdocs build --strict``, and its generated parts say the right thing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _hooks():
    spec = importlib.util.spec_from_file_location("gpufeed_docs_hooks", DOCS / "hooks" / "gpufeed_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _needs(*modules: str) -> None:
    for m in modules:
        if importlib.util.find_spec(m) is None:
            pytest.skip(f"{m} is not installed (pip install -e '.[dev]')")


def test_mkdocs_build_strict(tmp_path):
    _needs("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    pages = {p.parent.name for p in tmp_path.glob("*/index.html")}
    assert {"how-it-works", "sources", "cli", "tuning", "troubleshooting", "benchmarks", "reliability",
            "api"} <= pages
    assert not (tmp_path / "hooks").exists()  # the build hooks are not published
    api = (tmp_path / "api" / "index.html").read_text()
    for name in ("gpufeed.CudaPrefetcher", "gpufeed.PrefetchStats", "gpufeed.sources.H5Source"):
        assert f'id="{name}"' in api, name


def test_every_page_is_in_the_nav():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = {next(iter(item.values())) for item in config["nav"]}
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == in_nav


def test_api_page_lists_only_importable_names(monkeypatch):
    hooks = _hooks()
    monkeypatch.setattr(hooks, "API", [("Prefetcher", ["gpufeed.CudaPrefetcher", "gpufeed.nope.Missing"]),
                                       ("Gone", ["gpufeed.NotThere"])])
    md = hooks.api_markdown()
    assert "## Prefetcher\n" in md and "::: gpufeed.CudaPrefetcher\n" in md
    assert "## Gone" not in md and "::: gpufeed.NotThere" not in md
    assert md.rstrip().endswith(
        "Not importable in the checkout that built these docs: `gpufeed.nope.Missing`, `gpufeed.NotThere`.")


def test_benchmark_results_are_included_with_headings_nested_and_links_defused(tmp_path, monkeypatch):
    hooks = _hooks()
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    assert hooks.results_markdown().startswith("*No results are committed yet.*")
    (tmp_path / "prefetcher-h100.md").write_text(
        "# Prefetcher on H100\n\n## unpinned\n\n| method | GB/s |\n| --- | --- |\n| gpufeed | 50.1 |\n\n"
        "```text\n# not a heading\n```\nraw: [json](prefetcher-h100.json), [site](https://example.org)\n")
    md = hooks.results_markdown()
    assert md.splitlines()[:5] == [
        "### `benchmarks/results/prefetcher-h100.md`", "", "#### Prefetcher on H100", "", "##### unpinned"]
    assert "| gpufeed | 50.1 |" in md and "# not a heading" in md
    assert "raw: json (`benchmarks/results/prefetcher-h100.json`), [site](https://example.org)" in md


def _tuning_defaults() -> dict[str, str]:
    """``{knob: default}`` from the table of docs/tuning.md (first two cells, backticks stripped)."""
    rows = {}
    for line in (DOCS / "tuning.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 2:
            rows[cells[0]] = cells[1]
    return rows


def test_tuning_page_states_the_code_defaults():
    import inspect

    from gpufeed import CudaPrefetcher
    from gpufeed.host_memory.pinned_pool import DEFAULT_PINNED_BUDGET

    rows = _tuning_defaults()
    sig = inspect.signature(CudaPrefetcher)
    assert rows["depth"] == str(sig.parameters["depth"].default)
    assert "chunk_bytes" not in rows
    assert rows["pinned_budget` (of `SourceLoader`)"] == f"{DEFAULT_PINNED_BUDGET >> 20} MiB"
    assert rows["static"] == str(sig.parameters["static"].default)
    assert sig.parameters["trace"].default is None  # None: off unless GPUFEED_TRACE=1
    assert rows["trace"] == "False` (or `GPUFEED_TRACE=1`)"
    assert rows["num_threads` (of `RawSource`, `H5Source`)"] == (
        "min(8, os.cpu_count())`; in a DataLoader worker `min(8, cpus // num_workers)")
    assert rows["num_threads` (of `SourceLoader`)"] == "min(8, os.cpu_count())"


# -- pages a newcomer reads ----------------------------------------------------------------------------


def _sections(markdown: str, level: str = "### ") -> dict[str, str]:
    """``{heading: body}`` for the headings of one level (``body`` up to the next heading of any level)."""
    out: dict[str, str] = {}
    heading = None
    for line in markdown.splitlines():
        if line.startswith("#") and not line.startswith("#!"):
            heading = line[len(level):].strip() if line.startswith(level) else None
            if heading is not None:
                out[heading] = ""
        elif heading is not None:
            out[heading] += line + "\n"
    return out


def test_api_page_explains_every_public_name_with_an_example():
    import gpufeed

    sections = _sections((DOCS / "api.md").read_text())
    for name in gpufeed.__all__:
        body = sections.get(f"`{name}`")
        assert body is not None, f"docs/api.md has no section for {name}"
        prose, _, code = body.partition("```python\n")
        assert len(prose.split()) >= 25, f"{name}: a paragraph, not a line"
        assert name in code, f"{name}: its example does not use it"
    assert "<!-- gpufeed:api -->" in (DOCS / "api.md").read_text()  # the generated reference follows
    generated = {n.rsplit(".", 1)[1] for _, names in _hooks().API for n in names}
    assert set(gpufeed.__all__) <= generated


def test_api_page_examples_run_on_the_cpu(tmp_path, monkeypatch):
    """Every example of docs/api.md runs, in order, in one namespace (they build on one another)."""
    import re

    import torch

    pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "api.md").read_text(), re.S)
    assert len(blocks) >= 10  # one a public name
    ns: dict = {}
    for code in blocks:
        if "GDSSource(" in code and not torch.cuda.is_available():
            continue  # the page says this one needs CUDA
        exec(compile(code, "docs/api.md", "exec"), ns)
    assert (tmp_path / "train.raw" / "manifest.json").is_file()


def test_index_lists_every_example():
    index = (DOCS / "index.md").read_text()
    for script in sorted((ROOT / "examples").glob("*.py")):
        assert f"`{script.name}`" in index, f"docs/index.md does not list examples/{script.name}"


def test_index_installs_from_the_clone():
    install = (DOCS / "index.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "python3 -m pip install gpufeed " not in install  # no index serves it
    assert "python3 -m pip install -e '.[hdf5]'" in install
    assert "python3 -m pip wheel --no-deps . -w dist/" in install


def test_readme_setup_says_cpu_torch_and_venv_before_its_two_commands():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    block = setup.split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.splitlines() == ["python3 -m pip install -e '.[dev]' && gpufeed bench",
                                  "python3 -m pytest -q"]
    before = setup.split("```bash\n", 1)[0]
    assert "python3 -m venv .venv && . .venv/bin/activate" in before
    assert "python3 -m pip install torch --index-url https://download.pytorch.org/whl/cpu" in before
    ci = (ROOT / ".ci" / "run").read_text()  # CI runs the same two commands, quietly
    assert "python3 -m pip install -q -e '.[dev]'" in ci and "python3 -m pytest -q" in ci


def test_tuning_rows_are_a_few_sentences():
    for line in (DOCS / "tuning.md").read_text().splitlines():
        if line.startswith("| `"):
            words = len(line.replace("|", " ").split())
            assert words <= 130, f"{words} words: {line[:60]}"


@pytest.mark.parametrize("phrase", [
    "bookkeeping alone",
    "(47 and 47 of 90 cells)",
    "until a background thread pays",
    "a whole staging chunk per read and starts it without a Python thread",
    "fetch thread takes over",
])
def test_user_pages_do_not_use_insider_phrases(phrase):
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        if page.name in ("design.md", "how-it-works.md", "reliability.md"):
            continue  # pages about the internals
        assert phrase not in page.read_text().replace("\n", " "), f"{page.name}: {phrase!r}"
