"""The house's import rules, read from the source (no import is executed): layers import
downward only (docs/concepts/architecture.md), the driver's and the models' modules form no import
circle (the models' deferred imports included), and the driver defers no import it could
make at the top of its module."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "grpojax"

# What each layer may import from grpojax (docs/concepts/architecture.md). `data/` imports only
# `ops`, so `rewards/` may use its tokenizer helpers and `train/` its padding of token ids.
# `errors.py`, `user_code.py` (importing a config's "package.module:attr"), `rng.py` (the run's
# named random streams) and `distributed.py` (processes: start-up, rows between hosts, the
# test kill points) sit at the root, below every layer that uses them.
ALLOWED = {
    "errors": set(),
    "user_code": {"errors"},
    "rng": set(),
    "distributed": {"errors"},
    "ops": {"errors"},
    "models": {"ops", "errors"},
    "sampling": {"models", "ops", "errors"},
    "data": {"ops", "errors"},
    "rewards": {"data", "models", "ops", "errors", "user_code"},
    "envs": {"sampling", "rewards", "data", "models", "ops", "errors", "user_code"},
    "train": {"data", "models", "ops", "errors", "user_code"},
    "config": {"train", "envs", "rewards", "data", "sampling", "models", "ops", "errors"},
    "rollouts": {
        *("config", "train", "envs", "rewards", "data", "sampling", "models", "ops", "errors"),
        *("distributed", "rng"),
    },
    "driver": {
        *("rollouts", "config", "train", "envs", "rewards", "data", "sampling", "models", "ops"),
        *("distributed", "rng", "errors", "user_code", "grpojax"),
    },
    "jobs": {
        *("config", "driver", "train", "envs", "rewards", "data", "sampling", "models", "ops"),
        *("distributed", "rng", "errors"),
    },
    "cli": {"config", "driver", "jobs", "distributed", "errors", "grpojax"},
    "__init__": {"ops", "models", "sampling", "data", "rewards", "train", "errors"},
}
# Function-local imports the driver may make: optional or heavy packages a run may not use.
DEFERRED_OK = {"wandb", "tensorboardX", "tqdm.auto", "matplotlib.figure"}


def _imports(tree: ast.AST):
    """(module name, line, at module level) of every import statement in `tree`."""
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, node.lineno, id(node) in top
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top


def _layer(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_layers_import_downward_only():
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        layer = _layer(path)
        for name, line, _ in _imports(ast.parse(path.read_text())):
            parts = name.split(".")
            if parts[0] != "grpojax":
                continue
            target = parts[1] if len(parts) > 1 else "grpojax"
            if target != layer and target not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(PKG.parent)}:{line} ({layer}) imports {name}")
    assert not wrong, "\n".join(wrong)


def _assert_no_circle(graph: dict[str, set[str]]) -> None:
    """Depth-first search for a back edge: a circle, named module by module."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def _package_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of `grpojax.<package>` it imports, at any depth of its code
    (`from grpojax.<package> import x` counts as importing `grpojax.<package>.x` when x is
    a module of the package)."""
    prefix = f"grpojax.{package}"
    modules = {p.stem for p in (PKG / package).glob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {}
    for path in sorted((PKG / package).glob("*.py")):
        name = prefix if path.stem == "__init__" else f"{prefix}.{path.stem}"
        graph[name] = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if node.module == prefix:
                    graph[name] |= {f"{prefix}.{a.name}" for a in node.names if a.name in modules}
                elif node.module.startswith(prefix + "."):
                    graph[name].add(node.module)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name.startswith(prefix + ".")}
    return graph


def test_models_modules_form_no_import_circle():
    """Deferred (function-local) imports count: a circle hidden inside a function still
    ties the two modules together (lora <-> sharding was one)."""
    graph = _package_graph("models")
    assert len(graph) > 5, sorted(graph)
    _assert_no_circle(graph)


@pytest.mark.parametrize("package, modules", [("driver", 10), ("jobs", 5), ("rollouts", 4)])
def test_driver_and_jobs_modules_form_no_import_circle_and_defer_nothing(package, modules):
    graph: dict[str, set[str]] = {}
    deferred = []
    for path in sorted((PKG / package).glob("*.py")):
        stem = "" if path.stem == "__init__" else f".{path.stem}"
        graph[f"grpojax.{package}{stem}"] = set()
        for target, line, top in _imports(ast.parse(path.read_text())):
            if target.startswith(f"grpojax.{package}"):
                graph[f"grpojax.{package}{stem}"].add(target)
            if not top and target not in DEFERRED_OK:
                deferred.append(f"{path.relative_to(PKG.parent)}:{line} imports {target}")
    assert not deferred, "function-local imports that defer nothing:\n" + "\n".join(deferred)
    assert len(graph) > modules, sorted(graph)

    _assert_no_circle(graph)
