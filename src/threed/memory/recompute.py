"""Which blocks of a pipeline stage recompute in backward, as Megatron-LM's recompute flags say, for the memory model
(kept activations) and the planner (recompute FLOPs). The flags are read and the chunks cut by
`threed.parallel.partition` (`full_recompute`, `recompute_chunks`: what the pipeline runs); this adds the counts those
two need.

    none                  every block keeps its activations for backward
    full uniform N        every block recomputed, in chunks of N consecutive blocks: each chunk keeps its input and
                          backward re-runs one chunk at a time (--activation-checkpointing is full uniform 1)
    full block N          only the first N blocks of each stage recomputed (each keeps its input); the others keep
                          everything. N = 0 is none, N >= the stage's blocks is full uniform 1
    selective             only the core attention of every block (megatron's `core_attn`): threed's SDPA keeps no
                          s x s scores, so this saves only its logsumexp (4 bytes per head per token)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from threed.config import TrainConfig
from threed.parallel.partition import full_recompute, recompute_chunks


@dataclass(frozen=True)
class Recompute:
    granularity: Optional[str] = None  # None | "full" | "selective"
    method: Optional[str] = None  # full: "uniform" | "block"
    num_layers: int = 0  # full: blocks per chunk (uniform) or recomputed blocks per stage (block)

    @classmethod
    def of(cls, value: "bool | Recompute") -> "Recompute":
        """A `Recompute` as it is; True: --activation-checkpointing (full uniform 1); False: none."""
        if isinstance(value, Recompute):
            return value
        return cls("full", "uniform", 1) if value else cls()

    @classmethod
    def first_blocks(cls, n: int) -> "Recompute":
        """full block N (the planner's search); N = 0: none."""
        return cls("full", "block", n) if n > 0 else cls()

    @classmethod
    def from_train(cls, train: TrainConfig) -> "Recompute":
        """The run's flags as `threed.parallel.partition.full_recompute` reads them (the pipeline's own reading)."""
        if train.recompute_granularity == "selective":
            return cls("selective")
        plan = full_recompute(train)
        return cls("full", *plan) if plan else cls()

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"

    def _chunks(self, blocks: int) -> list[tuple[int, int]]:
        """The recomputed chunks of a stage of `blocks` blocks, as the pipeline runs them
        (`threed.parallel.partition.recompute_chunks`)."""
        if self.granularity != "full" or not blocks:
            return []
        return [(a, b) for a, b, again in recompute_chunks([True] * blocks, str(self.method), self.num_layers) if again]

    def recomputed(self, blocks: int) -> int:
        """Blocks of a stage of `blocks` blocks that are recomputed in backward."""
        return sum(b - a for a, b in self._chunks(blocks))

    def kept_inputs(self, blocks: int) -> int:
        """Checkpointed chunks of the stage, each keeping its input."""
        return len(self._chunks(blocks))

    def live_blocks(self, blocks: int) -> int:
        """Blocks whose activations backward re-creates at once: the largest chunk."""
        return max((b - a for a, b in self._chunks(blocks)), default=0)

    def label(self, blocks: Optional[int] = None) -> str:
        """'none', 'selective', 'full uniform 1', 'block 3/20' (with the stage's blocks)."""
        if self.granularity is None:
            return "none"
        if self.selective:
            return "selective"
        if self.method == "block" and blocks is not None:
            return f"block {self.recomputed(blocks)}/{blocks}"
        return f"{self.method} {self.num_layers}"

    def flags(self) -> list[str]:
        """Megatron-LM's command-line flags (threed train takes them verbatim)."""
        if self.granularity is None:
            return []
        out = ["--recompute-granularity", self.granularity]
        if self.granularity == "full":
            out += ["--recompute-method", str(self.method), "--recompute-num-layers", str(self.num_layers)]
        return out
