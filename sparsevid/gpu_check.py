"""The whole GPU check in one command, for a machine with a CUDA device: `python -m sparsevid.gpu_check
--out gpu.json` (about 5-8 minutes on one H100/H200-class GPU).

1. the tests, with the CUDA-only ones (compiled CUDA-graph steps against eager on the embedded model);
2. the cost side at the 7B shapes (`bench --shape`, all layers, bf16, CUDA graphs), batch 1 and 8,
   16k-64k prompt tokens: the StD paper's setting;
3. the embedded model's long-prompt benchmark with compiled steps (`bench --frames 256,512`).

Each part runs as its own process (a failure in one does not stop the others) and everything lands
in one JSON file: the device, each part's command, exit status, seconds, its JSON output (or the
tail of what it printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

PARTS = {
    "tests": [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_fast.py", "tests/test_speculative.py",
              "tests/test_core.py"],
    "shapes": [sys.executable, "-m", "sparsevid", "bench", "--shape", "qwen2-vl-7b", "--batch", "1,8",
               "--seq", "16384,32768,65536", "--repeats", "5", "--compile", "on", "--json"],
    "embedded": [sys.executable, "-m", "sparsevid", "bench", "--frames", "256,512", "--methods",
                 "std,htsparse,sparsemm", "--repeats", "3", "--compile", "on", "--json"],
}


def run_part(cmd: list[str], timeout: int) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, HF_HUB_OFFLINE="1"))
        out, rc = p.stdout, p.returncode
        tail = (p.stdout + p.stderr)[-4000:]
    except subprocess.TimeoutExpired as e:
        out, rc, tail = "", 124, f"timed out after {timeout} s: {str(e.stdout or '')[-2000:]}"
    part = dict(command=" ".join(cmd), returncode=rc, seconds=round(time.perf_counter() - t0, 1))
    try:
        part["result"] = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        part["output_tail"] = tail
    return part


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsevid.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of: {', '.join(PARTS)}")
    p.add_argument("--timeout", type=int, default=240, help="seconds per part")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device: this check is for a GPU machine", file=sys.stderr)
        return 2
    report = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, parts={})
    for name in args.parts.split(","):
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        report["parts"][name] = run_part(PARTS[name], args.timeout)
        with open(args.out, "w") as f:  # written after every part: a killed run keeps what it has
            json.dump(report, f, indent=1)
    print(json.dumps({n: (r["returncode"], r["seconds"]) for n, r in report["parts"].items()}))
    return 0 if all(r["returncode"] == 0 for r in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
