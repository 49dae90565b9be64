"""Speculative decoding with any draft, verified by dense (SPEC §3.1): lossless.

One round: the draft proposes up to γ tokens autoregressively; dense scores them all in one
forward over the full cache; the longest prefix dense agrees with is accepted, then dense's own
next token is added as a bonus. Greedy: agreement means dense's argmax. Sampling: accept draft
token x with probability min(1, p(x)/q(x)), else resample from norm(max(p - q, 0)), so the output
distribution is dense's. Rollback of either cache is a change of its length.

Drafts: `PolicyDraft` (the same weights attending to a compact cache chosen by a policy: StD,
Streaming, HT-Sparse, SparseMM) and `LayerSkipDraft` (the first L_e layers + final norm + head).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from .adapters import VideoInputs
from .engine import Result, Sampling, new_run, peak_memory, prefill, probs_from_logits, reset_peak_memory, step, sync
from .models import Loaded


class PolicyDraft:
    """Draft = the model over the compact sparse caches built by `policy` at prefill.

    The sparse cache holds every committed token except `pending` (1 token, or 2 when the whole
    draft was accepted and `refresh` is off). With `refresh`, after each round the accepted
    tokens' KV in the sparse cache is replaced by dense's (n+1 entries copied).
    """

    def __init__(self, policy, refresh: bool = True):
        self.policy, self.refresh = policy, refresh

    def begin(self, run, committed: list[int]) -> None:
        self.pending = committed[-1:]

    def feed(self) -> list[int]:
        return self.pending

    def forward(self, loaded: Loaded, run, tokens: list[int]) -> torch.Tensor:
        return step(loaded, run, tokens, mode="sparse")

    def before_verify(self, run) -> None:
        """The sparse cache keeps the draft's entries until the round ends."""

    def end_round(self, run, n_draft_fed: int, out: list[int]) -> None:
        """After verification: `out` is every committed token; the dense cache holds all but the last."""
        cache = run.cache
        committed_len = cache.dense_len  # dense holds every committed token but the last one
        if self.refresh:
            start = cache.sparse_len - n_draft_fed
            cache.refresh_sparse(start, committed_len)
            cache.sparse_len = committed_len
            self.pending = out[-1:]
        else:
            # The draft holds its own KV for the tokens it was fed; keep the committed ones.
            cache.sparse_len = min(cache.sparse_len, committed_len)
            missing = committed_len + 1 - cache.sparse_len  # committed tokens not in the sparse cache
            self.pending = out[-missing:]


class LayerSkipDraft:
    """Draft = the first `layers` decoder layers + final norm + LM head (tuning-free).

    Its KV in those layers is exactly dense's, so it reads and writes the dense cache; the dense
    verification pass rewrites the same positions, and the length is restored after drafting.
    """

    policy = None

    def __init__(self, layers: int):
        self.layers = layers

    def begin(self, run, committed: list[int]) -> None:
        self.last = committed[-1:]
        self._start = None  # dense length before this round's draft writes

    def feed(self) -> list[int]:
        return self.last

    @contextmanager
    def _truncated(self, loaded: Loaded):
        lm = loaded.model.model.language_model
        full = lm.layers
        lm.layers = full[: self.layers]
        try:
            yield
        finally:
            lm.layers = full

    def forward(self, loaded: Loaded, run, tokens: list[int]) -> torch.Tensor:
        if self._start is None:
            self._start = run.cache.dense_len
        with self._truncated(loaded):
            return step(loaded, run, tokens, mode="dense")

    def before_verify(self, run) -> None:
        """Forget the draft's dense-cache writes: verification rewrites those positions."""
        if self._start is not None:
            run.cache.dense_len = self._start
            self._start = None

    def end_round(self, run, n_draft_fed: int, out: list[int]) -> None:
        self.last = out[-1:]


@torch.inference_mode()
def speculative_decode(loaded: Loaded, inputs: VideoInputs, draft, *, method: str = "std", gamma: int = 9,
                       max_new_tokens: int = 64, sampling: Sampling = Sampling(),
                       on_token: Callable[[int], None] | None = None) -> Result:
    dev = loaded.device
    eos = sampling.eos(loaded)
    run = new_run(loaded, inputs, max_new_tokens + gamma + 2, draft.policy, store_dense=True)
    gen = sampling.generator(dev)
    sync(dev)
    reset_peak_memory(dev)
    t0 = time.perf_counter()
    logits = prefill(loaded, inputs, run)
    first = _sample(logits, sampling, gen)
    sync(dev)
    t1 = time.perf_counter()
    out = [first]
    if on_token is not None:
        on_token(first)
    rounds = []
    draft.begin(run, out)
    while out[-1] not in eos and len(out) < max_new_tokens:
        # Draft: at most γ tokens, and no more than can still be committed besides the bonus.
        g = min(gamma, max_new_tokens - len(out) - 1)
        ts = time.perf_counter()
        proposed, q_probs, fed = [], [], 0
        feed = draft.feed()
        for _ in range(g):
            lg = draft.forward(loaded, run, feed)[-1]
            fed += len(feed)
            if sampling.greedy:
                t = int(lg.argmax())
            else:
                q = probs_from_logits(lg, sampling)
                t = int(torch.multinomial(q, 1, generator=gen))
                q_probs.append(q)
            proposed.append(t)
            feed = [t]
            if t in eos:
                break
        draft.before_verify(run)
        sync(dev)
        tv = time.perf_counter()
        # Verify: dense scores the last committed token and every proposal in one pass.
        lg = step(loaded, run, out[-1:] + proposed, mode="dense")  # [len(proposed) + 1, V]
        accepted, bonus = _accept(lg, proposed, q_probs, sampling, gen)
        new = proposed[:accepted] + [bonus]
        committed = []
        for t in new:
            committed.append(t)
            if t in eos or len(out) + len(committed) >= max_new_tokens:
                break
        # Dense cache: keep the KV of every committed token but the newest (roll back the rest).
        run.cache.dense_len = run.cache.dense_len - (len(proposed) + 1) + len(committed)
        out.extend(committed)
        sync(dev)
        te = time.perf_counter()
        rounds.append(dict(proposed=proposed, accepted=accepted, bonus=bonus if len(committed) == len(new) else None,
                           draft_s=tv - ts, verify_s=te - tv))
        if on_token is not None:
            for t in committed:
                on_token(t)
        if out[-1] in eos or len(out) >= max_new_tokens:
            break
        draft.end_round(run, fed, out)
    t2 = time.perf_counter()
    proposed_n = sum(len(r["proposed"]) for r in rounds)
    accepted_n = sum(r["accepted"] for r in rounds)
    kv = run.cache.dense_nbytes() + (run.cache.sparse_nbytes() if draft.policy is not None else 0)
    res = Result(method, out, loaded.adapter.decode(out), t1 - t0, t2 - t1, [], kv)
    L = loaded.num_layers
    if draft.policy is not None:  # mean entries a draft step reads per KV head and layer: K + m_t
        lens = [sum(s.lengths) / len(s.lengths) for s in run.selections.values()]
        draft_entries = (sum(lens) + inputs.m * (L - len(lens))) / L
    else:
        draft_entries = inputs.m * draft.layers / L
    res.extra.update(draft_entries=draft_entries, acceptance=accepted_n / proposed_n if proposed_n else None, rounds=len(rounds),
                     tokens_per_round=(len(out) - 1) / len(rounds) if rounds else None, gamma=gamma,
                     proposed=proposed_n, accepted=accepted_n, peak_memory_bytes=peak_memory(dev))
    res.trace.update(rounds=rounds, selections=run.selections)
    return res


def _sample(logits, sampling: Sampling, gen) -> int:
    if sampling.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probs_from_logits(logits, sampling), 1, generator=gen))


def _accept(lg: torch.Tensor, proposed: list[int], q_probs: list[torch.Tensor], sampling: Sampling, gen):
    """Verification logits [n+1, V] -> (number accepted, bonus token)."""
    if sampling.greedy:
        target = lg.argmax(-1).tolist()
        a = 0
        while a < len(proposed) and proposed[a] == target[a]:
            a += 1
        return a, target[a]
    p = probs_from_logits(lg, sampling)
    for i, t in enumerate(proposed):
        u = torch.rand((), generator=gen, device=p.device)
        if u * q_probs[i][t] <= p[i, t]:  # u < p/q without dividing by a zero q
            continue
        residual = (p[i] - q_probs[i]).clamp_min(0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(proposed), int(torch.multinomial(p[len(proposed)], 1, generator=gen))
