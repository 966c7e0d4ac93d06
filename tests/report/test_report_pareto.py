"""The Pareto front of (memory, throughput): nothing on it is dominated, everything off it is."""

from hypothesis import given, strategies as st

from echo_plan.report.pareto import pareto_front

points_st = st.lists(st.tuples(st.floats(0.5, 200, allow_nan=False), st.floats(1, 1e6, allow_nan=False)),
                     max_size=60)


def dominates(a, b):
    return a[0] <= b[0] and a[1] >= b[1] and (a[0] < b[0] or a[1] > b[1])


@given(points_st)
def test_front_is_exactly_the_undominated_points(points):
    front = pareto_front(points)
    on = set(front)
    for i in front:
        assert not any(dominates(points[j], points[i]) for j in range(len(points)))
    for i in range(len(points)):
        if i not in on:  # dominated, or an exact duplicate of a front point
            assert any(dominates(points[j], points[i]) or points[j] == points[i] for j in on)


@given(points_st)
def test_front_is_ordered_for_drawing(points):
    front = pareto_front(points)
    mems = [points[i][0] for i in front]
    tps = [points[i][1] for i in front]
    assert mems == sorted(mems)
    assert all(a < b for a, b in zip(tps, tps[1:]))


def test_small_example():
    pts = [(10, 100), (20, 90), (5, 50), (30, 200), (30, 150)]
    assert pareto_front(pts) == [2, 0, 3]
    assert pareto_front([]) == []
