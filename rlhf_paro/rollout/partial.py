"""Partial rollouts: the engine-side scheduler (docs/design.md, "Partial rollouts: the
scheduler").

A replica that drains generates one step's prompts and waits for the longest response; late in
the call the engine decodes a handful of rows. ``PartialRollouts`` keeps the engine full
instead: samples queue in groups (a prompt's ``n`` samples), at most ``capacity`` decode at once
and a new one joins as soon as a slot frees, and a call (``advance``) stops as soon as enough
groups have finished. The samples still decoding are taken back out of the engine with what
they have decoded, and go on at the next call, under the next weights: each token keeps the
version of the policy that sampled it and its log-prob.

[Note: partial rollouts are reproducible]
Everything that decides a row is counted in decoding steps and sample indices, never in wall
time: a call stops at the decoding step where ``groups_wanted`` groups are complete; the groups
it returns are ordered by that step, ties by group index; every request's seed is a pure
function of the base seed, the sample's group and member, its restarts and its tokens so far
(``request_seed``), so a continuation draws afresh rather than replaying its first draws, and
the same sample draws the same tokens whatever decodes beside it (``hf.seeded_tokens``).
Between two calls the engine holds nothing and the scheduler's state is plain data
(``state``): a resume from it makes the same engine calls as the run that never stopped, so
it gives the same rows.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from rlhf_paro.rollout.base import Interrupts, Sampling
from rlhf_paro.rollout.batch import PromptBatch, RolloutBatch

# Where a sample is: waiting for a slot, decoding (tokens so far may be held here between
# calls), or ended (its <eos> or its budget).
QUEUED, DECODING, ENDED = "queued", "decoding", "ended"

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """A 64-bit integer hash (SplitMix64's finaliser): nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def request_seed(seed: int, group: int, member: int, restarts: int, tokens: int) -> int:
    """The seed of a request of sample ``member`` of group ``group``: a pure function of the
    base ``seed``, the two, the sample's restarts and the tokens it has so far. A continuation
    (``tokens`` > 0) starts a new stream, since an engine's stream counts a request's tokens
    from 0 ([Note: partial rollouts are reproducible])."""
    h = 0
    for part in (seed, group, member, restarts, tokens):
        h = _mix64(h ^ (part & _M64))
    return h & 0x7FFFFFFF


@dataclass
class Sample:
    """One sample of a group as it grows."""

    member: int  # its place in its group, 0 to n - 1
    restarts: int = 0  # times it was started again from its prompt, its tokens too old
    tokens: list[int] = field(default_factory=list)  # its response so far
    logprobs: list[float] = field(default_factory=list)  # the engine's, of each token
    versions: list[int] = field(default_factory=list)  # the policy that sampled each token
    state: str = QUEUED


@dataclass
class Group:
    """A prompt's ``n`` samples; ``payload``: the caller's (its prompt row), plain data."""

    index: int  # the caller's running index of groups: the order they queue in
    prompt: list[int]  # the prompt's token ids
    payload: Any
    samples: list[Sample]
    completed_at: int | None = None  # the decoding step at which its last sample ended

    @property
    def complete(self) -> bool:
        return all(s.state == ENDED for s in self.samples)


@dataclass(frozen=True)
class Figures:
    """What one ``advance`` did."""

    steps: int  # decoding steps it ran
    # Requests in flight per decoding step, mean over its steps: held at ``capacity`` while the
    # queue lasts, where a drained batch falls as its rows end.
    engine_batch_mean: float
    # Of the samples it returned, the share whose tokens more than one policy sampled.
    partial_fraction: float
    tokens_by_version: dict[int, int]  # the returned samples' tokens, by policy version
    restarts: int  # samples started again from their prompt (``oldest_version``)


class PartialRollouts:
    """Groups queued in order (``add``), decoded ``capacity`` samples at a time across calls
    (``advance``), returned as they finish; state between calls is plain data (``state``,
    ``from_state``)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed  # the base of every request's seed (``request_seed``)
        self.step = 0  # decoding steps run so far, over all calls: when each group completed
        self.last_index = -1  # the last group added: indices only grow
        self.groups: list[Group] = []  # added and not yet returned, by index

    def add(self, prompt: Sequence[int], index: int, n: int, payload: Any = None) -> None:
        """Queue group ``index`` (above every group added before): ``n`` samples of ``prompt``
        (token ids); ``payload`` comes back with it, and goes into ``state`` as it is."""
        if index <= self.last_index:
            raise ValueError(f"group index {index} after {self.last_index}; allowed: indices "
                             "that grow, a group added once")
        if n < 1 or not prompt:
            raise ValueError(f"group {index}: n={n} samples of {len(prompt)} prompt tokens; "
                             "allowed: n >= 1 of a prompt of at least one token")
        self.last_index = index
        self.groups.append(Group(index, list(prompt), payload,
                                 [Sample(member) for member in range(n)]))

    def advance(self, engine: Interrupts, sampling: Sampling, version: int, groups_wanted: int,
                capacity: int, oldest_version: int | None = None) -> tuple[list[Group], Figures]:
        """Decode under policy ``version`` until ``groups_wanted`` groups are complete; returns
        them, ordered by the decoding step each completed at (ties by index), and the call's
        figures. A sample with a token older than ``oldest_version`` starts again from its
        prompt first. The samples decoding go in first, each continuing its tokens, then queued
        ones join while fewer than ``capacity`` decode; when the call stops, those still
        decoding come back out of the engine with their tokens so far."""
        if sampling.greedy:
            raise ValueError("partial rollouts sample; a greedy evaluation drains its batch "
                             "(Rollout.generate)")
        if groups_wanted < 1 or capacity < 1:
            raise ValueError(f"groups_wanted={groups_wanted}, capacity={capacity}; allowed: "
                             "both >= 1")
        if len(self.groups) < groups_wanted:
            raise ValueError(f"{groups_wanted} groups wanted, {len(self.groups)} held (queued, "
                             "decoding or finished); allowed: add groups before advancing")
        restarts = self._restart_older(oldest_version) if oldest_version is not None else 0
        steps = rows = 0
        if sum(g.complete for g in self.groups) < groups_wanted:
            steps, rows = self._decode(engine, sampling, version, groups_wanted, capacity)
        done = sorted((g for g in self.groups if g.complete),
                      key=lambda g: (g.completed_at, g.index))[:groups_wanted]
        taken = {g.index for g in done}
        self.groups = [g for g in self.groups if g.index not in taken]
        samples = [s for g in done for s in g.samples]
        spans = sum(len(set(s.versions)) > 1 for s in samples)
        return done, Figures(steps, rows / steps if steps else 0.0, spans / len(samples),
                             dict(sorted(Counter(v for s in samples for v in s.versions).items())),
                             restarts)

    def _restart_older(self, oldest_version: int) -> int:
        """Every sample held with a token older than ``oldest_version``, started again from its
        prompt (a new seed: ``request_seed``); how many. An ended one queues again, at its
        group's place, so a group returned never holds a token older than the bound."""
        count = 0
        for group in self.groups:
            for s in group.samples:
                if s.versions and min(s.versions) < oldest_version:
                    s.tokens, s.logprobs, s.versions = [], [], []
                    s.restarts += 1
                    if s.state == ENDED:
                        s.state, group.completed_at = QUEUED, None
                    count += 1
        return count

    def _decode(self, engine: Interrupts, sampling: Sampling, version: int, groups_wanted: int,
                capacity: int) -> tuple[int, int]:
        """The engine stepped until ``groups_wanted`` groups are complete; (steps, requests in
        flight summed over steps). The engine holds nothing afterwards."""
        requests: dict[Any, tuple[Group, Sample]] = {}

        def submit(group: Group, s: Sample) -> None:
            seed = request_seed(self.seed, group.index, s.member, s.restarts, len(s.tokens))
            budget = sampling.max_new_tokens - len(s.tokens)
            # A sample held with its whole budget decoded would have ended in the engine.
            assert budget > 0, (group.index, s.member, len(s.tokens))
            key = engine.submit(group.prompt + s.tokens,
                                dataclasses.replace(sampling, max_new_tokens=budget), seed)
            requests[key] = group, s
            s.state = DECODING

        def admit() -> None:
            queued = ((g, s) for g in self.groups for s in g.samples if s.state == QUEUED)
            for group, s in queued:
                if len(requests) >= capacity:
                    return
                submit(group, s)

        def record(s: Sample, tokens: list[int], logprobs: list[float] | None) -> None:
            assert logprobs is not None and len(logprobs) == len(tokens)
            s.tokens += tokens
            s.logprobs += logprobs
            s.versions += [version] * len(tokens)

        steps = rows = 0
        complete = sum(g.complete for g in self.groups)
        with engine.turns():
            try:
                for group in self.groups:  # the samples decoding, in order, their slots kept
                    for s in group.samples:
                        if s.state == DECODING:
                            submit(group, s)
                admit()
                while complete < groups_wanted:
                    # Held groups are at least groups_wanted (advance), so some are unfinished.
                    assert requests, "nothing decoding and too few groups complete"
                    rows += len(requests)
                    ended = engine.step()
                    steps += 1
                    self.step += 1
                    for key, tokens, logprobs in ended:
                        group, s = requests.pop(key)
                        record(s, tokens, logprobs)
                        s.state = ENDED
                        if group.complete:
                            group.completed_at = self.step
                            complete += 1
                    admit()
                for key, (tokens, logprobs) in engine.interrupt(list(requests)).items():
                    record(requests.pop(key)[1], tokens, logprobs)
                assert not requests, "the engine did not give back every request"
            except BaseException:
                engine.abort(list(requests))
                raise
        return steps, rows

    def state(self) -> dict[str, Any]:
        """Plain lists, ints, floats and strings (and the groups' payloads as they came): what a
        checkpoint saves; ``from_state`` restores it."""
        return {"seed": self.seed, "step": self.step, "last_index": self.last_index,
                "groups": [dataclasses.asdict(g) for g in self.groups]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PartialRollouts:
        """The scheduler ``state`` was taken from, as it was between two calls."""
        out = cls(int(state["seed"]))
        out.step, out.last_index = int(state["step"]), int(state["last_index"])
        out.groups = [Group(g["index"], list(g["prompt"]), g["payload"],
                            [Sample(**s) for s in g["samples"]], g["completed_at"])
                      for g in state["groups"]]
        for s in (s for g in out.groups for s in g.samples):
            s.tokens, s.logprobs, s.versions = list(s.tokens), list(s.logprobs), list(s.versions)
        return out


def assemble(groups: Sequence[Group], pad_token_id: int) -> tuple[RolloutBatch, Tensor]:
    """The rollout of finished ``groups`` (a row per sample, groups in order, members in order)
    and (B, R) int64 the policy version of each response token, -1 past a response's end. A
    response's real tokens are all it holds (through its <eos>, or its budget)."""
    samples = [(g, s) for g in groups for s in g.samples]
    if not samples:
        raise ValueError("no groups to assemble")
    prompts = PromptBatch.left_padded([g.prompt for g, _ in samples], pad_token_id)
    width = max(len(s.tokens) for _, s in samples)
    responses = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(len(samples), width)
    versions = torch.full((len(samples), width), -1, dtype=torch.long)
    real = torch.zeros(len(samples), width, dtype=torch.long)
    for row, (_, s) in enumerate(samples):
        n = len(s.tokens)
        responses[row, :n] = torch.tensor(s.tokens, dtype=torch.long)
        logprobs[row, :n] = torch.tensor(s.logprobs)
        versions[row, :n] = torch.tensor(s.versions, dtype=torch.long)
        real[row, :n] = 1
    batch = RolloutBatch(torch.cat([prompts.input_ids, responses], dim=1),
                         torch.cat([prompts.attention_mask, real], dim=1), real.float(),
                         logprobs)
    return batch, versions
