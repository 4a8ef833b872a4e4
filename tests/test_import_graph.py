"""No import cycle in server/loraplane_server, and every package within the imports its `__init__` allows,
read from the source.

Every `import x` and `from x import y` counts: at module level, inside a function (a function-local import
hides a cycle, it does not break it) and under `if TYPE_CHECKING:` (a type hint's import never runs, but the
two modules still know each other: a knot for the reader, and one step from a cycle at run time).
"""

from __future__ import annotations

import ast
import re
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


def all_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, wherever it sits."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


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
    """Module -> the modules of the same package it imports."""
    files = module_names(root, package)
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in all_imports(tree):
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
        # a type hint's import counts too
        (
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "import pkg.b\n",
                "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
            },
            ["pkg.a", "pkg.b", "pkg.a"],
        ),
        (
            {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "import pkg.c\n", "pkg/c.py": ""},
            None,
        ),
    ],
)
def test_find_cycle_reads_every_kind_of_import(tmp_path, files, cycle):
    write_package(tmp_path, files)
    assert find_cycle(import_graph(tmp_path, "pkg")) == cycle


# Packages: what each may import, as its __init__ says


def allowed_imports(doc: str | None) -> list[str] | None:
    """The `May import: a, b.c, d.` line of a package docstring as dotted prefixes ([] for "nothing"); None
    when the docstring has no such line."""
    match = re.search(r"^May import: (.*)$", doc or "", re.M)
    if match is None:
        return None
    if match.group(1).startswith("nothing"):
        return []
    return [name.strip() for name in match.group(1).rstrip(".").split(",")]


def package_violations(root: Path, package: str) -> list[str]:
    """Every import from inside a package to outside it that its `May import` line does not allow. The
    vocabulary (the top-level modules) may be imported from any package; the top-level package's own line
    applies to those modules."""
    files = module_names(root, package)
    graph = import_graph(root, package)
    packages = [m for m, path in files.items() if path.name == "__init__.py"]
    vocabulary = {m for m, path in files.items() if m.count(".") == 1 and path.name != "__init__.py"}
    found = []
    for pkg in packages:
        doc = ast.get_docstring(ast.parse(files[pkg].read_text()))
        allowed = allowed_imports(doc)
        if allowed is None:
            found.append(f"{pkg}: no `May import:` line in its __init__ docstring")
            continue
        if pkg == package:  # the top level: its vocabulary modules
            members = vocabulary
            inside = vocabulary.__contains__
        else:
            members = {m for m in files if m == pkg or m.startswith(pkg + ".")}
            inside = members.__contains__
        prefixes = [f"{package}.{name}" for name in allowed]
        for module in sorted(members):
            for target in sorted(graph[module]):
                ok = inside(target) or target in vocabulary or target == package
                ok = ok or any(target == p or target.startswith(p + ".") for p in prefixes)
                if not ok:
                    found.append(f"{module} imports {target}, which {pkg}'s __init__ does not allow")
    return found


def test_every_package_imports_only_what_its_init_allows():
    found = package_violations(SERVER, PACKAGE)
    assert not found, "\n".join(found)


def test_package_rules_are_read_and_enforced(tmp_path):
    files = {
        "pkg/__init__.py": '"""Top.\n\nMay import: nothing.\n"""\n',
        "pkg/vocab.py": "",
        "pkg/low/__init__.py": '"""Low.\n\nMay import: nothing.\n"""\n',
        "pkg/low/a.py": "import pkg.vocab\nimport pkg.high.b\n",  # upwards: refused
        "pkg/high/__init__.py": '"""High.\n\nMay import: low.\n"""\n',
        "pkg/high/b.py": "from pkg.low import a\n",
        "pkg/other/__init__.py": "",  # no rule: refused
    }
    write_package(tmp_path, files)
    assert package_violations(tmp_path, "pkg") == [
        "pkg.low.a imports pkg.high.b, which pkg.low's __init__ does not allow",
        "pkg.other: no `May import:` line in its __init__ docstring",
    ]
