"""megatron-core's datasets for a run: `DataSplits` (`threed.data.splits`) -> train and valid datasets through
megatron's own `BlendedMegatronDatasetBuilder`, with its GPTDataset for pretraining data and ours
(`threed.data.sft_dataset`) for `threed preprocess --sft` data.

    build_datasets(cfg, splits, global_batch, builds_here)    every rank calls it (rank 0 builds the index caches)

megatron-core has the readers, the sample index, blending and caching; this is only the glue: the sample counts
Megatron asks for, the tokenizer facts GPTDataset needs, and the test split left unbuilt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from threed.config import RunConfig
from threed.data.splits import DataSplits


@dataclass(frozen=True)
class _TokenizerInfo:
    """What megatron-core's GPTDataset needs of a tokenizer: the vocabulary size, the end-of-document id, and
    an identity for its cache keys. The data is already tokenized, so nothing here encodes text."""

    vocab_size: int
    eod: int
    # No pad id: the data is not padded. A value that is no token and not the eod keeps megatron from masking
    # (or warning about) anything.
    pad: int = -1

    @property
    def unique_identifiers(self) -> dict:
        return {"class": "threed", "vocab_size": self.vocab_size, "eod": self.eod}


@dataclass
class Datasets:
    train: Optional[object]
    valid: Optional[object]
    valid_names: tuple[str, ...]  # source dataset of each dataset_id in the valid blend

    def __len__(self) -> int:  # the number of split datasets built on this rank
        return sum(d is not None for d in (self.train, self.valid))


def sample_counts(cfg: RunConfig, splits: DataSplits, global_batch: int) -> list[int]:
    """[train, valid, test] samples, as Megatron computes them: every step's global batch, and eval_iters global
    batches per evaluation (every eval_interval steps, plus one at the end)."""
    train = cfg.train.steps * global_batch
    evals = cfg.train.steps // splits.eval_interval + 1 if splits.eval_interval else 0
    valid = cfg.train.eval_iters * global_batch * evals if splits.has_valid else 0
    return [train, valid, 0]


def build_datasets(cfg: RunConfig, splits: DataSplits, global_batch: int, builds_here: bool) -> Datasets:
    """megatron-core's BlendedMegatronDatasetBuilder. Every rank must call it (it builds index caches on rank 0
    behind a barrier); only ranks with `builds_here` (the first and last pipeline stages) get datasets."""
    # megatron: heavy (all of megatron.core; sft_dataset subclasses its MegatronDataset), only where data is built
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from threed.data.sft_dataset import SFTDataset, SFTDatasetConfig

    d = cfg.data
    blends = splits.blends
    common = dict(
        random_seed=cfg.train.seed,
        sequence_length=cfg.train.seq_length,
        tokenizer=_TokenizerInfo(cfg.model.vocab_size, splits.eod),
        path_to_cache=d.data_cache_path,
        mmap_bin_files=True,
    )
    if splits.sft:  # whole examples with their response-only loss mask (threed.data.sft_dataset)
        cls, config_cls, common = SFTDataset, SFTDatasetConfig, dict(common, pack=d.pack)
    else:
        cls, config_cls = GPTDataset, GPTDatasetConfig
        # The attention is causal SDPA: megatron's [1, s, s] mask per sample would only cost memory.
        common.update(
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=d.eod_mask_loss,
            create_attention_mask=False,
        )
    # The test split is never read here: it is not built (megatron-core would loop forever building a split whose
    # document range is empty, as the 1/1000 test share of a small dataset is). Train and valid keep exactly
    # Megatron's document ranges for the same --split.
    if splits.split is not None:
        gcfg = config_cls(blend=blends[0].as_megatron(), split=splits.split, **common)
        gcfg.split_matrix[2] = None
    else:
        gcfg = config_cls(blend_per_split=[b.as_megatron() if b else None for b in blends[:2]] + [None], **common)
    counts = sample_counts(cfg, splits, global_batch)
    train, valid, _ = BlendedMegatronDatasetBuilder(cls, counts, lambda: builds_here, gcfg).build()
    valid_blend = blends[1]
    return Datasets(
        train=train if builds_here else None,
        valid=valid if builds_here else None,
        valid_names=valid_blend.prefixes if valid_blend else (),
    )
