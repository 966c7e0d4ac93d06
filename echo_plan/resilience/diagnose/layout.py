"""The job's parallel layout, when the user gives it (``diagnose --tp --cp --pp [--dp]``).

Records name each group's members but not what the group is for, and a rank that wrote nothing and
belongs to no recorded group is invisible. With the layout, every rank of the job is expected (a
whole server whose dumps were lost is reported missing) and each group is labelled with the
dimensions its members differ in, under Megatron-LM's default rank order (tensor fastest, then
context, then data, then pipeline parallel: rank = t + tp (c + cp (d + dp p))): a TP group varies
only in t, the gradient group of a CP job in c and d, a pipeline send/recv pair only in p. A group
that covers part of a dimension (an expert-parallel group is part of the data-parallel one) says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from echo_plan.errors import FileFormatError, SpecError
from echo_plan.limits import MAX_GPUS
from echo_plan.resilience.diagnose.records import RecordTable

DIMS = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    dp: int
    pp: int

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        t, rest = rank % self.tp, rank // self.tp
        c, rest = rest % self.cp, rest // self.cp
        d, p = rest % self.dp, rest // self.dp
        return t, c, d, p

    def label(self, members: tuple[int, ...]) -> str:
        """The dimensions ``members`` differ in, e.g. ``tp``, ``cp+dp``, ``part of dp``."""
        cs = [self.coords(r) for r in members]
        sizes = dict(zip(DIMS, (self.tp, self.cp, self.dp, self.pp)))
        varying = [(dim, {c[i] for c in cs}) for i, dim in enumerate(DIMS) if len({c[i] for c in cs}) > 1]
        if not varying:
            return "one rank"
        name = "+".join(dim for dim, _ in varying)
        whole = all(len(vals) == sizes[dim] for dim, vals in varying)
        return name if whole or name == "pp" else f"part of {name}"


def make_layout(tp: int | None, cp: int | None, pp: int | None, dp: int | None, t: RecordTable) -> Layout | None:
    """The layout from the options (None when none is given); dp from the highest rank when left out."""
    if tp is None and cp is None and pp is None and dp is None:
        return None
    for name, v in (("--tp", tp), ("--cp", cp), ("--pp", pp), ("--dp", dp)):
        if v is not None and not 1 <= v <= MAX_GPUS:
            raise SpecError(name, v, f"a parallel degree from 1 to {MAX_GPUS:,}")
    tp, cp, pp = tp or 1, cp or 1, pp or 1
    top = max(t.expected_ranks, default=0) + 1
    if dp is None:
        dp = max(1, -(-top // (tp * cp * pp)))
    layout = Layout(tp, cp, dp, pp)
    if layout.world > MAX_GPUS:
        raise SpecError("--tp x --cp x --dp x --pp", layout.world, f"at most {MAX_GPUS:,} GPUs")
    if top > layout.world:
        rank = top - 1
        raise FileFormatError(t.files.get(rank, "RECORDS"), f"rank {rank} is outside the layout's {layout.world:,} "
                                                            f"GPUs (tp {tp} x cp {cp} x dp {dp} x pp {pp})")
    return layout


def labelled(t: RecordTable, layout: Layout) -> RecordTable:
    """The table with each group's name followed by its kind, e.g. ``pg3 (tp)``."""
    names = tuple(f"{n} ({layout.label(r)})" for n, r in zip(t.group_names, t.group_ranks))
    return replace(t, group_names=names)


def missing_in(t: RecordTable, layout: Layout) -> tuple[int, ...]:
    present = set(t.ranks_present)
    return tuple(r for r in range(layout.world) if r not in present)
