"""Evaluation over a manifest: one process, two CPU processes under `accelerate launch`, resume,
failed clips, summary and report. A tiny random model on four toy clips (one of them broken)."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from sparsevid import cli, evaluation
from sparsevid.toy.evalset import TOY_EVAL_SEED
from sparsevid.toy.__main__ import main as toy_main
from sparsevid.video import load_video

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = "std,layerskip"


@pytest.fixture(scope="module")
def evalset(tmp_path_factory):
    """Three toy clips from `make-eval` (8 and 12 frames) plus a broken video file."""
    d = tmp_path_factory.mktemp("evalset")
    assert toy_main(["make-eval", "--n", "3", "--out", str(d), "--frames", "8,12"]) == 0
    (d / "clips" / "broken.mp4").write_bytes(b"this is not a video\n" * 100)
    with open(d / "manifest.jsonl", "a") as f:
        f.write(json.dumps({"id": "broken", "video": "clips/broken.mp4", "question": "What colour is the circle?",
                            "answer": "red"}) + "\n")
    return d


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("qwen2_vl")


def eval_args(data, model, out, *extra):
    return ["eval", "--data", str(data), "--model", model, "--methods", METHODS, "--max-new-tokens", "6",
            "--out", str(out), "--quiet", "--device", "cpu", "--no-adaptive-gamma", *extra]  # fixed γ: rounds to report


def read(out):
    with open(os.path.join(out, evaluation.RESULTS)) as f:
        return f.read().splitlines()


def answers(lines):
    """(id, method) -> (token ids, error) of results lines."""
    rows = [json.loads(line) for line in lines]
    return {(r["id"], r["method"]): (r.get("token_ids"), r.get("error")) for r in rows}


@pytest.fixture(scope="module")
def single(evalset, model, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    assert cli.main(eval_args(evalset, model, out, "--report")) == 0
    return out


def test_make_eval_manifest(evalset):
    items = evaluation.read_manifest(str(evalset))
    assert [it["id"] for it in items] == ["toy-0000", "toy-0001", "toy-0002", "broken"]
    for it in items[:3]:
        assert it["seed"] >= TOY_EVAL_SEED > 1_000_000_000  # toy training seeds are < 1e9
        assert it["answer"] and it["question"] and len(it["boxes"]) == it["frames"]
        assert all(b is None or all(0 <= v <= 1 for v in b) for b in it["boxes"])
        assert load_video(it["path"], it["frames"]).frames.shape[0] == it["frames"]
    assert [it["frames"] for it in items[:3]] == [8, 12, 8]


def test_correct_means_the_reference_or_an_accepted_alternative():
    from sparsevid.toy.questions import NARRATE, make_sample

    s = next(s for s in (make_sample(seed, 16, NARRATE) for seed in range(50)) if len(s.answers) > 1)
    item = {"answer": s.answer, "answers": s.answers[1:]}
    assert evaluation.is_correct(s.answers[-1].upper(), item) and evaluation.is_correct(s.answer, item)
    assert not evaluation.is_correct(s.answers[-1], {"answer": s.answer})
    assert not evaluation.is_correct("There is one object.", item)
    assert evaluation.is_correct("red", {"question": "?"}) is None


def test_single_process(single, capsys):
    lines = read(single)
    rows = [json.loads(line) for line in lines]
    assert [(r["id"], r["method"]) for r in rows] == [
        (i, m) for i in ("toy-0000", "toy-0001", "toy-0002", "broken") for m in ("dense", "std", "layerskip")]
    for r in rows[:9]:
        assert "error" not in r and r["text"] is not None and r["token_ids"]
        assert isinstance(r["correct"], bool) and r["reference"]
        assert r["identical_to_dense"] is True  # std and layerskip are lossless under greedy decoding
        assert r["kv_ratio"] > 0 and r["decode_s"] > 0 and r["frames"] in (8, 12)
        # a decode ratio only where enough steps were measured (metrics.MIN_DECODE_STEPS)
        if r["method"] != "dense":
            assert (r["speedup"] > 0) if r["decode_tokens"] >= 4 else r["speedup"] is None
    assert rows[1]["acceptance"] is not None and rows[0]["acceptance"] is None
    for r in rows[9:]:
        assert "could not be read" in r["error"]

    with open(single / evaluation.SUMMARY) as f:
        summary = json.load(f)
    assert list(summary["methods"]) == ["dense", "std", "layerskip"]
    std = summary["methods"]["std"]
    assert std["items"] == 4 and std["errors"] == 1 and std["with_reference"] == 3
    assert std["agreement_with_dense"] == 1.0
    measured = sum(r["speedup"] is not None for r in rows[:9] if r["method"] == "std")
    assert std["speedup"]["n"] == measured >= 1 and std["speedup"]["q1"] <= std["speedup"]["median"] <= std["speedup"]["q3"]
    assert summary["errors"] == [{"id": "broken", "error": rows[-1]["error"]}]

    md = (single / "report.md").read_text()
    assert md.splitlines()[0] == "| method | accuracy | agreement with dense | speedup | acceptance | KV vs dense | items |"
    assert len(md.splitlines()) == 7 and md.splitlines()[-1].startswith("Decode time, all items")
    page = (single / "report.html").read_text()
    assert page.count("Plotly.newPlot") == 3 and "<script src=" not in page  # plotly.js embedded once
    assert page.count("plotly.js v") == 1 and "Failed items" in page


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_two_processes_equal_single(single, evalset, model, tmp_path):
    out = tmp_path / "multi"
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port()), "-m", "sparsevid"]
    p = subprocess.run(launch + eval_args(evalset, model, out), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "process 0 of 2" in p.stderr and "process 1 of 2" in p.stderr
    assert answers(read(out)) == answers(read(single))
    assert p.stdout.startswith("| method | accuracy |")  # process 0 prints the table, once
    assert not list(out.glob("results.part-*"))  # journals merged and removed
    with open(out / evaluation.SUMMARY) as f, open(single / evaluation.SUMMARY) as g:
        a, b = json.load(f), json.load(g)
    assert a["errors"] == b["errors"] and a["items"] == b["items"]
    assert {k: (m["accuracy"], m["items"]) for k, m in a["methods"].items()} == \
           {k: (m["accuracy"], m["items"]) for k, m in b["methods"].items()}


def test_batched_eval_gives_every_item_the_answers_of_batch_one(single, evalset, model, tmp_path):
    """`eval --batch 3`: the four items (one a broken video) decoded three at a time, a row that ends
    making room for the next item: the same answers and errors as one at a time; rows say which
    batch they were decoded in and its decode time, counted once in the summary."""
    out = tmp_path / "batched"
    assert cli.main(eval_args(evalset, model, out, "--batch", "3")) == 0
    assert answers(read(out)) == answers(read(single))
    rows = [json.loads(line) for line in read(out)]
    dense = [r for r in rows if r["method"] == "dense" and "error" not in r]
    batches = {r["batch_of"]: r["batch_decode_s"] for r in dense}
    assert len(dense) == 3 and len(batches) == 1 and all(r["batch_decode_s"] >= r["decode_s"] for r in dense)
    assert all(r["batch"] == 3 for r in dense)
    with open(out / evaluation.SUMMARY) as f:  # each batch's decode time counted once per method
        assert json.load(f)["methods"]["dense"]["decode_s"] == pytest.approx(sum(batches.values()))
    assert cli.main(eval_args(evalset, model, tmp_path / "zero", "--batch", "0")) == 2


def test_questions_on_one_video_share_it(evalset, model, tmp_path, monkeypatch):
    """Benchmarks ask several questions per video: consecutive items on one video decode it once
    (one at a time and in batches), and each answer is the one its item gets alone."""
    with open(evalset / "manifest.jsonl") as f:
        first = json.loads(f.readline())
    data = tmp_path / "data"
    shutil.copytree(evalset / "clips", data / "clips")
    questions = ["What colour is the circle?", first["question"], "Describe the video."]
    with open(data / "manifest.jsonl", "w") as f:
        for i, q in enumerate(questions):
            f.write(json.dumps(dict(first, id=f"q{i}", question=q)) + "\n")
    decoded = []
    monkeypatch.setattr("sparsevid.video.load_video", lambda *a, **k: decoded.append(a) or load_video(*a, **k))
    assert cli.main(eval_args(data, model, tmp_path / "one")) == 0
    assert len(decoded) == 1
    assert cli.main(eval_args(data, model, tmp_path / "two", "--batch", "2")) == 0
    assert len(decoded) == 2
    shared = answers(read(tmp_path / "one"))
    assert answers(read(tmp_path / "two")) == shared
    for i, q in enumerate(questions):  # each item alone, in a manifest of its own
        alone = tmp_path / f"alone{i}"
        shutil.copytree(evalset / "clips", alone / "clips")
        with open(alone / "manifest.jsonl", "w") as f:
            f.write(json.dumps(dict(first, id=f"q{i}", question=q)) + "\n")
        assert cli.main(eval_args(alone, model, tmp_path / f"out{i}")) == 0
        assert answers(read(tmp_path / f"out{i}")) == {k: v for k, v in shared.items() if k[0] == f"q{i}"}


def test_batches_put_like_questions_together():
    """`--batch` fills its batches with items asking the same question (then by frames, then in
    manifest order), so a batch's answers tend to end together."""
    items = [dict(id=str(i), question=q, frames=f) for i, (q, f) in enumerate(
        [("Describe the video.", 64), ("What colour is the circle?", 16), ("describe  the video.", 16),
         ("What colour is the circle?", 16), ("Describe the video.", 16)])]
    assert [it["id"] for it in evaluation.batch_order(items)] == ["2", "4", "0", "1", "3"]


def test_resume_runs_only_what_is_missing(single, evalset, model, tmp_path, capsys):
    out = tmp_path / "resumed"
    shutil.copytree(single, out)
    lines = read(single)
    first, second = lines[0:3], lines[3:6]  # toy-0000 and toy-0001, three methods each
    # An interrupted run: toy-0000 never finished; toy-0001 finished but was only in a process's journal.
    (out / evaluation.RESULTS).write_text("\n".join(lines[6:]) + "\n")
    (out / evaluation.JOURNAL.format(1)).write_text("\n".join(second) + "\n" + second[0][:40])  # + a torn line
    assert cli.main(eval_args(evalset, model, out)) == 0
    assert "3 of 4 items done, 1 to run" in capsys.readouterr().err
    resumed = read(out)
    assert resumed[3:] == lines[3:]  # not recomputed: byte-identical, times included
    assert answers(resumed[:3]) == answers(first)  # recomputed: same answers
    assert resumed[:3] != first  # ... with new times
    assert not list(out.glob("results.part-*"))

    assert cli.main(eval_args(evalset, model, out)) == 0  # nothing left to do
    assert "4 of 4 items done, 0 to run" in capsys.readouterr().err
    assert read(out) == resumed


def test_other_settings_add_rows(single, evalset, model, tmp_path, capsys):
    out = tmp_path / "gammas"
    shutil.copytree(single, out)
    args = eval_args(evalset, model, out, "--gamma", "3", "--report")
    args[args.index("--methods") + 1] = "std"
    assert cli.main(args) == 0
    assert "0 of 4 items done, 4 to run" in capsys.readouterr().err
    assert len(read(out)) == len(read(single)) + 4 * 2
    with open(out / evaluation.SUMMARY) as f:
        summary = json.load(f)
    assert summary["varying_settings"] == ["gamma"]
    assert list(summary["methods"]) == ["dense (gamma=9)", "std (gamma=9)", "layerskip (gamma=9)",
                                        "dense (gamma=3)", "std (gamma=3)"]
    assert "Draft acceptance vs γ" in (out / "report.html").read_text()


def test_bad_manifest_is_one_error_line(tmp_path, model, capsys):
    (tmp_path / "manifest.jsonl").write_text('{"video": "a.mp4", "question": "What?"}\nnot json\n')
    assert cli.main(eval_args(tmp_path, model, tmp_path / "out")) == 2
    assert "line 2" in capsys.readouterr().err
    assert cli.main(eval_args(tmp_path / "nowhere", model, tmp_path / "out")) == 2


def test_spread_and_table():
    st = evaluation.spread([4.0, 1.0, None, 3.0, 2.0])
    assert st == dict(median=2.5, q1=1.75, q3=3.25, min=1.0, max=4.0, n=4)
    assert evaluation.spread([None]) is None
    assert evaluation._fmt(st) == "2.50x (1.75x–3.25x)" and evaluation._fmt(evaluation.spread([0.5]), True) == "50%"
