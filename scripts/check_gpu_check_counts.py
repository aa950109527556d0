#!/usr/bin/env python3
"""Checks that each test count scripts/gpu_check.sh expects equals what its filter selects in the GPU test binary.

A block of gpu_check.sh runs `gradcomp_gpu_tests --gtest_filter='F' > "$out/L.log"` and passes when the log says
`[  PASSED  ] N tests`; a test added to or removed from F without N would fail the one device run a session gets.
Usage: check_gpu_check_counts.py <gradcomp_gpu_tests> <gpu_check.sh>. Listing the tests needs no GPU.
"""
import re
import subprocess
import sys


def expected_counts(script: str) -> dict:
    filters = dict((log, f) for f, log in re.findall(
        r"gradcomp_gpu_tests --gtest_filter='([^']+)' > \"\$out/([\w.-]+)\"", script))
    counts = {log: int(n) for n, log in re.findall(r"PASSED  \\\] (\d+) tests?' \"\$out/([\w.-]+)\"", script)}
    missing = sorted(set(counts) - set(filters))
    if missing:
        sys.exit(f"gpu_check.sh counts the tests of {missing} but runs no filter into that log")
    return {log: (filters[log], n) for log, n in counts.items()}


def listed(binary: str, gtest_filter: str) -> int:
    out = subprocess.run([binary, "--gtest_list_tests", f"--gtest_filter={gtest_filter}"],
                         check=True, capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line.startswith("  "))


def main() -> int:
    binary, script_path = sys.argv[1], sys.argv[2]
    blocks = expected_counts(open(script_path).read())
    if not blocks:
        print("gpu_check.sh: no counted blocks found (has its form changed?)")
        return 1
    bad = 0
    for log, (gtest_filter, want) in sorted(blocks.items()):
        have = listed(binary, gtest_filter)
        print(f"{log}: filter {gtest_filter!r}: gpu_check.sh expects {want}, the binary has {have}")
        bad += have != want
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
