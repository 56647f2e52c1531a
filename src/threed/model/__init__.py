"""The Llama model: what it is (the spec) and the kernels that run it. The wing sits above the floor and below every
other wing (pyproject.toml's wings contract); inside it, the module layers of the modules contract:

    spec.py        (layer 2) what the model IS: the pipeline layer list and the one parameter table (shape, TP split,
                   init, ties); counts, FLOPs, TP slices and DeepSpeed's universal-checkpoint patterns derive
                   from it. A new parameter kind is a row there (and its HF names in `threed.hf.names`).
    presets.py     (layer 2) the named shapes (Llama 2 / 3 / 3.1 / 3.2 and the tiny test models)
    rope.py        (layer 2) RoPE's frequencies, Llama 3.1 scaling, positions that restart per document
    context.py     (layer 2b) context parallelism's kernels: the zigzag split of each row over a CP group, the
                   all-gather-K/V attention (exact, with packed documents), each CP rank's share of a micro-batch
    layers.py      (layer 3) the modules that run it: megatron-core's TransformerLayer (Column/RowParallelLinear,
                   RMSNorm, SwiGLU) with attention.py (SDPA core attention, packed documents, CP) and RoPE;
                   `megatron_config` holds the block's TP switches
    wgrad.py       (layer 3) weight gradients deferred to ZB-H1's W passes
    init.py        (layer 3) random init keyed by (seed, layer, tensor, row): the same weights at every layout

Where new things go: a tie between parameters is the table's `tie` column (plus `threed.parallel.pipeline`'s
`TiedLayerSpec` and the HF names); sequence parallelism is a switch of `megatron_config` (the block's TP plan)
plus what crosses a stage boundary (`threed.parallel.pipeline`). How the layers are cut into stages is
`threed.parallel.partition` / `threed.parallel.pipeline`, never here.
"""
