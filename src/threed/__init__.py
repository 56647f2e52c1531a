"""threed: 3D-parallel (megatron-core TP x DeepSpeed PP x ZeRO-1 DP) Llama training."""
__version__ = "0.1.0"
