"""threed: 3D-parallel (megatron-core TP x DeepSpeed PP x ZeRO-1 DP) Llama training. The wings of the package and
their layers are in docs/architecture.md, checked by the import-linter contract in pyproject.toml.

The one piece of code here, about module paths:
- an import of a module path that moved when the top level was split into wings (`threed.planner`, `threed.flags`,
  ...) fails with a line naming the new path, instead of a bare "No module named". The finder sits last on
  sys.meta_path, so it is asked only about names no other finder found;
- `python -m` of a moved path, or of a library module that runs nothing (`threed.plan.planner`), is one line
  naming what to run instead (the `threed` sub-command: `threed plan`, `threed check-config`) and exit 2. Before,
  the moved path's hint led to a module that printed nothing and exited 0: a CI gate written from it passed every
  config. It runs while Python locates the `-m` module (this package is imported first, and sys.argv[0] is "-m"
  until the module is found), so a command module (one with a `__main__` block, or a package's __main__.py) runs
  as before and nothing is imported for the check.
"""

import importlib.abc
import sys
from pathlib import Path

__version__ = "0.1.0"

MOVED = {
    "threed.check_config": "threed.cli.check_config",
    "threed.commands": "threed.cli",
    "threed.commands.convert": "threed.cli.convert",
    "threed.data.cli": "threed.cli.preprocess",
    "threed.demo_text": "threed.data.demo_text",
    "threed.distributed": "threed.parallel.distributed",
    "threed.evaluate": "threed.train.evaluate",
    "threed.flags": "threed.cli.flags",
    "threed.guard": "threed.train.guard",
    "threed.launch": "threed.parallel.launch",
    "threed.model.resolve": "threed.convert.resolve",
    "threed.parallel.context": "threed.model.context",
    "threed.layer_costs": "threed.parallel.layer_costs",
    "threed.layer_profile": "threed.plan.profile",
    "threed.megatron_device": "threed.parallel.megatron_device",
    "threed.partition": "threed.parallel.partition",
    "threed.pipeline": "threed.parallel.pipeline",
    "threed.plan_layout": "threed.plan.layout",
    "threed.planner": "threed.plan.planner",
    "threed.presets": "threed.model.presets",
    "threed.report": "threed.metrics.report",
    "threed.schedule": "threed.parallel.schedule",
    "threed.steptime": "threed.plan.steptime",
    "threed.train.engine": "threed.engine.build",
}

# The `threed` sub-command that does what a library module is about, for `python -m` of it (or of its old path).
# A module not listed is named a library module, and `threed --help` is the hint.
COMMANDS = {
    "threed.cli.check_config": "check-config",
    "threed.cli.convert": "convert",
    "threed.cli.eval_harness": "eval-harness",
    "threed.cli.generate": "generate",
    "threed.cli.preprocess": "preprocess",
    "threed.cli.profile_layers": "profile-layers",
    "threed.cli.report": "report",
    "threed.data.demo_text": "demo-text",
    "threed.memory.model": "memory",
    "threed.metrics.report": "report",
    "threed.plan.layout": "plan",
    "threed.plan.planner": "plan",
    "threed.plan.profile": "profile-layers",
    "threed.plan.steptime": "plan",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            raise ModuleNotFoundError(f"{name} moved to {MOVED[name]}: import that instead", name=name)
        return None


def _run_target():
    """The module `python -m NAME` is locating now, or None (not a `-m` run, or it was found already)."""
    if sys.argv[:1] != ["-m"]:
        return None
    argv = list(getattr(sys, "orig_argv", ()))
    for i, word in enumerate(argv[1:], 1):
        if word == "-m":
            return argv[i + 1] if i + 1 < len(argv) else None
        if word.startswith("-m") and not word.startswith("--"):
            return word[2:]
    return None


def _new_path(name: str):
    """Where a moved module (or one under a moved package) lives now; None when it did not move."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


def _runs(module: str):
    """True when `python -m module` runs a command, False for a library module (no `__main__` block), None when
    Python decides (a package: its __main__.py or Python's own "cannot be directly executed"; no such module)."""
    path = Path(__file__).parent.joinpath(*module.split(".")[1:])
    if (path / "__init__.py").is_file() or not path.with_suffix(".py").is_file():
        return None
    return '__name__ == "__main__"' in path.with_suffix(".py").read_text(encoding="utf-8")


def refuse_dead_run() -> None:
    """`python -m` of a moved path or of a library module: one line naming what to run instead, exit 2."""
    target = _run_target()
    if not target or not target.startswith("threed."):
        return
    new = _new_path(target)
    module = new or target
    runs = _runs(module)
    if new is None and runs is not False:
        return
    moved = f"{target} moved to {module}" if new else f"{target} is"
    command = COMMANDS.get(module)
    if runs is not False:  # moved to a command module (or package): it runs under its new path
        hint = f"run `python -m {module} ...` instead"
    elif command:
        hint = f"run `threed {command} ...` instead (`threed {command} --help` lists its flags)"
    else:
        hint = "run `threed --help` for the commands, or import it from Python"
    what = "" if runs is not False else (", " if new else " ") + "a library module, not a command"
    print(f"threed: error: `python -m {target}` runs nothing: {moved}{what}; {hint}", file=sys.stderr)
    raise SystemExit(2)


if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(MovedModuleFinder())
refuse_dead_run()
