"""Decode attention (`sparsevid.kernels`): every backend against a float64 reference, on the CPU
(Triton through its interpreter) and, where there is one, on a CUDA device."""

import json
import os
import subprocess
import sys

import pytest
import torch

from sparsevid import kernels  # noqa: E402  (conftest sets TRITON_INTERPRET=1 without a CUDA device)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (batch, KV heads, query heads per KV head, rows, head dim, capacity, write positions)
CASES = [
    (1, 4, 2, 1, 24, 100, [60]),  # the embedded model's heads, a decode step
    (2, 4, 2, 5, 24, 300, [[200], [37]]),  # two sequences of different lengths, a verification
    (1, 1, 4, 3, 24, 70, [10]),  # one KV head
    (1, 4, 7, 10, 128, 700, [600]),  # the 7B heads, γ + 1 rows
    (1, 2, 4, 4, 64, 900, [[850, 300]]),  # head dim 64, 16 rows per KV head
    (3, 2, 2, 2, 32, 2600, [[0], [5], [2590]]),  # many splits; a row that sees one entry
    (1, 4, 2, 3, 24, 400, [[390, 17, 0, 201]]),  # per-head lengths (a compact cache's K_h differ)
    (2, 2, 3, 1, 24, 300, [[5, 250], [299, 0]]),  # per sequence and head
]


def backends(device):
    out = ["sdpa"] + (["cpu"] if device == "cpu" else [])
    if kernels.triton_available() and (device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        out.append("triton")
    return out


def inputs(B, Hkv, G, q, D, N, starts, device, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(B, Hkv * G, q, D, generator=g), torch.randn(B, Hkv, N, D, generator=g),
         torch.randn(B, Hkv, N, D, generator=g)]
    b = None
    if bias:  # HT-Sparse's per-query-head masks: some entries hidden from some heads, never the first
        b = torch.zeros(Hkv, G, N).masked_fill(torch.rand(Hkv, G, N, generator=g) < 0.3, float("-inf"))
        b[..., 0] = 0
    return [t.to(device) for t in x], torch.tensor(starts, device=device), None if b is None else b.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_kernel_backend_matches_float64_attention(device, case, bias):
    B, Hkv, G, q, D, N, starts = case
    (query, k, v), start, b = inputs(B, Hkv, G, q, D, N, starts, device, bias)
    ref = kernels.reference(query.cpu(), k.cpu(), v.cpu(), start.cpu(), D ** -0.5, None if b is None else b.cpu())
    for which in backends(device):
        out = kernels.attend(query, k, v, start, D ** -0.5, b, which=which)
        assert out.shape == (B, q, Hkv * G, D)
        err = (out.double().cpu() - ref).abs().max().item()
        assert err < 2e-6, (which, err)  # float32 accumulation; TF32 is off for float32 inputs


@pytest.mark.parametrize("device", DEVICES)
def test_entries_past_a_rows_position_are_never_read(device):
    """Whatever the unfilled tail holds (a reused buffer: last run's values, even NaN), and whatever
    later rows of a verification wrote, row t's output depends on entries 0 .. start + t only."""
    (query, k, v), start, _ = inputs(1, 4, 2, 4, 24, 200, [120], device)
    clean = {w: kernels.attend(query, k, v, start, 0.2, which=w) for w in backends(device)}
    k[:, :, 124:], v[:, :, 124:] = float("nan"), float("nan")  # the tail past the last row
    k[:, :, 123], v[:, :, 123] = 1e4, -1e4  # written by row 3: rows 0-2 must not see it
    for w, before in clean.items():
        after = kernels.attend(query, k, v, start, 0.2, which=w)
        if w == "sdpa":  # SDPA's additive mask reads every entry: NaN poisons it; the engine's tail is finite
            continue
        assert torch.equal(after[:, :3], before[:, :3]), w
        assert torch.isfinite(after).all(), w


def test_sdpa_backend_takes_a_non_contiguous_sdpa_output(monkeypatch):
    """SDPA's CUDA kernels may return [B, Hkv, G*q, D] with other strides (the float32 crash of
    issue 39: `view` on it failed); the backend reshapes, whatever the layout."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention

    def strided(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, non-contiguous

    (query, k, v), start, _ = inputs(1, 4, 2, 3, 24, 50, [30], "cpu")
    monkeypatch.setattr(F, "scaled_dot_product_attention", strided)
    out = kernels.attend_sdpa(query, k, v, start, 0.2)
    ref = kernels.reference(query, k, v, start, 0.2)
    assert (out.double() - ref).abs().max() < 1e-6


# (query heads per KV head, head dim) of the models served: Qwen2-VL / Qwen2.5-VL 7B and
# LLaVA-OneVision 7B (28 / 4, 128), Qwen2-VL 2B (12 / 2, 128), the embedded model (8 / 4, 24)
HEADS = [(7, 128), (6, 128), (2, 24)]


@pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")
def test_each_triton_launch_compiles_for_an_h100_within_its_shared_memory_and_without_spilling():
    """Every distinct launch `kernels.triton_config` gives at HEADS, for a step (q = 1) and a
    verification of γ + 1 = 10 tokens, in bf16 and float32, compiled for sm_90 (H100 / H200) here on
    a machine without a GPU (Triton's own ptxas; in a process of its own, without the interpreter):
    it fits a block's shared memory (a 3-stage float32 verification once needed 295 KB, found only on
    a GPU) and keeps its tiles in registers (at most 1 KB of local memory per thread: 64-key float32
    tiles spilled 17 KB). With a bias and a shared prefix: the variant that needs the most."""
    launches = {}
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for G, D in HEADS:
            for q in (1, 10):
                cfg = kernels.triton_config(G, q, D, dtype)
                launches.setdefault((name, cfg["BLOCK_M"], cfg["BLOCK_D"]), (G, cfg, name))
    code = ("import json, sys; from sparsevid._triton_attention import sm90_usage; "
            "print(json.dumps([sm90_usage(*x) for x in json.load(sys.stdin)]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(list(launches.values())), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    usage = json.loads(done.stdout.strip().splitlines()[-1])
    report = [f"{name} {cfg}: {u}" for (G, cfg, name), u in zip(launches.values(), usage)]
    assert len(usage) == len(launches) >= 8
    assert all(u["shared"] <= kernels.SM90_SHARED and u["local"] <= 1024 for u in usage), "\n".join(report)


def test_the_backend_is_triton_on_cuda_and_the_own_kernel_on_the_cpu(monkeypatch):
    monkeypatch.setattr(kernels, "FORCED", None)
    assert kernels.cpu_available(), kernels.describe(torch.device("cpu"))  # CI has g++: the build must work there
    assert kernels.backend(torch.device("cpu")) == "cpu"
    if kernels.triton_available():
        assert kernels.backend(torch.device("cuda")) == "triton"
    monkeypatch.setattr(kernels, "FORCED", "sdpa")
    assert kernels.backend(torch.device("cuda")) == "sdpa"


def test_where_the_cpu_kernel_cannot_be_built_attention_falls_back_to_sdpa_and_says_why(monkeypatch, tmp_path):
    """A machine without a working compiler (here: a source that does not compile) still decodes,
    through SDPA, and the steps line says why the own kernel is not used."""
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "SOURCE", str(bad))
    monkeypatch.setenv("HOME", str(tmp_path))  # its build folder (~/.cache/sparsevid/ext) under tmp
    monkeypatch.setattr(kernels, "_CPU_OP", None)
    monkeypatch.setattr(kernels, "FORCED", None)
    cpu = torch.device("cpu")
    assert not kernels.cpu_available()
    assert kernels.backend(cpu) == "sdpa"
    assert kernels.describe(cpu).startswith("SDPA with a mask; own kernel: ") and "error" in kernels.describe(cpu)
    (query, k, v), start, _ = inputs(1, 4, 2, 1, 24, 100, [60], "cpu")
    out = kernels.attend(query, k, v, start, 0.2)
    assert (out.double() - kernels.reference(query, k, v, start, 0.2)).abs().max() < 2e-6


@pytest.mark.parametrize("D", [24, 64, 128])
def test_the_cpu_kernel_gives_a_row_the_same_bits_in_a_step_a_verification_and_a_batch(D):
    """A row's arithmetic depends only on the entries it sees: its output is bit-identical in a
    one-row step, as a row of a verification pass, and beside a longer sequence in a bigger buffer
    (splits and tiles start at fixed key indices; a step's few rows and a verification's many take
    different code with the same operations), so a lossless method's rows cannot drift from dense
    steps in attention."""
    (query, k, v), start, _ = inputs(2, 4, 2, 6, D, 3000, [[1500], [2900]], "cpu")
    verify = kernels.attend(query, k, v, start, 0.2, which="cpu")  # rows t = 0..5 of both sequences
    for t in range(6):
        step = kernels.attend(query[:1, :, t:t + 1], k[:1, :, :1600], v[:1, :, :1600], start[:1] + t, 0.2, which="cpu")
        assert torch.equal(step[0, 0], verify[0, t]), t


def sdpa_threads(monkeypatch) -> list[int]:
    """The thread count of every SDPA call from now on, in order (SDPA itself still runs)."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append(torch.get_num_threads()) or real(*a, **kw))
    return seen


def test_an_eager_call_over_one_kv_head_runs_on_one_thread_and_gives_the_same_result(monkeypatch):
    """One (sequence, KV head) pair, e.g. an HT-Sparse full head split into a group of its own: on
    more threads the CPU flash kernel runs it inline and its inner GEMMs wake the other threads per
    key block (2.4 ms against 0.1 ms at 9,400 entries, 2 threads, PASSIVE). It runs on one thread,
    the step's count is back after it, and a call over several heads keeps the step's threads."""
    before = torch.get_num_threads()
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 2, 16), torch.randn(1, 1, 300, 16), torch.randn(1, 1, 300, 16)
    q4, k4, v4 = torch.randn(1, 8, 2, 16), torch.randn(1, 4, 300, 16), torch.randn(1, 4, 300, 16)
    start = torch.tensor([[280]])
    seen = sdpa_threads(monkeypatch)
    try:
        torch.set_num_threads(2)
        out = kernels.attend(q, k, v, start, 0.25, which="sdpa")
        kernels.attend(q4, k4, v4, start, 0.25, which="sdpa")
        assert seen == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), kernels.reference(q, k, v, start, 0.25), atol=1e-5, rtol=1e-5)


def test_a_compiled_call_over_one_kv_head_on_two_threads_is_one_graph_and_exact():
    """In a graph compiled for two threads (no thread switch inside it) a call over one KV head
    runs its query heads as separate items (`attend_sdpa`): the float64 reference's output, and
    no graph break (a context manager calling torch.get_num_threads() broke every compiled step)."""
    from torch._dynamo.utils import counters

    before = torch.get_num_threads()
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 1, 300, 16), torch.randn(1, 1, 300, 16)
    bias = torch.zeros(1, 2, 300).masked_fill_(torch.rand(1, 2, 300) < 0.3, float("-inf"))
    start = torch.tensor([[280]])
    torch._dynamo.reset()
    broken = sum(counters["graph_break"].values())
    try:
        torch.set_num_threads(2)
        out = torch.compile(kernels.attend_sdpa, fullgraph=True)(q, k, v, start, 0.25, bias)
    finally:
        torch.set_num_threads(before)
    assert sum(counters["graph_break"].values()) == broken
    torch.testing.assert_close(out.double(), kernels.reference(q, k, v, start, 0.25, bias), atol=1e-5, rtol=1e-5)


def test_a_large_eager_attention_call_runs_on_every_thread_and_gives_the_same_result(monkeypatch):
    """Inside a decode step on one thread (`engine.step_threads`), a call over at least WIDE_MIN
    (row, KV head, entry) triples runs on the process's threads: the same output as on one thread,
    and the step's thread count is back after it."""
    before = torch.get_num_threads()
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 8, 2, 16), torch.randn(4, 4, 300, 16), torch.randn(4, 4, 300, 16)
    start = torch.tensor([[280], [150], [298], [10]])
    seen = sdpa_threads(monkeypatch)
    try:
        torch.set_num_threads(1)
        narrow = kernels.attend(q, k, v, start, 0.25, which="sdpa")
        monkeypatch.setattr(kernels, "WIDE_THREADS", 2)
        monkeypatch.setattr(kernels, "WIDE_MIN", 4 * 4 * 300)
        wide = kernels.attend(q, k, v, start, 0.25, which="sdpa")
        assert seen == [1, 2] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(wide, narrow, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(wide.double(), kernels.reference(q, k, v, start, 0.25), atol=1e-5, rtol=1e-5)


def test_a_long_call_in_a_compiled_one_thread_step_runs_the_cpu_op_on_two_threads_with_the_same_bits(monkeypatch):
    """A compiled step runs on one thread (no switch inside a graph); a call long enough to pay
    for waking the second thread (a verification's many rows, a long cache: WIDE_GRAPH_WORK) has
    the CPU op run its items on WIDE_THREADS itself. The graph holds the two as constants and the op
    compares the call's work (so no guard on the dynamic rows or capacity: one graph on both sides
    of the threshold, nothing recompiled inside a timed run). Items are independent: the same bits
    on any number of threads."""
    if not kernels.cpu_available():
        pytest.skip(f"the CPU op is not built here: {kernels.describe(torch.device('cpu'))}")
    before = torch.get_num_threads()
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 24), torch.randn(2, 4, 1300, 24), torch.randn(2, 4, 1300, 24)
    q2, start = torch.randn(2, 8, 2, 24), torch.tensor([[1200], [700]])
    monkeypatch.setattr(kernels, "WIDE_THREADS", 2)
    monkeypatch.setattr(kernels, "WIDE_GRAPH_WORK", 100_000)  # 5 rows: 2 x 4 x 1205 x 13; 2 rows: 67,312
    graphs = []

    def capture(gm, example_inputs):
        graphs.append([tuple(n.args[7:9]) for n in gm.graph.nodes
                       if n.op == "call_function" and "decode_attention" in str(n.target)])
        return gm.forward

    try:
        torch.set_num_threads(1)
        torch._dynamo.reset()
        fn = torch.compile(kernels.attend_cpu, backend=capture, fullgraph=True, dynamic=True)
        long, short = fn(q, k, v, start, 0.2), fn(q2, k, v, start, 0.2)
    finally:
        torch.set_num_threads(before)
        torch._dynamo.reset()
    assert graphs == [[(2, 100_000)]]  # one graph for both
    op, start = torch.ops.sparsevid.decode_attention, start.expand(2, 4).contiguous()
    assert torch.equal(long, op(q, k, v, start, 0.2, None, None)) and torch.equal(short, op(q2, k, v, start, 0.2, None, None))
    assert torch.equal(op(q, k, v, start, 0.2, None, None, 2, 0), op(q, k, v, start, 0.2, None, None, 0, 0))


def test_the_two_thread_threshold_is_measured_once_per_machine_where_it_costs_least(monkeypatch, tmp_path):
    """Where a compiled step's attention call starts to pay for a second thread depends on the CPU
    (a 2-core Xeon with AVX-512: ~240,000; an AVX2-only EPYC: ~180,000): `measure_graph_work`
    times one layer at a few lengths and row counts on one thread and on two, picks the threshold
    that makes those calls cheapest in all, and keeps it beside the op's build, so a later process
    reads it instead of measuring (never inside a timed run)."""
    if not kernels.cpu_available():
        pytest.skip(f"the CPU op is not built here: {kernels.describe(torch.device('cpu'))}")
    before = torch.get_num_threads()
    monkeypatch.setattr(kernels, "BUILD_DIR", str(tmp_path))
    try:
        torch.set_num_threads(2)
        work = kernels.measure_graph_work(reps=3)
        saved = json.loads((tmp_path / "graph_work.json").read_text())
        cost = lambda w: sum(many if c >= w else one for c, one, many in saved["cells"])  # noqa: E731
        assert saved["work"] == work and saved["threads"] == 2
        assert cost(work) == min(cost(c) for c, _, _ in saved["cells"])
        monkeypatch.setattr(kernels, "threads", None)  # a second call measures nothing (it would fail)
        assert kernels.measure_graph_work() == work
    finally:
        torch.set_num_threads(before)


def test_the_cpu_kernel_splits_heads_of_different_lengths_between_threads_with_the_same_bits():
    """A compact cache's KV heads keep different numbers of entries (SparseMM's budgets: 9,241 /
    9,241 / 6,897 / 3,707 in a layer at 512 frames): the op cuts its items between threads where
    their entries, not their count, are shared evenly. Any cut gives the same bits, on ATen's
    threads and on its own, and the float64 reference's values."""
    if not kernels.cpu_available():
        pytest.skip(f"the CPU op is not built here: {kernels.describe(torch.device('cpu'))}")
    op, before = torch.ops.sparsevid.decode_attention, torch.get_num_threads()
    for lens in ([2400, 2400, 1700, 900], [0, 0, 0, 2400], [2400, 3, 0, 1], [700, 700, 700, 700]):
        (q, k, v), start, _ = inputs(1, 4, 2, 3, 24, 2500, [lens], "cpu", seed=len(lens) + lens[-1])
        try:
            torch.set_num_threads(1)
            one = op(q, k, v, start, 0.2, None, None, 0, 0)
            own = op(q, k, v, start, 0.2, None, None, 2, 0)  # the op's own two threads (a compiled one-thread step)
            torch.set_num_threads(2)
            aten = op(q, k, v, start, 0.2, None, None, 0, 0)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, own) and torch.equal(one, aten), lens
        torch.testing.assert_close(one.double(), kernels.reference(q, k, v, start, 0.2), atol=1e-5, rtol=1e-5)


def test_sequences_sharing_their_first_entries_read_one_copy_with_the_same_bits():
    """Questions on one video: their KV over the common prefix is bit-identical, and the op told so
    (`prefix` [B, 2]: the sequence to read, for how many first entries) reads that sequence's K and V
    for every split lying wholly below it, in cache for all of them: the same bits as each reading
    its own. A split that reaches past the shared entries reads the sequence's own."""
    if not kernels.cpu_available():
        pytest.skip(f"the CPU op is not built here: {kernels.describe(torch.device('cpu'))}")
    op = torch.ops.sparsevid.decode_attention
    torch.manual_seed(0)
    q = torch.randn(3, 8, 2, 24)
    k, v = torch.randn(3, 4, 1300, 24), torch.randn(3, 4, 1300, 24)
    k[1:, :, :1100], v[1:, :, :1100] = k[:1, :, :1100], v[:1, :, :1100]  # rows 1 and 2 share row 0's first 1,100
    start = torch.tensor([[1290] * 4, [1250] * 4, [1100] * 4])
    shared = torch.tensor([[0, 0], [0, 1100], [0, 1100]])
    own = op(q, k, v, start, 0.2, None, None, 0, 0)
    for threads in (0, 2):
        assert torch.equal(op(q, k, v, start, 0.2, None, shared, threads, 0), own)
    torch.testing.assert_close(own.double(), kernels.reference(q, k, v, start, 0.2), atol=1e-5, rtol=1e-5)
    # it does read row 0 there: told so where row 1 differs, row 1 gets row 0's first two splits (1,024 keys)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, :1100] += 1.0
    told = op(q, k2, v2, start, 0.2, None, shared, 0, 0)
    mixed_k, mixed_v = k2.clone(), v2.clone()
    mixed_k[1, :, :1024], mixed_v[1, :, :1024] = k[0, :, :1024], v[0, :, :1024]
    assert torch.equal(told, op(q, mixed_k, mixed_v, start, 0.2, None, None, 0, 0))
    assert not torch.equal(told[1], op(q, k2, v2, start, 0.2, None, None, 0, 0)[1])
    assert torch.equal(kernels.attend(q, k, v, start, 0.2, which="cpu", prefix=shared), kernels.attend(q, k, v, start, 0.2, which="cpu"))


@pytest.mark.parametrize("which", [w for w in backends("cpu") if w != "sdpa"])
def test_each_kernel_reads_a_shared_prefix_from_the_sequence_it_is_told(which):
    """`attend(..., prefix=...)` through each kernel that reads shared prefixes (the CPU op; Triton,
    here in its interpreter): the same output where the prefixes are the same values, and where told
    so of a sequence whose first entries differ, the other sequence's keys for every split wholly
    below the shared length (so it does read them there)."""
    torch.manual_seed(1)
    q = torch.randn(3, 4, 1, 16)
    k, v = torch.randn(3, 2, 1300, 16), torch.randn(3, 2, 1300, 16)
    k[1:, :, :1100], v[1:, :, :1100] = k[:1, :, :1100], v[:1, :, :1100]
    start = torch.tensor([[1290] * 2, [1250] * 2, [1100] * 2])
    shared = torch.tensor([[0, 0], [0, 1100], [0, 1100]])
    own = kernels.attend(q, k, v, start, 0.25, which=which)
    torch.testing.assert_close(own.double(), kernels.reference(q, k, v, start, 0.25), atol=1e-5, rtol=1e-5)
    assert torch.equal(kernels.attend(q, k, v, start, 0.25, which=which, prefix=shared), own)
    k2 = k.clone()
    k2[1, :, :1100] += 1.0  # row 1 differs, but the kernel is told it shares row 0's first 1,100
    told = kernels.attend(q, k2, v, start, 0.25, which=which, prefix=shared)
    assert not torch.equal(told[1], kernels.attend(q, k2, v, start, 0.25, which=which)[1])
    assert torch.equal(told[0], own[0]) and torch.equal(told[2], own[2])


def test_an_eager_one_thread_step_gives_the_cpu_op_the_threads_a_compiled_one_does(monkeypatch):
    """`op_threads`: inside a step on fewer threads the op gets (WIDE_THREADS, WIDE_GRAPH_WORK),
    eager or compiled alike, so the eager steps `runs.choose_step_threads` times spend their
    attention as the compiled steps will; outside such a step, (0, 0): the step's own threads. The
    op compares each call's work itself: the same bits on either side of the threshold."""
    if not kernels.cpu_available():
        pytest.skip(f"the CPU op is not built here: {kernels.describe(torch.device('cpu'))}")
    calls = []
    real = torch.ops.sparsevid.decode_attention

    class Op:  # records the thread arguments of each call and runs the real op
        def __call__(self, *args):
            calls.append(args[7:9])
            return real(*args)

    monkeypatch.setattr(torch.ops.sparsevid, "decode_attention", Op(), raising=False)
    torch.manual_seed(0)
    q, k, v, start = torch.randn(2, 8, 2, 24), torch.randn(2, 4, 900, 24), torch.randn(2, 4, 900, 24), torch.tensor([[880], [400]])
    own = kernels.attend_cpu(q, k, v, start, 0.2)
    monkeypatch.setattr(kernels, "WIDE_THREADS", 2)
    monkeypatch.setattr(kernels, "WIDE_GRAPH_WORK", 48_000)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        wide = kernels.attend_cpu(q, k, v, start, 0.2)
        assert torch.get_num_threads() == 1  # no switch: the op runs its items on its own threads
    finally:
        torch.set_num_threads(before)
    assert calls == [(0, 0), (2, 48_000)]
    assert torch.equal(own, wide)
    monkeypatch.setattr(kernels, "WIDE_THREADS", None)  # no wider count: the step's own threads
    assert kernels.op_threads() == (0, 0)




# (hidden, query heads, KV heads, head dim): the 7B shape, the embedded model
LAYERS = [(3584, 28, 4, 128), (192, 8, 4, 24)]


@pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden,H,Hkv,D", LAYERS)
def test_fused_layer_kernels_give_transformers_norm_and_rotary(device, dtype, hidden, H, Hkv, D):
    """`kernels.rms_norm` and `kernels.rotary` (one Triton kernel each, in every decode step on
    CUDA) against transformers' own RMSNorm and `apply_rotary_pos_emb` on the same inputs: queries
    and keys laid out as transformers hands them over (heads transposed out of the projection), cos
    and sin per sequence or one for all. The rotary embedding gives transformers' bits (its
    roundings kept) and its layout; the norm differs only by its mean's summation order (a few
    units in the last place). Triton's interpreter rounds to bf16 by truncation (a GPU rounds
    to nearest): there bf16 is held to one unit in the last place."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs on the CPU only through its interpreter")
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl

    g = torch.Generator().manual_seed(1)
    ulp = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    exact = dtype != torch.bfloat16 or device == "cuda"
    norm = qwen2_vl.Qwen2VLRMSNorm(hidden, 1e-6).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g) * 0.3 + 1)
    x = (torch.randn(2, 3, hidden, generator=g) * 4).to(device, dtype)
    with torch.no_grad():
        want, got = norm(x), kernels.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = (4 if dtype == torch.float32 else 2) * ulp * want.float().abs()  # x / rms rounded, then times w rounded
    assert ((got.float() - want.float()).abs() <= tol).all()
    for B_cos in (2, 1):
        T = 3
        q = torch.randn(2, T, H, D, generator=g).to(device, dtype).transpose(1, 2)  # [B, H, T, D], as transformers'
        k = torch.randn(2, T, Hkv, D, generator=g).to(device, dtype).transpose(1, 2)
        angle = torch.randn(B_cos, T, D // 2, generator=g) * 50
        cos, sin = (torch.cat([f(angle)] * 2, -1).to(device, dtype) for f in (torch.cos, torch.sin))
        assert kernels.rotary_fusable(q, k, cos, sin)
        want = qwen2_vl.apply_rotary_pos_emb(q, k, cos, sin)
        got = kernels.rotary(q, k, cos, sin)
        for x, a, b in zip((q, k), want, got):
            assert b.dtype == a.dtype and b.shape == a.shape and b.stride() == a.stride()
            if exact:
                assert torch.equal(a, b)
            else:  # three truncations, each within a unit of its term's magnitude
                terms = x.float().abs() * cos.float().abs()[:, None] + \
                    qwen2_vl.rotate_half(x.float()).abs() * sin.float().abs()[:, None]
                assert ((a.float() - b.float()).abs() <= 2 * ulp * terms).all()


@pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,heads", [(1, 1), (2, 1), (1, 4), (2, 4)])
def test_the_fused_kv_write_kernel_writes_what_the_cache_writes(device, rows, heads):
    """`kernels.write_kv` against `cache.write_at` for every form of write positions a step hands a
    layer (one for all, per sequence, per KV head, both), a step's one token and a verification's
    three, new entries laid out as transformers hands them over: the same buffers, bit for bit."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs on the CPU only through its interpreter")
    from sparsevid.cache import write_at

    g = torch.Generator().manual_seed(2)
    B, Hkv, D, cap = 2, 4, 24, 40
    for q in (1, 3):
        start = torch.randint(0, cap - q + 1, (rows, heads), generator=g).to(device)
        key, value = (torch.randn(B, q, Hkv, D, generator=g).to(device).transpose(1, 2) for _ in range(2))
        bufs = [torch.randn(B, Hkv, cap, D, generator=g).to(device) for _ in range(2)]
        want = [t.clone() for t in bufs]
        pos = start[:, :, None] + torch.arange(q, device=device)
        write_at(want[0], pos, key)
        write_at(want[1], pos, value)
        assert kernels.write_kv_fusable(*bufs, start, key, value)
        kernels.write_kv(*bufs, start, key, value)
        assert torch.equal(bufs[0], want[0]) and torch.equal(bufs[1], want[1])


@pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")
def test_fused_layer_kernels_compile_for_an_h100_without_spilling():
    """`kernels.rms_norm`, `kernels.rotary` and `kernels.write_kv` as launched at the 7B shape and the embedded model's,
    in bf16 and float32, compiled for sm_90 here without a GPU (see the split-KV test above): each
    compiles, keeps its row in registers and needs next to no shared memory."""
    cases = [(dtype, hidden, D) for dtype in ("bf16", "fp32") for hidden, _, _, D in LAYERS]
    code = ("import json, sys; from sparsevid._triton_layer import sm90_usage; "
            "print(json.dumps([sm90_usage(*x) for x in json.load(sys.stdin)]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    usage = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(usage) == len(cases)
    assert all(u["local"] == 0 and u["shared"] <= 1024 for x in usage for u in x.values()), usage
