"""The memory model: what each rank of a layout allocates, term by term, before anything is built.

    model.py      the static estimate (weights, fp32 grads and master weights, ZeRO-1 shards, buffers, the
                  schedule's activations, temporaries) as DeepSpeed + megatron-core + torch allocate them;
                  checked against real engines by tests/ranks/test_memory.py
    __main__.py   `python -m threed.memory ...`: `threed memory` (threed.cli.memory); `threed check-config` and
                  recipes/launch.sh's dry run print the same line
    recompute.py  which blocks of a stage Megatron's recompute flags recompute (shared with threed.plan.steptime)
    deferred.py   what a micro-batch holds between its B and its W under --pipeline-schedule zb-h1 (from the
                  spec's linear shapes; checked against the engine's queue by tests/ranks/test_memory_zb.py)

`threed plan` (`threed.plan.planner`) ranks layouts with it.
"""
