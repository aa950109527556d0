#!/usr/bin/env bash
# On the lent H200: build, run the GPU tests of both kernel generations (v1, v2) and under
# compute-sanitizer (memcheck, racecheck), the front ends on CUDA, then the kernel benchmarks v1 vs
# v2 vs copy vs cub::DeviceTopK vs torch.topk vs torch.compile, and print one table.
# Needs .gpu-deps/ (scripts/gpu_pack_deps.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/build-gpu/out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$root/.gpu-deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_PREFIX_PATH="$root/.gpu-deps/usr" -DGRADCOMP_CCCL_INCLUDE_DIR="$root/.gpu-deps/cccl" \
  > "$out/configure.log"
cmake --build build-gpu -j "$(nproc)" --target gradcomp_gpu_tests gradcomp_bench_cuda gradcomp_bench_cli > "$out/build.log" 2>&1 || {
  tail -40 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"

status=0
./build-gpu/tests/gradcomp_gpu_tests 2>&1 | tee "$out/tests.log" | grep -E '^\[  (PASSED|FAILED|SKIPPED) ' || status=1
grep -q 'FAILED' "$out/tests.log" && status=1 || true
compute-sanitizer --tool memcheck --error-exitcode 3 ./build-gpu/tests/gradcomp_gpu_tests \
  --gtest_filter='-*Nccl*' > "$out/memcheck.log" 2>&1 && echo "memcheck: clean" || { echo "memcheck: FAILED"; status=1; }
compute-sanitizer --tool racecheck --error-exitcode 3 ./build-gpu/tests/gradcomp_gpu_tests \
  --gtest_filter='GpuTopK.*:GpuQ4.Fused*:GpuQ4.BothGenerationsSeal*:GpuQ4.V2*' > "$out/racecheck.log" 2>&1 && echo "racecheck: clean" || { echo "racecheck: FAILED"; status=1; }
# ---- issue 36: the q2 v2 kernels (Q2's only CUDA kernels) by name; memcheck runs them above with
# every GPU test. Racecheck on the seal with few blocks (the last block's ticket) and the corrupt
# payloads (the payload checks' finished-block count).
./build-gpu/tests/gradcomp_gpu_tests --gtest_filter='GpuQ2.*:GpuRejects.Q2*' > "$out/q2.log" 2>&1 &&
  grep -q '\[  PASSED  \] 5 tests' "$out/q2.log" && echo "q2 v2 kernels: ok" ||
  { echo "q2 v2 kernels: FAILED"; tail -20 "$out/q2.log"; status=1; }
compute-sanitizer --tool racecheck --error-exitcode 3 ./build-gpu/tests/gradcomp_gpu_tests \
  --gtest_filter='GpuQ2.V2SealsWithFewBlocks:GpuQ2.CorruptPayloadsAreRejectedByName' > "$out/q2-racecheck.log" 2>&1 &&
  echo "q2 racecheck: clean" || { echo "q2 racecheck: FAILED"; status=1; }
# ---- end of issue 36's block
# ---- issue 34 (FSDP/DiLoCo review): the CUDA reduce-scatter's rejection contract (item 5) by name;
# DiLoCo's broadcast-before-anchors ordering (item 4) is checked by `test_diloco.py -k cuda` below,
# whose ranks start from different seeds.
./build-gpu/tests/gradcomp_gpu_tests --gtest_filter='GpuReduceScatter.*' > "$out/issue34.log" 2>&1 &&
  grep -q '\[  PASSED  \] 1 test' "$out/issue34.log" && echo "issue 34 reduce-scatter rejection: ok" ||
  { echo "issue 34 reduce-scatter rejection: FAILED"; tail -20 "$out/issue34.log"; status=1; }
# ---- end of issue 34's block
# The blocks below run each issue's GPU tests by name, counting them; memcheck ran them all above.
# ---- issue 35 (int8 and 4-bit weight all-gathers on CUDA, v2 only): byte equality with the CPU
# backend, the NaN and corrupt-payload refusals.
./build-gpu/tests/gradcomp_gpu_tests --gtest_filter='GpuInt8AllGather.*' > "$out/issue35.log" 2>&1 &&
  grep -q '\[  PASSED  \] 6 tests' "$out/issue35.log" && echo "issue 35 int8 all-gather: ok" ||
  { echo "issue 35 int8 all-gather: FAILED"; tail -20 "$out/issue35.log"; status=1; }
# The 4-bit codec's v2 kernels (GCW4; the fused and the scales-then-bytes layouts, runs at odd row
# offsets) the same way.
./build-gpu/tests/gradcomp_gpu_tests --gtest_filter='GpuInt4AllGather.*' > "$out/issue35-int4.log" 2>&1 &&
  grep -q '\[  PASSED  \] 3 tests' "$out/issue35-int4.log" && echo "issue 35 4-bit all-gather: ok" ||
  { echo "issue 35 4-bit all-gather: FAILED"; tail -20 "$out/issue35-int4.log"; status=1; }
# ---- end of issue 35's block
# ---- issue 35 (the FSDP reduce-scatter without host waits, v2 kernels, q4 and top-k): byte
# equality with the CPU reduce-scatter over rounds with error feedback and a poisoned round, a
# corrupt payload raised by name at flush() and at the bucket's next call.
./build-gpu/tests/gradcomp_gpu_tests --gtest_filter='*GpuReduceScatterNoWait.*' > "$out/rs-no-wait.log" 2>&1 &&
  grep -q '\[  PASSED  \] 4 tests' "$out/rs-no-wait.log" && echo "reduce-scatter without host waits: ok" ||
  { echo "reduce-scatter without host waits: FAILED"; tail -20 "$out/rs-no-wait.log"; status=1; }
# ---- end of the reduce-scatter-without-host-waits block
# ---- issue 36 (DiLoCo's outer step on the device, v2 only): the outer kernels byte-equal to the
# CPU backend (a 300-tensor table among them) and OuterSync rounds on CUDA (tau = 0 and tau > 0)
# equal to the CPU's, plain and under racecheck (the round's thread beside the caller's).
./build-gpu/tests/gradcomp_gpu_tests --gtest_filter='GpuOuterStep.*' > "$out/outer.log" 2>&1 &&
  grep -q '\[  PASSED  \] 6 tests' "$out/outer.log" && echo "issue 36 outer step: ok" ||
  { echo "issue 36 outer step: FAILED"; tail -20 "$out/outer.log"; status=1; }
compute-sanitizer --tool racecheck --error-exitcode 3 ./build-gpu/tests/gradcomp_gpu_tests \
  --gtest_filter='GpuOuterStep.*' > "$out/outer-racecheck.log" 2>&1 &&
  echo "issue 36 outer racecheck: clean" || { echo "issue 36 outer racecheck: FAILED"; status=1; }
# ---- end of issue 36's outer-step block
echo "tests: $(( $(date +%s) - t0 )) s"

# The DDP hook and GradSync on the GPU: the torch layer built against the machine's torch (2.7 or
# newer; the image has 2.11), then their GPU tests, each under a deadline so that one hang cannot
# spend the lease (the launcher prints every thread's stack before it gives up).
torch_ok=0
if python3 -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 7))" 2>/dev/null; then
  torch_ok=1
else
  echo "SKIPPED: the hook's and GradSync's GPU tests: this machine's torch ($(python3 -c 'import torch; print(torch.__version__)' 2>&1 | tail -1)) is older than 2.7"
fi
if [ "$torch_ok" = 1 ]; then
  export CMAKE_PREFIX_PATH="$root/.gpu-deps/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  CMAKE_CUDA_ARCHITECTURES=90 GRADCOMP_BUILD_DIR="$root/build-gpu-python" \
    python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/pip.log" 2>&1 || { tail -20 "$out/pip.log"; status=1; }
  echo "torch layer: $(( $(date +%s) - t0 )) s"
  for t in "test_gpu_hook.py" "test_shared_device.py -k cuda" "test_fsdp.py -k cuda" "test_diloco.py -k cuda" \
           "test_fsdp_params.py -k cuda"; do
    log="$out/pytest-$(echo "$t" | cut -d. -f1).log"
    # shellcheck disable=SC2086  # $t carries the file and its -k filter
    PYTHONUNBUFFERED=1 timeout 240 python3 -m pytest tests/python/$t -q -rs 2>&1 | tee "$log" | tail -4 || true
    grep -qE "[0-9]+ passed" "$log" && ! grep -qE "failed|error|Timeout" "$log" || status=1
  done
  # The DDP hook once more on the v2 kernels (GRADCOMP_KERNELS picks them for every front end).
  GRADCOMP_KERNELS=v2 PYTHONUNBUFFERED=1 timeout 240 python3 -m pytest tests/python/test_gpu_hook.py -q -rs 2>&1 |
    tee "$out/pytest-gpu-hook-v2.log" | tail -4 || true
  grep -qE "[0-9]+ passed" "$out/pytest-gpu-hook-v2.log" && ! grep -qE "failed|error|Timeout" "$out/pytest-gpu-hook-v2.log" || status=1
  # One rank's step on a GPT-2-small-sized transformer (bf16 autocast, NCCL): step times with and
  # without the hook, codec time, and how much of gradcomp's kernel time overlapped backward.
  PYTHONUNBUFFERED=1 timeout 180 python3 bench/gpu_overlap.py --out "$out/overlap.json" > "$out/overlap.log" 2>&1 ||
    { tail -20 "$out/overlap.log"; status=1; }
  python3 - "$out/overlap.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['device']}, {r['params'] / 1e6:.0f}M parameters, torch {r['torch']}")
for name, m in r["methods"].items():
    t = m.get("trace", {})
    print(f"  {name:14s} {m['median_step_ms']:7.2f} ms  x{m.get('vs_ddp', float('nan')):.3f}  codec "
          f"{m.get('codec_ms_per_step', 0):.2f} ms/step  overlap {t.get('overlap_fraction')}")
PY
  # The step-time model of docs/benchmarks.md with the codec rate measured above (q4's kernels'
  # GPU time per step from the trace, not the host's queueing time), 8 GPUs a node, 2-64 nodes.
  encode=$(python3 - "$out/overlap.json" <<'PY' 2>/dev/null || true
import json, sys
r = json.load(open(sys.argv[1]))
t = r["methods"]["gradcomp-q4"]["trace"]
seconds = t["gradcomp_kernel_us"] / 3 * 1e-6  # three profiled steps
# project_mode's codec cost is 24 bytes per element over --encode-gbps GB/s: invert it.
print(f"--params {r['params']} --encode-gbps {24 * r['params'] / seconds / 1e9:.1f}" if seconds > 0 else "")
PY
)
  if [ -n "$encode" ]; then
    for nodes in 2 4 8 16 32 64; do
      # shellcheck disable=SC2086  # $encode holds two options
      ./build-gpu/bench/gradcomp-bench project $encode --link-gbps 25,100,400 --gpus-per-node 8 --nodes "$nodes"
    done > "$out/projection.txt" 2>&1 && tail -4 "$out/projection.txt" || status=1
  fi
fi
echo "front ends: $(( $(date +%s) - t0 )) s"

# Kernels: v1 and v2 side by side in one binary (medians of 5), against the device copy, cub's
# DeviceTopK, torch.topk and torch.compile of the same decode math; one table, target met or not.
./build-gpu/bench/gradcomp_bench_cuda --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
  --benchmark_format=json --benchmark_out="$out/bench.json" > "$out/bench.txt" 2>&1 || status=1
python3 - "$out/bench.json" <<'PY' | tee "$out/table.txt" || status=1
import json, math, sys
runs = {b["name"]: b for b in json.load(open(sys.argv[1]))["benchmarks"] if b.get("aggregate_name") == "median"}
def run(name): return runs.get(name + "/manual_time_median", {})
def t(name): return run(name).get("real_time", math.nan)          # microseconds
def r(name): return run(name).get("vs_copy", math.nan)            # fraction of the device copy
big = 100_000_000
copy_bps = run(f"BM_CudaCopy/{big}").get("bytes_per_second", math.nan)
def peer_torch():
    out = {}
    try:
        import torch
        def timed(fn, reps=7):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn(); torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) * 1e3)
            return sorted(ts)[reps // 2]
        x = torch.randn(big, device="cuda")
        out["topk"] = timed(lambda: torch.topk(x.abs(), big // 100))
        n, w = big // 4, 4  # decode-and-mean of 4 q4 payloads, the same math compiled by torch
        codes = torch.randint(0, 256, (w, n // 2), dtype=torch.uint8, device="cuda")
        scales = torch.rand(w, n // 64, device="cuda")
        def decode(codes, scales):
            lo = (codes & 15).to(torch.float32) - 8
            hi = (codes >> 4).to(torch.float32) - 8
            q = torch.stack((lo, hi), dim=-1).reshape(w, n // 64, 64)
            return (q * scales.unsqueeze(-1)).sum(0).reshape(-1) / w
        compiled = torch.compile(decode)
        out["decode4"] = timed(lambda: compiled(codes, scales))
    except Exception as err:  # the table says so rather than dropping the row
        print("torch peers unavailable:", err)
    return out
peers = peer_torch()
dec4_bytes = 4 * (n4 := big // 4) * (0.5 + 4 / 64) + 4.0 * n4
def frac(us, nbytes): return nbytes / (us * 1e-6) / copy_bps if us == us and copy_bps == copy_bps else math.nan
E = "BM_CudaQ4Encode/n:{n}/dtype:{d}/sr:{sr}/ef:{ef}/gen:{g}"
D = "BM_CudaQ4DecodeSum/n:{n}/W:{w}/gen:{g}"
K = "BM_CudaTopKEncode/n:{n}/exact:{x}/gen:{g}"
F = "BM_CudaFusedPacking/tensors:100/fused:1/gen:{g}"
one_read_us = 4.0 * big / copy_bps * 2 * 1e6 if copy_bps == copy_bps else math.nan  # copy moves 2x
rows = []
for label, fmt, kw, target, better in [
    ("q4 encode fp32 SR+EF, of copy", E, dict(n=big, d=0, sr=1, ef=1), 0.85, "ge"),
    ("q4 encode fp32 SR, no EF, of copy", E, dict(n=big, d=0, sr=1, ef=0), 0.60, "ge"),
    ("q4 encode bf16 SR, no EF, of copy", E, dict(n=big, d=2, sr=1, ef=0), 0.45, "ge"),
    ("q4 decode-and-mean W=4, of copy", D, dict(n=big // 4, w=4), 0.75, "ge"),
    ("q4 decode W=1, of copy", D, dict(n=big, w=1), 0.80, "ge"),
]:
    rows.append((label, r(fmt.format(g=1, **kw)), r(fmt.format(g=2, **kw)),
                 frac(peers.get("decode4", math.nan), dec4_bytes) if "W=4" in label else math.nan, target, better))
rows.append(("exact top-k 1% of 1e8 + EF, us", t(K.format(n=big, x=1, g=1)),
             min(t(K.format(n=big, x=1, g=2)), t(K.format(n=big, x=1, g=3))),
             min(t(f"BM_CubDeviceTopK/n:{big}"), peers.get("topk", math.inf)), 500, "le"))
rows.append(("approx top-k / one read", t(K.format(n=big, x=0, g=1)) / one_read_us,
             t(K.format(n=big, x=0, g=2)) / one_read_us, math.nan, 2.0, "le"))
single = r(E.format(n=big, d=0, sr=1, ef=0, g=2))
rows.append(("fused 100 tensors / single segment", r(F.format(g=1)) / r(E.format(n=big, d=0, sr=1, ef=0, g=1)),
             r(F.format(g=2)) / single, math.nan, 0.9, "ge"))
rows.append(("1M-element encode, us", t(E.format(n=1 << 20, d=0, sr=1, ef=1, g=1)),
             t(E.format(n=1 << 20, d=0, sr=1, ef=1, g=2)), math.nan, 15, "le"))
rows.append(("1M-element decode, us", t(D.format(n=1 << 20, w=1, g=1)), t(D.format(n=1 << 20, w=1, g=2)),
             math.nan, 15, "le"))
print(f"{'kernel':38s} {'v1':>9s} {'v2':>9s} {'peer':>9s} {'target':>8s}  met (v2)")
for label, v1, v2, peer, target, better in rows:
    met = (v2 >= target) if better == "ge" else (v2 <= target)
    print(f"{label:38s} {v1:9.3f} {v2:9.3f} {peer:9.3f} {('>= ' if better == 'ge' else '<= ') + str(target):>8s}  "
          f"{'yes' if met else 'NO'}")
print("peer: torch.compile decode (W=4), min(cub::DeviceTopK, torch.topk) (top-k); times in us, ratios of the copy")
PY

# GradSync on the GPU (NCCL, compression stream): the C++ trainer against the installed package.
if [ "$torch_ok" = 1 ] && [ -d build-gpu-python ]; then
  torch_cmake="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
  { cmake --build build-gpu-python -j "$(nproc)" && cmake --install build-gpu-python --prefix build-gpu/install-torch &&
    cmake -S examples/cpp -B build-gpu/example-cpp -G Ninja -DCMAKE_PREFIX_PATH="$root/build-gpu/install-torch;$torch_cmake" &&
    cmake --build build-gpu/example-cpp; } > "$out/grad-sync-build.log" 2>&1 || { tail -20 "$out/grad-sync-build.log"; status=1; }
  GRADCOMP_CPP_TRAINER="$root/build-gpu/example-cpp/digits_trainer" PYTHONUNBUFFERED=1 timeout 240 \
    python3 -m pytest tests/python/test_gpu_grad_sync.py "tests/python/test_grad_sync.py::test_resume_from_a_checkpoint_is_bit_identical" \
    "tests/python/test_grad_sync.py::test_a_non_finite_bf16_step_is_reported_on_every_rank" -k "cuda or gpu" -q -rs 2>&1 |
    tee "$out/pytest-grad-sync.log" | tail -3 || true
  grep -qE "failed|error" "$out/pytest-grad-sync.log" && status=1 || true
fi
echo "total: $(( $(date +%s) - t0 )) s"
exit $status
