"""The pipeline timeline raster: every event shows, nothing shows where nothing ran."""

from hypothesis import given, settings, strategies as st
from report_synthetic import one_f_one_b, search_outcome

from echo_plan.replay.results import TimelineEvent
from echo_plan.report.charts_plan import _row_labels, raster, timeline_chart

event_st = st.builds(
    TimelineEvent, rank=st.integers(0, 3), stream=st.sampled_from(["compute", "pp_fwd", "dp_comm"]),
    name=st.text("abcF B0123", min_size=1, max_size=8), start_s=st.floats(0, 10, allow_nan=False),
    duration_s=st.floats(1e-6, 3, allow_nan=False), category=st.sampled_from(["forward", "backward", "p2p", "dp"]))


@settings(max_examples=60, deadline=None)
@given(st.lists(event_st, min_size=1, max_size=40), st.integers(5, 300))
def test_slots_show_what_runs_at_their_middle_and_every_event_shows(events, bins):
    events = tuple(events)
    labels, order = _row_labels(events, pp=4)
    row_of = {k: order.index(v) for k, v in labels.items()}
    cats = sorted({e.category for e in events})
    width, z, names = raster(events, row_of, len(order), {c: i for i, c in enumerate(cats)}, bins)
    assert width * bins >= max(e.start_s + e.duration_s for e in events) * (1 - 1e-9)
    for e in events:  # each event covers at least one slot of its row
        row = row_of[(e.rank, e.stream)]
        first, last = int(e.start_s / width), min(bins - 1, int((e.start_s + e.duration_s) / width))
        assert any(z[row][b] is not None for b in range(first, last + 1))
    for row in range(len(order)):  # a filled slot overlaps an event of that row with that name
        for b in range(bins):
            if z[row][b] is None:
                assert names[row][b] == ""
                continue
            lo, hi = b * width, (b + 1) * width
            assert any(row_of[(e.rank, e.stream)] == row and e.name == names[row][b]
                       and e.start_s <= hi and e.start_s + e.duration_s >= lo for e in events)
            mid = (b + 0.5) * width
            at_mid = {e.name for e in events if row_of[(e.rank, e.stream)] == row
                      and e.start_s <= mid < e.start_s + e.duration_s}
            if at_mid:  # what runs at the slot's middle is what the slot shows
                assert names[row][b] in at_mid


def test_one_f_one_b_timeline_chart_rows_and_legend():
    events = one_f_one_b(pp=4, m=8, f_s=0.01, b_s=0.02, p2p_s=0.001, dp_s=0.05, opt_s=0.01)
    r = search_outcome(30, seed=1, gbs=256).best
    from dataclasses import replace

    chart = timeline_chart(replace(r, plan={**r.plan, "pp": 4}, timeline=events))
    heat = chart.data[0]
    assert heat["type"] == "heatmap"
    assert heat["y"][:3] == ["stage 0 · compute", "stage 0 · PP comm", "stage 0 · DP comm"]
    assert len(heat["y"]) == 12
    legend = {t["name"] for t in chart.data[1:]}
    assert legend == {"forward", "backward", "p2p", "dp", "optimizer"}
    # the bubble: stage 3 waits for the first forward to cross three stages before it starts
    stage3 = heat["z"][heat["y"].index("stage 3 · compute")]
    assert stage3[0] is None


def test_no_events_no_chart():
    from dataclasses import replace

    r = search_outcome(30, seed=1, gbs=256).best
    assert timeline_chart(replace(r, timeline=())) is None


def test_both_pipeline_directions_share_one_row_per_stage():
    ev = (TimelineEvent(0, "compute", "F mb0", 0.0, 1.0, "forward"),
          TimelineEvent(0, "pp_fwd", "send F mb0", 1.0, 0.1, "p2p"),
          TimelineEvent(1, "pp_bwd", "send B mb0", 2.0, 0.1, "p2p"),
          TimelineEvent(1, "dp_comm", "reduce-scatter", 3.0, 0.5, "dp"))
    labels, order = _row_labels(ev, pp=2)
    assert order == ["stage 0 · compute", "stage 0 · PP comm", "stage 1 · PP comm", "stage 1 · DP comm"]
    assert labels[(1, "pp_bwd")] == "stage 1 · PP comm"


def test_split_backward_passes_have_their_own_colour_and_legend_entry():
    from dataclasses import replace

    events = tuple(replace(e, category="backward-input", name=e.name.replace("B", "Bi")) if e.category == "backward"
                   else e for e in one_f_one_b(pp=2, m=4, f_s=0.01, b_s=0.02, p2p_s=0.001, dp_s=0.05, opt_s=0.01))
    last = max(e.start_s + e.duration_s for e in events)
    events += (TimelineEvent(0, "compute", "W mb0 chunk0", last, 0.01, "backward-weight"),)
    r = search_outcome(30, seed=1, gbs=256).best
    chart = timeline_chart(replace(r, plan={**r.plan, "pp": 2}, timeline=events))
    legend = {t["name"]: t["marker"]["color"] for t in chart.data[1:]}
    assert {"backward-input", "backward-weight"} <= set(legend)
    assert legend["backward-input"] != legend["backward-weight"]
    assert "weight gradients" in chart.caption
