"""The Llama model: megatron-core TP layers plus our RoPE and SDPA attention. How it is cut into pipeline
stages lives in `threed.pipeline`."""
