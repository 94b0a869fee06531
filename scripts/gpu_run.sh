#!/usr/bin/env bash
# One device call on an H100 or H200: set up, the GPU tests, the benchmark table; logs and JSON
# into $OUT. What to carry and how (the wheelhouse, the tokenizers, FlashInfer's kernel cache,
# the demo GGUF in parts): docs/CONTRIBUTING.md.
# Usage: bash scripts/gpu_run.sh [setup] [tests] [table]   (default: tests table)
#   setup: only the set-up below (every call does it unless SKIP_SETUP=1).
#   tests: pytest -m gpu over the GPU test files (TESTS_FILES; TESTS_K, a -k filter, default
#          "not demo"; TESTS_TIMEOUT s, default 540).
#   table: benchmarks/gpu_table.py, both models (TABLE_MODELS to pick; TABLE_BUDGET s, default
#          450; TABLE_SERVE_ROUNDS, default 1), its clock logs packed as one tar.xz.
# SKIP_SETUP=1: a machine that already set up (a warm one keeps what was installed).
set -uo pipefail
[ -f /tmp/demo.gguf ] && export INFERX_DEMO_GGUF=/tmp/demo.gguf
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 INFERX_FIXTURES=$PWD/.carry/tok
[ -f .carry/tokxz/tok.tar.xz ] && mkdir -p .carry/tok && tar -C .carry/tok -xJf .carry/tokxz/tok.tar.xz
# FlashInfer's kernel cache: .carry/fi (all of it), else .carry/fi64 (the demo model's head dim).
fi_parts=
for d in .carry/fi .carry/fi64; do
  compgen -G "$d/fi-cache.tar.part-*" >/dev/null && { fi_parts=$(ls "$d"/fi-cache.tar.part-*); break; }
done
if [ -z "${SKIP_SETUP:-}" ]; then
  [ -n "$fi_parts" ] && cp $fi_parts .whl/ 2>/dev/null  # setup.sh unpacks the parts it finds
  bash .whl/setup.sh >"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
  tail -1 "$OUT/setup.log"
elif [ -n "$fi_parts" ]; then
  mkdir -p "$HOME/.cache/flashinfer"
  cat $fi_parts | tar -C "$HOME/.cache/flashinfer" -xf -
fi
# pip stamps installed files with the install time, so FlashInfer's headers (and tvm_ffi's)
# would be newer than every carried kernel object and ninja would rebuild them all: back-date
# the two packages (the carried objects were built from the same release's files).
if [ -n "$fi_parts" ]; then
  for d in $(python3 -c "import importlib.util as u, os
for n in ('flashinfer', 'tvm_ffi'):
    s = u.find_spec(n)
    print(os.path.dirname(s.origin) if s and s.origin else '')" 2>/dev/null); do
    find "$d" -exec touch -h -d 2026-01-01 {} +
  done
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests table)
for step in "${steps[@]}"; do
  case $step in
    setup) ;;
    tests)
      # FlashInfer's tests compile its kernels first (minutes) unless .carry/fi is carried.
      files=${TESTS_FILES:-$(grep -l "mark.gpu" tests/test_*.py | tr '\n' ' ')}
      timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest $files -m gpu -q -k "${TESTS_K:-not demo}" \
        2>&1 | tee "$OUT/gpu-tests.log" | tail -15 ;;
    table)
      models=${TABLE_MODELS:-qwen2.5-3b-instruct,llama-3.1-8b-instruct}
      python3 benchmarks/gpu_table.py --models "$models" --tokenizers .carry/tok/tokenizers \
        --budget-s "${TABLE_BUDGET:-450}" --serve-rounds "${TABLE_SERVE_ROUNDS:-1}" \
        --json "$OUT/gpu-table.json" 2>&1 | tee "$OUT/gpu-table.log"
      # a device call brings back few files: the per-run clock CSVs and logs as one archive
      [ -d "$OUT/gpu-table-logs" ] && tar -C "$OUT" -cJf "$OUT/gpu-table-logs.tar.xz" \
        gpu-table-logs && rm -rf "$OUT/gpu-table-logs" ;;
    *) echo "gpu_run.sh: unknown step $step (setup, tests, table)" >&2; exit 2 ;;
  esac
done
