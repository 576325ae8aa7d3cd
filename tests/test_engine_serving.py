"""The Engine end to end on the toy runner: events, batching, limits, admission, cancellation."""

from __future__ import annotations

import asyncio
import functools
import random
import time

import pytest

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import EngineError, GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.testing import ScriptPolicy, ToyRunner, ToyTokenizer, collect, run_async

TOK = ToyTokenizer()
GREEDY = SamplingParams(temperature=0.0)
TIMINGS_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}

_engines: list[Engine] = []


@pytest.fixture(autouse=True)
def _shutdown_engines():
    yield
    while _engines:
        eng = _engines.pop()
        eng.runner.resume()
        eng.shutdown(timeout=30)


def make_engine(runner: ToyRunner | None = None, **opts) -> Engine:
    eng = Engine(runner or ToyRunner(), TOK, EngineOptions(**{"max_context": 512, **opts}))
    _engines.append(eng)
    eng.start()
    return eng


def async_test(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return run_async(fn(*args, **kwargs))

    return wrapper


def assert_idle(eng: Engine) -> dict:
    snap = eng.snapshot()
    assert snap["lanes_active"] == 0 and snap["pending"] == 0 and snap["outstanding"] == 0, snap
    assert snap["pages_free"] == snap["pages_total"] and snap["slots_free"] == snap["slots_total"], snap
    return snap


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


def req(prompt, max_tokens=None, sampling=GREEDY, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), sampling=sampling, max_tokens=max_tokens, **kw)


async def wait_entered(runner: ToyRunner) -> None:
    assert await asyncio.to_thread(runner.entered.wait, 30), "the worker never reached the model"


def scripted(prompt_text: str, output: list[int], after: int | None = TOK.EOS):
    prompt = TOK.encode(prompt_text)
    return prompt, ToyRunner(policy=ScriptPolicy({tuple(prompt): output}, after=after))


# -- the event stream ---------------------------------------------------------------------------


@async_test
async def test_event_stream_shape():
    eng = make_engine()
    prompt = TOK.encode("hello world")
    out = await collect(eng.submit(req(prompt, 20, ignore_eos=True, request_id="r1")))
    assert out.kinds[0] == "admitted" and out.events[0].usage.prompt_tokens == len(prompt)
    assert set(out.kinds[1:-1]) == {"delta"} and out.kinds[-1] == "finish"
    fin = out.finish
    assert (fin.finish_reason, fin.stop_reason) == ("length", "max_tokens")
    assert (fin.usage.prompt_tokens, fin.usage.completion_tokens, fin.usage.cached_tokens) == (2, 20, 0)
    assert len(out.token_ids) == 20
    assert out.text == TOK.decode(out.token_ids)
    assert set(fin.timings) == TIMINGS_KEYS
    assert fin.timings["prompt_n"] == 2 and fin.timings["predicted_n"] == 20 and fin.timings["cache_n"] == 0
    assert all(v >= 0 for v in fin.timings.values())
    snap = assert_idle(eng)
    assert snap["counters"]["requests_completed"] == 1
    assert snap["counters"]["prompt_tokens_total"] == 2 and snap["counters"]["generated_tokens_total"] == 20


@async_test
async def test_request_id_is_kept_or_made():
    eng = make_engine()
    h1 = eng.submit(req([1, 2], 1, request_id="mine"))
    h2 = eng.submit(req([1, 2], 1))
    assert h1.request_id == "mine" and h2.request_id and h2.request_id != "mine"
    assert h1.prompt_tokens == 2 and h1.max_tokens == 1
    await collect(h1)
    await collect(h2)


# -- batching and chunking never change outputs -------------------------------------------------


def _batch_requests(sampled: bool) -> list[GenerationRequest]:
    rng = random.Random(5)
    reqs = []
    for i, (n, m) in enumerate([(5, 60), (70, 25), (130, 90), (200, 40), (1, 33), (64, 64)]):
        sp = (SamplingParams(temperature=1.0, top_p=0.95, top_k=0, seed=i * 1000 - 3,
                             presence_penalty=0.5 * (i % 2), frequency_penalty=0.1 * (i % 3))
              if sampled else GREEDY)
        reqs.append(req(rand_prompt(rng, n), m, sp, ignore_eos=i % 2 == 0))
    return reqs


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@async_test
async def test_outputs_do_not_depend_on_the_batch(sampled):
    solo_eng = make_engine(max_concurrency=1)
    solo = [(await collect(solo_eng.submit(r))).token_ids for r in _batch_requests(sampled)]
    for lanes, chunk in ((4, 32), (3, 1024)):
        runner = ToyRunner()
        eng = make_engine(runner, max_concurrency=lanes, prefill_chunk=chunk, kv_capacity=4096)
        handles = [eng.submit(r) for r in _batch_requests(sampled)]
        together = [(await collect(h)).token_ids for h in handles]
        assert together == solo
        widths = [len(c[1]) for c in runner.calls if c[0] == "decode"]
        assert max(widths) > 1 and max(widths) <= lanes
        assert_idle(eng)
    if sampled:
        assert len({tuple(t[:10]) for t in solo}) == len(solo)


@async_test
async def test_seeded_sampling_repeats_and_seeds_differ():
    eng = make_engine(max_concurrency=2)
    prompt = TOK.encode("hello")

    def r(seed):
        return req(prompt, 30, SamplingParams(temperature=1.0, seed=seed), ignore_eos=True)

    a, b, c = [await collect(eng.submit(r(s))) for s in (42, 42, -42)]
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


@async_test
async def test_process_greedy_and_seed_options():
    prompt = TOK.encode("hello")
    sampled = SamplingParams(temperature=1.0)
    greedy = (await collect(make_engine().submit(req(prompt, 20, ignore_eos=True)))).token_ids
    forced = make_engine(greedy=True)
    assert (await collect(forced.submit(req(prompt, 20, sampled, ignore_eos=True)))).token_ids == greedy
    seeded = make_engine(seed=77)
    x = (await collect(seeded.submit(req(prompt, 20, sampled, ignore_eos=True)))).token_ids
    y = (await collect(seeded.submit(req(prompt, 20, sampled, ignore_eos=True)))).token_ids
    z = (await collect(seeded.submit(req(prompt, 20, SamplingParams(temperature=1.0, seed=77),
                                         ignore_eos=True)))).token_ids
    assert x == y == z


@async_test
async def test_chunked_prefill_equals_unchunked():
    prompt = rand_prompt(random.Random(9), 300)
    outs = []
    for chunk in (1024, 64, 7):
        runner = ToyRunner()
        eng = make_engine(runner, prefill_chunk=chunk)
        outs.append((await collect(eng.submit(req(prompt, 30, ignore_eos=True)))).token_ids)
        sizes = [c[2] for c in runner.calls if c[0] == "prefill"]
        assert sum(sizes) == 300 and max(sizes) <= chunk and len(sizes) == -(-300 // chunk)
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 30


@async_test
async def test_short_prompt_prefills_before_a_long_one():
    runner = ToyRunner()
    eng = make_engine(runner, max_concurrency=3, max_context=1024, prefill_chunk=64, concurrent_prefill=True)
    runner.pause()
    first = eng.submit(req([1, 2, 3], 3, ignore_eos=True))
    await wait_entered(runner)
    long_h = eng.submit(req(rand_prompt(random.Random(1), 600), 2))
    short_h = eng.submit(req([4] * 20, 2))
    runner.resume()
    for h in (first, long_h, short_h):
        assert (await collect(h)).finish is not None
    prefills = [c for c in runner.calls if c[0] == "prefill"]
    assert prefills[0][2] == 3  # the first request's prompt
    assert prefills[1][2] == 20  # the short prompt goes before the long one it arrived behind
    assert [c[2] for c in prefills[2:]] == [64] * 9 + [24]


@async_test
async def test_staged_prefill_holds_admission_back():
    # Without --concurrent-prefill a request is admitted only once the staged prefill finished.
    runner = ToyRunner()
    eng = make_engine(runner, max_concurrency=3, max_context=1024, prefill_chunk=64)
    runner.pause()
    first = eng.submit(req([1, 2, 3], 3, ignore_eos=True))
    await wait_entered(runner)
    long_h = eng.submit(req(rand_prompt(random.Random(1), 600), 2))
    short_h = eng.submit(req([4] * 20, 2))
    runner.resume()
    for h in (first, long_h, short_h):
        assert (await collect(h)).finish is not None
    prefills = [c[2] for c in runner.calls if c[0] == "prefill"]
    # FIFO: the long prompt (arrived first) is prefilled whole before the short one is admitted
    assert prefills == [3] + [64] * 9 + [24] + [20]


@async_test
async def test_decode_rounds_run_between_prefill_chunks():
    runner = ToyRunner()
    eng = make_engine(runner, max_concurrency=2, prefill_chunk=16, decode_rounds_per_prefill=3)
    streaming = eng.submit(req([1, 2, 3, 4, 5], 300, ignore_eos=True))
    got_delta = asyncio.Event()

    def on_event(ev):
        if ev.kind == "delta":
            got_delta.set()

    stream_task = asyncio.create_task(collect(streaming, on_event))
    await asyncio.wait_for(got_delta.wait(), 30)
    newcomer = await collect(eng.submit(req(rand_prompt(random.Random(2), 56), 1)))
    streaming.cancel()
    await stream_task
    assert newcomer.finish.usage.completion_tokens == 1
    kinds = [c[0] for c in runner.calls]
    chunks = [i for i, c in enumerate(runner.calls) if c[0] == "prefill"][1:]  # the newcomer's
    assert [runner.calls[i][2] for i in chunks] == [16, 16, 16, 8]
    between = [kinds[a + 1: b].count("decode") for a, b in zip(chunks, chunks[1:])]
    assert between == [3, 3, 1]  # fewer rounds before the shorter last unit
    assert kinds[chunks[0] - 3: chunks[0]] == ["decode"] * 3
    assert_idle(eng)


# -- output text --------------------------------------------------------------------------------


@async_test
async def test_stop_string_across_token_boundaries():
    out_ids = TOK.encode("hello world STOP here") + [TOK.EOS]
    prompt, runner = scripted("Q:", out_ids)
    eng = make_engine(runner)
    out = await collect(eng.submit(req(prompt, 50, stop=["d ST", "zzz"])))
    assert out.text == "hello worl"
    assert (out.finish.finish_reason, out.finish.stop_reason) == ("stop", "stop_string")
    assert out.token_ids == out_ids[:4] and out.finish.usage.completion_tokens == 4
    out = await collect(eng.submit(req(prompt, 50, stop=["o wor"])))
    assert out.text == "hell" and out.finish.usage.completion_tokens == 2
    assert_idle(eng)


@async_test
async def test_stop_prefix_is_held_back_then_released():
    out_ids = TOK.encode("hello world STOP") + [TOK.EOS]
    prompt, runner = scripted("Q:", out_ids)
    eng = make_engine(runner)
    out = await collect(eng.submit(req(prompt, 50, stop=["STOP!"])))
    deltas = [e for e in out.events if e.kind == "delta"]
    assert out.text == "hello world STOP"
    assert (out.finish.finish_reason, out.finish.stop_reason) == ("stop", "eos")
    assert deltas[-1].text == "STOP" and deltas[-1].token_ids == [260, TOK.EOS]
    assert all("STOP" not in d.text for d in deltas[:-1])
    out = await collect(eng.submit(req(prompt, 4, stop=["STOP!"])))  # released at a length finish too
    assert out.text == "hello world STOP" and out.finish.finish_reason == "length"


@async_test
async def test_utf8_split_over_tokens():
    out_ids = [TOK.EURO_HEAD, 0xAC, 0xC3, 0xA9, ord("!"), TOK.EOS]
    prompt, runner = scripted("Q:", out_ids)
    eng = make_engine(runner)
    out = await collect(eng.submit(req(prompt, 50)))
    deltas = [e for e in out.events if e.kind == "delta"]
    assert out.text == "€é!" and all("\ufffd" not in d.text for d in deltas)
    assert deltas[0].token_ids == [TOK.EURO_HEAD, 0xAC] and deltas[0].text == "€"
    assert out.token_ids == out_ids and out.finish.usage.completion_tokens == 6


@async_test
async def test_special_tokens_produce_no_text():
    prompt, runner = scripted("Q:", [ord("a"), TOK.TOOL, ord("b"), TOK.EOS])
    eng = make_engine(runner)
    out = await collect(eng.submit(req(prompt, 50)))
    assert out.text == "ab" and TOK.TOOL in out.token_ids


@async_test
async def test_eos_stops_and_ignore_eos_runs_on():
    prompt, runner = scripted("Q:", [ord("h"), ord("i"), TOK.EOS, ord("x")], after=ord("z"))
    eng = make_engine(runner)
    out = await collect(eng.submit(req(prompt, 50)))
    assert out.text == "hi" and (out.finish.finish_reason, out.finish.stop_reason) == ("stop", "eos")
    assert out.token_ids[-1] == TOK.EOS and out.finish.usage.completion_tokens == 3
    out = await collect(eng.submit(req(prompt, 6, ignore_eos=True)))
    assert out.text == "hixzz" and out.finish.usage.completion_tokens == 6
    assert (out.finish.finish_reason, out.finish.stop_reason) == ("length", "max_tokens")


@async_test
async def test_eos_as_first_token():
    prompt, runner = scripted("Q:", [TOK.EOS])
    eng = make_engine(runner)
    out = await collect(eng.submit(req(prompt, 50)))
    assert out.kinds == ["admitted", "delta", "finish"] and out.text == ""
    assert out.finish.usage.completion_tokens == 1 and out.finish.stop_reason == "eos"


# -- output limits ------------------------------------------------------------------------------


@async_test
async def test_max_tokens_and_the_context_ceiling():
    eng = make_engine(max_context=128)
    out = await collect(eng.submit(req([1] * 10, 5, ignore_eos=True)))
    assert len(out.token_ids) == 5 and out.finish.stop_reason == "max_tokens"
    h = eng.submit(req([1] * 100, 500, ignore_eos=True))
    assert h.max_tokens == 28
    out = await collect(h)
    assert len(out.token_ids) == 28
    assert (out.finish.finish_reason, out.finish.stop_reason) == ("length", "context")
    out = await collect(eng.submit(req([1] * 100, None, ignore_eos=True)))
    assert len(out.token_ids) == 28 and out.finish.stop_reason == "context"
    out = await collect(eng.submit(req([1] * 127, None, ignore_eos=True)))
    assert len(out.token_ids) == 1 and out.finish.stop_reason == "context"
    assert_idle(eng)


@async_test
async def test_max_tokens_zero_processes_the_prompt_only():
    runner = ToyRunner()
    eng = make_engine(runner, prefill_chunk=16)
    out = await collect(eng.submit(req(list(range(40)), 0)))
    assert out.kinds == ["admitted", "finish"]
    assert (out.finish.finish_reason, out.finish.stop_reason) == ("length", "max_tokens")
    assert out.finish.usage.completion_tokens == 0 and out.finish.timings["predicted_n"] == 0
    assert [c[2] for c in runner.calls] == [16, 16, 8] and {c[0] for c in runner.calls} == {"prefill"}
    assert_idle(eng)


@async_test
async def test_default_output_limit_follows_the_lane_share():
    one = make_engine(max_concurrency=1, max_context=1024, kv_capacity=1024)
    four = make_engine(max_concurrency=4, max_context=1024, kv_capacity=1024)
    big = make_engine(max_concurrency=4, max_context=1024)
    fixed = make_engine(max_concurrency=4, max_context=1024, kv_capacity=1024, default_max_tokens=50)
    assert one.default_output_limit(100) == 924
    assert four.default_output_limit(100) == 156 and four.default_output_limit(300) == 724
    assert big.default_output_limit(100) == 156  # kv_capacity follows max_context: a 1024 pool
    assert fixed.default_output_limit(100) == 50 and fixed.default_output_limit(1000) == 24
    runner = ToyRunner()
    eng = make_engine(runner, max_concurrency=4, max_context=1024, kv_capacity=1024)
    handles = [eng.submit(req([i + 1] * 100, None, ignore_eos=True)) for i in range(4)]
    outs = [await collect(h) for h in handles]
    assert all(len(o.token_ids) == 156 and o.finish.stop_reason == "max_tokens" for o in outs)
    assert max(len(c[1]) for c in runner.calls if c[0] == "decode") == 4  # all four ran together
    assert_idle(eng)


# -- submit-time rejections ---------------------------------------------------------------------


@async_test
async def test_submit_rejections_and_the_engine_keeps_serving():
    eng = make_engine(max_context=256, kv_capacity=128)
    cases = [(req([], 1), "invalid_prompt", "messages", None),
             (req([1] * 256, 1), "context_length_exceeded", "messages", "256"),
             (req([1] * 300, None), "context_length_exceeded", "messages", "300"),
             (req([1] * 200, 0), "context_length_exceeded", "messages", "--kv-capacity"),
             (req([1] * 100, 100), "context_length_exceeded", "max_tokens", "--kv-capacity")]
    for r, code, param, needle in cases:
        with pytest.raises(EngineError) as e:
            eng.submit(r)
        assert (e.value.status, e.value.code, e.value.param) == (400, code, param)
        assert e.value.type == "invalid_request_error"
        if needle:
            assert needle in e.value.message
    out = await collect(eng.submit(req([1] * 100, None, ignore_eos=True)))
    assert len(out.token_ids) == 28  # the default stays inside the 128-token pool
    snap = assert_idle(eng)
    assert snap["counters"]["requests_completed"] == 1


@async_test
async def test_overload_is_429():
    runner = ToyRunner()
    eng = make_engine(runner, max_concurrency=1, max_pending_requests=1)
    runner.pause()
    a = eng.submit(req([1, 2], 3))
    b = eng.submit(req([3, 4], 3))
    with pytest.raises(EngineError) as e:
        eng.submit(req([5, 6], 3))
    assert (e.value.status, e.value.code, e.value.type) == (429, "server_overloaded", "server_overloaded")
    assert eng.snapshot()["outstanding"] == 2
    runner.resume()
    assert (await collect(a)).finish and (await collect(b)).finish
    assert (await collect(eng.submit(req([5, 6], 3)))).finish  # capacity is back
    snap = assert_idle(eng)
    assert snap["counters"]["requests_rejected"] == 1 and snap["counters"]["requests_completed"] == 3


@async_test
async def test_no_pending_room_means_one_request_at_a_time():
    runner = ToyRunner()
    eng = make_engine(runner, max_concurrency=1, max_pending_requests=0)
    runner.pause()
    a = eng.submit(req([1, 2], 3))
    with pytest.raises(EngineError):
        eng.submit(req([3, 4], 3))
    runner.resume()
    await collect(a)
    assert_idle(eng)


@async_test
async def test_queue_timeout_is_503():
    runner = ToyRunner()
    eng = make_engine(runner, max_concurrency=1)
    runner.pause()
    running = eng.submit(req([1, 2], 5, ignore_eos=True))
    await wait_entered(runner)
    late = eng.submit(req([3, 4], 5, deadline=time.monotonic()))
    patient = eng.submit(req([5, 6], 5, ignore_eos=True, deadline=time.monotonic() + 3600))
    runner.resume()
    out = await collect(late)
    assert out.kinds == ["error"]
    err = out.error
    assert (err.status, err.code, err.type) == (503, "request_queue_timeout", "service_unavailable")
    assert len((await collect(running)).token_ids) == 5
    assert len((await collect(patient)).token_ids) == 5
    snap = assert_idle(eng)
    assert snap["counters"]["requests_timed_out"] == 1 and snap["counters"]["requests_completed"] == 2


# -- cancellation -------------------------------------------------------------------------------


@async_test
async def test_cancel_while_queued():
    runner = ToyRunner()
    eng = make_engine(runner, max_concurrency=1)
    runner.pause()
    a = eng.submit(req([1, 2], 10, ignore_eos=True))
    b = eng.submit(req([3, 4], 10, ignore_eos=True))
    await wait_entered(runner)
    b.cancel()
    b.cancel()
    assert eng.snapshot()["pending"] == 1  # released by the worker, at its next boundary
    runner.resume()
    out_b = await collect(b)
    assert out_b.kinds == ["finish"] and out_b.finish.finish_reason == "cancelled"
    assert out_b.finish.usage.completion_tokens == 0
    assert len((await collect(a)).token_ids) == 10
    snap = assert_idle(eng)
    assert snap["counters"]["requests_cancelled"] == 1 and snap["counters"]["requests_completed"] == 1


@async_test
async def test_cancel_while_decoding_leaves_the_batch_mates_alone():
    prompt_b = TOK.encode("hello world")
    solo_b = (await collect(make_engine().submit(req(prompt_b, 60, ignore_eos=True)))).token_ids
    eng = make_engine(max_concurrency=2)
    a = eng.submit(req([1, 2, 3], 400, ignore_eos=True))
    b = eng.submit(req(prompt_b, 60, ignore_eos=True))
    seen = 0

    def on_event(ev):
        nonlocal seen
        if ev.kind == "delta":
            seen += 1
            if seen == 3:
                a.cancel()

    out_a, out_b = await asyncio.gather(collect(a, on_event), collect(b))
    assert out_a.finish.finish_reason == "cancelled" and 3 <= out_a.finish.usage.completion_tokens < 400
    assert out_a.finish.usage.completion_tokens >= len(out_a.token_ids)
    assert out_b.token_ids == solo_b
    a.cancel()  # after the end: a no-op
    snap = assert_idle(eng)
    assert snap["counters"]["requests_cancelled"] == 1 and snap["counters"]["requests_completed"] == 1


@async_test
async def test_cancel_during_prefill():
    runner = ToyRunner()
    eng = make_engine(runner, prefill_chunk=16)
    runner.pause()
    h = eng.submit(req(list(range(100)), 10))
    await wait_entered(runner)
    h.cancel()
    runner.resume()
    out = await collect(h)
    assert out.kinds == ["admitted", "finish"] and out.finish.finish_reason == "cancelled"
    assert len([c for c in runner.calls if c[0] == "prefill"]) < 7
    assert_idle(eng)


# -- failures -----------------------------------------------------------------------------------


@async_test
async def test_prefill_exception_fails_only_that_request():
    runner = ToyRunner()
    runner.fail_if = lambda kind, views, tokens: kind == "prefill" and 7 in tokens
    eng = make_engine(runner, max_concurrency=2)
    good = eng.submit(req([1, 2, 3], 20, ignore_eos=True))
    bad = eng.submit(req([7, 7, 7], 20, ignore_eos=True))
    out_bad, out_good = await collect(bad), await collect(good)
    assert out_bad.kinds[-1] == "error"
    err = out_bad.error
    assert (err.status, err.code, err.type) == (500, "server_error", "server_error")
    assert "injected prefill failure" in out_bad.error.message
    assert len(out_good.token_ids) == 20
    assert len((await collect(eng.submit(req([1, 2, 3], 20, ignore_eos=True)))).token_ids) == 20
    snap = assert_idle(eng)
    assert snap["counters"]["requests_failed"] == 1 and snap["counters"]["requests_completed"] == 2


@async_test
async def test_decode_exception_fails_the_batch_and_serving_goes_on():
    runner = ToyRunner()
    runner.fail_if = lambda kind, views, tokens: kind == "decode" and any(v.num_cached == 12 for v in views)
    eng = make_engine(runner, max_concurrency=2)
    out = await collect(eng.submit(req([1] * 10, 50, ignore_eos=True)))
    assert out.kinds[-1] == "error" and out.error.code == "server_error"
    assert len(out.token_ids) <= 3
    runner.fail_if = None
    assert len((await collect(eng.submit(req([1] * 10, 50, ignore_eos=True)))).token_ids) == 50
    snap = assert_idle(eng)
    assert snap["counters"]["requests_failed"] == 1


@async_test
async def test_shutdown_ends_running_and_queued_requests():
    runner = ToyRunner()
    eng = make_engine(runner, max_concurrency=1)
    runner.pause()
    running = eng.submit(req([1, 2], 400, ignore_eos=True))
    queued = eng.submit(req([3, 4], 10))
    await wait_entered(runner)
    eng.shutdown(timeout=0)  # stop asked; the worker is still inside the held forward
    runner.resume()
    for h in (running, queued):
        out = await collect(h)
        assert out.kinds[-1] == "error"
        assert (out.error.status, out.error.code, out.error.message) == (
            503, "service_unavailable", "server is shutting down")
    eng.shutdown()
    with pytest.raises(EngineError) as e:
        eng.submit(req([1], 1))
    assert e.value.status == 503
    assert_idle(eng)


@async_test
async def test_shutdown_before_start_fails_queued_requests():
    eng = Engine(ToyRunner(), TOK, EngineOptions(max_context=128))
    h = eng.submit(req([1, 2], 3))
    eng.shutdown()
    out = await collect(h)
    assert out.error.status == 503
    assert_idle(eng)


@async_test
async def test_pending_timeout_option_applies_without_a_request_deadline():
    runner = ToyRunner()
    eng = make_engine(runner, max_concurrency=1, pending_timeout_ms=1)
    runner.pause()
    running = eng.submit(req([1, 2], 3, deadline=time.monotonic() + 3600))
    await wait_entered(runner)
    waiting = eng.submit(req([3, 4], 3))
    await asyncio.sleep(0.01)  # not a timing assertion: makes sure the 1 ms deadline is behind us
    runner.resume()
    assert (await collect(waiting)).error.code == "request_queue_timeout"
    assert (await collect(running)).finish is not None
    assert_idle(eng)
