#!/usr/bin/env python3
"""Checks that no source includes a header of a higher layer (docs/design.md, "Layers").

Layers, lowest first: element math and the wire-format header (kernels/math, payload_header.h,
params.h), device code (kernels/), the core vocabulary (types.h, csrc/common), the wire format
(format.h, csrc/format), codecs and backends (backend.h, cpu.h, cuda.h, csrc/codec), collectives
(communicator.h, inprocess_group.h, collectives.h, nccl_communicator.h, csrc/collective), the
bucket engine (engine.h, csrc/engine), the umbrella header, the torch layer (torch_ext/).
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
ELEMENT, DEVICE, VOCABULARY, FORMAT, CODEC, COLLECTIVE, ENGINE, UMBRELLA, TORCH = range(9)
NAMES = ["element math", "device code", "vocabulary", "format", "codec", "collective", "engine",
         "umbrella", "torch layer"]

PUBLIC = {
    "types.h": VOCABULARY, "launch_env.h": VOCABULARY, "format.h": FORMAT, "backend.h": CODEC, "forwarding_backend.h": CODEC, "cpu.h": CODEC, "cuda.h": CODEC,
    "communicator.h": COLLECTIVE, "inprocess_group.h": COLLECTIVE, "collectives.h": COLLECTIVE, "reduce_scatter.h": COLLECTIVE, "all_gather.h": COLLECTIVE, "outer_sync.h": COLLECTIVE, "outer_short_run.h": COLLECTIVE,
    "nccl_communicator.h": COLLECTIVE, "fault_injection.h": COLLECTIVE, "shm_communicator.h": COLLECTIVE, "engine.h": ENGINE, "codec_spec.h": ENGINE, "gradcomp.h": UMBRELLA,
}
FOLDERS = {"common": VOCABULARY, "format": FORMAT, "codec": CODEC, "collective": COLLECTIVE,
           "engine": ENGINE}


def layer(path: pathlib.Path) -> int:
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith("kernels/"):
        element = rel.startswith("kernels/math/") or path.name in ("payload_header.h", "params.h")
        return ELEMENT if element else DEVICE
    if rel.startswith("csrc/include/gradcomp/"):
        return PUBLIC[path.name]
    if rel.startswith("csrc/"):
        return FOLDERS[rel.split("/")[1]]
    if rel.startswith("torch_ext/"):
        return TORCH
    raise KeyError(rel)


def resolve(including: pathlib.Path, name: str):
    for base in (including.parent, ROOT / "csrc" / "include", ROOT / "kernels", ROOT / "torch_ext" / "include"):
        candidate = (base / name).resolve()
        if candidate.is_file() and ROOT in candidate.parents:
            return candidate
    return None  # a system or third-party header


def main() -> int:
    sources = [p for folder in ("kernels", "csrc", "torch_ext") for p in (ROOT / folder).rglob("*")
               if p.suffix in (".h", ".cuh", ".cpp", ".cu")]
    problems = []
    for src in sources:
        own = layer(src)
        for lineno, line in enumerate(src.read_text().splitlines(), 1):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if not m:
                continue
            target = resolve(src, m.group(1))
            if target is not None and layer(target) > own:
                problems.append(f"{src.relative_to(ROOT)}:{lineno}: the {NAMES[own]} includes "
                                f"{m.group(1)} of the {NAMES[layer(target)]}")
    for p in problems:
        print(p)
    print(f"check_layers: {len(sources)} files, {len(problems)} upward includes")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
