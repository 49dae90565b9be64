"""The whole GPU check in one command, for a machine with a CUDA device: `python -m sparsevid.gpu_check
--out gpu.json` (about 3-4 minutes on one H100/H200-class GPU for parts 1-4, from a cold process:
no compiler, the steps are captured as CUDA graphs by hand; the batched parts add 2-4 minutes).

Parts, each its own process with its own timeout (a part that fails or hangs is killed and the
others still run; the JSON is written after every part):

1. `tests`: the kernel and CUDA-graph tests (`tests/test_kernels.py`; of `test_fast.py` the CUDA test
   and the fused layer kernels' tokens on the tiny architectures);
2. `kernels`: decode attention of one layer at the 7B head shape, each backend (`kernels.BACKENDS`)
   and SDPA's mask-free flash kernel as the ceiling, batch 1 and 8, 16k-64k entries, 1 and γ + 1
   rows: ms, GB/s, error against float64, and per shape the fastest kernel within the dtype's
   tolerance (`fastest_exact`: the one to choose there; `bench --verify-kernels`);
3. `shapes`: the 28-layer 7B shape (random weights, bf16), batch 1 and 8, prompts 16k-64k: dense
   step, draft step and verification, eager and captured, each against its limit, StD's round
   bound against the ideal one, HT-Sparse's and SparseMM's per-head layouts at their default
   proportions against the limit of what they read, and (batch 1) a dense prefill (`bench --shape`);
   `shapes-sdpa`: one row of it with SDPA attention; `shapes-unfused`: batch 1 and 8 at 16k with
   transformers' own RMSNorm, rotary and KV-write ops in each step instead of the fused kernels
   (`fast.FUSED`, `kernels.rms_norm`, `kernels.rotary`, `kernels.write_kv`): what fusing them saves;
4. `embedded`: the embedded model in bf16 on every bundled example, every method against dense as
   the app runs them (`runs.compare`, warm-up included): tokens identical for the lossless ones,
   decode speedups, steps served by graphs, and the first comparison's seconds from a cold model;
   `embedded-batch`: batched decoding on it, 8 held-out 256-frame narrations in batches of 1 and 8,
   dense and StD in real rounds (`bench --batch 1,8`: tokens/s, speedup, acceptance, bound);
5. `rounds`: real rounds at the 7B shape (a whole Qwen2-VL, random weights, tiny vision tower; 8
   random clips of 16,384 visual tokens, one question each, in batches of 1 and 8, dense and StD:
   `bench --shape qwen2-vl-7b --rounds --clips 8`, the StD paper's batch of 8 different prompts):
   the batch's tokens/s, StD's speedup and its bound from the run's own step costs, steps served by
   graphs; `rounds-shared`: the same with 8 questions on one clip (the demo's batch: the rows read
   the clip's KV once, `cache.Stack.prefix`, so dense at batch 8 reads far less).

The parts' own timeouts add up to 975 s; `--budget` (default 570 s, inside a 600-s command limit)
caps the whole check: a part runs at most for the time left, and one that would get less than 30 s
is skipped (recorded as skipped). `--parts tests,kernels,shapes,shapes-sdpa,shapes-unfused,embedded`
is the 4-5-minute check.

Prints one line of exit codes and seconds; everything lands in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

SEQ = "16384,32768,65536"
PARTS = {
    "tests": ([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_kernels.py",
               "tests/test_fast.py", "-k", "cuda or kernel"], 150),
    "kernels": ([sys.executable, "-m", "sparsevid", "bench", "--verify-kernels", "--shape", "qwen2-vl-7b", "--batch",
                 "1,8", "--seq", SEQ, "--json"], 60),
    "shapes": ([sys.executable, "-m", "sparsevid", "bench", "--shape", "qwen2-vl-7b", "--batch", "1,8", "--seq", SEQ,
                "--json"], 150),
    "shapes-sdpa": ([sys.executable, "-m", "sparsevid", "bench", "--shape", "qwen2-vl-7b", "--batch", "1", "--seq",
                     "16384", "--json"], 60),
    "shapes-unfused": ([sys.executable, "-m", "sparsevid", "bench", "--shape", "qwen2-vl-7b", "--batch", "1,8",
                        "--seq", "16384", "--json"], 75),
    "embedded": ([sys.executable, "-m", "sparsevid.gpu_check", "--embedded"], 120),
    "embedded-batch": ([sys.executable, "-m", "sparsevid", "bench", "--frames", "256", "--batch", "1,8", "--methods",
                        "std", "--ignore-eos", "--max-new-tokens", "48", "--repeats", "2", "--json"], 90),
    "rounds": ([sys.executable, "-m", "sparsevid", "bench", "--shape", "qwen2-vl-7b", "--rounds", "--batch", "1,8",
                "--clips", "8", "--seq", "16384", "--methods", "std", "--ignore-eos", "--max-new-tokens", "32",
                "--repeats", "1", "--json"], 150),
    "rounds-shared": ([sys.executable, "-m", "sparsevid", "bench", "--shape", "qwen2-vl-7b", "--rounds", "--batch",
                       "1,8", "--seq", "16384", "--methods", "std", "--ignore-eos", "--max-new-tokens", "32",
                       "--repeats", "1", "--json"], 120),
}
ENV = {"shapes-sdpa": {"SPARSEVID_ATTENTION": "sdpa"}, "shapes-unfused": {"SPARSEVID_FUSED": "off"}}
LOSSLESS = ("std", "streaming", "layerskip")
LOSSY = ("htsparse", "sparsemm")


def run_part(name: str, cmd: list[str], timeout: int) -> dict:
    """Run one part in its own process session; killed with its children at `timeout`."""
    t0 = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **ENV.get(name, {}))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, err = p.communicate()
        rc = 124
    part = dict(command=" ".join(cmd), returncode=rc, seconds=round(time.perf_counter() - t0, 1))
    try:
        part["result"] = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        part["output_tail"] = (out + err)[-4000:]
    if rc != 0 and "output_tail" not in part:
        part["output_tail"] = err[-3000:]
    return part


@torch.inference_mode()
def embedded(names=("dense",) + LOSSLESS + LOSSY, max_new_tokens: int = 96) -> dict:
    """The embedded model, bf16 on CUDA, captured steps: each bundled example compared as the app
    does (`runs.compare`, 3 timing passes)."""
    from .fast import enable
    from .models import ASSETS, load_model
    from .runs import compare
    from .video import load_video

    t0 = time.perf_counter()
    loaded = load_model(None, device="cuda", dtype="bfloat16")
    enable(loaded, "on")
    load_s = time.perf_counter() - t0
    rows, first = [], None
    folder = os.path.join(ASSETS, "examples")  # read here: `demo.config` would import the app's plotting
    with open(os.path.join(folder, "examples.json")) as f:
        examples = json.load(f)
    for e in examples:
        tc = time.perf_counter()
        vid = load_video(os.path.join(folder, e["file"]), int(e["frames"]))
        inputs = loaded.adapter.build_inputs(vid.frames, e["question"], vid.timestamps).to(loaded.device)
        traces, figs = compare(loaded, inputs, list(names), None, max_new_tokens, repeats=3)
        took = time.perf_counter() - tc
        if first is None:
            first = dict(example=e["file"], seconds=took, with_load=took + load_s,
                         captures=loaded.fast.captures, capture_s=loaded.fast.capture_s)
        dense = traces["dense"]
        for n in names[1:]:
            t = traces[n]
            rows.append(dict(example=e["file"], frames=int(e["frames"]), visual_tokens=inputs.m_v, method=n,
                             tokens=len(t.token_ids), identical=t.token_ids == dense.token_ids,
                             lossless=n in LOSSLESS, speedup=figs[n].get("speedup"),
                             fast_steps=t.fast_steps, dense_fast_steps=dense.fast_steps,
                             dense_step_ms=statistics.median(dense.step_s) * 1e3 if dense.step_s else None,
                             seconds=took))
    lossless = [r for r in rows if r["lossless"]]
    return dict(load_s=load_s, first_comparison=first, captures=loaded.fast.captures,
                capture_s=loaded.fast.capture_s, all_lossless_identical=all(r["identical"] for r in lossless),
                min_lossless_speedup=min((r["speedup"] for r in lossless if r["speedup"]), default=None),
                rows=rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsevid.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of: {', '.join(PARTS)}")
    p.add_argument("--embedded", action="store_true", help="run the embedded part in this process (JSON on stdout)")
    p.add_argument("--budget", type=float, default=570.0, help="seconds for the whole check (parts that no longer fit are skipped)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device: this check is for a GPU machine", file=sys.stderr)
        return 2
    if args.embedded:
        print(json.dumps(embedded()))
        return 0
    report = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, parts={})
    deadline = time.perf_counter() + args.budget
    for name in args.parts.split(","):
        cmd, timeout = PARTS[name]
        timeout = min(timeout, int(deadline - time.perf_counter()))
        if timeout < 30:
            print(f"gpu_check: {name} skipped ({args.budget:.0f} s budget spent)", file=sys.stderr, flush=True)
            report["parts"][name] = dict(command=" ".join(cmd), returncode=None, seconds=0.0, skipped=True)
        else:
            print(f"gpu_check: {name} (at most {timeout} s) ...", file=sys.stderr, flush=True)
            report["parts"][name] = run_part(name, cmd, timeout)
        with open(args.out, "w") as f:  # written after every part: a killed run keeps what it has
            json.dump(report, f, indent=1)
    print(json.dumps({n: (r["returncode"], r["seconds"]) for n, r in report["parts"].items()}))
    return 0 if all(r["returncode"] == 0 for r in report["parts"].values()) else 1  # a skipped part too


if __name__ == "__main__":
    sys.exit(main())
