"""End-to-end: the context cache and /slots on a real server (tiny Qwen3.5, real clients)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(600)

SYSTEM = {"role": "system", "content": "You are terse. Use the tools when needed and quote their output."}
TURN1 = [SYSTEM, {"role": "user", "content": "What does a context cache keep between turns?"}]


def chat(client, messages, max_tokens=12):
    r = client.chat.completions.with_raw_response.create(model="", messages=messages, max_tokens=max_tokens,
                                                         temperature=0)
    return r.parse(), r.http_response.json()


def follow_up(turn1, reply_text, question="Name one cost of it."):
    return turn1 + [{"role": "assistant", "content": reply_text}, {"role": "user", "content": question}]


def assert_error(resp: httpx.Response, status: int, code: str, param: str | None = None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def slots(base) -> list:
    return httpx.get(base + "/slots", timeout=30).json()


@pytest.fixture
def cache_server(start_server, tmp_path):
    save_dir = tmp_path / "slots"
    server = start_server("--slot-save-path", str(save_dir), "--max-private-continuations", "2")
    server.save_dir = save_dir
    return server


def test_multi_turn_reuse_matches_a_root_only_server(cache_server, start_server):
    root_server = start_server("--no-prefix-reuse")
    with openai.OpenAI(base_url=cache_server.api_base, api_key="x", max_retries=0, timeout=300) as c, \
            openai.OpenAI(base_url=root_server.api_base, api_key="x", max_retries=0, timeout=300) as r:
        one, raw_one = chat(c, TURN1)
        assert one.usage.prompt_tokens_details.cached_tokens == 0 and raw_one["timings"]["cache_n"] == 0
        turn2 = follow_up(TURN1, one.choices[0].message.content or "")
        two, raw_two = chat(c, turn2)
        cached = two.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < two.usage.prompt_tokens
        assert raw_two["timings"]["cache_n"] == cached
        assert raw_two["timings"]["prompt_n"] == two.usage.prompt_tokens - cached
        # Greedy output from the checkpoint equals the same prompt prefilled from root.
        root_two, raw_root = chat(r, turn2)
        assert raw_root["timings"]["cache_n"] == 0
        assert two.choices[0].message.content == root_two.choices[0].message.content
        # Regenerating the last reply resumes at its turn closure.
        again, raw_again = chat(c, turn2)
        stream = list(c.chat.completions.create(model="", messages=turn2, max_tokens=4, temperature=0,
                                                stream=True))
        last = stream[-1].model_extra
        assert len(last["session_digest"]) == 16 and last["timings"]["cache_n"] > 0
        assert raw_again["timings"]["cache_n"] >= cached
        assert again.choices[0].message.content == two.choices[0].message.content

    rows = slots(cache_server.base_url)
    assert len(rows) == 2 and all(row["is_processing"] is False for row in rows)
    # The response names the slot and session digest it was retained under.
    assert rows[last["id_slot"]]["session_digest"] == last["session_digest"]  # the latest session
    assert len(raw_again["session_digest"]) == 16 and 0 <= raw_again["id_slot"] < 2
    assert "id_slot" not in raw_root  # a root-only server retains nothing
    kept = [row for row in rows if row["retained"]]
    assert kept and all(len(row["session_digest"]) == 16 for row in kept)
    assert all(row["checkpoints"] and row["n_prompt_tokens"] > 0 for row in kept)
    load = httpx.get(cache_server.base_url + "/v1/load").json()
    assert load["counters"]["reused_prompt_tokens"] >= cached
    assert load["counters"]["committed_decode_tokens"] > 0 and load["counters"]["decode_rounds"] > 0
    assert load["capacity"]["host_state_slots"] == 8 and load["capacity"]["host_kv_bytes"] == 8192 * 2**20
    assert load["capacity"]["device_state_slots"] == 2  # one lane + one Device checkpoint slot
    assert load["occupancy"]["device_state_slots"] >= 1  # retained checkpoints hold Device slots
    assert load["requests"]["running"] == 0
    assert "What does a context cache" not in cache_server.log()  # no prompt text in the logs


def test_slot_save_erase_restore_and_refused_files(cache_server):
    base = cache_server.base_url
    with openai.OpenAI(base_url=cache_server.api_base, api_key="x", max_retries=0, timeout=300) as c:
        one, _ = chat(c, TURN1)
    slot = next(row for row in slots(base) if row["retained"])
    sid, digest = slot["id"], slot["session_digest"]

    # Conditional save with a stale digest is refused; a save writes the file.
    assert_error(httpx.post(f"{base}/slots/{sid}?action=save",
                            json={"filename": "Conv-1.bin", "if_digest": "0" * 16}), 409, "slot_session_mismatch",
                 "if_digest")
    saved = httpx.post(f"{base}/slots/{sid}?action=save", json={"filename": "Conv-1.bin", "if_digest": digest},
                       timeout=60).json()
    assert saved["filename"] == "conv-1.bin" and saved["session_digest"] == digest
    assert saved["n_saved"] == slot["n_prompt_tokens"] and saved["n_written"] > 0
    path = cache_server.save_dir / "conv-1.bin"
    assert path.stat().st_size == saved["n_written"]
    assert not [p for p in os.listdir(cache_server.save_dir) if p.endswith(".tmp")]

    erased = httpx.post(f"{base}/slots/{sid}?action=erase", json={}).json()
    assert erased == {"id_slot": sid, "n_erased": saved["n_saved"]}
    assert slots(base)[sid]["retained"] is False
    restored = httpx.post(f"{base}/slots/{sid}?action=restore", json={"filename": "CONV-1.BIN"}, timeout=60).json()
    assert restored["n_restored"] == saved["n_saved"] and restored["session_digest"] == digest
    row = slots(base)[sid]
    assert row["retained"] and row["checkpoints"] == slot["checkpoints"]

    # The restored session is an ordinary cache entry: the next turn reuses it.
    with openai.OpenAI(base_url=cache_server.api_base, api_key="x", max_retries=0, timeout=300) as c:
        _, raw = chat(c, follow_up(TURN1, one.choices[0].message.content or ""))
    assert raw["timings"]["cache_n"] > 0

    # A truncated and an altered file are refused and leave the slot empty.
    data = path.read_bytes()
    (cache_server.save_dir / "cut.bin").write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    flipped[len(flipped) // 3] ^= 0x01
    (cache_server.save_dir / "flip.bin").write_bytes(bytes(flipped))
    for name in ("cut.bin", "flip.bin", "missing.bin"):
        httpx.post(f"{base}/slots/{sid}?action=restore", json={"filename": "conv-1.bin"}, timeout=60)
        assert slots(base)[sid]["retained"]
        assert_error(httpx.post(f"{base}/slots/{sid}?action=restore", json={"filename": name}, timeout=60),
                     400, "slot_restore_failed")
        assert slots(base)[sid]["retained"] is False
    load = httpx.get(base + "/v1/load").json()
    assert load["requests"]["running"] == 0

    # Request errors: status, code and param; the server keeps serving.
    assert_error(httpx.post(f"{base}/slots/{sid}?action=copy", json={}), 400, "invalid_action", "action")
    assert_error(httpx.post(f"{base}/slots/7?action=erase", json={}), 400, "invalid_slot", "id_slot")
    assert_error(httpx.post(f"{base}/slots/x?action=erase", json={}), 400, "invalid_slot", "id_slot")
    for bad in ("../escape", ".hidden", "trail.", "CON", "nul.txt", "a" * 129, "", "sp ace"):
        assert_error(httpx.post(f"{base}/slots/{sid}?action=save", json={"filename": bad}), 400,
                     "invalid_filename", "filename")
    assert_error(httpx.post(f"{base}/slots/{sid}?action=save", json={"filename": "empty.bin"}), 400,
                 "slot_save_failed")
    assert_error(httpx.post(f"{base}/slots/{sid}?action=save", content=b"{not json"), 400, "invalid_json")
    with openai.OpenAI(base_url=cache_server.api_base, api_key="x", max_retries=0, timeout=300) as c:
        assert chat(c, TURN1)[0].choices[0].finish_reason in ("stop", "length")


def test_slot_persistence_disabled_is_501(live_server):
    r = httpx.post(live_server.base_url + "/slots/0?action=save", json={"filename": "a.bin"})
    err = assert_error(r, 501, "slot_persistence_disabled")
    assert err["type"] == "not_supported_error"
    assert httpx.get(live_server.base_url + "/health").status_code == 200


@pytest.mark.parametrize("flags", [["--no-prefix-reuse", "--host-state-slots", "0"],
                                   ["--no-prefix-reuse", "--slot-save-path", "x"],
                                   ["--host-cache-mib", "64", "--host-kv-mib", "8"],
                                   ["--no-prefix-reuse", "--disk-kv-path", "x"],
                                   ["--disk-kv-restore", "--disk-kv-gib", "1"]])
def test_refused_cache_flag_combinations_exit_1(tiny_artifact, flags):
    proc = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", tiny_artifact, "--port", "0", *flags],
                          capture_output=True, text=True, timeout=120, check=False, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1
    assert flags[0] in proc.stderr or flags[-2] in proc.stderr
