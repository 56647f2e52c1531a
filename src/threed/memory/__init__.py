"""The memory model: what each rank of a layout allocates, term by term, before anything is built.

    model.py      the static estimate (weights, fp32 grads and master weights, ZeRO-1 shards, buffers, 1F1B
                  activations, temporaries) as DeepSpeed + megatron-core + torch allocate them; checked against
                  real engines by tests/test_memory.py
    __main__.py   `python -m threed.memory ...` (recipes/launch.sh prints its line)
    recompute.py  which blocks of a stage Megatron's recompute flags recompute (shared with threed.steptime)

`threed plan` (`threed.planner`) ranks layouts with it.
"""
