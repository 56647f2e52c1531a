"""What an HF Llama model directory holds, said once for the reader and the writer: the safetensors dtype codes,
the index file's name, the tokenizer and side files, the buffers that are not weights, and the error for a
directory or file that is not what it should be.

    <dir>/config.json                      the model (threed.hf.config)
    <dir>/model.safetensors                one file, or
    <dir>/model-00001-of-00004.safetensors + model.safetensors.index.json   {"weight_map": {tensor: file}}
    <dir>/pytorch_model*.bin               (older checkpoints; read, never written)
    <dir>/tokenizer.json, tokenizer_config.json, tokenizer.model, ...       TOKENIZER_FILES
"""

from __future__ import annotations

import torch

from threed.errors import ThreedError


class HFError(ThreedError):
    """A bad HF model directory or safetensors file. The message names the file / tensor and the fix."""


# safetensors' dtype codes <-> torch (only float tensors are weights of a Llama).
ST_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}
ST_NAMES: dict[torch.dtype, str] = {dtype: code for code, dtype in ST_DTYPES.items()}
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# Buffers some HF versions saved; they are recomputed from the config, so they are skipped, not converted.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)
SIDE_FILES = TOKENIZER_FILES + ("generation_config.json", "config.json")  # carried into a converted checkpoint
