"""threed: 3D-parallel (megatron-core TP x DeepSpeed PP x ZeRO-1 DP) Llama training. The layers of the package
are listed in README.md ("Layout: the house") and checked by the import-linter contract in pyproject.toml."""
__version__ = "0.1.0"
