"""The planner's admission choice, search budget and StateImage demotion order, on their own (no
model, no pools): a request resumes from a shallower checkpoint when the room for the deepest one
costs more retained work than it gains, the search is bounded with a maximal fallback, and Device
StateImages go to Host by expected cost rather than by recency alone."""

from __future__ import annotations

import pytest

from ninfer_core.engine.cache_planner import (
    HOST_RESUME_COST,
    Extent,
    Item,
    Planner,
    Resume,
    choose_resume,
    combined_likelihood,
    resume_work,
    state_demotion_cost,
)


def pages(*holders, count=1, host=False, pinned=False):
    return Extent(frozenset(holders), count, host, pinned)


def view(x_weight=1.0, host_free=0):
    """A request of 366 prompt tokens whose deepest match is "end" (265 tokens, KV on Host, 5 Host
    pages) above its own turn closure "cl" (192 tokens, 3 Device pages); another conversation "x"
    (305 tokens, 5 Device pages) is retained; 4 Device pages are free and it needs 6."""
    items = [Item("cl", 192, weight=1.0, owner="a"),
             Item("end", 265, weight=1.0, parents=(("cl", 192),), on_device=False, owner="a"),
             Item("x", 305, weight=x_weight, owner="x")]
    ext = [pages("cl", count=3), pages("end", count=5, host=True), pages("x", count=5)]
    planner = Planner(items, ext, host_free_pages=host_free)
    free, entitlement, prompt = 4, 6, 366
    options = [Resume("end", 265, resume_work(prompt, 265, True), entitlement - 0 - free, ("end",)),
               Resume("cl", 192, resume_work(prompt, 192, False), entitlement - 3 - free, ("cl",)),
               Resume("root", 0, resume_work(prompt, 0, False), entitlement - free)]
    return planner, options


def test_admission_degrades_to_a_shallower_checkpoint_when_the_room_costs_more_than_it_gains():
    planner, options = view()
    choice = choose_resume(planner, options)
    # From "end": 101 tokens to prefill + the Host copy back, but its 2 pages cost "cl" (192) or "x"
    # (305): 298 in all. From "cl": 174 tokens and no room to make.
    assert choice.resume.key == "cl" and choice.plan.drop == choice.plan.demote == []
    assert choice.degradation == 265 - 192 and choice.total == pytest.approx(174)
    assert choice.evaluated == 3


def test_admission_keeps_the_deepest_resume_when_the_room_is_cheap():
    # With Host KV room, demoting "cl" to Host (192 x 0.02) makes the room: the deepest wins.
    planner, options = view(host_free=5)
    choice = choose_resume(planner, options)
    assert choice.resume.key == "end" and choice.degradation == 0
    assert choice.plan.demote == ["cl"] and choice.plan.drop == []
    assert choice.total == pytest.approx(101 + 265 * HOST_RESUME_COST + 192 * HOST_RESUME_COST)


def test_a_stale_victim_is_cheaper_than_a_degradation():
    # "x" unused for long (weight 0.1): evicting it (30.5) beats both dropping the closure and the
    # degradation, so the deepest resume stays and "x" goes instead of "cl" (a cheaper victim set).
    planner, options = view(x_weight=0.1)
    choice = choose_resume(planner, options)
    assert choice.resume.key == "end" and choice.plan.drop == ["x"]


def test_no_pressure_takes_the_deepest_without_a_search():
    planner, options = view()
    options[0].need_pages = 0
    choice = choose_resume(planner, options)
    assert choice.resume.key == "end" and choice.work == 0 and choice.plan.drop == []


def test_a_kept_resume_point_is_never_a_victim():
    planner, _ = view()
    plan = planner.plan(need_pages=3, keep=("cl",))
    # Dropping "end" from Host (73 tokens above "cl") makes room for "x"'s demotion: cl untouched.
    assert plan.drop == ["end"] and plan.demote == ["x"] and plan.freed_pages == 5
    # Unkept, "cl" is the cheaper one to demote.
    assert planner.plan(need_pages=3).demote == ["cl"]
    assert planner.plan(need_pages=9, keep=("cl",)) is None  # only 5 pages are not kept


def test_search_budget_exhausted_falls_back_to_the_maximal_plan():
    items = [Item(f"c{i}", 100 + i) for i in range(12)]
    ext = [pages(f"c{i}", count=1) for i in range(12)]
    bounded = Planner(items, ext, work=5)
    plan = bounded.plan(need_pages=3)
    assert bounded.last.budget_exhausted and bounded.last.maximal_fallback
    assert plan.maximal_fallback and len(plan.drop) == 12 and plan.freed_pages == 12
    full = Planner(items, ext)
    plan = full.plan(need_pages=3)
    assert not full.last.budget_exhausted and not plan.maximal_fallback
    assert plan.drop == ["c0", "c1", "c2"]  # the three cheapest
    # A maximal plan that still does not cover the need is no plan.
    assert Planner(items, ext, work=5).plan(need_pages=13) is None


def test_maximal_fallback_spares_the_kept_resume_point():
    items = [Item(f"c{i}", 100 + i) for i in range(6)]
    ext = [pages(f"c{i}", count=1) for i in range(6)]
    planner = Planner(items, ext, work=2)
    plan = planner.plan(need_pages=2, keep=("c0",))
    assert plan.maximal_fallback and "c0" not in plan.drop and len(plan.drop) == 5


def test_state_demotion_is_by_expected_cost_not_recency():
    # A fresh anchor 20 tokens above a retained prefix is cheaper to demote (it is at worst rebuilt
    # from there) than an older endpoint whose copy back saves 1000 tokens of prefill: LRU demotes
    # the older one.
    copy_back = 40.0
    fresh_short = state_demotion_cost(weight=1.0, copy_back=copy_back, rebuild=20)
    older_long = state_demotion_cost(weight=0.8, copy_back=copy_back, rebuild=1000)
    assert fresh_short < older_long
    # A prefix two conversations resume from weighs more than one used equally recently by one.
    shared = state_demotion_cost(combined_likelihood([0.5, 0.5]), copy_back, 1000)
    single = state_demotion_cost(combined_likelihood([0.5]), copy_back, 1000)
    assert shared > single and combined_likelihood([0.5, 0.5]) == pytest.approx(0.75)


def test_an_impossible_need_is_refused_without_a_search():
    items = [Item(f"c{i}", 100 + i) for i in range(6)]
    ext = [pages(f"c{i}", count=1) for i in range(6)] + [pages("c0", "c1", count=3, pinned=True)]
    planner = Planner(items, ext)
    assert planner.plan(need_pages=7) is None and planner.last.work == 0
    assert planner.plan(need_pages=6) is not None
