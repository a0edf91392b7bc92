"""The package's shape: data flows one way (no import circle), and one module pins host memory."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gpufeed"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Each module of the package, and the package modules it imports (at the top or inside a function)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - node.level + 1], base]).rstrip(".")
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            for t in targets:
                while t and t not in modules:  # gpufeed.x.y (a name in module gpufeed.x) -> gpufeed.x
                    t = t.rpartition(".")[0]
                if t and t != name and t in modules:
                    deps.add(t)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done, path = set(), []

    def visit(n: str) -> list[str] | None:
        if n in path:
            return [*path[path.index(n):], n]
        if n in done:
            return None
        path.append(n)
        for d in sorted(graph[n]):
            found = visit(d)
            if found:
                return found
        path.pop()
        done.add(n)
        return None

    for n in sorted(graph):
        found = visit(n)
        if found:
            return found
    return None


def test_no_module_imports_back_into_one_that_imports_it():
    graph = _imports()
    # A package's __init__ that re-exports its submodules is not a step of the data path.
    for name in ("gpufeed", "gpufeed.sources"):
        graph[name] = set()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_only_host_memory_pins():
    """Pinned host memory has one owner in the library (the CLI's baselines aside)."""
    pins = ("pin_memory()", "pin_memory=True", "cudaHostRegister", ".pin_memory(")
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("host_memory/", "_cli_")):
            continue
        text = path.read_text()
        found += [f"{rel}: {p}" for p in pins if p in text]
    assert not found
