"""No import cycle in server/loraplane_server, read from the source.

Every `import x` and `from x import y` counts, at module level or inside a function (a function-local
import hides a cycle, it does not break it); only imports under `if TYPE_CHECKING:` do not, as they
never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[1] / "server"
PACKAGE = "loraplane_server"


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package` under `root`."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that can run: all of them but those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that one import statement in `module` loads."""
    if isinstance(node, ast.Import):
        targets = {alias.name for alias in node.names}
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        # `from pkg import name`: the submodule pkg.name if there is one, else a name defined in pkg
        targets = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    return {target for target in targets if target in known}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports at run time."""
    files = module_names(root, package)
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in runtime_imports(tree):
            edges |= imported_modules(node, module, is_package, known)
        graph[module] = edges - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_server_has_no_import_cycle():
    graph = import_graph(SERVER, PACKAGE)
    assert len(graph) > 50 and any(graph.values()), "the graph was not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    "files, cycle",
    [
        # absolute, relative and `from pkg import module` imports, a function-local one too
        (
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "from pkg.sub import b\n",
                "pkg/sub/__init__.py": "",
                "pkg/sub/b.py": "from . import c\n",
                "pkg/sub/c.py": "def f():\n    from ..a import x\n",
            },
            ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"],
        ),
        (
            {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "import pkg.a as a\n"},
            ["pkg.a", "pkg.b", "pkg.a"],
        ),
        # a name imported from a package is an edge to the package's __init__
        ({"pkg/__init__.py": "from .a import x\n", "pkg/a.py": "from pkg import y\n"}, ["pkg", "pkg.a", "pkg"]),
        # TYPE_CHECKING imports never run; its else branch does
        (
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "import pkg.b\n",
                "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
            },
            None,
        ),
        (
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "import pkg.b\n",
                "pkg/b.py": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    import pkg.a\n",
            },
            ["pkg.a", "pkg.b", "pkg.a"],
        ),
    ],
)
def test_find_cycle_reads_every_kind_of_import(tmp_path, files, cycle):
    write_package(tmp_path, files)
    assert find_cycle(import_graph(tmp_path, "pkg")) == cycle
