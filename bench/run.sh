#!/usr/bin/env bash
# `make bench`: benchmark mixprec against peer converters on real pretrained models.
#
#   bash bench/run.sh [python -m bench options, e.g. --models minilm,mnist_cnn]
#
# 1. creates .venv-bench (if missing) and installs bench/requirements.txt + this repo
# 2. fetches the pinned corpus (bench.harness.fetch; cache: bench/cache or $MIXPREC_BENCH_CACHE)
# 3. exports MiniLM to ONNX and trains the MNIST CNN (both cached); with --weights-only also
#    exports SmolLM2-135M, Gemma 3 270M and Qwen2.5-Coder-0.5B with their KV caches
#    (bench.exporters.smollm2, .gemma3, .qwen; cached)
# 4. runs python -m bench (bench/main.py): results in bench/results/<date>.{json,md,png}
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv-bench"
PY="$VENV/bin/python"
STAMP="$VENV/.bench-requirements.sha256"
start=$(date +%s)

if [ ! -x "$PY" ]; then
  echo "run.sh: creating $VENV"
  python3 -m venv "$VENV"
fi
want="$(sha256sum bench/requirements.txt | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "run.sh: installing bench/requirements.txt"
  # torch first, alone, pinned: the machine's CPU wheel; nothing later may pull another.
  "$PY" -m pip install --disable-pip-version-check -q torch==2.13.0
  "$PY" -m pip install --disable-pip-version-check -q -r bench/requirements.txt
  echo "$want" > "$STAMP"
fi
echo "run.sh: installing mixprec from $ROOT"
# constrained by the pins, so mixprec's own dependency ranges cannot move them
"$PY" -m pip install --disable-pip-version-check -q --no-build-isolation \
  -c bench/requirements.txt -e .
"$PY" -m pip check --disable-pip-version-check || echo "run.sh: pip check reported the above"
echo "run.sh: environment ready after $(( $(date +%s) - start ))s"

"$PY" -m bench.harness.fetch
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" -m bench.exporters.minilm
"$PY" -m bench.exporters.mnist
case " $* " in
  *" --weights-only "*)  # the decoders with their KV caches, for the weight-only part (cached)
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" -m bench.exporters.smollm2
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" -m bench.exporters.gemma3
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" -m bench.exporters.qwen ;;
esac
echo "run.sh: corpus and derived models ready after $(( $(date +%s) - start ))s"

"$PY" -m bench "$@"
echo "run.sh: total $(( $(date +%s) - start ))s"
