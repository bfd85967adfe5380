"""The package's shape: no import cycles, and the core never reaches up into its front ends."""

import ast
from pathlib import Path

import mlx_dflash

ROOT = Path(mlx_dflash.__file__).parent
FRONT_ENDS = ("cli", "server", "train")  # may import the core, never the other way round


def module_imports() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports (in functions too)."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + [node.module] if node.module else base) \
                    if node.level else node.module
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    found.add(sub if sub in names else module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def test_no_import_cycles():
    graph = module_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_core_does_not_import_front_ends():
    def front_end(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in FRONT_ENDS else None

    wrong = [(m, i) for m, imports in module_imports().items() for i in imports
             if front_end(i) and front_end(m) is None]
    assert not wrong, f"core modules importing cli/server/train: {wrong}"
