"""The package's layers as a checked contract, read from the source (every ``import``, at module level
or inside a function, but for those under ``if TYPE_CHECKING:``):

- the engine never imports Airflow, Spark, or the package's Airflow and Spark faces;
- only ``engine/dialects/factory.py`` (and the dialects themselves) import a dialect's modules: the
  designs, maintenance, the hooks, operators, triggers and pages reach a database through the
  ``Database`` protocol and the factory (``engine/embedded.py``, the PostgreSQL server the engine starts
  on demand, is PostgreSQL's by nature and may use its connection strings);
- the seam (``dialects/base.py``, ``ownership.py``, ``indexes.py``) imports neither a dialect nor the
  factory;
- no two modules import each other, directly or around a circle, at module level.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "airflow_dbqueue"
DIALECT_PACKAGES = ("airflow_dbqueue.engine.dialects.postgres", "airflow_dbqueue.engine.dialects.mssql")
FACES = ("hooks", "operators", "sensors", "triggers", "plugins", "queues", "spark", "cli", "cli_demo")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """``(every module imported, those imported at module level)``, type-checking imports aside."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    everywhere: set[str] = set()
    top: set[str] = set()

    def visit(node: ast.AST, at_top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other, at_top)
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - child.level + 1], base]).strip(".")
                names = [base, *(f"{base}.{a.name}" for a in child.names)]
            for n in names:
                everywhere.add(n)
                if at_top:
                    top.add(n)
            inner = at_top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(tree, True)
    return everywhere, top


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
IMPORTS = {name: _imports(path) for name, path in MODULES.items()}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_engine_imports_neither_airflow_nor_spark_nor_the_faces() -> None:
    bad = {
        mod: sorted(
            n
            for n in everywhere
            if _under(n, "airflow")
            or _under(n, "pyspark")
            or any(_under(n, f"airflow_dbqueue.{face}") for face in FACES)
        )
        for mod, (everywhere, _) in IMPORTS.items()
        if _under(mod, "airflow_dbqueue.engine")
    }
    assert {m: b for m, b in bad.items() if b} == {}


def test_only_the_factory_and_the_dialects_import_a_dialect() -> None:
    allowed = {"airflow_dbqueue.engine.dialects.factory", "airflow_dbqueue.engine.embedded"}
    bad = {
        mod: sorted(n for n in everywhere if any(_under(n, d) for d in DIALECT_PACKAGES))
        for mod, (everywhere, _) in IMPORTS.items()
        if mod not in allowed and not any(_under(mod, d) for d in DIALECT_PACKAGES)
    }
    assert {m: b for m, b in bad.items() if b} == {}
    # the embedded server uses PostgreSQL's connection strings, nothing else of a dialect
    embedded = IMPORTS["airflow_dbqueue.engine.embedded"][0]
    assert {n for n in embedded if any(_under(n, d) for d in DIALECT_PACKAGES)} <= {
        "airflow_dbqueue.engine.dialects.postgres.conninfo",
        "airflow_dbqueue.engine.dialects.postgres.conninfo.connect_error",
    }


def test_the_seam_imports_no_dialect_and_not_the_factory() -> None:
    seam = [f"airflow_dbqueue.engine.dialects.{m}" for m in ("base", "ownership", "indexes")]
    for mod in seam:
        everywhere = IMPORTS[mod][0]
        assert not [
            n
            for n in everywhere
            if any(_under(n, d) for d in DIALECT_PACKAGES)
            or _under(n, "airflow_dbqueue.engine.dialects.factory")
        ], mod


def test_no_import_circles() -> None:
    """Imports inside functions count too: a lazy import that closes a circle is still one."""
    graph: dict[str, set[str]] = {}
    for mod, (everywhere, _) in IMPORTS.items():
        targets = set()
        for name in everywhere:
            # "from a.b import c" names a.b and a.b.c: keep the modules that exist
            n = name
            while n and n not in MODULES:
                n = n.rsplit(".", 1)[0] if "." in n else ""
            if n and n != mod and not _under(mod, n):  # a package's own __init__ is no circle
                targets.add(n)
        graph[mod] = targets
    circles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for mod in sorted(graph):
        if mod not in state:
            walk(mod)
    assert circles == []


def test_the_contract_sees_imports() -> None:
    """The reader finds what a module imports (a test of the contract's own reading)."""
    everywhere, top = IMPORTS["airflow_dbqueue.engine.dialects.factory"]
    assert "airflow_dbqueue.engine.dialects.base" in top
    assert "airflow_dbqueue.engine.dialects.postgres" in everywhere  # lazily, inside a function
    assert "airflow_dbqueue.engine.dialects.postgres" not in top
