"""The floor plan, read from the source by walking every module's AST (imports inside functions
included): no module outside `ntk` imports an underscore module of `ntk`, no package imports
another package's underscore modules, the benchmarks and examples use public modules only, and
the library's modules import each other without cycles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ntk", "projections", "attribution")
SCRIPTS = ("benchmarks", "tests", "examples")
# the store's sharded writer and the store import each other; the integrity work (issue 15,
# item 3: one store-format module) removes it


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """Library modules by dotted name (packages by their own name)."""
    return {
        _name(p): p
        for package in PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
        if ".ipynb_checkpoints" not in p.parts
    }


LIBRARY = _modules()


def imports(path: Path, name: str) -> set[str]:
    """Library modules that the file at `path` (module `name`) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            targets = [f"{stem}.{alias.name}" for alias in node.names] + [stem]
            # `from package import name`: the submodule if there is one, else the package
            targets = [t for t in targets[:-1] if t in LIBRARY] or [stem]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            while parts and ".".join(parts) not in LIBRARY:
                parts.pop()
            if parts and ".".join(parts) != name:
                found.add(".".join(parts))
    return found


def _underscore(module: str) -> bool:
    return any(part.startswith("_") for part in module.split("."))


def _script_files() -> dict[str, Path]:
    return {
        str(p.relative_to(ROOT)): p
        for folder in SCRIPTS
        if (ROOT / folder).is_dir()
        for p in sorted((ROOT / folder).rglob("*.py"))
    }


def graph() -> dict[str, set[str]]:
    return {name: imports(path, name) for name, path in LIBRARY.items()}


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_imports_inside_functions_and_relative_imports():
    assert "projections.distributed" in imports(LIBRARY["projections.store"], "projections.store")
    assert "ntk.core.kinds" in imports(LIBRARY["ntk.core.tiles"], "ntk.core.tiles")
    assert "attribution.outputs" in imports(LIBRARY["attribution._trak"], "attribution._trak")
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_nothing_outside_ntk_imports_an_underscore_module_of_ntk():
    files = {name: path for name, path in LIBRARY.items() if name.split(".")[0] != "ntk"}
    files.update(_script_files())
    offenders = [
        (name, target)
        for name, path in files.items()
        for target in imports(path, name)
        if target.split(".")[0] == "ntk" and _underscore(target)
    ]
    assert not offenders


def test_benchmarks_and_examples_import_public_modules_only():
    files = {
        name: path
        for name, path in _script_files().items()
        if name.split("/")[0] in ("benchmarks", "examples")
    }
    offenders = [
        (name, target)
        for name, path in files.items()
        for target in imports(path, name)
        if _underscore(target)
    ]
    assert not offenders


def test_no_package_imports_another_packages_underscore_modules():
    offenders = [
        (name, target)
        for name, targets in graph().items()
        for target in targets
        if target.split(".")[0] != name.split(".")[0] and _underscore(target)
    ]
    assert not offenders


def test_no_import_cycles():
    assert cycles(graph()) == []
