#!/usr/bin/env bash
# One device run: CUDA tests, then the GPU benchmarks; everything lands in $OUT/results.tgz.
# Run from the repo root on the GPU machine (no network): carry the pure-Python wheels the image
# lacks (bytecode, depyf, astor, dill) in ./wheels, e.g.
#   pip download bytecode depyf astor dill --no-deps --only-binary=:all: --python-version 3.12 -d wheels
# and compressed-tensors with what it imports that the image lacks (without them the W8A8 checkpoint tests,
# tests/models/test_quant_fusion.py and test_quantized.py, skip on the GPU: "could not import 'compressed_tensors'"):
#   pip download compressed-tensors loguru pydantic pydantic-core annotated-types typing-inspection --no-deps \
#     --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d wheels
# and xgrammar with its FFI library (without them the structured-output tests skip on the GPU):
#   pip download xgrammar apache-tvm-ffi --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d wheels
# Usage: bash benchmarks/gpu_pass.sh [failed|tests|ops|opsfull|sweepsmall|profile|profileprefill|prefill1b|clean|ops3|tracesize|overhead|decode|decode8b|serve|quant|importtime|startupprof|startupphases|startup|gemm|gemmsweep|attn|compare1b|compare8b|comparepw|passes|passesi|pwi|prefix|attnhost|tptests|allreduce|tpdecode|tpsp|pw|mixed|attnprof|attnbreak|chunked|fqconfigs|stepab|kprofmodes|gated|gatedk|gatedstep|gatedlin|attnops|quantgemm|gaqfp8|targets|pdlinline|nativeops|w8a8|preload|next16|swap16|swap16b|next16c|attnvar|b128|tma|tmastep|narrow1b|attn1b|step1b|gated8b|attnb1|normlin ...]
# (default: tests ops overhead decode). Per-step timeouts keep one call inside the device's 10 minutes.
set -u
OUT=${OUT:-/tmp/out}
R=${R:-/tmp/dynamo_once_results}   # two passes at once (one per GPU): give each its own R and TAR
TAR=${TAR:-results.tgz}
mkdir -p "$R" "$OUT"
if ls wheels/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site wheels/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
# The GPU image sets PYTHONDONTWRITEBYTECODE and its site-packages are read-only: every process byte-compiled
# torch, sympy and Dynamo again (2554 modules, 5.6 s of a warm start's profile). An install has its .pyc files;
# here they go to a writable pycache.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
steps=${*:-tests ops overhead decode}
for step in $steps; do
  echo "== $step $(date -u +%H:%M:%S)"
  case $step in
    failed)   timeout ${FAILED_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -m cuda --tb=short -rf -n ${FAILED_WORKERS:-0} \
                ${FAILED_TESTS:-tests/models/test_llava.py tests/ops/test_size_configs.py} > "$R/failed_tests.log" 2>&1
              grep -E "^E |FAILED|passed|failed" "$R/failed_tests.log" | head -30 ;;
    tests)    # TESTS_PATHS: part of the suite (e.g. tests/models, ~80 slow model tests; the whole suite on 8 workers
              # reached 97% in 380 s, those left)
              timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -v -p no:cacheprovider -n ${TEST_WORKERS:-8} -m cuda --durations=30 \
                --tb=short -rf ${TESTS_PATHS:-tests} > "$R/cuda_tests.log" 2>&1
              grep -E "FAILED|ERROR" "$R/cuda_tests.log" | head -20; tail -1 "$R/cuda_tests.log" ;;
    ops)      timeout 200 python3 benchmarks/bench_ops.py --targets-only --no-dynamic --out "$R" 2>&1 \
                | grep -E "PASS|MISS" | tail -30 ;;
    opsfull)  timeout ${OPS_TIMEOUT:-560} python3 benchmarks/bench_ops.py --no-dynamic --out "$R" 2>&1 | grep -E "PASS|MISS" | tail -40 ;;
    sweepsmall) timeout ${SWEEP_TIMEOUT:-400} python3 benchmarks/bench_ops.py --sweep-small \
                  --ops "${SWEEP_OPS:-silu_and_mul,gelu_and_mul,static_scaled_fp8_quant}" --out "$R" > "$R/sweep_small.log" 2>&1;
                tail -3 "$R/sweep_small.log" ;;
    profile)  timeout 200 python3 -m benchmarks.decode --profile --models llama-3.2-1b --batches 1 \
                > "$R/profile_llama-3.2-1b.log" 2>&1; grep -E "^== profile|Error" "$R/profile_llama-3.2-1b.log" ;;
    profileprefill) timeout 300 python3 -m benchmarks.decode --profile prefill --models llama-3.2-1b --batches 1 \
                > "$R/profile_prefill_llama-3.2-1b.log" 2>&1; grep -E "^== profile|Error" "$R/profile_prefill_llama-3.2-1b.log" ;;
    prefill1b) timeout 300 python3 -m benchmarks.decode --models llama-3.2-1b --batches 1 --iters 20 \
                --modes "level 3,reduce-overhead,level 1,eager" --out "$R/prefill1b" 2>&1 | tee "$R/prefill1b.log" | grep -E "^\{|Error" ;;
    clean)    # level 3 against reduce-overhead alone on the machine (no concurrent compiles: they slow the
              # host side of reduce-overhead's replays); no prefill
              for m in llama-3-8b llama-3.2-1b; do
                timeout ${CLEAN_TIMEOUT:-220} python3 -m benchmarks.decode --models $m --prefill 0 --iters 30 \
                  --modes "level 3,reduce-overhead" --out "$R/clean_$m" 2>&1 | tee "$R/clean_$m.log" | grep -E "^\{|Error"
              done ;;
    ops3)     # level 3 with the default ops (Inductor fuses native code) against level 3 with every Triton op on
              timeout ${OPS3_TIMEOUT_1B:-80} python3 -m benchmarks.decode --models llama-3.2-1b --iters 30 \
                --modes "level 3,level 3 +ops" --out "$R/ops3_1b" 2>&1 | tee "$R/ops3_1b.log" | grep -E "^\{|Error"
              timeout ${OPS3_TIMEOUT_8B:-100} python3 -m benchmarks.decode --models llama-3-8b --iters 30 \
                --modes "level 3,level 3 +ops" --out "$R/ops3_8b" 2>&1 | tee "$R/ops3_8b.log" | grep -E "^\{|Error" ;;
    tracesize) # does the first call's size (where Inductor autotunes dynamic-shape kernels) move decode or prefill?
              for n in 2 512 2048; do
                timeout ${TRACESIZE_TIMEOUT:-100} python3 -m benchmarks.decode --models llama-3.2-1b --iters 30 \
                  --modes "level 3" --trace-tokens $n --out "$R/trace$n" 2>&1 | tee "$R/trace$n.log" | grep -E "^\{|Error"
              done ;;
    overhead) timeout 180 python3 -m benchmarks.guard_overhead --device cuda --out "$R" 2>&1 \
                | grep -E "fast|floor|stock" ;;
    decode)   timeout ${DECODE_TIMEOUT:-540} python3 -m benchmarks.decode ${DECODE_STARTUP---startup} --generate \
                --models llama-3.2-1b --out "$R/llama-3.2-1b" 2>&1 | tee "$R/decode1b.log" | grep -E "^\{|Error" ;;
    decode8b) timeout ${DECODE_TIMEOUT:-560} python3 -m benchmarks.decode --startup cold --generate --iters 30 --models llama-3-8b \
                --out "$R/llama-3-8b" 2>&1 | tee "$R/decode8b.log" | grep -E "^\{|Error" ;;
    serve)    # issue 14: the OpenAI-compatible server (openai client, in-process uvicorn) against offline LLM.generate; per-step profile by phase (serve_steps.csv)
              timeout ${SERVE_TIMEOUT:-560} python3 -m benchmarks.serve --models ${SERVE_MODELS:-llama-3.2-1b,llama-3-8b} --step-profile \
                --out "$R/serve" 2>&1 | tee "$R/serve.log" | grep -E "^\{|Error" ;;
    quant)    # issue 12: the quantized 8B decode step at level 3 (native code: the default)
              for m in ${QUANT_MODELS:-llama-3-8b-int8 llama-3-8b-fp8}; do
                timeout ${QUANT_TIMEOUT:-150} python3 -m benchmarks.decode --models $m --iters 30 --prefill 0 ${QUANT_ARGS:-} \
                  --modes "level 3" --out "$R/quant" 2>&1 | tee "$R/quant_$m.log" | grep -E "^\{|Error"
              done ;;
    importtime) python3 -X importtime -c "import benchmarks.decode; from models import LLM" 2> "$R/importtime.log";
              sort -t'|' -k2 -n "$R/importtime.log" | tail -12 ;;
    startupprof) # where a warm start's seconds go: llama-3.2-1b cold once, then warm under cProfile
              d=/tmp/startupprof; rm -rf $d; mkdir -p $d
              export TORCHINDUCTOR_CACHE_DIR=$d/inductor TRITON_CACHE_DIR=$d/triton DYNAMO_ONCE_CACHE_DIR=$d/ours
              timeout 120 python3 -m benchmarks.decode --startup-child ${PROF_MODEL:-llama-3.2-1b} | tail -1
              timeout 120 python3 -m cProfile -o "$R/warm_start.prof" -m benchmarks.decode --startup-child \
                ${PROF_MODEL:-llama-3.2-1b} | tail -1
              python3 -c "import pstats; pstats.Stats('$R/warm_start.prof').sort_stats('cumulative').print_stats(150)" \
                > "$R/warm_start_prof.txt" 2>&1
              unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR DYNAMO_ONCE_CACHE_DIR ;;
    startupphases) # warm trace/compile phases: cold + 2 warm starts, then a warm one under cProfile (library + Inductor rows)
              timeout ${STARTUP_TIMEOUT:-400} python3 -m benchmarks.startup_phases --model ${PROF_MODEL:-llama-3-8b} \
                --warm-runs 2 --profile "$R/startup_phases.prof" --limit 80 > "$R/startup_phases.txt" 2>&1
              grep -E "^\{|Error" "$R/startup_phases.txt" ;;
    startup)  # issue 15: process start to first token, cold and warm caches, every default capture size
              timeout ${STARTUP_TIMEOUT:-560} python3 -m benchmarks.decode --startup --startup-only \
                --models ${STARTUP_MODELS:-llama-3.2-1b,llama-3-8b,llama-3-8b-fp8} --out "$R/startup" 2>&1 \
                | tee "$R/startup.log" | grep -E "^\{|Error" ;;
    gemm)     # the 8B linear stack + lm_head at M 1/8/32/128: cuBLAS against the small-M Triton GEMM
              timeout ${GEMM_TIMEOUT:-240} python3 -m benchmarks.gemm ${GEMM_ARGS:-} --out "$R/gemm" 2>&1 | tee "$R/gemm.log" \
                | grep -E "'ours|Error" ;;
    attn)     # issue 16: paged decode attention alone at batch 1-128 x context 512-4096 (% of copy bandwidth), then the
              # sweep of its configs (best per shape, suggested DECODE_TABLE rows: the "best" lines)
              timeout ${ATTN_TIMEOUT:-330} python3 -m benchmarks.attention --sweep --deadline ${ATTN_DEADLINE:-220} ${ATTN_ARGS:-} \
                --out "$R/attention" 2>&1 | tee "$R/attention.log" | grep -E "^\{|^best|precompiled|deadline|Error" ;;
    attnops)  # issue 12/16: the minimal decode kernel's dot orders and the fp8 value tile converted as loaded (form 3),
              # bf16 and fp8 caches (ATTNOPS_ARGS, e.g. --shapes 128x512 --configs 64x2x3,128x4x3)
              timeout ${ATTNOPS_TIMEOUT:-200} python3 -m benchmarks.attention_operands ${ATTNOPS_ARGS:-} \
                --out "$R/attention_operands" 2>&1 | tee "$R/attention_operands.log" | grep -E "^\{|Error" ;;
    gemmsweep) # the small-M GEMM's configs on each layer shape (int8, fp8, bf16): the best per shape, for its table
              timeout ${SWEEP_TIMEOUT:-300} python3 -m benchmarks.gemm --sweep --sweep-ms ${SWEEP_MS:-1,4,16} \
                --sweep-dtypes ${SWEEP_DTYPES:-bf16,fp8,int8} ${SWEEP_ARGS:-} --out "$R/gemm_sweep" 2>&1 | tee "$R/gemm_sweep.log" \
                | grep -E "^best|Error" ;;
    compare1b|compare8b) # this tree against an earlier checkout in $BEFORE (e.g. `git archive <rev> | tar -x -C before`),
              # one after the other: level 3 decode and LLM.generate (1b: also the piecewise path)
              m=llama-3.2-1b; modes="level 3,level 3 piecewise"; [ $step = compare8b ] && m=llama-3-8b && modes="level 3"
              for v in after before; do
                d=$PWD; [ $v = before ] && d=$(cd "${BEFORE:-before}" && pwd)
                (cd "$d" && PYTHONPATH=/tmp/site:$d timeout ${COMPARE_TIMEOUT:-170} python3 -m benchmarks.decode --models $m \
                  --prefill 0 --iters ${COMPARE_ITERS:-30} --modes "$modes" --generate --out "$R/${v}_$m" 2>&1 \
                  | tee "$R/${v}_$m.log" | grep -E "^\{|Error")
              done ;;
    comparepw) # the piecewise step alone, this tree and $BEFORE alternately, twice
              for r in 1 2; do for v in after before; do
                d=$PWD; [ $v = before ] && d=$(cd "${BEFORE:-before}" && pwd)
                (cd "$d" && PYTHONPATH=/tmp/site:$d:$OLDPWD timeout 80 python3 $OLDPWD/benchmarks/piecewise_step.py --tag $v 2>&1 \
                  | grep -E "^\{|Error" | tee -a "$R/comparepw.log")
              done; done ;;
    passes)   # issue 13: native code / custom ops / the default (for a W8A8 checkpoint the custom ops and the quant
              # fusions, models.compile_defaults), quantized 8B decode and a 2048-token prefill; bf16 8B: the passes
              # with the ops on against the default
              for m in ${PASS_MODELS:-llama-3-8b-fp8 llama-3-8b-int8 llama-3-8b}; do
                modes=${PASS_MODES:-"level 3 native,level 3 +ops,level 3"}
                [ $m = llama-3-8b ] && modes=${PASS_MODES_BF16:-"level 3,level 3 +ops +passes"}
                timeout ${PASSES_TIMEOUT:-280} python3 -m benchmarks.decode --models $m --iters 30 --modes "$modes" ${PASS_ARGS:-} \
                  --out "$R/passes_$m" 2>&1 | tee "$R/passes_$m.log" | grep -E "^\{|Error"
              done ;;
    passesi)  # issue 13: as passes, the modes interleaved (decode --rounds: each built and captured first, then timed in
              # turn PASS_ROUNDS rounds a size), so that a drift over the run does not fall on the modes timed last
              for m in ${PASS_MODELS:-llama-3-8b-fp8 llama-3-8b-int8}; do
                modes=${PASS_MODES:-"level 3 native,level 3 +ops,level 3"}
                [ $m = llama-3-8b ] && modes=${PASS_MODES_BF16:-"level 3,level 3 +ops +passes"}
                timeout ${PASSES_TIMEOUT:-280} python3 -m benchmarks.decode --models $m --iters 30 --modes "$modes" \
                  --rounds ${PASS_ROUNDS:-3} ${PASS_ARGS:-} --out "$R/passesi_$m" 2>&1 | tee "$R/passesi_$m.log" | grep -E "^\{|Error"
              done ;;
    nativeops) # issue 13: the W8A8 default (custom ops + quant fusions; with a compile size above
              # DYNAMO_ONCE_NATIVE_OPS_ABOVE tokens also native_ops: native code back in those compiles, so each mode
              # gets a 128-token compile) with and without native_ops against native code, interleaved: 8B fp8 and
              # int8, batch 1-128 and a 2048-token prefill; with pynvml (wheels/: nvidia-ml-py) each row's SM clock and
              # power (--clocks)
              for m in ${NATIVE_MODELS:-llama-3-8b-fp8 llama-3-8b-int8}; do
                timeout ${NATIVE_TIMEOUT:-280} python3 -m benchmarks.decode --models $m --iters 30 --rounds ${NATIVE_ROUNDS:-2} \
                  $(python3 -c "import pynvml" 2>/dev/null && echo --clocks) \
                  --modes "${NATIVE_MODES:-level 3 native size:128,level 3 -native_ops size:128,level 3 size:128}" \
                  --out "$R/nativeops_$m" 2>&1 \
                  | tee "$R/nativeops_$m.log" | grep -E "^\{|Error"
              done ;;
    w8a8)     # issue 13: the W8A8 default's and native_ops' CUDA tests, then nativeops for fp8 (one device call)
              timeout ${W8A8_TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m cuda -n 4 --tb=short -rf \
                tests/models/test_compile_defaults.py tests/models/test_quantized.py tests/models/test_quant_fusion.py \
                tests/models/test_quant_gemm_pass.py tests/models/test_native_ops.py > "$R/w8a8_tests.log" 2>&1
              grep -E "FAILED|ERROR" "$R/w8a8_tests.log" | head -10; tail -1 "$R/w8a8_tests.log"
              NATIVE_MODELS=${NATIVE_MODELS:-llama-3-8b-fp8} bash "$0" nativeops ;;
    pwi)      # issue 18: the piecewise step against the whole-step graph, interleaved (vs_first_mode: the paired ratio)
              for m in ${PWI_MODELS:-llama-3.2-1b llama-3-8b}; do
                timeout ${PWI_TIMEOUT:-250} python3 -m benchmarks.decode --models $m --modes "level 3,level 3 piecewise" \
                  --rounds ${PWI_ROUNDS:-5} --prefill 0 --iters 30 --out "$R/pwi_$m" 2>&1 | tee "$R/pwi_$m.log" | grep -E "^\{|Error"
              done ;;
    prefix)   # LLM.generate over prompts sharing a 1024-token prefix, without and with prefix caching
              timeout ${PREFIX_TIMEOUT:-400} python3 -m benchmarks.prefix_caching --models ${PREFIX_MODELS:-llama-3.2-1b,llama-3-8b} \
                ${PREFIX_ARGS:-} --out "$R/prefix_caching" 2>&1 | tee "$R/prefix_caching.log" | grep -E "^\{|Error" ;;
    kprof0|kprof1) # issue 16: kernel time by kind in level-3 decode graphs and the GEMM stack; Inductor's PDL off / on
              pdl=${step#kprof}
              timeout ${KPROF_TIMEOUT:-280} python3 -m benchmarks.kernel_profile ${KPROF_ARGS:-} --inductor-pdl $pdl \
                --out "$R/kprof_pdl$pdl" > "$R/kprof_pdl$pdl.log" 2>&1; grep -E "\| total \||Error" "$R/kprof_pdl$pdl.log" | tail -12 ;;
    kvariants) # issue 12/16: the fp8 8B decode graph's kernels per GEMM variant (table / fp8 on ours / + PREFETCH, Inductor PDL)
              # variants: tag|args, '+' for a space inside args; a tag ending in pdl runs with Inductor's PDL on
              for v in ${KVAR_VARIANTS:-base| ours|--fp8-ours ours_pf1_pdl|--fp8-ours+--prefetch+1 base_pf1_pdl|--prefetch+1}; do
                tag=${v%%|*}; args=$(echo "${v#*|}" | tr '+' ' '); pdl=0; [ "${tag%pdl}" != "$tag" ] && pdl=1
                timeout ${KVAR_TIMEOUT:-120} python3 -m benchmarks.kernel_profile --models ${KVAR_MODELS:-llama-3-8b-fp8} \
                  --batches ${KVAR_BATCHES:-1,8} --tag $tag $args --inductor-pdl $pdl --out "$R/kvar_$tag" > "$R/kvar_$tag.log" 2>&1
                grep -E "\| total \||Error" "$R/kvar_$tag.log" | tail -4
              done ;;
    attnhost) # issue 18: host time of one eager attention call (a mixed step's), the unified launch against the split form
              # (ATTNHOST_ARGS, e.g. --forms unified,split,split_config: the mixed steps' fused decode on and off)
              timeout ${ATTNHOST_TIMEOUT:-150} python3 -m benchmarks.attention_host ${ATTNHOST_ARGS:-} --out "$R/attention_host" 2>&1 \
                | tee "$R/attention_host.log" | grep -E "^\{|Error" ;;
    tptests)  # issue 17 (two GPUs): the tensor-parallel CUDA tests
              # -x -v: the first failure's traceback is printed at once (a timeout would cut the summary)
              timeout ${TPTESTS_TIMEOUT:-150} python3 -m pytest -x -v -p no:cacheprovider -m cuda --tb=short -rf \
                tests/models/test_tensor_parallel.py tests/models/test_sequence_parallel.py > "$R/tp_tests.log" 2>&1; grep -E "FAILED|ERROR|passed|failed" "$R/tp_tests.log" | tail -8 ;;
    chunked)  # issue 18: LLM.generate with chunked prefill, the mixed steps' share and cost; this tree, then $BEFORE if given
              # (an earlier checkout, e.g. `git archive <rev> | tar -x -C before`; its LLM.stats need not time mixed steps apart)
              # The earlier tree runs with this tree's benchmark helpers (benchmarks/, models/reporting.py) over it:
              # benchmarks.common may import what an earlier tree lacks.
              for v in after ${BEFORE:+before}; do
                d=$PWD
                if [ $v = before ]; then
                  d=/tmp/before_with_helpers; rm -rf $d; cp -r "$BEFORE" $d
                  cp -r benchmarks/. $d/benchmarks/; cp models/reporting.py $d/models/reporting.py
                fi
                PYTHONPATH=/tmp/site:$d timeout ${CHUNKED_TIMEOUT:-240} python3 benchmarks/chunked_prefill.py \
                  --models ${CHUNKED_MODELS:-llama-3.2-1b,llama-3-8b} --tag $v ${CHUNKED_ARGS:-} --out "$R/chunked" 2>&1 \
                  | tee "$R/chunked_$v.log" | grep -E "^\{|Error"
              done ;;
    attnprof) # issue 18: where one attention call's host µs go (cProfile, fast path): 8B, 1 decode + a 512-token prompt, and 32 decodes
              for shape in "1 512" "32 0"; do set -- $shape
                timeout 60 python3 -m benchmarks.attention_host --models llama-3-8b --batches $1 --prefill $2 --cprofile \
                  --out "$R/attnprof_b$1_p$2" > "$R/attnprof_b$1_p$2.log" 2>&1; head -30 "$R/attnprof_b$1_p$2.log"
              done ;;
    attnbreak) # issue 18: one eager attention call's host µs, layer by layer (context lookup .. C launchers)
              timeout ${ATTNBREAK_TIMEOUT:-90} python3 -m benchmarks.attention_host_breakdown --out "$R/attention_host_breakdown" \
                2>&1 | tee "$R/attention_host_breakdown.log" | grep -E "^\{|Error" ;;
    allreduce) # issue 17 (two GPUs): all-reduce latency inside CUDA graphs, NCCL against symmetric memory
              timeout ${ALLREDUCE_TIMEOUT:-90} python3 -m benchmarks.all_reduce --out "$R/all_reduce" 2>&1 \
                | tee "$R/all_reduce.log" | grep -E "^\{|Error" ;;
    tpdecode) # issue 17 (two GPUs): LLM.generate decode step and prefill, TP=1 against TP=2
              timeout ${TPDECODE_TIMEOUT:-200} python3 -m benchmarks.tp_decode --models ${TP_MODELS:-llama-3-8b} \
                --out "$R/tp_decode" 2>&1 | tee "$R/tp_decode.log" | grep -E "^\{|Error" ;;
    tpsp)     # issue 17 (two GPUs): prefill 2048 at TP=2, the sequence-parallel rewrite (fused async-TP ops, and without them) against plain
              timeout ${TPSP_TIMEOUT:-540} python3 -m benchmarks.tp_decode --sp --tp 2 --models ${TP_MODELS:-llama-3-8b} \
                --out "$R/tp_sp" 2>&1 | tee "$R/tp_sp.log" | grep -E "^\{|Error" ;;
    pw)       # issue 18: decode steps on the piecewise path (attention eager between piece graphs) against whole-step graphs;
              # PW_REPEATS=N: N runs a model, one process each, into pw/, pw2/, ... (the 1B's ratio moves ~10% run to run)
              for m in ${PW_MODELS:-llama-3.2-1b llama-3-8b}; do for r in $(seq 1 ${PW_REPEATS:-1}); do
                d=pw; [ $r -gt 1 ] && d=pw$r
                timeout ${PW_TIMEOUT:-120} python3 -m benchmarks.decode --models $m --prefill 0 --iters 20 \
                  --modes "level 3 piecewise,level 3" --out "$R/$d" 2>&1 | tee "$R/${d}_$m.log" | grep -E "^\{|Error"
              done; done ;;
    tma)      # issue 16: the small-M tiles read by tensor descriptors (SmallMConfig.TMA): their CUDA tests, then the
              # bf16 sweep of the wide / swapped tiles at TMA_MS (64, 128) with pointer and descriptor loads side by side
              timeout ${TMA_TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -m cuda -n 4 --tb=short -rf \
                tests/ops/test_small_m_gemm.py -k "tma or 8b_shapes or every_config" > "$R/tma_tests.log" 2>&1
              grep -E "FAILED|ERROR" "$R/tma_tests.log" | head -10; tail -1 "$R/tma_tests.log"
              R=$R/sweep_tma SWEEP_TIMEOUT=${TMA_SWEEP_TIMEOUT:-330} SWEEP_MS=${TMA_MS:-64,128} SWEEP_DTYPES=bf16 \
                SWEEP_ARGS="--separated --sweep-forms tma" bash "$0" gemmsweep ;;
    tmastep)  # issue 16: the bf16 8B's step with every dot tile of the table read by tensor descriptors (tma=1), and
              # with the picks of TMASTEP_CSVS' sweeps (e.g. the tma step's) where they beat cuBLAS, against the table
              csvs=$(ls ${TMASTEP_CSVS:-benchmarks/results/gemm_sweep_bf16_tma_m64_128_separated_h100.csv} 2>/dev/null | paste -sd,)
              timeout ${TMASTEP_TIMEOUT:-500} python3 -m benchmarks.gemm_step_ab --model ${TMASTEP_MODEL:-llama-3-8b} \
                --batches ${TMASTEP_BATCHES:-8,32,64,128} --rounds ${TMASTEP_ROUNDS:-2} --variant table= ${TMASTEP_ALL---variant tma=tma=1} \
                ${csvs:+--sweep-variant "sweep=$csvs"} --out "$R/stepab_tma" 2>&1 | tee "$R/stepab_tma.log" \
                | grep -E "^\{|^--sweep|Error" ;;
    narrow1b) # issue 16: Llama-3.2-1B at 8-128 tokens: its step's kernels (N1B_PROFILE_BATCHES), then the swapped tiles
              # with 1-4 splits summed in the kernel, each read by pointers and by tensor descriptors, on its narrow
              # shapes (qkv, o, down; the table has cuBLAS there past 16 rows) at N1B_MS (each call after a small kernel)
              [ -n "${N1B_PROFILE_BATCHES-8,32,128}" ] && timeout ${N1B_PROFILE_TIMEOUT:-120} python3 -m benchmarks.kernel_profile \
                --models llama-3.2-1b --batches ${N1B_PROFILE_BATCHES-8,32,128} --out "$R/kernel_profile_1b" \
                > "$R/kernel_profile_1b.log" 2>&1; grep -E "\| total \||Error" "$R/kernel_profile_1b.log" | tail -4
              R=$R/sweep_narrow1b SWEEP_TIMEOUT=${N1B_SWEEP_TIMEOUT:-380} SWEEP_MS=${N1B_MS:-32,64,128} SWEEP_DTYPES=bf16 \
                SWEEP_ARGS="--model llama-3.2-1b --separated --sweep-forms narrow --sweep-shapes ${N1B_SHAPES:-down,qkv,o}" bash "$0" gemmsweep ;;
    attn1b)   # issue 16: Llama-3.2-1B's 64-size heads at 32 and 128 sequences (the 8B's rows run them now): the decode
              # attention sweep over contexts 512-4096
              timeout ${ATTN1B_TIMEOUT:-300} python3 -m benchmarks.attention --head-size 64 --batches ${ATTN1B_BATCHES:-32,128} \
                --sweep --deadline ${ATTN1B_DEADLINE:-220} --out "$R/attn_d64" > "$R/attn_d64.log" 2>&1
              grep -E "^best|Error" "$R/attn_d64.log" | head ;;
    step1b)   # issue 16: the 1B's step against the table with the picks of the narrow1b sweep (N1B_CSVS; where they beat
              # cuBLAS by 2%, the other shapes on the table's rows) and with the rows the attn1b sweep suggests (A1B_CSVS)
              csvs=$(ls ${N1B_CSVS:-$R/sweep_narrow1b/gemm_sweep/gemm_sweep_llama-3.2-1b_separated_narrow.csv} 2>/dev/null | paste -sd,)
              acsvs=$(ls ${A1B_CSVS:-$R/attn_d64/attention_sweep_d64.csv} 2>/dev/null | paste -sd,)
              timeout ${STEP1B_TIMEOUT:-400} python3 -m benchmarks.gemm_step_ab --model llama-3.2-1b \
                --batches ${STEP1B_BATCHES:-32,64,128} --rounds ${STEP1B_ROUNDS:-2} --variant table= --sweep-others table \
                ${csvs:+--sweep-variant "gemm=$csvs"} ${acsvs:+--attn-sweep-variant "attn=64:$acsvs"} \
                --out "$R/stepab_1b" 2>&1 | tee "$R/stepab_1b.log" | grep -E "^\{|^--|Error" ;;
    attnb1)   # issue 16: the decode attention at one sequence with 1-8 splits (the table's row has 16; the sweep's
              # candidates start at 8): alone (Llama-3.2-1B's heads and Llama-3-8B's) against the table's row, then the
              # 1B's batch-1 step with the two variants fastest alone on its heads (on average over the contexts), if
              # faster than the table's row
              vs=${AB1_VARIANTS:-"s1=num_splits=1 s2=num_splits=2 s4=num_splits=4 s8=num_splits=8 s2n128=num_splits=2,BLOCK_N=128,num_stages=3 s4n128=num_splits=4,BLOCK_N=128,num_stages=3"}
              for h in 64 128; do
                timeout ${AB1_ATTN_TIMEOUT:-100} python3 -m benchmarks.attention --head-size $h --batches 1 \
                  --contexts 512,1024,2048 $(for v in $vs; do echo --variant $v; done) \
                  --out "$R/attnb1" > "$R/attnb1_d$h.log" 2>&1; grep -E "Error" "$R/attnb1_d$h.log" | head -5
              done
              best=$(python3 -c "import csv,sys; r=[x for x in csv.DictReader(l for l in open(sys.argv[1]) if l[0] != '#')]
g={}; [g.setdefault(x['variant'],[]).append(float(x['vs_table'])) for x in r if x['variant'] != 'table' and x['correct'] == 'True']
print(*sorted((k for k in g if sum(g[k])/len(g[k]) > 1), key=lambda k: -sum(g[k])/len(g[k]))[:2])" \
                "$R/attnb1/attention_variants_d64.csv" 2>/dev/null)
              echo "attnb1: variants faster than the table alone on the 1B's heads: ${best:-none}"
              stepvs=$(for v in $vs; do n=${v%%=*}; case " $best " in *" $n "*) echo --variant "$n=attn_rule=1:128:${v#*=}";; esac; done)
              [ -n "$stepvs" ] && timeout ${AB1_STEP_TIMEOUT:-240} python3 -m benchmarks.gemm_step_ab --model ${AB1_MODEL:-llama-3.2-1b} \
                --batches 1 --rounds ${AB1_ROUNDS:-2} --variant table= $stepvs \
                --out "$R/stepab_attnb1" 2>&1 | tee "$R/stepab_attnb1.log" | grep -E "^\{|^--|Error" ;;
    normlin)  # issue 16: the norm_linear pass (each residual add + RMSNorm in the QKV / gate-up GEMV after it at one
              # token): its CUDA tests, then the level-3 step with it against without, interleaved (batch 1, where it
              # fuses; 8 and 32, where its op runs the fused-add norm kernel and the linear op; a 2048-token prefill, where
              # the op's eager call adds host time), 1B and 8B; first the op alone against the unfused ops, with 2-16
              # weight rows a program
              for m in ${NORMLIN_MODELS:-llama-3.2-1b llama-3-8b}; do
                timeout ${NORMLIN_OP_TIMEOUT:-90} python3 -m benchmarks.norm_linear --model $m --out "$R/norm_linear" \
                  > "$R/norm_linear_$m.log" 2>&1; grep -E "Error" "$R/norm_linear_$m.log" | head -3
              done
              timeout ${NORMLIN_TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -m cuda -n 4 --tb=short -rf \
                tests/ops/test_norm_linear.py tests/models/test_graph_passes.py > "$R/normlin_tests.log" 2>&1
              grep -E "FAILED|ERROR" "$R/normlin_tests.log" | head -10; tail -1 "$R/normlin_tests.log"
              for m in ${NORMLIN_MODELS:-llama-3.2-1b llama-3-8b}; do
                timeout ${NORMLIN_TIMEOUT:-200} python3 -m benchmarks.decode --models $m --batches ${NORMLIN_BATCHES:-1,8,32} \
                  --modes "level 3,level 3 +norm_linear" --rounds ${NORMLIN_ROUNDS:-3} --prefill ${NORMLIN_PREFILL:-2048} --iters 30 \
                  --out "$R/normlin_$m" 2>&1 | tee "$R/normlin_$m.log" | grep -E "^\{|Error"
              done ;;
    gated8b)  # issue 16: the bf16 8B's gate-up at 33-128 tokens in the gated form (GEMM + SiLU-and-mul in one kernel, the
              # unfused tiles nearest cuBLAS with BLOCK_N halved: the gated form reads BLOCK_N gate and BLOCK_N up rows) against the table (cuBLAS, then
              # the activation kernel)
              timeout ${GATED8B_TIMEOUT:-400} python3 -m benchmarks.gemm_step_ab --model llama-3-8b --batches ${GATED8B_BATCHES:-64,128} \
                --rounds ${GATED8B_ROUNDS:-2} --variant table= \
                --variant "gated=gated_row=bf16:64:64x64x128,w4,s4;gated_row=bf16:128:128x64x64,w8,s5" \
                --out "$R/stepab_gated8b" 2>&1 | tee "$R/stepab_gated8b.log" | grep -E "^\{|Error" ;;
    targets)  # issues 12 and 16's figures in one call: the level-3 decode step of the 1B, the bf16 8B and both
              # quantized 8Bs (batch 1-128, context 512), the 8B linear stack at M = 1, attention alone (bf16 cache)
              for m in ${TARGET_MODELS:-llama-3.2-1b llama-3-8b llama-3-8b-fp8 llama-3-8b-int8}; do
                timeout ${TARGET_TIMEOUT:-120} python3 -m benchmarks.decode --models $m --iters 30 --prefill 0 \
                  --modes "level 3" --out "$R/targets" 2>&1 | tee "$R/targets_$m.log" | grep -E "^\{|Error"
              done
              timeout 120 python3 -m benchmarks.gemm --ms 1 --out "$R/targets_gemm" 2>&1 | tee "$R/targets_gemm.log" \
                | grep -E "'ours|Error"
              timeout 150 python3 -m benchmarks.attention --batches 32,128 --contexts 512,1024,2048,4096 \
                --out "$R/targets_attention" 2>&1 | tee "$R/targets_attention.log" | grep -E "^\{|Error" ;;
    pdlinline) # issue 13: the library's kernels Inductor runs inlined, launched with PDL: their CUDA tests, then native
              # code / custom ops / custom ops + every pass but quant_gemm interleaved (fp8, int8), and the fp8 batch-1
              # kernel profile of the passes graph (no kernel should start after its predecessor's end)
              timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda -n 4 tests/ops/test_pdl.py \
                tests/ops/test_rotary_embedding.py tests/models/test_quant_fusion.py > "$R/pdlinline_tests.log" 2>&1
              tail -1 "$R/pdlinline_tests.log"
              PASS_MODES="level 3,level 3 +ops,level 3 +ops +passes -quant_gemm" PASS_ROUNDS=2 PASS_ARGS="--prefill 0" \
                PASSES_TIMEOUT=220 bash "$0" passesi
              timeout 120 python3 -m benchmarks.kernel_profile --models llama-3-8b-fp8 --batches 1,8 \
                --mode "level 3 +ops +passes -quant_gemm" --out "$R/kernel_profile_pdlinline" > /dev/null 2>&1 ;;
    preload)  # issue 16: the GEMV's weights read before its PDL wait (SmallMConfig.PRELOAD, the table's one-token rows)
              # against none, in the level-3 step at batch 1 of each model (PRELOAD_MODELS), a fresh process a run;
              # PRELOAD_BATCHES=1,2 PRELOAD_VARIANTS="default= off=preload=0 pl2=preload=2" also times the M = 2 rows
              # (no PRELOAD in the table) with two steps preloaded
              for m in ${PRELOAD_MODELS:-llama-3.2-1b llama-3-8b-int8 llama-3-8b-fp8}; do
                STEPAB_MODEL=$m STEPAB_BATCHES=${PRELOAD_BATCHES:-1} STEPAB_ROUNDS=2 \
                  STEPAB_VARIANTS="${PRELOAD_VARIANTS:-default= off=preload=0}" \
                  STEPAB_TIMEOUT=${PRELOAD_TIMEOUT:-200} bash "$0" stepab
                mv "$R/gemm_step_ab" "$R/preload_$m"
              done ;;
    stepab)   # issue 12/16: small-M table variants inside the decode step (STEPAB_VARIANTS: NAME=RULES words, see
              # benchmarks/gemm_step_ab.py), alternating, a fresh process a run
              args=(); for v in ${STEPAB_VARIANTS:-table=}; do args+=(--variant "$v"); done
              timeout ${STEPAB_TIMEOUT:-400} python3 -m benchmarks.gemm_step_ab --model ${STEPAB_MODEL:-llama-3-8b-int8} \
                --batches ${STEPAB_BATCHES:-32,128} --rounds ${STEPAB_ROUNDS:-2} "${args[@]}" --out "$R/gemm_step_ab" 2>&1 \
                | tee "$R/gemm_step_ab.log" | grep -E "^\{|Error" ;;
    gated|gatedk|gatedstep) # issues 12/13: the gate-up GEMM + SiLU + quant fused (gemm_act_quant) against the unfused ops,
              # alone (gatedk: int8 per token, fp8 static, the gated GEMM's configs GATED_CONFIGS) and in the quantized 8B's
              # steps (gatedstep: native code with and without gemm_act_quant); gated: both; GATED_DTYPES: e.g. "fp8,static"
              [ $step = gatedstep ] || for dq in ${GATED_DTYPES:-int8,dynamic fp8,static}; do set -- ${dq/,/ }
                timeout ${GATED_TIMEOUT:-150} python3 -m benchmarks.gated_gemm --dtype $1 --quant $2 --ms ${GATED_MS:-1,8,16,32,64,128} \
                  --configs "${GATED_CONFIGS:-64x64x128,w4,s5;128x128x128,w8,s4;64x128x128,w4,s4}" --out "$R/gated_gemm" \
                  > "$R/gated_gemm_$1.log" 2>&1; grep -E "^\| |Error" "$R/gated_gemm_$1.log" | cut -c1-110
              done
              [ $step = gatedk ] || for m in ${GATED_MODELS:-llama-3-8b-int8 llama-3-8b-fp8}; do
                timeout ${GATED_DECODE_TIMEOUT:-200} python3 -m benchmarks.decode --models $m --iters 30 \
                  --modes "${GATED_MODES:-level 3,level 3 +gemm_act_quant}" --out "$R/gated_$m" 2>&1 | tee "$R/gated_$m.log" \
                  | grep -E "^\{|Error"
              done ;;
    gatedlin) # issue 16: bf16 gate-up GEMM + SiLU-and-mul (ops.gated_linear) and QKV GEMM + rotary (ops.rope_linear) in one
              # kernel each, against the unfused pairs, alone (both models' shapes) and in the bf16 decode steps with and
              # without the gated_linear (on by default) and rope_linear passes (GATEDLIN_MODES; a 2048-token prefill too,
              # GATEDLIN_PREFILL=0: none); GATEDLIN_KERNELS=0 skips the kernels alone (e.g. a second call for the 8B's steps)
              [ "${GATEDLIN_KERNELS:-1}" = 0 ] || for m in llama-3.2-1b llama-3-8b; do
                timeout ${GATEDLIN_TIMEOUT:-120} python3 -m benchmarks.gated_gemm --dtype bf16 --model $m --ms ${GATEDLIN_MS:-1,2,4,8,16} \
                  ${GATEDLIN_ARGS:-} --out "$R/gated_gemm" > "$R/gated_gemm_bf16_$m.log" 2>&1
                grep -E "^\| |Error" "$R/gated_gemm_bf16_$m.log" | cut -c1-110
                timeout ${GATEDLIN_TIMEOUT:-120} python3 -m benchmarks.rope_linear --model $m --ms ${GATEDLIN_MS:-1,2,4,8,16} \
                  --out "$R/rope_linear" > "$R/rope_linear_$m.log" 2>&1
                grep -E "^\| |Error" "$R/rope_linear_$m.log" | cut -c1-110
              done
              for m in ${GATEDLIN_MODELS:-llama-3.2-1b llama-3-8b}; do
                timeout ${GATEDLIN_DECODE_TIMEOUT:-240} python3 -m benchmarks.decode --models $m --iters 30 --batches ${GATEDLIN_BATCHES:-1,8} \
                  --prefill ${GATEDLIN_PREFILL:-2048} --modes "${GATEDLIN_MODES:-level 3 -gated_linear,level 3,level 3 +rope_linear}" \
                  --out "$R/gatedlin_$m" 2>&1 | tee "$R/gatedlin_$m.log" | grep -E "^\{|Error"
              done ;;
    quantgemm) # issue 13: ops.static_quant_scaled_mm's CUDA tests (and every pass on, test_quant_fusion's), then the fp8 8B
              # decode step with and without the quant_gemm pass, in the default and in custom ops + passes
              timeout ${QG_TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m cuda -n 4 --tb=short -rf \
                tests/ops/test_static_quant_scaled_mm.py tests/models/test_quant_gemm_pass.py tests/models/test_quant_fusion.py \
                > "$R/quant_gemm_tests.log" 2>&1; grep -E "FAILED|ERROR" "$R/quant_gemm_tests.log" | head; tail -1 "$R/quant_gemm_tests.log"
              timeout ${QG_TIMEOUT:-300} python3 -m benchmarks.decode --models llama-3-8b-fp8 --iters 30 --prefill 0 \
                --modes "${QG_MODES:-level 3,level 3 +quant_gemm,level 3 +ops,level 3 +ops +passes,level 3 +ops +passes -quant_gemm}" \
                --out "$R/quant_gemm" 2>&1 | tee "$R/quant_gemm.log" | grep -E "^\{|Error" ;;
    gaqfp8)   # issue 13: does gemm_act_quant take the fp8 gate-up on the GPU? (an H200 profile of the default fp8 step at
              # batch 8 showed cuBLAS + Inductor's SiLU-and-quant kernel): its CUDA tests (int8 and fp8-static), the
              # quant_gemm pass's, then the default fp8 step's kernels at batch 1 and 8
              timeout ${GAQ_TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m cuda -n 2 --tb=short -rf \
                tests/models/test_quant_fusion.py tests/models/test_quant_gemm_pass.py tests/ops/test_rotary_embedding.py \
                > "$R/gaq_tests.log" 2>&1
              grep -E "FAILED|ERROR" "$R/gaq_tests.log" | head; tail -1 "$R/gaq_tests.log"
              timeout ${GAQ_TIMEOUT:-150} python3 -m benchmarks.kernel_profile --models llama-3-8b-fp8 --batches 1,8 \
                --tag default --out "$R/gaq_kprof" > "$R/gaq_kprof.log" 2>&1
              grep -E "gated_scaled|_small_m_gemm_kernel|silu|Error" "$R/gaq_kprof.log" | cut -c1-160 | head -12
              # and, custom ops + passes: the generated code (the Inductor kernel beside the rotary op in the batch-8
              # profile, triton_poi_fused_rotary_embedding_split_with_sizes_0, should be gone: nothing printed)
              TORCH_LOGS=output_code timeout ${GAQ_TIMEOUT:-150} python3 -m benchmarks.kernel_profile --models llama-3-8b-fp8 \
                --batches 8 --mode "level 3 +ops +passes -quant_gemm" --tag opspasses --out "$R/gaq_kprof_ops" \
                > "$R/gaq_output_code.log" 2>&1
              grep -n -A25 "def triton_poi_fused_rotary_embedding" "$R/gaq_output_code.log" | head -40
              grep -E "\| total \||Error" "$R/gaq_output_code.log" | tail -3 ;;
    mixed)    # issue 18: prefill chunk + decodes, level 3 piecewise, against the chunk alone + the decodes' whole-step graph
              timeout ${MIXED_TIMEOUT:-200} python3 -m benchmarks.mixed_step --models ${MIXED_MODELS:-llama-3-8b,llama-3.2-1b} \
                ${MIXED_ARGS:-} --out "$R/mixed_step" 2>&1 | tee "$R/mixed_step.log" | grep -E "^\{|Error" ;;
    fqconfigs) # issue 13: the quant kernels' launch configs at a symbolic token count (as a compiled graph launches them)
              timeout ${FQ_TIMEOUT:-240} python3 -m benchmarks.fused_quant_configs ${FQ_ARGS:-} --out "$R/fused_quant_configs" 2>&1 \
                > "$R/fused_quant_configs.log" 2>&1; grep -E "Error|'default': True|'inductor'|'compiled op'" "$R/fused_quant_configs.log" ;;
    kprofmodes) # issue 16: the decode graphs' kernels per level-3 mode (KPM_MODES, comma-separated), one process a mode
              IFS=, read -ra kpm <<< "${KPM_MODES:-level 3}"; i=0
              for md in "${kpm[@]}"; do i=$((i+1))
                timeout ${KPM_TIMEOUT:-150} python3 -m benchmarks.kernel_profile --models ${KPM_MODELS:-llama-3.2-1b} \
                  --batches ${KPM_BATCHES:-1} ${KPM_ARGS:-} --mode "$md" --tag "$md" --out "$R/kprofmode$i" > "$R/kprofmode$i.log" 2>&1
                grep -E "\| total \||Error" "$R/kprofmode$i.log" | tail -6
              done ;;
    next16)   # issue 16 in one call (~8 min on an H100): the targets, the 8B's kernel profile at 1-128 (own_us: each kind's
              # share of the span), the swapped dot tiles swept at 2-16 rows (bf16), and the batch-8 attention row over
              # four splits (with PDL) A/B'd in the 8B's step
              TARGET_TIMEOUT=${TARGET_TIMEOUT:-100} bash "$0" targets
              timeout 120 python3 -m benchmarks.kernel_profile --models llama-3-8b --batches 1,8,32,128 \
                --out "$R/kernel_profile_8b" > "$R/kernel_profile_8b.log" 2>&1; grep -E "\| total \||Error" "$R/kernel_profile_8b.log"
              SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-120} SWEEP_MS=${SWEEP_MS:-2,4,8,16} SWEEP_DTYPES=bf16 \
                SWEEP_ARGS="--separated --sweep-forms swap" bash "$0" gemmsweep
              STEPAB_MODEL=llama-3-8b STEPAB_BATCHES=4,8 STEPAB_TIMEOUT=${STEPAB_TIMEOUT:-200} STEPAB_VARIANTS="default= \
                s4=attn_rule=8:128:num_splits=4 s4b128=attn_rule=8:128:num_splits=4,BLOCK_N=128,num_stages=3" bash "$0" stepab ;;
    swap16)   # issue 16, after next16's sweep (the swapped 16-row tiles won every bf16 8B shape at 4-16 rows): that row
              # A/B'd in the 8B's and the 1B's steps at 4-16, the swapped tiles swept at 64 / 128 rows (bf16) and at
              # 8 / 16 (fp8, int8), and the attention configs swept at batch 32 / 128 (contexts 512, 2048). Each part
              # in its own folder of $R.
              x16="bf16:16:0:4096:16x64x128,w4,s6,x"
              for m in llama-3-8b llama-3.2-1b; do
                R=$R/stepab_$m STEPAB_MODEL=$m STEPAB_BATCHES=4,8,16 STEPAB_TIMEOUT=${STEPAB_TIMEOUT:-150} \
                  STEPAB_VARIANTS="default= x16=$x16" bash "$0" stepab
              done
              R=$R/sweep_bf16 SWEEP_TIMEOUT=90 SWEEP_MS=64,128 SWEEP_DTYPES=bf16 SWEEP_ARGS="--separated --sweep-forms swap" \
                bash "$0" gemmsweep
              R=$R/sweep_8bit SWEEP_TIMEOUT=90 SWEEP_MS=8,16 SWEEP_DTYPES=fp8,int8 SWEEP_ARGS="--separated --sweep-forms swap" \
                bash "$0" gemmsweep
              R=$R/attn ATTN_TIMEOUT=170 ATTN_DEADLINE=120 ATTN_ARGS="--batches 32,128 --contexts 512,2048" bash "$0" attn ;;
    swap16b)  # after swap16 (the bf16 rows at 3-16 now the swapped 16-row tiles): their CUDA tests; at batch 2 the same
              # tile for gate-up and the lm_head (8B, 1B); fp8's qkv and down on swapped tiles (the 8-bit sweep's picks);
              # the 8B's and the 1B's steps and the 8B's kernel profile with the table as it is
              FAILED_TIMEOUT=200 FAILED_WORKERS=8 FAILED_TESTS="tests/ops/test_small_m_gemm.py tests/ops/test_linear.py \
                tests/ops/test_gated_linear.py tests/ops/test_rope_linear.py tests/models/test_llama.py" bash "$0" failed
              for m in llama-3-8b llama-3.2-1b; do
                R=$R/stepab_m2_$m STEPAB_MODEL=$m STEPAB_BATCHES=2 STEPAB_TIMEOUT=80 \
                  STEPAB_VARIANTS="default= m2=bf16:2:0:16384:16x64x128,w4,s6,x" bash "$0" stepab
              done
              q="fp8:16:0:16384:cublas;fp8:16:0:6144:16x64x128,w4,s6,x"
              R=$R/stepab_fp8 STEPAB_MODEL=llama-3-8b-fp8 STEPAB_BATCHES=4,8,16 STEPAB_TIMEOUT=150 \
                STEPAB_VARIANTS="default= fq=$q fqd=$q;fp8:16:2.0:0:16x64x256/2,w4,s4,x,r" bash "$0" stepab
              R=$R/after TARGET_TIMEOUT=100 TARGET_MODELS="llama-3-8b llama-3.2-1b" bash "$0" targets
              timeout 90 python3 -m benchmarks.kernel_profile --models llama-3-8b --batches 8 \
                --out "$R/kernel_profile_8b" > "$R/kernel_profile_8b.log" 2>&1; grep -E "\| total \||Error" "$R/kernel_profile_8b.log" ;;
    next16c)  # issue 16, after swap16 / swap16b (the swapped 16-row tiles in the bf16 and fp8 tables at 2-16): the 1B's
              # narrower shapes on those tiles at 4-16 rows (bf16), fp8 on them at 32 rows (past fp8's range: a row there
              # raises it in the step A/B), int8's gate-up gated on them A/B'd at batch 8 / 16 (the targets: a step of their own)
              R=$R/sweep_1b SWEEP_TIMEOUT=90 SWEEP_MS=4,8,16 SWEEP_DTYPES=bf16 \
                SWEEP_ARGS="--separated --sweep-forms swap --model llama-3.2-1b" bash "$0" gemmsweep
              R=$R/sweep_fp8_32 SWEEP_TIMEOUT=90 SWEEP_MS=32 SWEEP_DTYPES=fp8 SWEEP_ARGS="--separated --sweep-forms swap" \
                bash "$0" gemmsweep
              R=$R/stepab_int8 STEPAB_MODEL=llama-3-8b-int8 STEPAB_BATCHES=8,16 STEPAB_TIMEOUT=120 \
                STEPAB_VARIANTS="default= g8=gated_row=int8:16:16x128x256,w8,s3,x" bash "$0" stepab ;;
    b128)     # issue 16: the bf16 8B at 128 tokens: the small-M GEMM's swapped tiles on 128 rows of a and the wide unswapped
              # ones (each call after a small kernel), then the batch-64 / 128 steps with the picks of those and of
              # B128_CSVS' sweeps (default: the committed M = 64 ones) where they beat cuBLAS (gemm_step_ab
              # --sweep-variant) against the table (its first run: results/gemm_step_ab_bf16_m64_128_sweep_h100.md,
              # the table then cuBLAS above 32 tokens); B128_PROFILE=1: first
              # the step's kernel profile at batch 64 / 128
              [ -n "${B128_PROFILE:-}" ] && timeout 150 python3 -m benchmarks.kernel_profile --models llama-3-8b \
                --batches 64,128 --out "$R/kernel_profile_b128" > "$R/kernel_profile_b128.log" 2>&1
              R=$R/sweep_swap128 SWEEP_TIMEOUT=${B128_SWAP_TIMEOUT:-130} SWEEP_MS=128 SWEEP_DTYPES=bf16 \
                SWEEP_ARGS="--separated --sweep-forms swap" bash "$0" gemmsweep
              R=$R/sweep_wide128 SWEEP_TIMEOUT=${B128_WIDE_TIMEOUT:-170} SWEEP_MS=128 SWEEP_DTYPES=bf16 \
                SWEEP_ARGS="--separated" bash "$0" gemmsweep
              csvs=$(ls "$R"/sweep_*128/gemm_sweep/gemm_sweep_separated*.csv ${B128_CSVS:-benchmarks/results/gemm_sweep_bf16_swap_m64_128_h100.csv \
                benchmarks/results/gemm_sweep_bf16_m64_separated_h100.csv} 2>/dev/null | paste -sd,)
              timeout ${B128_STEP_TIMEOUT:-240} python3 -m benchmarks.gemm_step_ab --model llama-3-8b --batches 64,128 \
                --rounds 2 --variant table= --sweep-variant "sweep=$csvs" --out "$R/stepab_b128" 2>&1 \
                | tee "$R/stepab_b128.log" | grep -E "^\{|^--sweep|Error" ;;
    attnvar)  # issue 16: variants of the decode table's attention rows (ATTN_VARIANTS: NAME=FIELD=VALUE,... words,
              # benchmarks.attention --variant) against the rows, alone at batch 32 / 128 x context 512-4096, then the
              # bf16 8B's level-3 step (ATTN_STEP_BATCHES, default 32,128) under ATTN_STEP (a gemm_step_ab variant
              # of attn_rule items). Its first run measured a persistent form since removed
              # (results/attention_variants_persistent_h100.md).
              args=(); for v in ${ATTN_VARIANTS:-n64=BLOCK_N=64}; do args+=(--variant "$v"); done
              timeout ${ATTN_TIMEOUT:-200} python3 -m benchmarks.attention --batches 32,128 --contexts 512,1024,2048,4096 \
                "${args[@]}" --out "$R/attn_variants" 2>&1 | tee "$R/attn_variants.log" | grep -E "variant|Error" | cut -c1-220
              [ -n "${ATTN_STEP:-}" ] && R=$R/stepab_attn STEPAB_MODEL=llama-3-8b STEPAB_BATCHES=${ATTN_STEP_BATCHES:-32,128} \
                STEPAB_TIMEOUT=${ATTN_STEP_TIMEOUT:-200} STEPAB_VARIANTS="table= $ATTN_STEP" bash "$0" stepab ;;
    *) echo "unknown step $step" ;;
  esac
done
tar czf "$OUT/$TAR" -C "$R" .
