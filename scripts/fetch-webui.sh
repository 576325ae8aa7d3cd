#!/usr/bin/env bash
# Build llama.cpp's WebUI for `ninfer serve` from the llama-cpp-python 0.3.36 sdist on PyPI.
#
#   scripts/fetch-webui.sh [OUT_DIR]
#
# OUT_DIR defaults to where `ninfer serve` looks for it without --webui-dir:
# $NINFER_WEBUI_DIR, else ${NINFER_CACHE_DIR:-~/.cache/ninfer}/webui/llama-cpp-python-0.3.36.
# Reproducible: the sdist is checked against its SHA-256, `npm ci` installs exactly the versions
# of the UI's package-lock.json, and nothing else is downloaded (PyPI and the npm registry only).
# Needs python3 with pip, node >= 18 and npm. Prints the directory it built into; an existing
# build there is kept unless FORCE=1.
set -euo pipefail

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CACHE=${NINFER_CACHE_DIR:-$HOME/.cache/ninfer}
OUT=${1:-${NINFER_WEBUI_DIR:-$CACHE/webui/llama-cpp-python-$VERSION}}

if [ -f "$OUT/index.html" ] && [ "${FORCE:-0}" != 1 ]; then
  echo "$OUT"
  exit 0
fi
command -v npm >/dev/null || { echo "error: npm is needed (node >= 18)" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ninfer-webui.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
SDIST="$CACHE/downloads/llama_cpp_python-$VERSION.tar.gz"
mkdir -p "$(dirname "$SDIST")"
if [ ! -f "$SDIST" ] || ! echo "$SHA256  $SDIST" | sha256sum -c --status; then
  echo "== downloading the llama-cpp-python $VERSION sdist from PyPI" >&2
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK/sdist" >&2
  mv "$WORK/sdist/llama_cpp_python-$VERSION.tar.gz" "$SDIST"
fi
echo "$SHA256  $SDIST" | sha256sum -c --status || { echo "error: $SDIST does not have SHA-256 $SHA256" >&2; exit 1; }

UI=llama_cpp_python-$VERSION/vendor/llama.cpp/tools/ui
echo "== unpacking $UI" >&2
tar -xzf "$SDIST" -C "$WORK" "$UI"
cd "$WORK/$UI"
# SvelteKit names each build by the time it was made (kit.version.name defaults to Date.now()),
# which is written into the bundle; a fixed name makes two builds of this sdist byte-identical.
grep -q '^export default config;$' svelte.config.js || { echo "error: unexpected svelte.config.js" >&2; exit 1; }
sed -i "s/^export default config;\$/config.kit.version = { name: 'llama-cpp-python-$VERSION' };\nexport default config;/" \
  svelte.config.js
echo "== npm ci (the versions of package-lock.json)" >&2
npm ci --no-audit --no-fund --loglevel=error >&2
echo "== npm run build" >&2
LLAMA_UI_OUT_DIR="$WORK/dist" npm run build --silent >&2
rm -rf "$OUT"
mkdir -p "$(dirname "$OUT")"
cp -r "$WORK/dist" "$OUT"
echo "$OUT"
