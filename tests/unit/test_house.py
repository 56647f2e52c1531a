"""The house is checked, not remembered: the import-linter `layers` contract in pyproject.toml passes, it names
every module of src/threed, no import circle exists (not even through an import inside a function), nothing is
imported behind importlib, an import inside a function is only for a heavy or optional dependency, with a comment
saying which; the top level holds at most ten modules (the wings are folders), no class is built inside a function,
the pure modules import no heavy library at the top, a moved module path names its new home, and no function
runs over 60 lines.

    .venv/bin/python -m pytest -q tests/unit/test_house.py      (or: .venv/bin/lint-imports)
"""

from __future__ import annotations

import ast
import pkgutil
import tomllib
from pathlib import Path

import grimp
import pytest

from helpers import REPO

SRC = REPO / "src" / "threed"
# Third-party packages that may be imported inside a function: heavy to import (seconds) or optional extras.
HEAVY = {
    "deepspeed",
    "megatron",
    "torch",
    "transformers",
    "tensorboard",
    "wandb",
    "matplotlib",
    "pyarrow",
    "sentencepiece",
    "safetensors",
    "tqdm",
    "numpy",
    "pydoc_data",
    "lm_eval",  # the eval extra (threed.harness)
    "peft",  # the lora extra (threed.convert.lora: HF PEFT folders)
}


def contract(name: str = "threed layers") -> dict:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers" and c["name"].startswith(name)]
    return layers


def wing(module: str) -> str:
    """The folder a module lives in (`threed.model.spec` -> `model`); a top-level module is the floor."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (SRC / parts[-1]).is_dir() else "(floor)"


# The entry doors: `python -m threed.train` / `python -m threed.memory` forward to threed.cli (the wings contract
# ignores exactly these imports).
DOORS = {"threed.train.__main__": "threed.cli.main", "threed.memory.__main__": "threed.cli.memory"}


def all_modules() -> set[str]:
    out = {"threed"}
    for info in pkgutil.walk_packages([str(SRC)], prefix="threed."):
        out.add(info.name)
    return out


def layer_members(layers: list[str]) -> list[set[str]]:
    return [{m.strip() for part in layer.split("|") for m in part.split(":")} for layer in layers]


def test_import_linter_contract_passes():
    from importlinter.cli import lint_imports

    assert lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def test_every_module_is_in_a_layer():
    c = contract()
    placed = set().union(*layer_members(c["layers"]))
    covered = {m for m in all_modules() if any(m == p or m.startswith(p + ".") for p in placed)}
    # A package's __init__ (docstring only) is the container of its layer members, not a layer of its own.
    packages = {m for m in all_modules() if (SRC / Path(*m.split(".")[1:]) / "__init__.py").is_file()}
    missing = sorted(all_modules() - covered - packages)
    assert not missing, f"modules in no layer of pyproject.toml's import-linter contract: {missing}"


def test_package_inits_import_nothing_of_threed():
    for init in SRC.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("threed"):
                pytest.fail(
                    f"{init.relative_to(REPO)} imports {node.module}: a package's __init__ holds its "
                    f"docstring only, so importing one module does not drag in the others"
                )


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & modules) for m in modules}
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            recurse = False
            for j in range(i, len(edges[node])):
                nxt = edges[node][j]
                if nxt not in index:
                    work.append((node, j + 1))
                    work.append((nxt, 0))
                    recurse = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if recurse:
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return out


def test_no_import_circle_anywhere():
    # grimp reads every import statement, those inside functions and under `if TYPE_CHECKING` included.
    graph = grimp.build_graph("threed", cache_dir=None)
    cycles = _cycles(graph, set(graph.modules))
    assert not cycles, f"import circles: {cycles}"


def test_no_two_wings_import_each_other():
    # Every import between two folders, those inside functions included; a circle of any length is found.
    graph = grimp.build_graph("threed", cache_dir=None)
    wings = sorted({wing(m) for m in graph.modules if m != "threed"})
    edges: dict[str, set[str]] = {w: set() for w in wings}
    for m in graph.modules - {"threed"}:
        for t in graph.find_modules_directly_imported_by(m) - {"threed"}:
            if wing(m) != wing(t) and DOORS.get(m) != t:
                edges[wing(m)].add(wing(t))
    # The wing graph, as a module graph of one node per wing, through the same circle finder as the modules.
    wing_graph = grimp.ImportGraph()
    for w in wings:
        wing_graph.add_module(w)
    for w, targets in edges.items():
        for t in targets:
            wing_graph.add_import(importer=w, imported=t)
    assert not _cycles(wing_graph, set(wings)), f"wings in a circle: {_cycles(wing_graph, set(wings))}"


def test_wings_contract_names_every_wing_and_the_doors_stay_thin():
    placed = set().union(*layer_members(contract("threed wings")["layers"]))
    folders = {f"threed.{p.name}" for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert folders <= placed, f"folders in no layer of the wings contract: {sorted(folders - placed)}"
    for door, target in DOORS.items():
        tree = ast.parse((SRC / Path(*door.split(".")[1:])).with_suffix(".py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and "threed" in (n.module or "")}
        assert imported == {target}, f"{door} imports {sorted(imported)}: a door forwards to {target} alone"


def _function_imports(path: Path):
    text = path.read_text()
    lines = text.splitlines()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    module = sub.module if isinstance(sub, ast.ImportFrom) else sub.names[0].name
                    if isinstance(sub, ast.ImportFrom) and sub.level:
                        module = "threed." + (module or "")
                    # The comment stands on the import, or above it (a group of imports may share one comment).
                    commented = any("#" in line for line in lines[sub.lineno - 1 : sub.end_lineno])
                    j = sub.lineno - 2
                    while not commented and j >= 0:
                        above = lines[j].strip()
                        if above.startswith("#"):
                            commented = True
                        elif not (above.startswith(("import ", "from ")) or above == "" or above.endswith(")")):
                            break
                        j -= 1
                    yield sub.lineno, module or "", commented


def test_imports_inside_functions_are_for_heavy_dependencies_with_a_reason():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        for line, module, commented in _function_imports(path):
            top = module.split(".")[0]
            if top == "threed" or top in HEAVY:
                if not commented:
                    bad.append(
                        f"{path.relative_to(REPO)}:{line}: `{module}` imported in a function without a "
                        f"comment saying which heavy dependency it defers"
                    )
            else:
                bad.append(f"{path.relative_to(REPO)}:{line}: `{module}` is light: import it at the top")
    assert not bad, "\n".join(bad)


def test_nothing_is_imported_behind_importlib():
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        for needle in ("import_module(", "__import__("):
            assert needle not in text, f"{path.relative_to(REPO)} loads a module by name ({needle}): import it"


def test_the_top_level_holds_at_most_ten_modules():
    # The wings are folders (parallel/, plan/, cli/, train/, ...); the top level keeps the floor only.
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= 10, f"{len(top)} modules at the top of src/threed (at most 10): {top}"


def test_no_class_is_built_inside_a_function():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                bad += [f"{path.relative_to(REPO)}:{sub.lineno}: class {sub.name} inside {node.name}()"
                        for sub in ast.walk(node) if isinstance(sub, ast.ClassDef)]  # fmt: skip
    assert not bad, "\n".join(bad)


MAX_FUNCTION_LINES = 60  # from `def` to the function's last line, its docstring included


def function_lengths() -> list[tuple[str, int, int]]:
    """(path relative to src/threed, `def` line, length in lines) of every function and method of src/threed,
    nested ones included."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((f"{rel}:{node.name}", node.lineno, node.end_lineno - node.lineno + 1))
    return out


def test_no_function_is_over_sixty_lines():
    # A function that reads in one screen can be checked in one reading: a longer one is cut into named steps.
    lengths = function_lengths()
    long = [(where, line, n) for where, line, n in lengths if n > MAX_FUNCTION_LINES]
    bad = [
        f"src/threed/{where.split(':')[0]}:{line}: {where.split(':')[1]}() is {n} lines (at most {MAX_FUNCTION_LINES})"
        for where, line, n in long
    ]
    assert not bad, "functions over the limit: cut them into named steps\n" + "\n".join(bad)


# What says which layers go where and in what order: the planner, the memory model and check-config use these in a
# second, without torch, so their module level imports none of the heavy libraries.
PURE = ["parallel/partition.py", "parallel/schedule.py", "parallel/layer_costs.py", "model/spec.py", "config.py",
        "cli/recipe.py", "cli/flags.py", "convert/resolve.py", "parallel/dims.py", "engine/ds_config.py",
        "engine/resolved.py", "train/preflight.py", "parallel/device_policy.py", "memory/model.py"]  # fmt: skip


@pytest.mark.parametrize("path", PURE)
def test_pure_modules_import_no_heavy_library_at_the_top(path: str):
    for node in ast.parse((SRC / path).read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            heavy = [n for n in names if n.split(".")[0] in {"deepspeed", "megatron", "torch"}]
            assert not heavy, f"src/threed/{path}:{node.lineno} imports {heavy[0]} at the top: it is a pure module"


def test_a_moved_module_path_names_its_new_home():
    import threed

    for old, new in threed.MOVED.items():
        assert module_exists(new), f"threed.MOVED sends {old} to {new}, which does not exist"
        assert not module_exists(old), f"{old} exists again: drop it from threed.MOVED"
    with pytest.raises(ModuleNotFoundError, match=r"threed\.planner moved to threed\.plan\.planner"):
        import threed.planner  # noqa: F401


def module_exists(name: str) -> bool:
    return name in all_modules()
