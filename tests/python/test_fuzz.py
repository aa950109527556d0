"""The payload fuzzer's Python side: gradcomp.decompress and state loading on damaged inputs, in
a subprocess so that a crash fails the test instead of ending pytest."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_python_entry_points_raise_on_damaged_inputs_and_never_crash():
    proc = subprocess.run([sys.executable, str(ROOT / "fuzz" / "fuzz_python.py"), "--cases", "3000"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "0 findings" in proc.stdout
