"""The code's layout (docs/architecture.md, "The core's rooms"): no import circles among the product modules, the
rooms of specdec/ import one another in one direction only, each room says what it holds, and specdec/ keeps
at its top only what a user imports or runs. Imports are read from the code with ast, TYPE_CHECKING ones too."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRODUCT = ("specdec", "coordinator", "draft_service", "verify_service")
SERVICES = ("coordinator", "draft_service", "verify_service")
# The rooms of specdec/ and the rooms each one may import (v1, the generated stubs, may be imported by any).
ROOMS = {
    "common": set(),
    "engine": {"common"},
    "sampling": {"common"},
    "decoding": {"common", "engine", "sampling"},
    "telemetry": {"common", "engine"},
    "serving": {"common", "engine", "sampling", "decoding", "telemetry"},
    "v1": set(),
}
# Modules at the top of specdec/: what a user imports or runs (the client, the CLI, a stack on loopback with its
# throwaway Redis) and the stub generator.
TOP_LEVEL = {"__init__", "__main__", "client", "cli", "local_stack", "redis_server", "protogen"}


def module_name(path: pathlib.Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def product_modules() -> dict[str, pathlib.Path]:
    return {
        module_name(path): path
        for package in PRODUCT
        for path in (ROOT / package).rglob("*.py")
        if "v1" not in path.relative_to(ROOT).parts
    }


def imported_names(name: str, path: pathlib.Path) -> set[str]:
    """Every module name an import statement of the file names (a `from x import y` names x and x.y)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Product module -> the product modules it imports."""
    modules = product_modules()
    return {name: imported_names(name, path) & modules.keys() - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def room_of(name: str) -> str | None:
    """The room of a specdec module (None for one at the top of specdec/, or outside it)."""
    parts = name.split(".")
    return parts[1] if parts[0] == "specdec" and len(parts) > 2 or name in ROOM_PACKAGES else None


ROOM_PACKAGES = {f"specdec.{room}" for room in ROOMS}


def test_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_among_product_modules():
    assert cycles(import_graph()) == []


def test_rooms_import_only_the_rooms_below_them():
    wrong = []
    for name, imported in import_graph().items():
        room = room_of(name)
        if room is None:
            continue
        for other in imported:
            other_room = room_of(other)
            if other_room is None and other.startswith("specdec."):
                wrong.append(f"{name} ({room}) -> {other}, a module on top of the rooms")
            elif other_room not in (room, None) and other_room not in ROOMS[room]:
                wrong.append(f"{name} ({room}) -> {other} ({other_room})")
    assert wrong == []


def test_the_core_never_imports_a_service_and_services_never_import_one_another():
    wrong = []
    for name, imported in import_graph().items():
        top = name.split(".")[0]
        wrong += [
            f"{name} -> {other}" for other in imported if other.split(".")[0] in SERVICES and other.split(".")[0] != top
        ]
    assert wrong == []


def test_specdec_holds_only_rooms_and_the_modules_a_user_imports():
    top = {path.stem for path in (ROOT / "specdec").glob("*.py")}
    rooms = {path.name for path in (ROOT / "specdec").iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert top == TOP_LEVEL
    assert rooms == set(ROOMS)


@pytest.mark.parametrize("room", sorted(set(ROOMS) - {"v1"}))
def test_each_room_opens_with_a_docstring_saying_what_it_holds(room):
    packages = [
        ROOT / "specdec" / room,
        *(p for p in (ROOT / "specdec" / room).iterdir() if (p / "__init__.py").exists()),
    ]
    for package in packages:
        docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert docstring and len(docstring.split()) >= 12, f"{package} has no docstring saying what it holds"
