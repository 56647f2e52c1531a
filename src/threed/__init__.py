"""threed: 3D-parallel (megatron-core TP x DeepSpeed PP x ZeRO-1 DP) Llama training. The wings of the package and
their layers are in docs/architecture.md, checked by the import-linter contract in pyproject.toml.

The one piece of code here: an import of a module path that moved when the top level was split into wings
(`threed.planner`, `threed.flags`, ...) fails with a line naming the new path, instead of a bare "No module named".
The finder sits last on sys.meta_path, so it is asked only about names no other finder found.
"""

import importlib.abc
import sys

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


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            raise ModuleNotFoundError(f"{name} moved to {MOVED[name]}: import that instead", name=name)
        return None


if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(MovedModuleFinder())
