"""The package's structure, read off its files. Its layers, from its imports (module-level and inside functions
alike): nothing reaches back up. The training side (what the loop runs) never imports the launching side (what
`memrecipe run` runs); both read the run folder's layout below them (memrecipe/layout.py). No two modules import each
other, directly or round a circle, but for the one that is documented: planning/architecture.py reads a model type it
has no reader for on the meta device (training/meta.py), which reads the architecture's records back
(docs/architecture.md). Functions a reader can hold; a unit test file for every module."""

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "cli" / "memrecipe"  # the import package memrecipe
ALLOWED_CIRCLES = [{"planning.architecture", "training.meta"}]


def module_name(path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """memrecipe's modules (dotted, without the package's name) -> the memrecipe modules each imports."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("memrecipe"):
                target = node.module.removeprefix("memrecipe").lstrip(".")
            else:
                continue
            for candidate in [target, *(f"{target}.{a.name}".lstrip(".") for a in node.names)]:
                if candidate in paths and candidate != name:
                    graph[name].add(candidate)
    return graph


def circles(graph) -> list[set[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, found, counter = {}, {}, [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(group)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_reaches_back_round_a_circle_but_the_documented_one():
    assert circles(import_graph()) == ALLOWED_CIRCLES


def test_the_training_side_never_imports_the_launching_side():
    graph = import_graph()
    assert [(m, t) for m, targets in graph.items() if m.startswith("training") for t in targets
            if t.startswith("launching")] == []
    assert "layout" in graph["training.checkpoint"] and "layout" in graph["launching.run_folder"]


def test_the_graph_sees_imports_inside_functions_and_relative_ones():
    """The reader itself: a lazy import (report.py's run of its own, architecture's meta read) is an edge."""
    graph = import_graph()
    assert "training.meta" in graph["planning.architecture"]  # imported inside a function
    assert "errors" in graph["planning.rules"] and "planning.schema" in graph["planning.rules"]
    looped = {**graph, "errors": {"planning.rules"}}  # a planted circle is found
    assert any({"errors", "planning.rules"} <= circle for circle in circles(looped))


# Functions over 60 lines, each a table or a card printed line by line, read top to bottom: the justified exceptions
LONG = {("commands/plan.py", "command"), ("report.py", "card"), ("report.py", "build")}


def test_functions_a_reader_can_hold():
    """No function in cli/memrecipe/ or recipes/*.py over 80 lines, counted from `def` to its last line (docstring and nested
    functions included), and none over 60 but the named exceptions."""
    lengths = {}
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "recipes").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = str(path.relative_to(PACKAGE if path.is_relative_to(PACKAGE) else REPO))
                lengths[(where, node.name)] = node.end_lineno - node.lineno + 1
    assert {f: n for f, n in lengths.items() if n > 80} == {}
    long = {f for f, n in lengths.items() if n > 60}
    assert long <= LONG and len(LONG) <= 3, (f"functions over 60 lines: {sorted(long - LONG)}: split each into named "
                                             "steps (or a table its body reads), do not add it to LONG")


def test_every_module_has_a_unit_test_file_of_its_name():
    """tests/unit/ mirrors the package: memrecipe/<package>/<module>.py is tested in tests/unit/<package>/
    test_<module>.py (in process, or with small worker processes); whole runs of the loop are tests/runs/."""
    untested = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):  # `python -m memrecipe`: how every CLI test runs it
            continue
        relative = path.relative_to(PACKAGE)
        if not (REPO / "tests" / "unit" / relative.parent / f"test_{relative.name}").is_file():
            untested.append(str(relative))
    assert not untested, f"modules without a unit test file of their name: {untested}"


def test_the_package_is_found_on_a_path_entry_editors_follow():
    """One source folder named as the package (cli/memrecipe/, pyproject's package-dir): an editable install adds
    cli/ to sys.path, which pyright and editors read, so `from memrecipe.loop import ...` in recipes/sft.py resolves
    for them. (A package mapped from a folder of another name, cli/ as `memrecipe`, was installed as an import hook
    that no static tool follows: this finder then found nothing.)"""
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("memrecipe")
    assert spec is not None and Path(spec.origin).parent.resolve() == PACKAGE.resolve()
    assert (PACKAGE / "recipes").resolve() == REPO / "recipes" and (PACKAGE / "recipes" / "sft.py").is_file()
