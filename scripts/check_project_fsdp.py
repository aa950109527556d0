#!/usr/bin/env python3
"""Checks the FSDP rows of `gradcomp-bench project --json` (a model) against its traffic rule.

Usage: check_project_fsdp.py ROWS.json WORLD   (WORLD: nodes x GPUs per node of the run; one GPU per node)
Per step two parameter all-gathers and one reduce-scatter, each ring crossing a node link (W-1)/W of the
model; q4's reduce-scatter payload and int8's all-gather row as the core sizes them (0.5626 and 1.0313 bytes
per element at block 64, headers included, within 0.1 %).
"""
import json
import math
import sys


def main() -> int:
    rows = json.load(open(sys.argv[1]))
    world = float(sys.argv[2])
    assert rows, "no rows"
    for r in rows:
        assert r["model"] is True, r
        ring = (world - 1) / world * r["params"]
        assert math.isclose(r["fsdp_bf16_node_bytes"], 3 * ring * 2, rel_tol=1e-9), r
        assert math.isclose(r["fsdp_q4_node_bytes"], 2 * ring * 2 + ring * 0.5626, rel_tol=1e-3), r
        assert math.isclose(r["fsdp_q4_int8_node_bytes"], 2 * ring * 1.0313 + ring * 0.5626, rel_tol=1e-3), r
        assert r["fsdp_fp32_step_s"] > r["fsdp_bf16_step_s"] > r["fsdp_q4_step_s"] > r["fsdp_q4_int8_step_s"], r
        assert r["fsdp_q4_int8_step_s"] > r["compute_s"], r
    print(f"FSDP model: {len(rows)} rows hold the traffic rule")
    return 0


if __name__ == "__main__":
    sys.exit(main())
