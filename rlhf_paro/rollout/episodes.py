"""Multi-turn episodes on one actor rank: the one place that assembles an episode's tokens
(docs/design.md, "Multi-turn episodes").

Each turn generates the next action of every episode still running, in one batched call of the
rollout engine (``Rollout.generate`` on the episodes' contexts; finished episodes drop out), and
steps their environments (``envs.EnvRunner``: in threads, each call within ``env.timeout_s``);
once all have ended, it closes the environments that have a ``close()``.
Token in, token out: an episode's context is the exact token ids of its prompt, its actions and
the observations' tokens (``envs.Observations``), never a re-tokenised transcript, so the
trainer's log-probs of an action are those of the context it was sampled in. An action runs
through the first <eos> (the engine's ``action_mask``) and at most ``ppo.max_new_tokens``.

The rollout keeps the layout every model reads (``RolloutBatch``): the prompt (with the reset's
observation, if any), then the response: actions and observations in order, all attended,
``action_mask`` 1 on the actions only; the engine's log-probs on the actions; ``scores`` the sum
of each episode's step rewards. An episode ends when its environment says done, after
``env.max_turns`` actions (truncated), or when its context would pass ``env.max_total_tokens``
(truncated): an action is cut at the budget and not stepped, an observation that leaves no room
for a next action is dropped, never tokenised past the budget (``Observations.encode``). So every
row ends with an action. An episode's score that float32 cannot hold (step rewards summing past
3.4e38) is its environment's error, named, before any model sees it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from rlhf_paro.envs import EnvError, EnvRunner, Observations
from rlhf_paro.rollout.base import Rollout, Sampling
from rlhf_paro.rollout.batch import PromptBatch, RolloutBatch

FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # the largest score a rollout carries
# Why an episode ended: its environment said done, or a budget cut it short.
DONE, MAX_TURNS, MAX_TOKENS = "done", "max_turns", "max_total_tokens"


@dataclass(frozen=True)
class Budget:
    max_turns: int  # actions an episode takes at most
    max_total_tokens: int  # its context at most, prompt included


@dataclass
class Episode:
    """One sample's episode as it grows."""

    prompt: list[int]  # the prompt's real tokens, then the reset's observation
    tokens: list[int] = field(default_factory=list)  # actions and observations, in order
    actions: list[float] = field(default_factory=list)  # 1 on action tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0 on observations
    score: float = 0.0  # the sum of the step rewards
    turns: int = 0
    ended: str | None = None  # DONE, MAX_TURNS or MAX_TOKENS

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def add(self, ids: list[int], action: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += ids
        self.actions += [float(action)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


def run(engine: Rollout, prompts: PromptBatch, rows: Sequence[dict[str, Any]],
        seeds: Sequence[int], runner: EnvRunner, observations: Observations,
        decode: Callable[[list[int]], str], sampling: Sampling, budget: Budget,
        pad_token_id: int, where: Callable[[int], str]) -> tuple[RolloutBatch, dict[str, float]]:
    """The episodes of ``prompts`` (one per row, its environment built from ``rows[i]`` and
    reset with ``seeds[i]``) as a rollout, and sums over them for the driver: ``episodes``,
    ``turns``, ``truncated_max_turns``, ``truncated_max_total_tokens``, ``steps``,
    ``step_time_s``, ``observation_tokens``, ``dropped_observations``, ``action_tokens``,
    ``tool_calls``, ``tool_errors``. ``where(i)`` names sample i in error lines."""
    runner.calls = type(runner.calls)()
    envs, first = runner.start(rows, seeds, where)
    episodes = [Episode(ids[mask.bool()].tolist())
                for ids, mask in zip(prompts.input_ids, prompts.attention_mask)]
    observed = dropped = 0
    for i, (episode, obs) in enumerate(zip(episodes, first)):
        if obs is None:
            continue
        ids = _encoded(observations, obs, budget.max_total_tokens - episode.length - 1,
                       f"{runner.name}.reset", where(i))
        if ids is None:
            raise EnvError(f"{runner.name}.reset's observation ({len(str(obs))} characters) "
                           "leaves no room for an action within env.max_total_tokens="
                           f"{budget.max_total_tokens} {where(i)}")
        episode.prompt += ids
        observed += len(ids)
    with engine.turns():
        for turn in range(budget.max_turns):
            active = [i for i, e in enumerate(episodes) if e.ended is None]
            if not active:
                break
            contexts = [episodes[i].prompt + episodes[i].tokens for i in active]
            room = [budget.max_total_tokens - len(c) for c in contexts]
            batch = engine.generate(
                PromptBatch.left_padded(contexts, pad_token_id),
                dataclasses.replace(sampling,
                                    max_new_tokens=min(sampling.max_new_tokens, max(room))))
            stepping, actions = [], []
            for row, i in enumerate(active):
                episode = episodes[i]
                keep = batch.action_mask[row].bool()
                action = batch.responses[row][keep].tolist()
                logp = (batch.logprobs[row][keep].tolist() if batch.logprobs is not None
                        else None)
                cut = len(action) > room[row]
                episode.add(action[:room[row]], True, None if logp is None else logp[:room[row]])
                episode.turns += 1
                if cut:  # the action met the episode's budget: nothing to step on
                    episode.ended = MAX_TOKENS
                    continue
                stepping.append(i)
                actions.append(decode(action))
            results = runner.step([envs[i] for i in stepping], actions,
                                  lambda k: where(stepping[k]) + f" (turn {turn})")
            for i, result in zip(stepping, results):
                episode = episodes[i]
                episode.score += result.reward
                if not math.isfinite(episode.score) or abs(episode.score) > FLOAT32_MAX:
                    raise EnvError(f"{runner.name}.step's rewards sum to {episode.score:g} "
                                   f"{where(i)} (turn {turn}); allowed: step rewards whose sum "
                                   "an episode's score (float32) holds")
                if result.done:
                    episode.ended = DONE
                    continue
                if episode.turns == budget.max_turns:
                    episode.ended = MAX_TURNS
                    continue
                ids = [] if result.observation is None else _encoded(
                    observations, result.observation,
                    budget.max_total_tokens - episode.length - 1, f"{runner.name}.step",
                    f"{where(i)} (turn {turn})")
                if ids is None or episode.length + len(ids) >= budget.max_total_tokens:
                    episode.ended = MAX_TOKENS  # no room for another action after it
                    dropped += ids is None
                    continue
                episode.add(ids, False)
                observed += len(ids)
    runner.end(envs, where)
    stats = {
        "episodes": float(len(episodes)),
        "turns": float(sum(e.turns for e in episodes)),
        "truncated_max_turns": float(sum(e.ended == MAX_TURNS for e in episodes)),
        "truncated_max_total_tokens": float(sum(e.ended == MAX_TOKENS for e in episodes)),
        "steps": float(runner.calls.steps),
        "step_time_s": runner.calls.step_time_s,
        "observation_tokens": float(observed),
        "dropped_observations": float(dropped),
        "action_tokens": float(sum(sum(e.actions) for e in episodes)),
        "tool_calls": float(sum(getattr(env, "tool_calls", 0) for env in envs)),
        "tool_errors": float(sum(getattr(env, "tool_errors", 0) for env in envs)),
    }
    return assemble(episodes, pad_token_id, sampling.greedy), stats


def _encoded(observations: Observations, observation: Any, limit: int, what: str, where: str
             ) -> list[int] | None:
    """``observations.encode``, its error naming the environment's call and the sample."""
    try:
        return observations.encode(observation, limit)
    except EnvError as err:
        raise EnvError(f"{what}'s observation {where}: {err}") from None


def assemble(episodes: Sequence[Episode], pad_token_id: int, greedy: bool) -> RolloutBatch:
    """The rollout of finished episodes: prompts left-padded to the longest, responses (actions
    and observations) right-padded to the longest."""
    prompt = PromptBatch.left_padded([e.prompt for e in episodes], pad_token_id)
    width = max(len(e.tokens) for e in episodes)
    responses = torch.full((len(episodes), width), pad_token_id, dtype=torch.long)
    actions = torch.zeros(len(episodes), width)
    logprobs = torch.zeros(len(episodes), width)
    real = torch.zeros(len(episodes), width, dtype=torch.long)
    for row, e in enumerate(episodes):
        n = len(e.tokens)
        responses[row, :n] = torch.tensor(e.tokens, dtype=torch.long)
        actions[row, :n] = torch.tensor(e.actions)
        logprobs[row, :n] = torch.tensor(e.logprobs)
        real[row, :n] = 1
    return RolloutBatch(torch.cat([prompt.input_ids, responses], dim=1),
                        torch.cat([prompt.attention_mask, real], dim=1), actions,
                        None if greedy else logprobs,
                        torch.tensor([e.score for e in episodes], dtype=torch.float32))
