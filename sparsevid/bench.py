"""Benchmarks: methods against dense in the same process, interleaved, medians of ratios.

`bench_main` measures whole runs on a model (the embedded one by default). `mechanical` measures
only the cost side at a real model's shape (random weights, random KV): a dense decode step, a
sparse draft step and a γ+1 verification over 4k–32k visual tokens.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from tqdm import tqdm

from .engine import Sampling
from .methods import add_ratios, parse_methods, run_method
from .models import load_model

ROW_FIELDS = ("speedup", "acceptance", "tokens_per_round", "identical_to_dense", "kv_ratio", "predicted_speedup",
              "e2e_speedup")


def bench_clip(frames: int, video: str | None, question: str | None):
    """(frames [T, H, W, 3], question, answer or None): a video file, or a synthetic toy clip."""
    if video:
        from .video import load_video

        return load_video(video, frames).frames, question or "Describe the video.", None
    from .toy.questions import make_sample

    s = make_sample(seed=10_000 + frames, n_frames=frames, qtype="describe")
    return s.clip.frames, question or s.question, s.answer


def _median(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    if isinstance(values[0], bool):
        return all(values)
    return statistics.median(values)


def bench_main(args) -> int:
    if args.shape:
        return mechanical(args)
    from .cli import settings_from

    loaded = load_model(args.model, args.device, args.dtype)
    settings = settings_from(args)
    names = [n for n in parse_methods(args.methods) if n != "dense"] or ["std"]
    frame_counts = [int(f) for f in str(args.frames).split(",")]
    decoding = Sampling(ignore_eos=args.ignore_eos)
    rows = []
    bar = tqdm(total=len(frame_counts) * len(names) * args.repeats, desc="bench", file=sys.stderr)
    for F in frame_counts:
        frames, question, _ = bench_clip(F, args.video, args.question)
        inputs = loaded.adapter.build_inputs(frames, question).to(loaded.device)
        run_method(loaded, inputs, "dense", settings, args.max_new_tokens, decoding)  # warm-up
        for name in names:
            per = []
            for _ in range(args.repeats):
                dense = run_method(loaded, inputs, "dense", settings, args.max_new_tokens, decoding)
                res = run_method(loaded, inputs, name, settings, args.max_new_tokens, decoding)
                add_ratios(res, dense, inputs, loaded)
                per.append(res.extra)
                bar.update()
            row = dict(frames=F, visual_tokens=inputs.m_v, method=name, tokens=len(res.token_ids))
            row.update({f: _median([p.get(f) for p in per]) for f in ROW_FIELDS})
            rows.append(row)
    bar.close()
    if args.json:
        print(json.dumps(dict(model=loaded.name, device=str(loaded.device), gamma=settings.gamma, k=settings.k,
                              repeats=args.repeats, ignore_eos=args.ignore_eos, threads=torch.get_num_threads(),
                              rows=rows)))
    else:
        print(format_table(rows))
    return 0


def format_table(rows: list[dict]) -> str:
    def f(v, kind=""):
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "NO"
        return {"pct": f"{v:.0%}", "x": f"{v:.2f}x"}.get(kind, f"{v:.2f}")

    lines = ["| frames | visual tokens | method | tokens | decode speedup | end-to-end | acceptance | tokens/round | "
             "identical | KV vs dense | I/O-model speedup |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['frames']} | {r['visual_tokens']} | {r['method']} | {r.get('tokens', '-')} | "
                     f"{f(r['speedup'], 'x')} | {f(r.get('e2e_speedup'), 'x')} | {f(r['acceptance'], 'pct')} | "
                     f"{f(r['tokens_per_round'])} | {f(r['identical_to_dense'])} | {f(r['kv_ratio'], 'pct')} | "
                     f"{f(r['predicted_speedup'], 'x')} |")
    return "\n".join(lines)


# Language-model shapes of the supported 7B-class checkpoints (from their published config.json).
SHAPES = {
    "qwen2-vl-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                        num_key_value_heads=4, vocab_size=152064),
    "qwen2.5-vl-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                          num_key_value_heads=4, vocab_size=152064),
    "llava-video-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                           num_key_value_heads=4, vocab_size=152064),
}


@torch.inference_mode()
def mechanical(args) -> int:
    """Cost of one dense step, one sparse draft step and one γ+1 verification at a real shape.

    The language model is built from the shape with random weights (Qwen2 decoder, as in all
    three architectures); caches are filled with random KV instead of running a prefill, since
    only the cost is measured. Acceptance is meaningless here and not reported.
    """
    import transformers

    from .attention import NAME, Run
    from .cache import KVCache, LayerSelection, SparseKV
    from .models import pick_device
    from .policies import visual_budget

    if args.shape not in SHAPES:
        from .errors import InputError

        raise InputError(f"Unknown shape '{args.shape}'; known: {', '.join(SHAPES)}.")
    dev, dtype = pick_device(args.device, args.dtype)
    shape = dict(SHAPES[args.shape])
    layers = args.layers or (shape["num_hidden_layers"] if dev.type == "cuda" else 2)
    shape.update(num_hidden_layers=layers, max_position_embeddings=65536)
    if dev.type != "cuda":
        shape["vocab_size"] = 4096  # the LM head's cost does not depend on the cache; keep CPU runs short
    config = transformers.Qwen2Config(**shape)
    config._attn_implementation = NAME
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(dev, dtype).eval()
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    D = config.hidden_size // H
    gamma = args.gamma
    rows = []
    for m_v in [int(v) for v in args.visual_tokens.split(",")]:
        m_t = 64
        m = m_v + m_t
        K = visual_budget(args.k, m_v, m_t)
        cache = KVCache(layers, m + gamma + 8)
        vis = torch.arange(16, 16 + m_v)
        run = Run(cache, H, vis, 16 + m_v)
        for layer in cache.layers:
            kv = torch.randn(2, 1, Hkv, m, D, device=dev, dtype=dtype)
            layer.lazy_initialization(kv[0], kv[1])
            layer.keys[:, :, :m] = kv[0]
            layer.values[:, :, :m] = kv[1]
            text = torch.cat([torch.arange(16), torch.arange(16 + m_v, m)])
            keep = torch.cat([text.expand(Hkv, -1), vis[torch.rand(Hkv, m_v).topk(K, dim=1).indices]], 1).sort(1).values
            layer.sparse = SparseKV(kv[0], kv[1], LayerSelection(list(keep)), gamma + 8, H)
        cache.finish_prefill(m)

        def timed(mode, q):
            from .attention import active

            ids = torch.randint(0, 100, (1, q), device=dev)
            cache.mode = mode
            times = []
            for _ in range(args.repeats + 1):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                with active(run):
                    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            return statistics.median(times[1:])

        dense, draft, verify = timed("dense", 1), timed("sparse", 1), timed("dense", gamma + 1)
        rows.append(dict(shape=args.shape, layers=layers, visual_tokens=m_v, k=K, dense_step_ms=dense * 1e3,
                         draft_step_ms=draft * 1e3, verify_ms=verify * 1e3, draft_vs_dense=draft / dense,
                         verify_vs_dense=verify / dense,
                         round_bound_speedup=(gamma + 1) * dense / (gamma * draft + verify)))
    if args.json:
        print(json.dumps(dict(device=str(dev), dtype=str(dtype)[6:], gamma=gamma, rows=rows)))
    else:
        print(f"{args.shape} ({layers} layers, {dev}, {str(dtype)[6:]}), gamma={gamma}")
        print("| visual tokens | K | dense step ms | draft step ms | verify (γ+1) ms | draft/dense | verify/dense | "
              "speedup if all accepted |\n|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['visual_tokens']} | {r['k']} | {r['dense_step_ms']:.1f} | {r['draft_step_ms']:.1f} | "
                  f"{r['verify_ms']:.1f} | {r['draft_vs_dense']:.2f} | {r['verify_vs_dense']:.2f} | "
                  f"{r['round_bound_speedup']:.2f}x |")
    return 0
