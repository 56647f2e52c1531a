"""The Llama model, in two layers of the house.

    spec.py        (layer 2) what the model IS: the pipeline layer list and the one parameter table (shape, TP split,
                   init, ties); counts, FLOPs, TP slices and DeepSpeed's universal-checkpoint patterns derive
                   from it. A new parameter kind is a row there (and its HF names in `threed.hf.names`).
    layers.py      (layer 3) the modules that run it: megatron-core's TransformerLayer (Column/RowParallelLinear,
                   RMSNorm, SwiGLU) with our attention.py (SDPA core attention, packed documents) and rope.py
                   (RoPE incl. Llama 3.1 scaling); `megatron_config` holds the block's TP switches
    init.py        (layer 3) random init keyed by (seed, layer, tensor, row): the same weights at every layout

Where new things go: a tie between parameters is the table's `tie` column (plus `threed.parallel.pipeline`'s
`TiedLayerSpec` and the HF names); sequence parallelism is a switch of `megatron_config` (the block's TP plan)
plus what crosses a stage boundary (`threed.parallel.pipeline`). How the layers are cut into stages is
`threed.parallel.partition` / `threed.parallel.pipeline`, never here.
"""
