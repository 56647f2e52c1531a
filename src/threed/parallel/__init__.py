"""How a run is parallelised: everything that knows about ranks, groups, stages and schedules.

    dims.py             a run's dimensions, resolved once: dp, micro x gas x dp, stage bounds, recompute, schedule
                        (pure; threed.engine.resolved hands them down)
    distributed.py      the device policy (cuda+nccl or cpu+gloo, chosen in one place), megatron-core's parallel
                        state (tp-cp-dp-pp), and the check that megatron's groups are DeepSpeed's
    megatron_device.py  megatron-core's CUDA-only buffers, put on the device policy's device (the one adaptation)
                        and its fusers left uncompiled off CUDA (no torch.compile import on a CPU rank)
    launch.py           N ranks under torchrun, ending as the ranks do (one line, their exit status)
    build_lock.py       a JIT build lock a killed build left (DeepSpeed's CPU comm op), named in one line (pure)
    partition.py        which stage holds which layers (--partition-method), full recompute's chunks (pure)
    layer_costs.py      the values of --partition-method costs:... (pure)
    pipeline.py         the model's LayerSpecs -> DeepSpeed's PipelineModule over (pipe, data = dp x cp, model)
    staged.py           StagedPipelineModule: DeepSpeed's PipelineModule with explicit stage boundaries, Megatron's
                        recompute chunks, and sequence parallelism's norm-gradient sum
    schedule.py         --pipeline-schedule: each stage's F/B/W order, what it holds, its idle time (pure)
    zero_bubble.py      ZB-H1 on DeepSpeed's PipelineEngine (the W passes, sends that do not wait)

Context parallelism's split and attention are model kernels: threed.model.context. The pure modules (dims,
partition, layer_costs, schedule) import no DeepSpeed at the top: the planner, the memory model and
check-config use them in a second, without torch.
"""
