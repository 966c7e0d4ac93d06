"""What would make a plan that does not fit fit (cost/fit_hints.py): each change's memory is what simulating
the changed plan (with its own traces) gives, and sharding more never needs more memory."""

from __future__ import annotations

import pytest

from echo_plan.cost.fit_hints import FitChange, fit_changes, fit_note
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import PlanSpec, Recompute, load_cluster, load_stack
from echo_plan.trace.cache import TraceCache

CLUSTER = load_cluster("h800").resized(gpus=8)
GiB = 2**30


def _peak(result) -> int:
    return max(m.total_bytes for m in result.memory)


def test_every_change_matches_simulating_it_and_sharding_never_needs_more_memory(small_dense, tmp_path):
    plan = PlanSpec.build({"tp": 1, "pp": 2, "dp": 4, "micro_batch_size": 4, "global_batch_size": 64})
    cache, memo, stack = TraceCache(tmp_path), SimulationMemo(), load_stack()
    roomy = simulate(small_dense, CLUSTER, plan, stack=stack, cache=cache, memo=memo, memory_headroom_bytes=0)
    # a headroom that leaves one byte less than the plan needs: it no longer fits, lighter plans may
    headroom = int(CLUSTER.gpu.hbm_GiB * GiB) - _peak(roomy) + 1
    tight = simulate(small_dense, CLUSTER, plan, stack=stack, cache=cache, memo=memo, memory_headroom_bytes=headroom)
    assert not tight.fits
    (hint,) = [n for n in tight.notes if n.startswith("it fits with")]
    traces = memo.traces(small_dense, plan, cache, stack)
    changes = fit_changes(small_dense, plan, CLUSTER, traces, stack, headroom)
    flags = {c.flags for c in changes}
    assert {"--recompute selective", "--recompute full", "--sharding optimizer"} <= flags
    assert "--recompute full --sharding optimizer" in flags
    for change in changes:
        if change.recompute is plan.recompute:  # sharding more never needs more memory (recomputing may: the
            assert change.peak_bytes <= _peak(tight)  # recomputed part is live in the backward)
        args = change.flags.split()
        fields = {args[i][2:]: args[i + 1] for i in range(0, len(args), 2)}
        if "sharding" in fields:
            fields["distributed_optimizer"] = True
        changed = PlanSpec.build({**plan.model_dump(mode="json"), **fields})
        real = simulate(small_dense, CLUSTER, changed, stack=stack, cache=cache, memo=memo, memory_headroom_bytes=headroom)
        assert _peak(real) == pytest.approx(change.peak_bytes, rel=1e-9), change.flags  # its own traces agree
        assert real.fits == change.fits
    for kind in ("--recompute", "--sharding"):  # the least of each that fits alone is named, nothing heavier
        alone = [c for c in changes if c.single and c.fits and c.flags.startswith(kind)]
        if alone:
            assert alone[0].flags in hint and all(c.flags not in hint for c in alone[1:])


def test_full_recomputation_is_offered_in_place_of_recompute_layers(small_dense, tmp_path):
    """A plan recomputing some layers whole may still fit with all of them recomputed: --recompute full, which the
    plan rules take only without recompute_layers, is priced as that plan (simulated, the same peak)."""
    plan = PlanSpec.build({"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 4, "global_batch_size": 64,
                           "recompute_layers": 1})
    cache, memo, stack = TraceCache(tmp_path), SimulationMemo(), load_stack()
    traces = memo.traces(small_dense, plan, cache, stack)
    full = {c.flags: c for c in fit_changes(small_dense, plan, CLUSTER, traces, stack, 0)}["--recompute full"]
    changed = PlanSpec.build({**plan.model_dump(mode="json"), "recompute": "full", "recompute_layers": 0})
    real = simulate(small_dense, CLUSTER, changed, stack=stack, cache=cache, memo=memo, memory_headroom_bytes=0)
    assert _peak(real) == pytest.approx(full.peak_bytes, rel=1e-9)


def test_a_plan_that_fits_gets_no_hint(small_dense, tmp_path):
    plan = PlanSpec.build({"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1, "global_batch_size": 8})
    result = simulate(small_dense, CLUSTER, plan, cache=TraceCache(tmp_path))
    assert result.fits
    assert not any(n.startswith(("it fits with", "no more recomputation")) for n in result.notes)


def test_the_note_names_single_changes_first_then_pairs_needing_less_recomputation():
    sel = FitChange("--recompute selective", Recompute.SELECTIVE, 90 * GiB, False)
    full = FitChange("--recompute full", Recompute.FULL, 70 * GiB, True)
    opt = FitChange("--sharding optimizer", Recompute.NONE, 95 * GiB, False)
    pair = FitChange("--recompute selective --sharding optimizer", Recompute.SELECTIVE, 66 * GiB, True)
    heavy_pair = FitChange("--recompute full --sharding optimizer", Recompute.FULL, 50 * GiB, True)
    note = fit_note((sel, full, opt, pair, heavy_pair))
    assert note.startswith("it fits with --recompute full (70.0 GiB peak); --recompute selective --sharding "
                           "optimizer (66.0 GiB peak)")
    assert "--recompute full --sharding" not in note  # no lighter on recomputation than the single change
    assert "\n" not in note


def test_when_nothing_fits_the_note_says_what_was_tried_and_what_is_left():
    note = fit_note((FitChange("--recompute full", Recompute.FULL, 90 * GiB, False),
                     FitChange("--sharding optimizer", Recompute.NONE, 95 * GiB, False)))
    assert note.startswith("no more recomputation or sharding makes it fit (tried --recompute full, --sharding "
                           "optimizer, and each pair of them)")
    assert "pipeline, tensor or context parallelism" in note
    assert fit_note(()).startswith("it already has the most recomputation and sharding the plan and stack allow: "
                                   "more pipeline")
