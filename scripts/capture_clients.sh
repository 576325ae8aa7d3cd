#!/usr/bin/env bash
# Capture what real agent clients send to `ninfer serve`, as replayable fixtures.
#
#   scripts/capture_clients.sh [OUT_DIR]      (default: tests/e2e/fixtures/clients)
#
# Installs Claude Code and Codex (pinned versions) from npm into a scratch directory, starts
# `ninfer serve` on its default model as docs/clients.md says, puts scripts/logging_proxy.py in
# front of it, runs each client for two turns of one conversation (the second continues the
# first), and writes OUT_DIR/<client>.json: the client's version, the commands it ran and every
# request it sent (credentials removed) with the status it got. tests/e2e/test_e2e_client_fixtures.py
# replays them against the real server. Needs node/npm and network access to the npm registry;
# the clients talk only to the local server (a dummy API key, no real API).
#
# NINFER_CMD overrides how the server is started (default: python -m ninfer_core.cli, so a
# checkout with PYTHONPATH set serves its own code).
set -euo pipefail

CLAUDE_CODE_VERSION=2.1.197
CODEX_VERSION=0.171.0
REPO=${NINFER_REPO:-$(cd "$(dirname "$0")/.." && pwd)}
OUT=${1:-$REPO/tests/e2e/fixtures/clients}
NINFER_CMD=${NINFER_CMD:-python -m ninfer_core.cli}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ninfer-capture.XXXXXX")
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mkdir -p "$OUT"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_ready() {  # URL
  for _ in $(seq 1 600); do
    if curl -fsS "$1/health" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  echo "error: $1 did not become ready" >&2; exit 1
}

echo "== installing @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION and @openai/codex@$CODEX_VERSION"
npm install --prefix "$WORK/npm" --no-audit --no-fund --no-save \
  "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION" >/dev/null
# Claude Code's postinstall puts the platform binary in place; npm versions that hold back
# install scripts skip it, and running it again is harmless.
(cd "$WORK/npm/node_modules/@anthropic-ai/claude-code" && node install.cjs >/dev/null)
CLAUDE="$WORK/npm/node_modules/.bin/claude"
CODEX="$WORK/npm/node_modules/.bin/codex"
"$CLAUDE" --version
"$CODEX" --version

# The server as docs/clients.md starts it for both clients.
SERVER_FLAGS="--max-context 65536 --drop-hosted-tools"
PORT=$(free_port)
# shellcheck disable=SC2086
$NINFER_CMD serve --port "$PORT" $SERVER_FLAGS >"$WORK/server.log" 2>&1 &
PIDS+=($!)
wait_ready "http://127.0.0.1:$PORT"

# capture CLIENT VERSION -- TURN_COMMAND... (each turn one shell command, run in the client's home)
capture() {
  local client=$1 version=$2; shift 2
  local proxy_port raw turns=()
  proxy_port=$(free_port)
  raw="$WORK/$client.jsonl"
  : >"$raw"
  python3 "$REPO/scripts/logging_proxy.py" --upstream "http://127.0.0.1:$PORT" --port "$proxy_port" \
    --out "$raw" >"$WORK/proxy-$client.log" 2>&1 &
  local proxy_pid=$!
  PIDS+=("$proxy_pid")
  wait_ready "http://127.0.0.1:$proxy_port"
  local n_before=$(wc -l <"$raw")  # the readiness probe
  local home="$WORK/home-$client"
  mkdir -p "$home/project"
  if [ "$client" = codex ]; then
    mkdir -p "$home/.codex"
    cat >"$home/.codex/config.toml" <<EOF
model = "ninfer-tiny"
model_provider = "ninfer"

[model_providers.ninfer]
name = "NInfer"
base_url = "http://127.0.0.1:$proxy_port/v1"
wire_api = "responses"
EOF
  fi
  local i=0
  for cmd in "$@"; do
    i=$((i + 1))
    echo "== $client turn $i: $cmd"
    (cd "$home/project" && env HOME="$home" ANTHROPIC_BASE_URL="http://127.0.0.1:$proxy_port" \
        ANTHROPIC_API_KEY=sk-ninfer-local CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 \
        API_TIMEOUT_MS=1800000 CLAUDE_STREAM_IDLE_TIMEOUT_MS=1800000 CLAUDE_CODE_DISABLE_1M_CONTEXT=1 \
        CLAUDE="$CLAUDE" CODEX="$CODEX" timeout 900 bash -c "$cmd" </dev/null >"$WORK/$client-turn$i.out" 2>&1) \
      || { echo "error: $client turn $i failed:" >&2; tail -20 "$WORK/$client-turn$i.out" >&2
           echo "server log:" >&2; grep -v warmup "$WORK/server.log" | tail -20 >&2; exit 1; }
    sleep 1  # the proxy writes a request's line when its response has ended
    turns+=("$(wc -l <"$raw")")
  done
  kill "$proxy_pid"
  python3 - "$raw" "$OUT/$client.json" "$client" "$version" "$SERVER_FLAGS" "$n_before" "${turns[*]}" "$@" <<'PY'
import json, sys
raw, out, client, version, flags, skip = sys.argv[1:7]
ends = [int(n) for n in sys.argv[7].split()]
commands = sys.argv[8:]
lines = [json.loads(l) for l in open(raw, encoding="utf-8")][int(skip):]
turns, start = [], int(skip)
for cmd, end in zip(commands, ends):
    reqs = lines[start - int(skip): end - int(skip)]
    for r in reqs:
        r.pop("time", None)
        r.pop("seq", None)
    turns.append({"command": cmd.replace("$CLAUDE", "claude").replace("$CODEX", "codex"), "requests": reqs})
    start = end
doc = {"client": client, "version": version, "server": "ninfer serve " + flags, "turns": turns}
with open(out, "w", encoding="utf-8") as f:
    json.dump(doc, f, ensure_ascii=False, indent=1)
    f.write("\n")
print(f"wrote {out}: " + ", ".join(f"turn {i + 1}: {len(t['requests'])} requests" for i, t in enumerate(turns)))
PY
}

capture claude-code "$CLAUDE_CODE_VERSION" \
  '"$CLAUDE" -p "say hi"' \
  '"$CLAUDE" -p --continue "What is 38 + 47?"'
capture codex "$CODEX_VERSION" \
  '"$CODEX" exec --skip-git-repo-check "say hi"' \
  '"$CODEX" exec --skip-git-repo-check resume --last "What is 38 + 47?"'
echo "== server log (request lines)"
grep -E "request req_" "$WORK/server.log" | grep -v warmup || true
