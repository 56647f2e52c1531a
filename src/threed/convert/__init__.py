"""HF <-> DeepSpeed pipeline checkpoints (layer 5 of the house), tensor by tensor, never a whole model in memory.

    mapping         pure dict -> dict: HF tensors of one pipeline layer <-> its TP shards (fuse q/k/v, gate/up)
    slices          the streaming form of mapping: which slices of which HF tensors make one rank's tensor
    from_hf         `threed convert`: HF safetensors -> layer_XX-model_YY files (worker processes)
    export          `threed export`: a checkpoint -> sharded HF safetensors + config + tokenizer
    reshard         `threed reshard`: a checkpoint at another tp / pp, without HF in between
    into_stage      the same slices read straight into a rank's stage (--init-from, generate, eval-harness)
    ds_checkpoint   the writer side of the DeepSpeed checkpoint format (the reader is threed.checkpoint.format)
    in_memory, tiny small models for tests and the demo; io_utils: output directories, progress, dtypes
    resolve         what --model names (a preset, an HF directory or a checkpoint) -> one ModelConfig: above
                    presets, HF configs and checkpoints, which it composes (pure)

What each parameter is (shape, TP split) comes from `threed.model.spec`, its HF names from `threed.hf.names`.
"""
