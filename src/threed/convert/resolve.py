"""What `--model` names, resolved to a ModelConfig: a preset, a converted or trained checkpoint directory, or an HF
config.json / model directory. Every command that takes `--model` (train, check-config, memory, plan,
profile-layers) resolves it here, so a name means the same model everywhere.
"""

from __future__ import annotations

from pathlib import Path

from threed.config import ConfigError, ModelConfig
from threed.hf.config import from_hf_config
from threed.model.presets import PRESETS


def model_config(name_or_path: str) -> ModelConfig:
    """What `--model` names: a preset; a converted or trained checkpoint directory (its recorded model, vocab
    padding included); or a path to an HF config.json / model directory."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if Path(name_or_path).is_dir():
        # torch (threed.checkpoint.format reads .pt files): only for a checkpoint directory, so that
        # `threed --help` and a preset name stay fast.
        from threed.checkpoint.format import read_model_config

        recorded = read_model_config(name_or_path)
        if recorded is not None:
            return recorded
    if Path(name_or_path).exists():
        return from_hf_config(name_or_path)
    raise ConfigError(
        f"unknown model {name_or_path!r}: use one of {', '.join(PRESETS)}, a checkpoint directory or a path "
        f"to an HF config.json"
    )
