#!/usr/bin/env bash
# Runs every test gradcomp has on this machine: core (GoogleTest), sanitizers, fuzzing, packaging.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
jobs="${GRADCOMP_JOBS:-$(nproc)}"
fuzz_seconds="${GRADCOMP_FUZZ_SECONDS:-60}"
cuda_archs="${CMAKE_CUDA_ARCHITECTURES:-90}"
oldest_torch="${GRADCOMP_OLDEST_TORCH:-2.7.1}"  # the oldest torch the torch layer supports (README)
oldest_fsdp_torch=2.9.1  # the first torch with FSDPModule.set_custom_reduce_scatter (2.9), newest patch
gpu_machine_torch=2.11.0  # the torch of the GPU machine scripts/gpu_check.sh runs on

# Each stage's seconds go to a log outside the clone (CI runs on a clean clone of a machine like the
# developers'; the log keeps what the last runs spent where, for keeping the whole run under an hour).
timings="${GRADCOMP_CI_TIMINGS:-$HOME/.cache/gradcomp/ci-stage-times.log}"
mkdir -p "$(dirname "$timings")"
run_id="$(date -u +%Y-%m-%dT%H:%MZ) $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
stage_name="set-up" stage_start=$SECONDS
log_stage() { printf '%s %5ds %s\n' "$run_id" "$((SECONDS - stage_start))" "$stage_name" >> "$timings" || true; }
step() {
  log_stage
  stage_name="$*" stage_start=$SECONDS
  printf '\n[%ss] ==== %s\n' "$SECONDS" "$*"
}
trap 'rc=$?; stage_name="$stage_name (exit $rc; total ${SECONDS}s)"; log_stage' EXIT

"$root/scripts/setup.sh"

# One compiler cache, outside the clone, for every build below (CMake reads the launchers from the
# environment; pip's builds inherit it). Paths are rewritten relative to the clone, so a fresh clone
# hits what the last run compiled.
if command -v ccache >/dev/null 2>&1; then
  export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/gradcomp/ccache}" CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1
  export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-8G}"
  export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache
  ccache --zero-stats >/dev/null
fi

step "layers (no upward includes) and clang-format"
python3 "$root/scripts/check_layers.py"
git ls-files '*.h' '*.cpp' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  step "static SASS check: v1 kernels reported, v2 kernels held to kernels/sass_budgets.txt"
  GRADCOMP_VENV="$("$root/scripts/python_env.sh")" "$root/scripts/check_sass_budgets.sh"
fi

step "core build (CUDA architectures: $cuda_archs when nvcc is present)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$cuda_archs" \
  -DCMAKE_INSTALL_PREFIX="$root/build/install"
cmake --build build -j "$jobs"

step "core tests (GPU tests report as skipped without a device)"
ctest --test-dir build --output-on-failure -j "$jobs"

step "AddressSanitizer + UBSan build of the host code and tests"
cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=Debug -DGRADCOMP_WITH_CUDA=OFF \
  -DGRADCOMP_SANITIZE=ON -DGRADCOMP_BUILD_BENCHMARKS=OFF
cmake --build build-sanitize -j "$jobs"
ctest --test-dir build-sanitize --output-on-failure -j "$jobs"

step "ThreadSanitizer build of the host code and the multi-threaded tests (engine worker, in-process ranks, DiLoCo stats)"
tsan_start=$SECONDS
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADCOMP_WITH_CUDA=OFF \
  -DGRADCOMP_SANITIZE_THREAD=ON -DGRADCOMP_BUILD_BENCHMARKS=OFF
cmake --build build-tsan -j "$jobs" --target gradcomp_engine_tests gradcomp_collective_tests
# halt_on_error: a race fails the stage rather than scrolling past. Every test of both binaries:
# together they take well under a minute on 2 cores, and most of them run ranks on threads.
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
./build-tsan/tests/gradcomp_engine_tests
./build-tsan/tests/gradcomp_collective_tests
unset TSAN_OPTIONS
echo "ThreadSanitizer stage: $((SECONDS - tsan_start)) s"

step "ThreadSanitizer over the C++ front ends (GradSync, DDP hook, DiLoCo overlapped, FSDP collectives; 2 ranks, metrics scraped during every step)"
tsan_torch_start=$SECONDS
# The same build folder: the core's objects are reused; only the torch layer and the driver compile.
cmake -S . -B build-tsan -DGRADCOMP_BUILD_TORCH=ON \
  -DPython3_EXECUTABLE="$("$root/scripts/python_env.sh")/bin/python" > /dev/null
cmake --build build-tsan -j "$jobs" --target gradcomp_torch_front_end_threads
# libtorch (and its gloo) is not instrumented: TSan sees none of its atomics, only its calls into
# libc. ignore_noninstrumented_modules: those calls (memcpy, delete, pthread_cond_destroy) are not
# checked as accesses, while its mutexes and condition variables still order everything; every
# access of gradcomp's code and of the c10/ATen headers compiled into it is checked. No suppressions.
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1"
./build-tsan/tests/tsan/gradcomp_torch_front_end_threads 2
unset TSAN_OPTIONS
echo "ThreadSanitizer torch stage: $((SECONDS - tsan_torch_start)) s"

step "libFuzzer: payload decoders for ${fuzz_seconds}s"
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGRADCOMP_WITH_CUDA=OFF -DGRADCOMP_BUILD_TESTS=OFF -DGRADCOMP_BUILD_BENCHMARKS=OFF -DGRADCOMP_BUILD_FUZZERS=ON
cmake --build build-fuzz -j "$jobs"
rm -rf build-fuzz/corpus && mkdir -p build-fuzz/corpus
# The committed corpus (fuzz/corpus: a minimized earlier run) plus fresh seeds of valid payloads.
cp fuzz/corpus/* build-fuzz/corpus/
./build-fuzz/fuzz/gradcomp_fuzz_seeds build-fuzz/corpus
./build-fuzz/fuzz/gradcomp_fuzz_decode -max_total_time="$fuzz_seconds" -print_final_stats=1 build-fuzz/corpus

step "install + find_package(gradcomp) from a consumer project"
cmake --install build
cmake -S tests/consumer -B build-consumer -G Ninja -DCMAKE_PREFIX_PATH="$root/build/install"
cmake --build build-consumer
./build-consumer/gradcomp_consumer

step "Python package (pip install -e .): gradcomp._C and gradcomp::torch built against the venv's torch"
venv="$("$root/scripts/python_env.sh")"
CMAKE_CUDA_ARCHITECTURES="$cuda_archs" "$venv/bin/pip" install -q --no-build-isolation -e .

step "C++ training API: install gradcomp::torch, build examples/cpp with find_package(gradcomp COMPONENTS torch)"
cmake --build build-python -j "$jobs"
cmake --install build-python --prefix "$root/build/install-torch" > /dev/null
torch_cmake="$("$venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
cmake -S examples/cpp -B build/example-cpp -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$root/build/install-torch;$torch_cmake" > /dev/null
cmake --build build/example-cpp
export GRADCOMP_CPP_TRAINER="$root/build/example-cpp/digits_trainer"

step "Python and C++ front ends on real Gloo process groups (DDP hook, GradSync under torchrun)"
"$venv/bin/python" -m pytest tests/python -q -rs --durations=25

# The torch layer built against an older torch in that torch's own environment and build folder
# (extra CMake arguments in $2), then the test files after it run against it from tests/python, so
# that the package imported is the one installed there. $3 = trainer also builds GradSync's C++
# trainer (examples/cpp) against that torch, for the tests that launch it.
older_torch_stage() {
  local version="$1" cmake_args="$2" trainer="$3"
  shift 3
  local venv_v build_v="$root/build-torch-$version" trainer_env=()
  venv_v="$("$root/scripts/python_env.sh" "$version")"
  GRADCOMP_BUILD_DIR="$build_v" GRADCOMP_CMAKE_ARGS="$cmake_args" CMAKE_CUDA_ARCHITECTURES="$cuda_archs" \
    "$venv_v/bin/pip" install -q --no-build-isolation --no-deps .
  if [ "$trainer" = trainer ]; then
    cmake --build "$build_v" -j "$jobs"
    cmake --install "$build_v" --prefix "$root/build/install-torch-$version" > /dev/null
    local torch_cmake_v
    torch_cmake_v="$("$venv_v/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
    # torch 2.7's CMake config looks for NVTX 3 in its own source tree unless told to use the toolkit's.
    cmake -S examples/cpp -B "build/example-cpp-$version" -G Ninja -DCMAKE_BUILD_TYPE=Release -DUSE_SYSTEM_NVTX=ON \
      -DCMAKE_PREFIX_PATH="$root/build/install-torch-$version;$torch_cmake_v" > /dev/null
    cmake --build "build/example-cpp-$version"
    trainer_env=("GRADCOMP_CPP_TRAINER=$root/build/example-cpp-$version/digits_trainer")
  fi
  step "torch $version: the tests"
  (cd tests/python && env "${trainer_env[@]}" "$venv_v/bin/python" -m pytest -q -rs -p no:cacheprovider "$@")
}

# What the older torches run (-k over test and file names). The newest runs everything; the older
# ones run what touches torch's API: every front end, both DDP routes, checkpoints, faults, and the
# codecs at two ranks. Left to the newest: what only varies the core (world sizes of 4 and 8, every
# codec on the overlapped pipeline, the leak soaks, worker-CPU and optimizer-warning argument
# checks), to keep CI under an hour on two cores.
core_only="larger_world_sizes or overlapped_buckets or long_run or two_hundred_times or bad_worker_cpus \
or adaptive_optimizer or find_unused or four_ranks or slow_rank or extended_with_eager[3]"
# The oldest torch also leaves to the newest the variants of one front-end path that differ only in
# the core's codec, world size or pieces (each path still runs once there, at two ranks), and the
# accuracy and worker-placement runs: the torch layer is the same code for every codec.
core_variants="(pure_pytorch_reference and not -2]) or (averaged_gradients and not ([2-q4-1-0] or [3-topk-2-0])) \
or (resume_from_a_checkpoint_is_bit_identical and not [q4-) or (checkpoint_resume_is_bit_identical[ and not [q4]) \
or (rebuilds_buckets and topk) or (bad_bytes and not [q4-flip_bits]) or (killed_rank_makes_every and not [encode]) \
or (three_step_reference and [8-4-) or (diloco_equals_the_reference_bit_for_bit and not [2]) \
or elastic_restart_from_the_checkpoint_ends_bit_identical[topk] or sends_rounds_only[3] or q4_trains_digits \
or the_worker_runs or openmp_binding"

step "oldest supported torch ($oldest_torch): the torch layer, GradSync's trainer and every front end's tests but FSDP's"
older_torch_stage "$oldest_torch" "" trainer -k "not ($core_only or $core_variants)" test_torch_versions.py test_torch_compile.py \
  test_ddp_hook.py test_grad_sync.py test_hierarchical.py test_faults.py test_diloco.py test_monitoring.py

step "oldest torch with FSDP2's comm hooks ($oldest_fsdp_torch, CPU-only build): every FSDP test"
older_torch_stage "$oldest_fsdp_torch" "-DGRADCOMP_WITH_CUDA=OFF" no test_torch_versions.py test_fsdp.py \
  test_fsdp_params.py

# The GPU machine's torch sits between the two above on every interface gradcomp uses: the build
# (CUDA parts included) and one pass through each front end.
gpu_torch_k="test_torch_versions or test_fsdp_params or (test_fsdp and ([avg-2] or premul-2 or mixed_precision \
or checkpoint)) or (test_ddp_hook and (pure_pytorch_reference[q4-2] or pure_pytorch_reference[topk_dgc-2] \
or register_and_standard_route_agree[q4-float32] or checkpoint_resume_is_bit_identical[q4] or nan_on_one_rank \
or no_compression or grad_scaler)) or (test_grad_sync and (quickstart or uncompressed_grad_sync \
or averaged_gradients_equal_the_reference_and_the_python_hook[2-q4-1-0] or resume_from_a_checkpoint_is_bit_identical[q4-cpu] \
or non_finite or sends_rounds_only[2])) or (test_diloco and (reference_bit_for_bit[2] or resume or overlap))"
step "the GPU machine's torch ($gpu_machine_torch, CUDA build): each front end once"
older_torch_stage "$gpu_machine_torch" "" trainer -k "$gpu_torch_k" test_torch_versions.py test_ddp_hook.py \
  test_grad_sync.py test_fsdp.py test_fsdp_params.py test_diloco.py

step "example: torchrun, 2 ranks, q4 hook on digits"
"$venv/bin/torchrun" --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29511 \
  examples/ddp_train.py --codec q4 --epochs 3

step "smoke: gradcomp-bench (codec, projection, bad arguments) and the end-to-end benchmark"
./build/bench/gradcomp-bench codec --sizes 1e4,1e5 --reps 2
./build/bench/gradcomp-bench codec --sizes 1e4 --reps 1 --json > build/bench-smoke.json
"$venv/bin/python" -c "import json; rows = json.load(open('build/bench-smoke.json')); assert len(rows) == 8, rows"
./build/bench/gradcomp-bench project --params 1e9 --link-gbps 25
# FSDP rows of the model: the ring traffic of fp32 and bf16 exactly, int8 weights smaller than bf16's,
# and on one GPU per node (the all-to-all crossing each link once, as a ring) q4 below bf16.
./build/bench/gradcomp-bench project --params 1e9 --link-gbps 25 --gpus-per-node 1 --json > build/project-smoke.json
"$venv/bin/python" scripts/check_project_fsdp.py build/project-smoke.json 16
if ./build/bench/gradcomp-bench codec --sizes nope 2>/dev/null; then echo "bad argument accepted"; exit 1; fi
"$venv/bin/python" bench/e2e.py --world 2 --gbps 1 --steps 2 --warmup 1 --hidden 256 \
  --methods ddp-fp32,bf16-hook,powersgd-r4,gradcomp-q4,gradcomp-topk-dgc,diloco-q4-h20 --digits-epochs 1 \
  --out build/e2e-smoke
"$venv/bin/python" -c "import json; r = json.load(open('build/e2e-smoke/e2e.json')); \
assert all(x['ok'] for x in r['throughput']), r['throughput']; assert len(r['digits']) == 6 and all(x['ok'] for x in r['digits']), r['digits']"

step "smoke: two simulated nodes of 2 ranks (network namespaces, 1 Gbit/s between them): hierarchical q4 sends less between nodes than flat q4"
set +e
"$venv/bin/python" bench/e2e_nodes.py --quick --out build/e2e-nodes-smoke
nodes_rc=$?
set -e
if [ "$nodes_rc" -eq 2 ]; then
  echo "SKIPPED: the two-node smoke needs root and iproute2 for network namespaces"
else
  [ "$nodes_rc" -eq 0 ] || { echo "two-node smoke failed"; exit 1; }
  "$venv/bin/python" -c "import json; r = json.load(open('build/e2e-nodes-smoke/e2e_nodes_quick.json')); \
m = {x['method']: x for x in r['throughput']}; assert all(x['ok'] for x in m.values()), m; \
assert m['gradcomp-q4-hier']['link_bytes_per_step'] < 0.65 * m['gradcomp-q4']['link_bytes_per_step'], m"
fi

step "convergence smoke: a small transformer with AdamW on 2 ranks; top-k's remedies (warm-up + clipping, q4 warm-up) beat plain error feedback"
"$venv/bin/python" bench/convergence.py --quick --out build/convergence-smoke

step "convergence smoke: DiLoCo warm-started from dense DDP follows dense exactly up to the switch, then trains alone, on both LMs (lm2's text checked against its sha256)"
"$venv/bin/python" bench/convergence.py --tasks lm,lm2 --methods dense,diloco-h4-lr1.0-m0.3 --seeds 0 --steps 14 \
  --warm-start 8 --out build/convergence-warm-smoke

step "pip install --no-build-isolation . (a wheel against the installed torch, as the README says to install), used from outside the clone"
rm -rf build/wheel
# In the editable install's build folder, so nothing compiles twice. Plain `pip install .` (pyproject.toml's
# requirements, torch among them, in an isolated environment) is not run here: it downloads torch with its
# CUDA libraries (2.8 GB) and recompiles the torch layer against that copy (455 CPU-s), minutes that a
# CI run of under an hour on two cores does not have.
CMAKE_CUDA_ARCHITECTURES="$cuda_archs" "$venv/bin/pip" wheel -q --no-deps --no-build-isolation -w build/wheel .
"$venv/bin/pip" install -q --no-deps --force-reinstall build/wheel/gradcomp-*.whl
(cd tests/python && "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  test_ddp_hook.py -k "no_compression or nan_on_one_rank or standalone_compress" && \
  "$venv/bin/python" -c "import gradcomp, sys; assert '/site-packages/' in gradcomp.__file__, gradcomp.__file__")
# Back to the editable install the rest of this clone's tools expect.
CMAKE_CUDA_ARCHITECTURES="$cuda_archs" "$venv/bin/pip" install -q --no-build-isolation -e .

if command -v ccache >/dev/null 2>&1; then ccache --show-stats | grep -iE "hits|misses" || true; fi
step "all tests passed"
