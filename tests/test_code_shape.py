"""The package's shape, read from its source (no import). Device: none (pure Python, AST)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "cloudseg"
MOST_POSITIONAL = 6  # issue #31: options travel as keywords or the dataclasses that already exist


def modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.glob("*.py"))}


def positional_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    names = [arg.arg for arg in function.args.posonlyargs + function.args.args]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def too_many_positional(tree: ast.Module) -> list[str]:
    return [f"{node.name} ({len(positional_parameters(node))})" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and len(positional_parameters(node)) > MOST_POSITIONAL]


def imported_modules(tree: ast.Module, names: set[str]) -> set[str]:
    """The package's modules that `tree` imports, at any depth (functions' lazy imports included)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cloudseg":
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names} & names
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("cloudseg.")}
    return found & names


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path that returns to its start, or None."""
    state = {}

    def visit(name, path):
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state and (found := visit(other, path + [other])):
                return found
        state[name] = "done"
        return None

    return next((found for name in sorted(graph) if name not in state and (found := visit(name, [name]))), None)


def test_no_function_takes_more_than_six_positional_parameters():
    """Would catch: segment(sources, checkpoints, out_dir, tile, overlap, grid, ...) coming back
    (10 positional before issue #31), or any new function whose options are not keywords."""
    offenders = {name: found for name, tree in modules().items() if (found := too_many_positional(tree))}
    assert not offenders, offenders


def test_the_checker_counts_positional_parameters_as_python_does():
    """The rule's own control: six positional pass, seven (or six after `self`... plus one) fail,
    keyword-only ones never count."""
    source = ("def six(a, b, c, d, e, f, *, g, h): pass\n"
              "def seven(a, b, c, d, e, f, g): pass\n"
              "class K:\n    def method(self, a, b, c, d, e, f): pass\n    def wide(self, a, b, c, d, e, f, g, /): pass\n")
    assert too_many_positional(ast.parse(source)) == ["seven (7)", "wide (7)"]


def test_the_package_s_modules_import_each_other_in_no_cycle():
    """Would catch: a module importing one that (directly or through others) imports it back,
    lazy imports inside functions included."""
    trees = modules()
    graph = {name: imported_modules(tree, set(trees)) - {name} for name, tree in trees.items()}
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_finder_finds_a_cycle_two_modules_deep():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
