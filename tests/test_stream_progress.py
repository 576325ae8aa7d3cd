"""server/progress.py: llama.cpp's live timings and prompt progress, on a scripted clock."""

from __future__ import annotations

import math

from ninfer_core.server.progress import StreamTimings


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_prompt_phase_is_prompt_only_and_never_moves_backwards():
    clock = Clock()
    st = StreamTimings(1000, clock)
    st.admitted(200)
    assert st.progress() == {"total": 1000, "cache": 200, "processed": 200, "time_ms": 0}
    clock.t += 0.25
    st.progressed(600)
    st.progressed(500)  # coalesced or late events never move it back
    p = st.progress()
    assert p["processed"] == 600 and p["time_ms"] == 250
    snap = st.snapshot()
    assert snap["cache_n"] == 200 and snap["prompt_n"] == 400 and math.isclose(snap["prompt_ms"], 250.0)
    assert math.isclose(snap["prompt_per_second"], 1600.0)
    assert snap["predicted_n"] == 0 and snap["predicted_ms"] == 0 and snap["predicted_per_second"] == 0
    clock.t += 0.25
    final = st.progress(final=True)
    assert final["processed"] == 1000 and final["time_ms"] == 500


def test_generation_uses_token_intervals_and_zero_rates():
    clock = Clock()
    st = StreamTimings(10, clock)
    assert st.snapshot()["prompt_per_second"] == 0.0  # before admission: finite zeros
    st.admitted(0)
    clock.t += 0.1
    st.tokens(1)  # the first token closes the prompt phase
    one = st.snapshot()
    assert one["prompt_n"] == 10 and math.isclose(one["prompt_ms"], 100.0)
    assert one["predicted_n"] == 1 and one["predicted_per_second"] == 0.0  # one token: no interval yet
    clock.t += 0.5
    st.tokens(2)
    clock.t += 9.0  # time passing without a token does not change the generation figures
    s = st.snapshot()
    assert s["predicted_n"] == 3 and math.isclose(s["predicted_ms"], 500.0)
    assert math.isclose(s["predicted_per_second"], 4.0) and math.isclose(s["predicted_per_token_ms"], 250.0)
    assert math.isclose(s["prompt_ms"], 100.0)
    assert st.progress()["processed"] == 10
