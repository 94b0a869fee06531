#!/usr/bin/env bash
# One call on the H200 (device tool): set up, GPU tests, benchmarks; logs and JSON into $OUT.
# Needs .whl/ (bash ../shared/gpu/wheelhouse.sh gguf==0.19.0) and the tokenizers, xz-packed so
# that they travel small (2.9 MB instead of 20):
#   mkdir -p .carry/tok/tokenizers .carry/tokxz
#   cp -r ../shared/fixtures/tokenizers/{qwen,llama3} .carry/tok/tokenizers/
#   tar -C .carry/tok -cJf .carry/tokxz/tok.tar.xz tokenizers
# then carry [".whl", ".carry/tokxz"] (unpacked below into .carry/tok on the machine).
# Usage: bash scripts/gpu_run.sh [setup] [tests] [flashinfer] [profile] [profile-prefill] [profile-offline] [prefill-peers] [breakdown] [gemv] [tma-gemv] [mixed] [barrier] [regs] [tune] [tune-prefill] [split-gemm] [startup] [cold-start] [serve-ab] [bench] [demo]
#        [table | table-3b | table-8b] [pack]
#   pack (last): $OUT's files as one out.tar.gz (a call brings back at most 8 files).
#   flashinfer: its conformance tests (FI_K: a pytest -k filter), then its compiled kernels packed into $OUT as
#   fi-cache.tar.part-*: keep them in .carry/fi/ (38 MB) and carry .carry/fi in later runs
#   that use FlashInfer; they are copied into .whl/ before set-up, which unpacks them.
#   breakdown: benchmarks/step_breakdown.py (the offline throughput run, step by step);
#   profile-offline: benchmarks/profile_offline.py (the offline run's GPU time kernel by kernel,
#   its idle stretches; PROFILE_OFFLINE_ARGS, default 8B with the Llama 3 tokenizer);
#   profile: benchmarks/profile_decode.py (idle GPU time and kernels of a decode step, batch 1, 64).
#   serve-ab: 3B serving only, variants of config (SERVE_AB_SETS) in SERVE_AB_REPEATS rounds.
#   tune: benchmarks/tune_decode_attention.py (decode attention launch options, in graphs).
#   regs: benchmarks/kernel_registers.py (the decode kernel's registers, shared memory and
#   programs an SM, compiled by the machine's Triton).
#   mixed: benchmarks/mixed_step.py (host vs GPU time of eager steps with prompt tokens).
#   gemv: tests/test_gemv.py -m gpu, then benchmarks/bench_gemv.py (skinny_linear against
#   cuBLAS per decode GEMM shape; GEMV_ARGS for its options) into $OUT/gemv.json.
#   tests: test_gpu_correctness runs FlashInfer too; without .carry/fi carried, FlashInfer
#   compiles its kernels inside it (minutes on a fresh machine).
#   (default: tests bench). table: issue 4's whole table, both models (benchmarks/h200_table.py,
#   bounded to ~7.5 min after set-up, TABLE_BUDGET s); table-3b / table-8b: one model each, for
#   two calls. TABLE_SERVE_ROUNDS=N: each concurrency N times, the median's figures reported.
# demo: the real demo model on the GPU. Its GGUF (98 MB) cannot travel in one call (64 MiB with
#   the tracked tree, 12.6 MB at session 23): xz it (90.5 MB) and split it in three parts, each
#   carried by one of three back-to-back calls (a warm machine keeps ignored files and /tmp; it
#   is released after 30 s idle) and moved to /tmp there:
#     xz -T2 -6 -c FILE > /tmp/demo.gguf.xz; split -b 33000000 -d /tmp/demo.gguf.xz .carry/gx-
#     mkdir -p .carry/g1 .carry/g2a .carry/g2b
#     mv .carry/gx-00 .carry/g1/; mv .carry/gx-01 .carry/g2a/; mv .carry/gx-02 .carry/g2b/
#   1. [".whl", ".carry/g2b"]: `bash scripts/gpu_run.sh setup && mv .carry/g2b/gx-02 /tmp/`
#      (the 33 MB parts do not fit beside .whl's 24 MB);
#   2. [".carry/g1", ".carry/tokxz", ".carry/fi64"]: `mv .carry/g1/gx-00 /tmp/ && SKIP_SETUP=1
#      bash scripts/gpu_run.sh setup` (unpacks the tokenizers and FlashInfer's kernel cache);
#   3. [".carry/g2a"]: `mv .carry/g2a/gx-01 /tmp/ && cat /tmp/gx-0* | xz -d -T4 >
#      /tmp/demo.gguf && SKIP_SETUP=1 bash scripts/gpu_run.sh demo`.
#   .carry/fi64 is the part of FlashInfer's cache the demo model uses (its head dim 64, 10 MB):
#   the whole cache that the flashinfer step saves (38 MB since session 37: head dims 64 and
#   128, fp16 and FA3 modules) does not fit beside a 33 MB part. Cut it from .carry/fi with
#     rm -rf /tmp/fic && mkdir -p /tmp/fic .carry/fi64 && cat .carry/fi/fi-cache.tar.part-* |
#     tar -C /tmp/fic -xf - && (cd /tmp/fic && find . -type d -name '*head_dim_qk_64_*' -prune
#     | tar -cf - -T -) | split -b 15M - .carry/fi64/fi-cache.tar.part-
#   Without FlashInfer's cache set INFERX_TEST_BACKENDS=torch,triton, or FlashInfer compiles its
#   kernels first (minutes).
set -uo pipefail
[ -f /tmp/demo.gguf ] && export INFERX_DEMO_GGUF=/tmp/demo.gguf
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 INFERX_FIXTURES=$PWD/.carry/tok
[ -f .carry/tokxz/tok.tar.xz ] && mkdir -p .carry/tok && tar -C .carry/tok -xJf .carry/tokxz/tok.tar.xz
# .carry/fi (the whole cache), else .carry/fi64 (the demo model's part): one of them, since both
# name their parts alike (a warm machine keeps an earlier call's folder beside this one's).
fi_parts=
for d in .carry/fi .carry/fi64; do
  compgen -G "$d/fi-cache.tar.part-*" >/dev/null && { fi_parts=$(ls "$d"/fi-cache.tar.part-*); break; }
done
[ -n "$fi_parts" ] && cp $fi_parts .whl/ 2>/dev/null
# SKIP_SETUP=1: a second gpu_run.sh in the same call, or a call right after one that set up
# (a warm machine keeps the installed packages). .whl, the tokenizers and .carry/fi together
# pass the 64 MiB carry limit, so FlashInfer runs take two calls: set up carrying .whl and
# .carry/tokxz, then carry only .carry/fi with SKIP_SETUP=1, which unpacks its parts here.
if [ -z "${SKIP_SETUP:-}" ]; then
  bash .whl/setup.sh >"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
  tail -1 "$OUT/setup.log"
elif [ -n "$fi_parts" ]; then
  mkdir -p "$HOME/.cache/flashinfer"
  cat $fi_parts | tar -C "$HOME/.cache/flashinfer" -xf -
fi
# pip stamps what it installs with the install time, so FlashInfer's headers (and tvm_ffi's,
# which it includes) are newer than every carried kernel object and ninja rebuilds them all
# (session 38: the head-dim-64 modules rebuilt from .carry/fi64 in 45 s). Back-date the two
# packages' files: the carried objects were built from the same release's files.
if [ -n "$fi_parts" ]; then
  for d in $(python3 -c "import importlib.util as u, os
for n in ('flashinfer', 'tvm_ffi'):
    s = u.find_spec(n)
    print(os.path.dirname(s.origin) if s and s.origin else '')" 2>/dev/null); do
    find "$d" -exec touch -h -d 2026-01-01 {} +
  done
fi
# A variant ("KEY=VALUE KEY=VALUE") as the --set flags the benchmark scripts take, in sets.
set_flags() { sets=(); for kv in $1; do sets+=(--set "$kv"); done; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench)
TOK=.carry/tok/tokenizers/qwen
for step in "${steps[@]}"; do
  case $step in
    setup) ;;  # set-up only (done above), e.g. before benchmarks run by hand in the same call
    tests)
      files=${TESTS_FILES:-tests/test_kv_sizing.py tests/test_gpu_correctness.py \
        tests/test_cuda_graphs.py tests/test_triton_attention.py}
      # TESTS_K: a pytest -k expression (ANDed with "not demo").
      timeout ${TESTS_TIMEOUT:-400} python3 -m pytest $files -m gpu -q \
        -k "not demo${TESTS_K:+ and ($TESTS_K)}" 2>&1 | tee "$OUT/gpu-tests.log" | tail -15 ;;
    flashinfer)
      timeout 420 python3 -m pytest tests/test_flashinfer_attention.py -q -rs --maxfail=5 \
        ${FI_K:+-k "$FI_K"} 2>&1 \
        | tee "$OUT/gpu-flashinfer.log" | tail -15
      bash .whl/save-cache.sh "$OUT" 2>&1 | tail -3 ;;
    profile)
      # PROFILE_MODES: graphs|eager, each with -overlap or -serial (engine.overlap on/off);
      # PROFILE_SETS: ;-separated config variants (space-separated KEY=VALUE), each profiled
      # in every mode; PROFILE_ARGS: more options (--preset, --batch, --tokenizer ...).
      IFS=';' read -ra variants <<< "${PROFILE_SETS:-}"
      [ ${#variants[@]} -eq 0 ] && variants=("")
      for mode in ${PROFILE_MODES:-graphs-overlap graphs-serial}; do
        flag="--overlap ${mode##*-}"; flag=${flag/overlap overlap/overlap on}
        flag=${flag/overlap serial/overlap off}
        [ "${mode%%-*}" = eager ] && flag="$flag --eager"
        i=0
        for v in "${variants[@]}"; do
          set_flags "$v"
          echo "== profile $mode: ${v:-defaults} ${PROFILE_ARGS:-}"
          timeout 300 python3 benchmarks/profile_decode.py --tokenizer $TOK --backend triton \
            --batch 1,64 --steps 64 $flag "${sets[@]}" ${PROFILE_ARGS:-} \
            --json "$OUT/profile-$mode-$i.json" 2>&1 | grep -v Warning | tail -${PROFILE_TAIL:-40}
          i=$((i + 1))
        done
      done ;;
    prefill-peers)
      # benchmarks/bench_prefill_peers.py at the 8B's heads and the 3B's (PEERS_ARGS: --variants,
      # --dense configs, --shapes ...; FlashInfer variants compile its modules unless cached).
      for heads in 32,8 16,2; do
        timeout 150 python3 benchmarks/bench_prefill_peers.py --heads $heads \
          ${PEERS_ARGS:---variants triton,triton-dense,sdpa --dense 128x64x8x2,128x64x8x3,64x64x4x2,128x128x8x2} \
          --json "$OUT/prefill-peers-${heads/,/-}.json" 2>&1 | grep -v -i warn | tail -40
      done ;;
    profile-prefill)
      # benchmarks/profile_prefill.py: the kernels of the offline run's prefill steps, grouped,
      # and the dense-layer TFLOPS (PREFILL_ARGS: --preset, --tokenizer, --chunk ...).
      timeout 240 python3 benchmarks/profile_prefill.py ${PREFILL_ARGS:---preset qwen2.5-3b-instruct --tokenizer $TOK} \
        --json "$OUT/profile-prefill.json" 2>&1 | grep -v -i warn | tail -${PROFILE_TAIL:-40} ;;
    profile-offline)
      timeout 240 python3 benchmarks/profile_offline.py ${PROFILE_OFFLINE_ARGS:---preset llama-3.1-8b-instruct --tokenizer .carry/tok/tokenizers/llama3} \
        --json "$OUT/profile-offline.json" 2>&1 | grep -v -i warn | grep -v USDT | tail -${PROFILE_TAIL:-45} ;;
    breakdown)
      # BREAKDOWN_SETS: ;-separated variants, each a space-separated list of --set KEY=VALUE.
      IFS=';' read -ra variants <<< "${BREAKDOWN_SETS:-engine.overlap=true;engine.overlap=false}"
      i=0
      for v in "${variants[@]}"; do
        set_flags "$v"
        echo "== breakdown: $v"
        timeout 240 python3 benchmarks/step_breakdown.py --tokenizer $TOK "${sets[@]}" \
          --json "$OUT/breakdown-$i.json" 2>&1 | grep -v -i warn | tail -8
        i=$((i + 1))
      done ;;
    gemv)
      timeout 240 python3 -m pytest tests/test_gemv.py -m gpu -q 2>&1 | tee "$OUT/gpu-gemv-tests.log" \
        | tail -8
      timeout 300 python3 benchmarks/bench_gemv.py ${GEMV_ARGS:-} --json "$OUT/gemv.json" 2>&1 \
        | tee "$OUT/gemv.log" ;;
    tma-gemv)
      # the TMA GEMV's GPU tests (alone and in the model), then benchmarks/bench_tma_gemv.py
      # (against cuBLAS and the split bmm per decode GEMM shape; TMA_ARGS for its options).
      timeout 200 python3 -m pytest tests/test_tma_gemv.py tests/test_kernel_ops.py -m gpu -q \
        -k "tma" 2>&1 | tail -8
      timeout 300 python3 benchmarks/bench_tma_gemv.py ${TMA_ARGS:-} --json "$OUT/tma-gemv.json" \
        2>&1 | grep -v "^  " | tee "$OUT/tma-gemv.log" ;;
    serve-ab)
      # SERVE_AB_SETS: ;-separated variants, each a space-separated list of KEY=VALUE (default:
      # the engine on a thread vs in its own process), SERVE_AB_REPEATS rounds of all of them
      # (serving figures spread widely from run to run: compare rounds, not single runs).
      IFS=';' read -ra variants <<< "${SERVE_AB_SETS:-server.engine_process=false;server.engine_process=true}"
      for r in $(seq 1 ${SERVE_AB_REPEATS:-2}); do
        i=0
        for v in "${variants[@]}"; do
          set_flags "$v"
          echo "== round $r: $v"
          timeout 150 python3 benchmarks/h200_table.py --models qwen2.5-3b-instruct --only serve \
            --concurrency ${SERVE_AB_CONCURRENCY:-8,64,256} --tokenizers .carry/tok/tokenizers \
            --budget-s 140 "${sets[@]}" --json "$OUT/serve-ab-$r-$i.json" 2>&1 | grep "serve c="
          i=$((i + 1))
        done
      done ;;
    split-gemm)
      # benchmarks/bench_split_gemm.py: cuBLAS as the model calls it vs K-split bmm parts.
      timeout 200 python3 benchmarks/bench_split_gemm.py ${SPLIT_GEMM_ARGS:-} \
        --json "$OUT/split-gemm.json" 2>&1 | grep -v -i warn ;;
    startup)
      # benchmarks/server_startup.py: inferx-server spawn-to-ready, engine process vs thread.
      timeout 300 python3 benchmarks/server_startup.py --rounds ${STARTUP_ROUNDS:-2} \
        --set model.preset=qwen2.5-3b-instruct --set model.tokenizer=$TOK \
        --set model.dtype=bfloat16 --json "$OUT/server-startup.json" 2>&1 | grep -v -i warn ;;
    cold-start)
      # benchmarks/cold_start.py: 3B start-up on an empty Triton cache, engine.compile_threads
      # 0 against 8 (COLD_ARGS: --variants, --preset, --warm ...).
      timeout 300 python3 benchmarks/cold_start.py --tokenizer $TOK --rounds ${COLD_ROUNDS:-2} \
        ${COLD_ARGS:-} --json "$OUT/cold-start.json" 2>&1 | grep -v -i warn ;;
    barrier)
      # benchmarks/bench_grid_barrier.py: a launch, a PDL launch and a grid barrier a phase, and
      # split phases finished by a launch or by their last arrivals (BARRIER_ARGS: --programs,
      # --phases).
      timeout 120 python3 benchmarks/bench_grid_barrier.py ${BARRIER_ARGS:-} \
        --json "$OUT/grid-barrier.json" 2>&1 | grep -v -i warn ;;
    regs)
      # benchmarks/kernel_registers.py with this machine's Triton (REGS_ARGS: --group, --warps ...).
      timeout 200 python3 benchmarks/kernel_registers.py ${REGS_ARGS:---warps 2,4,8 --block-n 16,32,64} \
        --json "$OUT/kernel-registers.json" 2>&1 | grep -v -i warn ;;
    tune)
      timeout 300 python3 benchmarks/tune_decode_attention.py ${TUNE_ARGS:-} \
        --json "$OUT/tune-decode.json" 2>&1 | grep -v -i warn | tail -20 ;;
    tune-prefill)
      # benchmarks/tune_prefill_attention.py: the prefill kernel's tiles and stages per prompt
      # shape (TUNE_PREFILL_ARGS, e.g. --grid block_m=64,128 --grid stages=1,2,3; --heads 32,8
      # for 8B).
      timeout 300 python3 benchmarks/tune_prefill_attention.py ${TUNE_PREFILL_ARGS:-} \
        --json "$OUT/tune-prefill.json" 2>&1 | grep -v -i warn | tail -20 ;;
    mixed)
      timeout 300 python3 benchmarks/mixed_step.py --tokenizer $TOK ${MIXED_ARGS:-} \
        --json "$OUT/mixed-step.json" 2>&1 | grep -v -i warn | tail -45 ;;
    demo)
      python3 -m pytest tests/test_gpu_correctness.py -m gpu -q -k demo 2>&1 \
        | tee "$OUT/gpu-demo.log" | tail -15 ;;
    bench)
      for be in torch triton; do
        inferx-bench latency --preset qwen2.5-3b-instruct \
          --tokenizer $TOK --dtype bfloat16 --attention-backend $be --kv-cache-memory 40GiB \
          --scheduler-max-batched-tokens 8192 --scheduler-prefill-chunk 8192 --runs 3 \
          --json "$OUT/latency-3b-$be.json" 2>&1 | tail -12
      done
      inferx-bench throughput --preset qwen2.5-3b-instruct \
        --tokenizer $TOK --dtype bfloat16 --attention-backend triton --kv-cache-memory 40GiB \
        --input-len 512 --output-len 256 --num-prompts 256 --scheduler-max-batched-tokens 8192 \
        --scheduler-prefill-chunk 2048 --json "$OUT/throughput-3b-triton.json" 2>&1 | tail -8 ;;
    table|table-3b|table-8b)
      case $step in
        table) models=qwen2.5-3b-instruct,llama-3.1-8b-instruct; name=h200-table ;;
        table-3b) models=qwen2.5-3b-instruct; name=h200-table-3b ;;
        table-8b) models=llama-3.1-8b-instruct; name=h200-table-8b ;;
      esac
      python3 benchmarks/h200_table.py --models $models --tokenizers .carry/tok/tokenizers \
        --budget-s ${TABLE_BUDGET:-450} --serve-rounds ${TABLE_SERVE_ROUNDS:-1} \
        --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" ;;
    pack)
      # Everything under $OUT as one out.tar.gz: a device call brings back at most 8 files
      # (session 24 lost its serve JSONs that way). Put it last: pack ... after the other steps.
      tar -czf /tmp/out-pack.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete \
        && mv /tmp/out-pack.tar.gz "$OUT/out.tar.gz" && ls -la "$OUT/out.tar.gz" ;;
    *) echo "gpu_run.sh: unknown step $step" >&2; exit 2 ;;
  esac
done
