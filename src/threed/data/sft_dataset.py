"""SFT training samples from `threed preprocess --sft` output: whole examples, packed or one per sequence, with the
response-only loss mask, as a megatron-core `MegatronDataset` (so megatron's builder does the train/valid split by
documents and the blending, exactly as for pretraining data).

    PREFIX_text_document.bin/.idx   tokens, one document (one sequence) per example
    PREFIX_mask_document.bin/.idx   uint8, mask[t] = 1 iff token t is a target (a response token)

A sample (a row of `seq_length` positions) holds whole examples: an example of n tokens fills n - 1 positions
(inputs x[:-1], labels x[1:], loss mask m[1:]), so no label crosses from one example into the next. With `pack` the
examples of a row are consecutive in the shuffled order, taken greedily while they fit (the next example starts a
new row); without it each row is one example. The rest of a row is padding (token 0, loss mask 0). `doc_ids` gives
each position its example's index in the row (padding: one more), from which every pipeline stage rebuilds the
block-diagonal attention and the RoPE positions (`threed.model.attention.document_segments`).

Why our own dataset: megatron-core 0.16's GPTDataset concatenates documents and cuts them at seq_length (examples
split across samples, attention across examples), and its SFTDataset needs its own tokenizer stack and pads each
conversation; neither reads a separate loss mask. Row order is deterministic in (seed, split, epoch), independent
of the data-parallel layout, like GPTDataset's, so resume at another layout reads the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split

from threed.data.prefixes import mask_prefix

PAD_TOKEN = 0  # any valid id: padding positions are masked out of the loss and attend only among themselves


@dataclass
class SFTDatasetConfig(BlendedMegatronDatasetConfig):
    pack: bool = False


@dataclass
class SFTLowLevel:
    tokens: IndexedDataset
    mask: IndexedDataset


def greedy_rows(positions: np.ndarray, capacity: int) -> np.ndarray:
    """Row start offsets (plus the end) for examples taking `positions[i]` places each, in order, each row filled
    while the next example fits. Every example fits alone (`check_data` refuses longer ones)."""
    starts = [0]
    used = 0
    for i, n in enumerate(positions.tolist()):
        if used + n > capacity:
            starts.append(i)
            used = 0
        used += n
    starts.append(len(positions))
    return np.asarray(starts, dtype=np.int64)


class SFTDataset(MegatronDataset):
    def __init__(
        self,
        dataset: SFTLowLevel,
        dataset_path: Optional[str],
        indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: SFTDatasetConfig,
    ) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        seq = config.sequence_length
        # An example of n tokens fills n - 1 positions; one of fewer than 2 tokens trains nothing.
        positions = dataset.tokens.sequence_lengths[indices].astype(np.int64) - 1
        usable = indices[positions >= 1].astype(np.int64)
        positions = positions[positions >= 1]
        if len(usable) == 0:
            raise ValueError(f"{dataset_path}: the {index_split.name} split holds no example of 2 or more tokens")
        orders, rows, total = [], [np.zeros(1, dtype=np.int64)], 0
        epoch = 0
        while True:  # epochs until there are num_samples rows (one epoch when None)
            rng = np.random.default_rng([config.random_seed, index_split.value, epoch])
            perm = rng.permutation(len(usable))
            if config.pack:
                starts = greedy_rows(positions[perm], seq)
            else:
                starts = np.arange(len(perm) + 1, dtype=np.int64)
            orders.append(usable[perm])
            rows.append(starts[1:] + total)
            total += len(perm)
            epoch += 1
            if num_samples is None or sum(len(r) for r in rows) - 1 >= num_samples:
                break
        self.order = np.concatenate(orders)  # example ids (sequence numbers) in row order
        self.row_starts = np.concatenate(rows)  # row k = order[row_starts[k]:row_starts[k + 1]]
        self.epochs = epoch

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: SFTLowLevel) -> int:
        return len(low_level_dataset.tokens)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: SFTDatasetConfig) -> SFTLowLevel:
        mask = mask_prefix(dataset_path)
        assert mask is not None, dataset_path  # check_data has refused other prefixes
        return SFTLowLevel(
            IndexedDataset(dataset_path, mmap=config.mmap_bin_files), IndexedDataset(mask, mmap=config.mmap_bin_files)
        )

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return MegatronDataset._key_config_attributes() + ["pack"]

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def examples(self, idx: int) -> np.ndarray:
        return self.order[self.row_starts[idx] : self.row_starts[idx + 1]]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        seq = self.config.sequence_length
        examples = self.examples(idx)
        tokens = np.full(seq, PAD_TOKEN, dtype=np.int64)
        labels = np.full(seq, PAD_TOKEN, dtype=np.int64)
        loss_mask = np.zeros(seq, dtype=np.float32)
        doc_ids = np.full(seq, len(examples), dtype=np.int32)
        at = 0
        for k, example in enumerate(examples.tolist()):
            x = self.dataset.tokens[example]
            m = self.dataset.mask[example]
            n = len(x) - 1
            tokens[at : at + n], labels[at : at + n], loss_mask[at : at + n] = x[:-1], x[1:], m[1:]
            doc_ids[at : at + n] = k
            at += n
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
        if self.config.pack:
            sample["doc_ids"] = doc_ids
        return sample

    def real_tokens(self, idx: int) -> int:
        """Positions of row `idx` that hold data (not padding): the packing benchmark's measure."""
        return int((self.dataset.tokens.sequence_lengths[self.examples(idx)] - 1).sum())
