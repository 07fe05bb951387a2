#!/usr/bin/env bash
# The README's GPU benchmarks ("On an H100") on a lent accelerator machine, whose image has
# jax with CUDA, flax, optax, torch and transformers at its own versions:
#   bash experiments/tools/run_on_gpu.sh "JOB ..." [OUTDIR]
# JOBs: sampler_tiny sampler_0.5b roofline_tiny roofline_0.5b trl_workload profile_0.5b
# logits_0.5b decode_loops_0.5b gpu_tests gpu_tests_more attention long_context
# gpu_tests_attention fused_step longtail_0.5b longtail_0.5b_4k multiturn_slots
# gpu_tests_engines async_0.5b
# gpu_check (the accelerator issue's checks, one call), each under its own time limit, its
# output kept in OUTDIR/JOB.txt. One call of the device tool runs at most 10 minutes: pass
# the jobs of one call's worth (e.g. "decode_loops_0.5b trl_workload").
# Wheels the image lacks, in .whl/ (omegaconf, antlr4-python3-runtime and tensorboardX for the
# driver; trl, datasets, dill and multiprocess for TRL; tokamax 0.0.12, qwix, einshape,
# immutabledict, pydantic, pydantic-core, annotated-types, typing-inspection, typeguard 2.13.3
# for bench_attention's tokamax backends), are installed first; not flax 0.12.8,
# which fails to import with jax 0.11.
set -uo pipefail
jobs=${1:?"JOB ..." (see the header)}
out=${2:-${OUT:-/tmp/gpu-bench}}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/experiments/bench PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import jax, flax, optax, torch, transformers as t; print('jax', jax.__version__, \
jax.devices(), 'flax', flax.__version__, 'torch', torch.__version__, 'transformers', t.__version__)"
run() {  # run NAME SECONDS ARGS...: one benchmark under a time limit, its output kept
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  timeout "$limit" python3 "$@" 2>&1 | tee "$out/$name.txt"
  echo "=== $name: exit ${PIPESTATUS[0]}"
}
for job in $jobs; do
  case $job in
    sampler_tiny) run "$job" 150 experiments/bench/bench_sampler.py --repeats 10 ;;
    sampler_0.5b) run "$job" 300 experiments/bench/bench_sampler.py --arch 0.5b --repeats 10 ;;
    roofline_tiny) run "$job" 240 experiments/bench/bench_roofline.py --repeats 10 ;;
    roofline_0.5b)
      run "$job" 360 experiments/bench/bench_roofline.py --arch 0.5b --repeats 5 \
        --ns 32 128 512 --ts 32 512 ;;
    trl_workload)
      run "$job" 260 experiments/bench/bench_trl_workload.py --model-dir /tmp/qwen2-tiny \
        --trl --steps 10 --warmup 3 ;;
    profile_0.5b)
      run profile_update_0.5b 150 experiments/bench/bench_roofline.py --arch 0.5b --profile update
      run profile_decode_0.5b 150 experiments/bench/bench_roofline.py --arch 0.5b \
        --profile decode ;;
    logits_0.5b)  # the bf16 logits tiles against the float32 upcast, same machine and run
      run roofline_upcast_0.5b 200 experiments/bench/bench_roofline.py --arch 0.5b \
        --upcast-logits --ns 32 --ts 32
      run roofline_narrow_0.5b 200 experiments/bench/bench_roofline.py --arch 0.5b \
        --ns 32 --ts 32 ;;
    decode_loops_0.5b)
      run "$job" 300 experiments/bench/bench_decode_loops.py --arch 0.5b --ts 128 512 1024 \
        --rounds 3 ;;
    gpu_tests)  # the equivalence tests on the GPU, float32 matmuls exact as on the CPU, one
      # process; two jobs, since each compile takes seconds there (2026-11-24: about 500 s for
      # the first two files, 250 s for the rest)
      JAX_DEFAULT_MATMUL_PRECISION=highest run "$job" 560 -m pytest -q -p no:cacheprovider \
        -p no:benchmark -rA tests/test_sampling_generate.py tests/test_models.py ;;
    gpu_tests_more)
      JAX_DEFAULT_MATMUL_PRECISION=highest run "$job" 560 -m pytest -q -p no:cacheprovider \
        -p no:benchmark -rA tests/test_models_hf.py tests/test_precision.py \
        tests/test_logprobs.py tests/test_train_grpo.py tests/test_train_ppo.py ;;
    attention)  # one attention layer by backend, 4k-32k tokens (GPU memory: the einsum path's
      # 16k backward needs most of an H200)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 run "$job" 240 experiments/bench/bench_attention.py \
        --max-run-gb 120 ;;
    long_context)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 run "$job" 150 experiments/bench/bench_long_context.py \
        --lengths 4096,16384,32768 --max-run-gb 120 ;;
    fused_step)  # the default GRPO step at the 0.5B shape, fused (cuDNN) against blockwise,
      # completions of 4k and 16k tokens after a 256-token prompt, G = 8
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 run "$job" 400 experiments/bench/bench_fused_step.py \
        --lengths 4096,16384 --repeats 3 ;;
    gpu_tests_attention)
      JAX_DEFAULT_MATMUL_PRECISION=highest run "$job" 150 -m pytest -v -p no:cacheprovider \
        -p no:benchmark -rA tests/test_attention.py ;;
    longtail_0.5b)  # continuous batching against the static engine, 128 rows (2026-11-27:
      # about 50 s a length with one round; each program is compiled twice by the script,
      # the second time from the disk cache)
      JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
        run "$job" 300 experiments/bench/bench_sampler_longtail.py --arch 0.5b --ts 1024 2048 \
        --prompts 16 --group 8 --slots 32 64 --rounds 2 ;;
    longtail_0.5b_4k)  # 256 rows to 4k tokens: a call of its own (more than 240 s)
      JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
        run "$job" 540 experiments/bench/bench_sampler_longtail.py --arch 0.5b --ts 4096 \
        --prompts 32 --group 8 --slots 64 128 --rounds 1 ;;
    multiturn_slots)
      run "$job" 150 experiments/bench/bench_multiturn_slots.py --slots 8 64 --rounds 1 ;;
    gpu_tests_engines)  # the continuous engine, multi-turn slots and divergences on the GPU
      JAX_DEFAULT_MATMUL_PRECISION=highest run "$job" 240 -m pytest -q -p no:cacheprovider \
        -p no:benchmark -rA tests/test_sampling_continuous.py tests/test_sampling_multiturn.py \
        tests/test_divergences.py ;;
    async_0.5b)  # the pipelined rollouts at the Qwen2.5-0.5B shape, bf16, 256 rows, T 128: k 0
      # in sequence, k 0 with overlapped rewards, k 1, 2; a reward as costly as generation
      JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
        run "$job" 500 experiments/bench/bench_async.py --arch 0.5b --steps 6 --warmup 2 \
        --max-new-tokens 128 ;;
    gpu_check)  # the accelerator issue's checks in one call (about 8 minutes on an H200):
      # cuDNN's fused attention against the einsum (tests), the engines at the 0.5B shape on
      # a long tail to T 2,048 against the memory bound, attention at 16k and 32k, the
      # update's MFU; then `gpu_check: ...` in $out/gpu_check.txt. GPU_CHECK_QUICK=1: tiny
      # shapes, to try the script itself on a CPU (its figures are not a GPU's).
      quick=${GPU_CHECK_QUICK:-0}
      arch=0.5b; ts=2048; lens=16384,32768; slots=64; check_t=2048
      [ "$quick" = 1 ] && { arch=tiny; ts=64; lens=512,1024; slots=4; check_t=128; }
      JAX_DEFAULT_MATMUL_PRECISION=highest run gpu_check_tests 150 -m pytest -q \
        -p no:cacheprovider -p no:benchmark -rA tests/test_attention.py \
        tests/test_attention_fused.py -k "fused or decoder"
      JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
        run gpu_check_decode 200 experiments/bench/bench_sampler_longtail.py --arch "$arch" \
        --ts "$ts" --prompts 16 --group 8 --slots "$slots" --rounds 2 --compact --bound
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 run gpu_check_attention 120 \
        experiments/bench/bench_attention.py --lengths "$lens" --backends blockwise:1024,fused \
        --check-t "$check_t" --max-run-gb 120
      run gpu_check_update 150 experiments/bench/bench_roofline.py --arch "$arch" --repeats 3 \
        --ns 32 --ts 32
      python3 experiments/tools/gpu_check_summary.py "$out" | tee "$out/gpu_check.txt" ;;
    *) echo "unknown job $job" >&2; exit 2 ;;
  esac
done
