#!/usr/bin/env bash
# The main job on the built-in default model: set up, export EfficientNet-Lite0 to ONNX
# (checked against PyTorch), build an ONNX Runtime engine for this CPU, profile it with
# the trtexec method, check it against a 33 ms p99 budget and write a report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${OUT:-out/demo}
# edgekit replaces only its own output folders, so a second run writes over the first
edgekit export efficientnet-lite0 -o "$OUT/onnx"
edgekit build "$OUT/onnx" --target cpu -o "$OUT/engine"
edgekit profile "$OUT/engine" --json "$OUT/profile.json"
edgekit report "$OUT" --markdown "$OUT/report.md" --budget-ms 33 --percentile p99
edgekit check "$OUT/profile.json" --budget-ms 33 --percentile p99
