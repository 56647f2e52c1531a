"""Generation from a checkpoint on the training engine's own stages, at any tp / pp (`threed generate`).

- `prompts.py`: what is asked, checked before an engine is built (checkpoint, prompts, tokenizer, lengths,
  sampling settings); pure.
- `sampling.py`: the next token from vocabulary-parallel logits (greedy or seeded temperature / top-p), without
  gathering them.
- `decode.py`: one pipeline's generation loop: per-stage KV cache (megatron-core's static inference context),
  point-to-point hidden states, the last stage's token broadcast back.
- `run.py`: the ranks of `threed generate`: engine, prompts over data-parallel replicas, output.
"""
