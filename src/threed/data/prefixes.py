"""How a dataset on disk is named, in one place: Megatron-LM's `PREFIX_{key}_document.bin/.idx` (what `threed
preprocess` writes and `--data-path` names), and the SFT pair `PREFIX_text_document` + `PREFIX_mask_document`
(the loss mask beside the tokens). Writers, the training-data checks and the SFT dataset all agree through here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

LEVEL = "document"  # Megatron-LM's name for unsplit documents ("sentence" with --split-sentences, not supported)
TEXT_KEY, MASK_KEY = "text", "mask"  # the two outputs of `threed preprocess --sft`
TEXT_SUFFIX, MASK_SUFFIX = f"_{TEXT_KEY}_{LEVEL}", f"_{MASK_KEY}_{LEVEL}"


def dataset_prefix(prefix: str, key: str = TEXT_KEY) -> str:
    """What `IndexedDataset` / a GPTDataset blend takes for one json key: PREFIX_{key}_document."""
    return f"{prefix}_{key}_{LEVEL}"


def mask_prefix(text_prefix: str) -> Optional[str]:
    """The loss-mask dataset that `threed preprocess --sft` writes beside PREFIX_text_document, or None when the
    prefix does not have that form."""
    if not text_prefix.endswith(TEXT_SUFFIX):
        return None
    return text_prefix[: -len(TEXT_SUFFIX)] + MASK_SUFFIX


def is_sft_prefix(text_prefix: str) -> bool:
    """SFT data: a loss-mask dataset lies beside the tokens."""
    mask = mask_prefix(text_prefix)
    return mask is not None and Path(mask + ".idx").is_file()
