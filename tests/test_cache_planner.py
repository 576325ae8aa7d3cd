"""The pressure planner on its own (no model, no pools): it frees what the incoming request needs at
the least rebuild cost, and picks differently from least-recently-used where LRU throws away more
work or evicts something that frees nothing."""

from __future__ import annotations

import pytest

from ninfer_core.engine.cache_planner import HOST_RESUME_COST, Extent, Item, Planner, likelihood, lru_choice


def pages(*holders, count=1, host=False, pinned=False):
    return Extent(frozenset(holders), count, host, pinned)


def test_likelihood_halves_per_half_life():
    assert likelihood(0, 0) == 1.0
    assert likelihood(0, 600) == pytest.approx(0.5)
    assert likelihood(10, 5) == 1.0  # a future stamp is fresh, not more than certain


def test_a_long_conversation_outweighs_a_fresher_short_one_unlike_lru():
    now = 1000.0
    # "old": 4000 tokens last used 60 s ago; "new": 300 tokens used a second ago. Each holds its pages.
    items = [Item("old", 4000, likelihood(940, now)), Item("new", 300, likelihood(999, now))]
    ext = [pages("old", count=63), pages("new", count=5)]
    plan = Planner(items, ext).plan(need_pages=5)
    assert plan.drop == ["new"] and plan.freed_pages == 5
    assert lru_choice([("old", 940), ("new", 999)]) == "old"  # LRU would re-prefill 4000 tokens
    assert plan.cost == pytest.approx(300 * likelihood(999, now))


def test_never_evicts_what_frees_nothing():
    # "a" is older, but its pages are also held by a running request (pinned): evicting it frees no
    # page. LRU would evict it first; the planner takes "b".
    items = [Item("a", 640), Item("b", 640)]
    ext = [pages("a", count=10, pinned=True), pages("b", count=10)]
    assert Planner(items, ext).plan(need_pages=3).drop == ["b"]
    # Nothing frees enough: None (the request waits), never a useless eviction.
    assert Planner(items, ext).plan(need_pages=11) is None


def test_shared_pages_are_freed_only_with_all_holders_and_whole_owners_are_considered():
    # A conversation with a turn closure (c, 600 tokens) and an endpoint (e, 700) sharing pages 0-9;
    # e alone holds page 10. Freeing 11 pages needs both: the whole-owner choice finds it.
    items = [Item("c", 600, owner="conv"), Item("e", 700, parents=(("c", 600),), owner="conv"),
             Item("x", 5000)]
    ext = [pages("c", "e", count=10), pages("e", count=1), pages("x", count=79)]
    plan = Planner(items, ext).plan(need_pages=11)
    assert plan.drop == ["c", "e"] and plan.freed_pages == 11
    # Needing one page: drop only the endpoint; a later request resumes from the closure (100 tokens).
    plan = Planner(items, ext).plan(need_pages=1)
    assert plan.drop == ["e"] and plan.cost == pytest.approx(100)


def test_rebuild_cost_counts_from_the_next_shallower_surviving_checkpoint():
    # An anchor "a" (1000 tokens) below an endpoint "e" (1100) in the same conversation, and a shared
    # prefix "s" (900) that always survives (floor). Dropping "a" costs 100 (from s), "e" 100 (from a);
    # dropping both costs e from s: 200, not 100 + 100 counted from each other.
    items = [Item("a", 1000, floor=900), Item("e", 1100, parents=(("a", 1000),), floor=900)]
    planner = Planner(items, [pages("a", "e", count=16), pages("e", count=2)])
    assert planner.cost(frozenset({"a"}), frozenset()) == pytest.approx(100)
    assert planner.cost(frozenset({"e"}), frozenset()) == pytest.approx(100)
    assert planner.cost(frozenset({"a", "e"}), frozenset()) == pytest.approx(100 + 200)


def test_demotion_to_host_is_preferred_while_host_pages_last():
    items = [Item("a", 1280), Item("b", 640)]
    ext = [pages("a", count=20), pages("b", count=10)]
    plan = Planner(items, ext, host_free_pages=20).plan(need_pages=15)
    assert plan.demote == ["a"] and plan.drop == [] and plan.host_pages_needed == 20
    assert plan.cost == pytest.approx(1280 * HOST_RESUME_COST)
    # Without Host room the cheapest eviction that frees enough goes instead.
    plan = Planner(items, ext, host_free_pages=0).plan(need_pages=15)
    assert plan.demote == [] and plan.drop == ["a"]


def test_host_pages_shared_by_two_demoted_checkpoints_are_copied_once():
    items = [Item("c", 600, owner="o"), Item("e", 700, parents=(("c", 600),), owner="o")]
    ext = [pages("c", "e", count=10), pages("e", count=1)]
    plan = Planner(items, ext, host_free_pages=11).plan(need_pages=11)
    assert sorted(plan.demote) == ["c", "e"] and plan.host_pages_needed == 11


def test_host_state_slots_go_to_the_cheapest_image():
    items = [Item("big", 3000, host_image=True), Item("small", 200, host_image=True),
             Item("device", 10, host_image=False)]
    plan = Planner(items, []).plan(need_host_images=1)
    assert plan.drop == ["small"] and plan.freed_host_images == 1


def test_a_plan_dearer_than_the_limit_is_refused():
    items = [Item("a", 500, host_image=True)]
    assert Planner(items, []).plan(need_host_images=1, limit=400) is None
    assert Planner(items, []).plan(need_host_images=1, limit=600).drop == ["a"]


def test_nothing_needed_is_an_empty_plan():
    plan = Planner([Item("a", 10)], [pages("a")]).plan()
    assert plan.drop == plan.demote == [] and plan.cost == 0


def test_a_full_host_tier_makes_room_by_dropping_its_cheapest_resident():
    # Host KV is full of "stale" (a demoted 200-token checkpoint, 4 Host pages). Demoting "big"
    # (3000 tokens, 4 Device pages) needs those 4 Host pages: dropping stale (200) and demoting big
    # (60) beats evicting big (3000).
    items = [Item("big", 3000), Item("stale", 200, on_device=False)]
    ext = [pages("big", count=4), pages("stale", count=4, host=True)]
    plan = Planner(items, ext, host_free_pages=0).plan(need_pages=4)
    assert plan.demote == ["big"] and plan.drop == ["stale"]
    assert plan.cost == pytest.approx(200 + 3000 * HOST_RESUME_COST)


def test_a_page_shared_across_owners_is_freed_by_removing_all_its_holders():
    # The admission deadlock of a one-context pool (8 pages, --max-context 512): conversation 0
    # keeps a turn closure "c0" (8 tokens) and an endpoint "e0" (20 tokens, its own page);
    # conversation 1 resumed from c0 and keeps "c1" (13 tokens), whose tokens share c0's page. A
    # request needing the whole pool must free both pages. No single checkpoint nor one owner's
    # group frees the shared page, so the greedy search used to stall and answer None: the
    # request waited its whole pending timeout behind idle conversations.
    items = [Item("e0", 20, parents=(("c0", 8), ("c1", 13)), owner="conv0", host_image=True),
             Item("c0", 8, owner="conv0", host_image=True),
             Item("c1", 13, parents=(("c0", 8),), owner="conv1")]
    ext = [pages("e0"), pages("c0", "c1")]
    planner = Planner(items, ext, host_free_pages=1000)
    plan = planner.plan(need_pages=2)
    assert plan is not None and plan.freed_pages == 2 and not plan.maximal_fallback
    # Host has room: the conversations are demoted (cheaper than rebuilding them), not evicted.
    assert plan.drop == [] and sorted(plan.demote) == ["c0", "c1", "e0"]
    assert plan.cost == pytest.approx((20 + 8 + 13) * HOST_RESUME_COST)
    # Without Host room they are evicted, every holder of the shared page with them.
    plan = Planner(items, ext, host_free_pages=0).plan(need_pages=2)
    assert plan is not None and sorted(plan.drop) == ["c0", "c1", "e0"] and plan.freed_pages == 2
    # One page is one checkpoint's own: only it goes.
    plan = Planner(items, ext, host_free_pages=0).plan(need_pages=1)
    assert plan.drop == ["e0"]


def test_a_search_with_no_step_that_frees_more_falls_back_to_the_maximal_plan(monkeypatch):
    # Liveness: whenever every evictable checkpoint together covers the need, a plan is returned,
    # even if the greedy steps on offer cannot reach it.
    items = [Item("a", 100, owner="x"), Item("b", 100, owner="y")]
    ext = [pages("a", "b")]
    planner = Planner(items, ext)
    monkeypatch.setattr(planner, "_actions", lambda pages: [("drop", frozenset({"a"})), ("drop", frozenset({"b"}))])
    plan = planner.plan(need_pages=1)
    assert plan is not None and plan.maximal_fallback and sorted(plan.drop) == ["a", "b"]
    assert planner.last.maximal_fallback
