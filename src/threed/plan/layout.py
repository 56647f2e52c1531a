"""A layout `threed plan` (`threed.plan.planner`) weighs, and what it says about layouts: the table, and one phrase each
for recomputing every block, for the pipeline schedule and for the context-parallel degree. Apart from the search so
that each stays readable."""

from __future__ import annotations

from dataclasses import dataclass

from threed.memory.model import GB, Memory
from threed.memory.recompute import Recompute
from threed.parallel.schedule import simulate


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro: int
    gas: int
    recompute: Recompute
    memory: Memory  # the heaviest stage
    step_s: float
    fits: bool
    sp: bool = False
    blocks: int = 0  # the largest stage's blocks
    schedule: str = "1f1b"  # threed.parallel.schedule's
    passes: tuple[float, float, float] = (1.0, 1.0, 1.0)  # the slowest stage's F, B, W seconds (threed.plan.steptime)
    cp: int = 1  # context parallelism (dp excludes it)
    vpp: int = 1  # interleaved chunks per rank (1f1b only)

    @property
    def act_ckpt(self) -> bool:
        """Every block of every stage recomputed (--activation-checkpointing's memory and cost)."""
        return self.blocks > 0 and self.recompute.recomputed(self.blocks) == self.blocks

    @property
    def recomputed(self) -> int:
        """Recomputed blocks of the largest stage."""
        return self.recompute.recomputed(self.blocks)

    def bubble_under(self, schedule: str) -> float:
        """The fraction of the step a stage idles under `schedule`, with this layout's pass times."""
        return max(simulate(schedule, self.pp, self.gas, *self.passes, self.vpp if schedule == "1f1b" else 1)[1])

    @property
    def bubble(self) -> float:
        return self.bubble_under(self.schedule)

    def recompute_words(self) -> str:
        if self.act_ckpt:
            return "recomputing every block"
        if self.recomputed:
            return f"recomputing the first {self.recomputed} of {self.blocks} blocks per stage"
        return "without recompute"

    def name(self) -> str:
        sp = ", sequence parallel" if self.sp else ""
        schedule = f", {self.schedule}" if self.schedule != "1f1b" else f", interleaved vpp {self.vpp}" * (self.vpp > 1)
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        return (
            f"tp{self.tp}{cp} pp{self.pp} dp{self.dp}, micro {self.micro} x gas {self.gas}{sp}{schedule}, "
            f"{self.recompute_words()}"
        )


def full_recompute_verdict(every: list[Layout]) -> str:
    """One line: is recomputing every block needed, and why (fastest first)."""
    fitting = [la for la in every if la.fits]
    lighter = [la for la in fitting if not la.act_ckpt]
    if lighter:
        count = "1 layout fits" if len(lighter) == 1 else f"{len(lighter)} layouts fit"
        return (
            f"full recomputation: not needed: {count} without recomputing every block; the fastest, "
            f"{lighter[0].name()}, at {lighter[0].memory.peak / GB:.1f} GB/GPU"
        )
    others = [la for la in every if not la.act_ckpt]
    if not others:
        return "full recomputation: the only option searched (--activation-checkpointing true)"
    leanest = min(others, key=lambda la: la.memory.peak)
    return (
        f"full recomputation: needed: no layout fits without recomputing every block; the leanest, "
        f"{leanest.name()}, needs {leanest.memory.peak / GB:.0f} GB/GPU"
    )


def same_shape(best: Layout, every: list[Layout]) -> list[Layout]:
    """The layouts of `every` with the best one's tp, cp, pp, dp, micro, gas and sequence parallelism: what differs
    among them is the schedule, the chunks per rank and the recompute."""
    shape = (best.tp, best.cp, best.pp, best.dp, best.micro, best.gas, best.sp)
    return [la for la in every if (la.tp, la.cp, la.pp, la.dp, la.micro, la.gas, la.sp) == shape]


def would_need(rival: str, leanest: Layout, best: Layout) -> str:
    """`RIVAL would need N GB/GPU (...; bubble a -> b)`: why the leanest layout of a rival schedule lost."""
    return (
        f"{rival} would need {leanest.memory.peak / GB:.0f} GB/GPU ({leanest.recompute_words()}; bubble "
        f"{best.bubble:.1%} -> {leanest.bubble:.1%})"
    )


def schedule_verdict(best: Layout, every: list[Layout]) -> str:
    """One phrase: the best layout's pipeline schedule and why (the other schedule of the same tp, pp, dp, micro,
    gas and sequence parallelism: its bubble, or why it lost)."""
    if best.schedule != "1f1b":
        return f"{best.schedule}: bubble {best.bubble_under('1f1b'):.1%} -> {best.bubble:.1%}"
    if best.pp == 1:
        return "1f1b: one stage, no bubble"
    others = [la for la in same_shape(best, every) if la.schedule != "1f1b"]
    if not others:
        return "1f1b: the only schedule searched"
    fitting = [la for la in others if la.fits]
    if not fitting:
        leanest = min(others, key=lambda la: la.memory.peak)
        return would_need(f"1f1b: {leanest.schedule}", leanest, best)
    fastest = fitting[0]
    if fastest.recompute == best.recompute:  # it fits alike: its smaller bubble costs more than it saves
        # threed.plan.steptime: 1F1B's backward hides TP collectives behind weight-gradient GEMMs; ZB-H1's cannot
        why = "its backward runs the TP collectives alone, which 1f1b hides behind weight-gradient GEMMs"
        if best.sp:
            why += ", and its weight-gradient passes gather their inputs again"
        return (
            f"1f1b: {fastest.schedule} is slower here, {fastest.step_s:.1f} s/step (bubble {best.bubble:.1%} -> "
            f"{fastest.bubble:.1%}, but {why})"
        )
    return (
        f"1f1b: {fastest.schedule} fits only {fastest.recompute_words()}, {fastest.step_s:.1f} s/step "
        f"(bubble {best.bubble:.1%} -> {fastest.bubble:.1%})"
    )


def interleave_verdict(best: Layout, every: list[Layout]) -> str:
    """One phrase: the best layout's chunks per rank (--vpp) and why, against the fastest fitting layout of the same
    tp, cp, pp, dp, micro, gas and sequence parallelism under 1F1B with the other vpp (its bubble, its sends between
    stages, its memory)."""
    if best.pp == 1:
        return "vpp 1: one stage, nothing to interleave"
    twins = [la for la in same_shape(best, every) if la.schedule == "1f1b" and la.vpp != best.vpp]
    if not twins:
        return f"vpp {best.vpp}: the only one searched for this layout (pp x vpp must divide the blocks, pp the gas)"
    fitting = [la for la in twins if la.fits]
    if best.vpp > 1:
        plain = min(twins, key=lambda la: (la.vpp != 1, not la.fits, la.step_s))
        return (
            f"vpp {best.vpp}: bubble {plain.bubble:.1%} -> {best.bubble:.1%} for {best.vpp}x the sends between stages, "
            f"{plain.step_s:.1f} -> {best.step_s:.1f} s/step; {best.memory.peak / GB:.1f} GB/GPU against "
            f"{plain.memory.peak / GB:.1f} (rank 0 holds more micro-batches)"
        )
    if not fitting:
        leanest = min(twins, key=lambda la: la.memory.peak)
        return would_need(f"vpp 1: vpp {leanest.vpp}", leanest, best)
    fastest = fitting[0]
    verdict = (
        f"vpp 1: vpp {fastest.vpp} is slower here, {fastest.step_s:.1f} s/step against {best.step_s:.1f} (bubble "
        f"{best.bubble_under('1f1b'):.1%} -> {fastest.bubble:.1%}, but {fastest.vpp}x the sends between stages"
        f"{'' if fastest.recompute == best.recompute else ', ' + fastest.recompute_words()})"
    )
    faster = [la for la in twins if not la.fits and la.step_s < best.step_s]
    if faster:  # a smaller bubble that would win, but rank 0's extra micro-batches do not fit
        la = faster[0]
        verdict += f"; vpp {la.vpp} would take {la.step_s:.1f} s/step but needs {la.memory.peak / GB:.0f} GB/GPU"
    return verdict


def context_parallel_verdict(best: Layout, every: list[Layout]) -> str:
    """One line: which CP degree the best layout has and why, against the best layout without CP (fastest first)."""
    fitting = [la for la in every if la.fits]
    plain = next((la for la in fitting if la.cp == 1), None)
    searched = sorted({la.cp for la in every})
    if searched == [best.cp]:
        return f"context parallelism: cp{best.cp}: the only degree searched"
    if best.cp == 1:
        rival = next((la for la in fitting if la.cp > 1), None)
        if rival is None:
            return "context parallelism: cp1: no layout with cp > 1 fits"
        return (
            f"context parallelism: cp1: the fastest with CP, {rival.name()}, is slower at {rival.step_s:.1f} s/step "
            f"against {best.step_s:.1f}"
        )
    why = f"context parallelism: cp{best.cp}: {best.step_s:.1f} s/step"
    if plain is None:
        leanest = min((la for la in every if la.cp == 1), key=lambda la: la.memory.peak, default=None)
        need = f"; the leanest, {leanest.name()}, needs {leanest.memory.peak / GB:.0f} GB/GPU" if leanest else ""
        return f"{why}, and no layout without CP fits{need}"
    gain = []
    if best.recomputed * plain.blocks < plain.recomputed * best.blocks:  # a smaller share of the blocks
        gain.append(
            f"recompute {best.recomputed}/{best.blocks} blocks per stage, not {plain.recomputed}/{plain.blocks}"
        )
    if best.tp < plain.tp:
        gain.append(f"tp{best.tp}, not tp{plain.tp}")
    if best.bubble < plain.bubble:
        gain.append(f"a bubble of {best.bubble:.1%}, not {plain.bubble:.1%} (gas {best.gas}, pp{best.pp})")
    because = f"; each rank holds 1/{best.cp} of every sequence: {', '.join(gain)}" if gain else ""
    return (
        f"{why} against {plain.step_s:.1f} s/step for the best layout without CP ({plain.name()}), "
        f"{plain.step_s / best.step_s:.2f}x faster{because}"
    )


def table(rows: list[Layout], budget: float) -> list[str]:
    """Fitting layouts are numbered in rank order; the ones that do not fit are marked, not numbered. recompute:
    recomputed blocks per stage / the largest stage's blocks."""
    out = [
        f"{'rank':>4} {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>4} {'micro':>5} {'gas':>5} {'sp':>3} {'sched':>5} "
        f"{'vpp':>3} {'recompute':>9} {'GB/GPU':>7} {'bubble':>7} {'step s':>8}  fits"
    ]
    rank = 0
    for la in rows:
        rank += la.fits
        fits = "yes" if la.fits else f"NO: {la.memory.peak / GB:.0f} > {budget / GB:.0f} GB"
        recompute = f"{la.recomputed}/{la.blocks}"
        out.append(
            f"{rank if la.fits else '-':>4} {la.tp:>3} {la.cp:>3} {la.pp:>3} {la.dp:>4} {la.micro:>5} {la.gas:>5} "
            f"{'yes' if la.sp else 'no':>3} {la.schedule:>5} {la.vpp:>3} {recompute:>9} {la.memory.peak / GB:>7.1f} "
            f"{la.bubble:>7.1%} {la.step_s:>8.2f}  {fits}"
        )
    return out
