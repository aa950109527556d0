"""bench/gpu_overlap.py's trace reading, on a hand-made chrome trace (the GPU run has no second
chance to find a mistake in it), and the script end to end on the CPU with a tiny model."""
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_overlap  # noqa: E402


def kernel(name, stream, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_overlap_counts_gradcomp_kernel_time_that_other_streams_cover(tmp_path):
    trace = {"traceEvents": [
        kernel("void gradcomp::kernels::q4_encode_kernel<float>(...)", 7, 100, 50),   # 100-150
        kernel("void gradcomp::kernels::q4_decode_mean_kernel(...)", 7, 300, 100),   # 300-400
        kernel("sm90_xmma_gemm_bf16", 1, 120, 60),                                    # 120-180
        kernel("sm90_xmma_gemm_bf16", 1, 170, 20),                                    # inside the last
        kernel("elementwise_kernel", 2, 350, 100),                                    # 350-450
        {"ph": "X", "cat": "cpu_op", "name": "gradcomp::q4_encode", "ts": 0, "dur": 1000, "args": {}},
    ]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    r = gpu_overlap.kernel_overlap(str(path))
    assert r["gradcomp_kernels"] == 2 and r["other_kernels"] == 3 and r["gradcomp_streams"] == ["7"]
    assert r["gradcomp_kernel_us"] == 150
    assert r["overlapped_us"] == 30 + 50  # 120-150 and 350-400
    assert abs(r["overlap_fraction"] - 80 / 150) < 1e-12


def test_the_script_runs_on_the_cpu(tmp_path):
    out = tmp_path / "overlap.json"
    subprocess.check_call([sys.executable, str(ROOT / "bench" / "gpu_overlap.py"), "--device", "cpu", "--layers", "1",
                           "--d", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "128", "--steps", "2",
                           "--warmup", "1", "--methods", "ddp,gradcomp-q4", "--out", str(out)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    q4 = r["methods"]["gradcomp-q4"]
    assert q4["stats_total"]["compressed_buckets"] == q4["stats_total"]["buckets"] > 0
    assert q4["codec_ms_per_step"] > 0 and r["methods"]["ddp"]["vs_ddp"] == 1.0
