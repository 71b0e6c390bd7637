"""The rooms of the harness import one way: every import of one harness module by another (at module
top or inside a function) follows the table below, and no module imports itself back through a
chain (no import circles). docs/architecture.md shows the same table."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "harness"

#: room -> the rooms it may import (besides itself). A room is a subpackage of harness/ or one of
#: the top-level modules grouped below.
ALLOWED: dict[str, set[str]] = {
    "files": set(),  # shared-file primitives: atomic writes, unique temporary names, locks
    "contracts": {"files"},
    "random_source": {"files"},
    "record_schema": set(),
    "measure": {"files", "record_schema"},
    "tracking": {"files", "record_schema"},
    "topology": {"files", "contracts"},
    "verifiers": {"files", "contracts", "random_source", "topology"},
    "target": {"files", "contracts", "topology", "measure"},
    "workloads": {"files", "contracts", "target"},
    "heads": {"files", "contracts", "target", "workloads"},
    "proposers": {
        "files",
        "contracts",
        "random_source",
        "topology",
        "verifiers",
        "target",
        "workloads",
        "heads",
        "measure",
    },
    "engine": {"files", "contracts", "random_source", "measure", "topology", "verifiers", "target", "proposers"},
    "gates": {
        "files",
        "record_schema",
        "contracts",
        "random_source",
        "measure",
        "topology",
        "verifiers",
        "target",
        "workloads",
        "heads",
        "proposers",
        "engine",
    },
    "prepare": {
        "files",
        "contracts",
        "random_source",
        "measure",
        "topology",
        "verifiers",
        "target",
        "workloads",
        "heads",
        "proposers",
        "engine",
        "gates",
    },
    # the application layer: configuration, manifest, the runner and its entry points, benchmarks
    "app": {
        "files",
        "record_schema",
        "contracts",
        "random_source",
        "measure",
        "topology",
        "verifiers",
        "target",
        "workloads",
        "heads",
        "proposers",
        "engine",
        "gates",
        "prepare",
        "tracking",
    },
}
APP_MODULES = {"config", "manifest", "runner", "sweep", "app", "cli", "bench", "gpu_check"}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "harness"
    top = parts[1]
    return "app" if top in APP_MODULES else top


def harness_imports(path: Path) -> list[tuple[str, int]]:
    """(imported harness module, line) for every import in the file, wherever it stands."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("harness"):
            if node.module == "harness":  # from harness import x: x is a module of the package
                out += [(f"harness.{a.name}", node.lineno) for a in node.names]
            else:
                out.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("harness")]
    return out


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for target, _ in harness_imports(path):
            # `from harness.x import y` names a module or, when it is no module, an attribute of one
            edges[m].add(target if target in modules else target.rsplit(".", 1)[0])
    return edges


def test_every_room_is_in_the_table():
    rooms = {room_of(module_name(p)) for p in PACKAGE.rglob("*.py")} - {"harness"}
    assert rooms <= set(ALLOWED), f"rooms missing from the table: {sorted(rooms - set(ALLOWED))}"


def test_rooms_import_one_way():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = room_of(module_name(path))
        for target, line in harness_imports(path):
            dst = room_of(target)
            if dst in (src, "harness"):
                continue
            if dst not in ALLOWED.get(src, set()):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {src} -> {dst} ({target})")
    assert not bad, "imports against the room table:\n" + "\n".join(bad)


def test_no_import_circles():
    edges = graph()
    seen: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if n not in edges:
                continue
            if seen.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in seen:
                visit(n)
        stack.pop()
        seen[m] = 2

    for m in sorted(edges):
        if m not in seen:
            visit(m)
    # a package's __init__ importing its own submodules (registration) is not a circle
    cycles = [c for c in cycles if not all(x == c[0] or x.startswith(c[0] + ".") for x in c)]
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_the_table_has_no_circle_between_rooms(room):
    """The table itself is a one-way order: no room can reach itself through the rooms it may import."""
    todo, reach = list(ALLOWED[room]), set()
    while todo:
        r = todo.pop()
        if r not in reach:
            reach.add(r)
            todo += list(ALLOWED.get(r, ()))
    assert room not in reach
