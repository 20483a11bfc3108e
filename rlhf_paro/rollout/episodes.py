"""Multi-turn episodes on one actor rank: the one place that assembles an episode's tokens
(docs/design.md, "Multi-turn episodes").

One loop (``_loop``), one set of rules (``_Play``), two schedules. Every episode's next action
is a request to the engine (``Requests``), and the loop steps the engine while requests are in
flight and starts each ended action's environment step at once (``envs.EnvRunner``: in threads,
each call within ``env.timeout_s``). ``stream``, each episode its own loop, on an engine that
takes requests (``Rollout.takes_requests``: vLLM, ``hf`` on its dynamic cache): an episode's next
action is submitted the moment its own environment step returns, so no episode waits for
another's action or step. ``run``, turn by turn, on any engine: the answers of a turn's steps are
held until all have returned, and the next turn's actions, submitted together, are one batched
``Rollout.generate`` on the episodes' contexts (``_Batched``; finished episodes drop out). Once
all have ended, the loop closes the environments that have a ``close()``.
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
import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import torch

from rlhf_paro.metrics import Sums
from rlhf_paro.envs import EnvError, EnvRunner, Observations, StepResult
from rlhf_paro.rollout.base import Requests, Rollout, Sampling
from rlhf_paro.rollout.batch import PromptBatch, RolloutBatch
from rlhf_paro.usercode import finite32

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
        pad_token_id: int, where: Callable[[int], str]) -> tuple[RolloutBatch, Sums]:
    """The episodes of ``prompts`` (one per row, its environment built from ``rows[i]`` and
    reset with ``seeds[i]``) as a rollout, and sums over them for the driver: ``episodes``,
    ``turns``, ``truncated_max_turns``, ``truncated_max_total_tokens``, ``steps``,
    ``step_time_s``, ``observation_tokens``, ``dropped_observations``, ``action_tokens``,
    ``tool_calls``, ``tool_errors``, ``engine_idle_s`` and ``rollout_s`` (the seconds the engine
    had nothing to decode, of the rollout's) as totals, ``first_sample_s`` (least) and
    ``last_sample_s`` (most: when the first and the last episode ended), ``step_latencies_s``
    (each environment step's seconds, as each). ``where(i)`` names sample i in error lines.

    Turn by turn, on any engine: the episode loop (``_loop``) holding each turn's actions until
    every environment step of the turn before has returned, then decoding them in one batched
    ``engine.generate`` (``_Batched``), from the process's random stream."""
    return _loop(_Batched(engine, pad_token_id), prompts, rows, seeds, runner, observations,
                 decode, sampling, budget, pad_token_id, where, None, by_turns=True)


def stream(engine: Requests, prompts: PromptBatch, rows: Sequence[dict[str, Any]],
           seeds: Sequence[int], runner: EnvRunner, observations: Observations,
           decode: Callable[[list[int]], str], sampling: Sampling, budget: Budget,
           pad_token_id: int, where: Callable[[int], str], sample_seeds: Sequence[int]
           ) -> tuple[RolloutBatch, Sums]:
    """``run``'s episodes and sums, each episode its own loop: its next action is a request of
    its own, submitted the moment its environment answers, while the engine goes on decoding
    the others' and the environments step in their threads. A sampled action draws from its
    own stream, seeded from ``sample_seeds[i]`` and its turn (``action_seed``), so which tokens
    it samples does not depend on what else the engine decodes; greedy actions are ``run``'s."""
    return _loop(engine, prompts, rows, seeds, runner, observations, decode, sampling, budget,
                 pad_token_id, where, sample_seeds, by_turns=False)


def _loop(engine: Requests, prompts: PromptBatch, rows: Sequence[dict[str, Any]],
          seeds: Sequence[int], runner: EnvRunner, observations: Observations,
          decode: Callable[[list[int]], str], sampling: Sampling, budget: Budget,
          pad_token_id: int, where: Callable[[int], str], sample_seeds: Sequence[int] | None,
          by_turns: bool) -> tuple[RolloutBatch, Sums]:
    """The one episode loop: every episode's first action submitted, then the engine stepped
    while requests are in flight, each ended action's environment step started at once, and
    each answer observed and the episode's next action submitted. ``by_turns``: the answers
    are held until no request and no step is in flight, then observed in episode order (a
    turn boundary: the next turn's actions are submitted together); else each is observed as
    it returns. ``sample_seeds``: each sampled action's seed (``action_seed``); None: the
    engine's own stream."""
    play = _Play(engine.eos_token_id, runner, observations, sampling, budget, where)
    envs, episodes = play.start(prompts, rows, seeds)
    requests: dict[Any, int] = {}  # request -> its episode
    steps: dict[Future, int] = {}  # environment step in flight -> its episode
    answered: dict[int, StepResult] = {}  # episode -> its step's answer, not yet observed

    def submit(i: int) -> None:
        episode = episodes[i]
        context = episode.prompt + episode.tokens
        room = budget.max_total_tokens - len(context)
        seed = (None if sampling.greedy or sample_seeds is None
                else action_seed(sample_seeds[i], episode.turns))
        requests[engine.submit(context, dataclasses.replace(
            sampling, max_new_tokens=min(sampling.max_new_tokens, room)), seed)] = i

    try:
        with engine.turns():
            for i in range(len(episodes)):
                submit(i)
            while requests or steps:
                if requests:
                    begin = time.monotonic()
                    ended = engine.step()
                    play.busy_s += time.monotonic() - begin
                    for request, tokens, logprobs in ended:
                        i = requests.pop(request)
                        action = play.act(i, tokens, logprobs)
                        if action is not None:
                            steps[runner.submit_step(envs[i], decode(action), where(i) +
                                                     f" (turn {episodes[i].turns - 1})")] = i
                # With requests in flight the engine goes on at once; without, wait for a step.
                for future in runner.poll(set(steps), 0 if requests else _WAIT_S):
                    answered[steps.pop(future)] = future.result()
                if by_turns and (requests or steps):
                    continue
                for i in sorted(answered):
                    if play.observe(i, answered[i]):
                        submit(i)
                answered.clear()
    except BaseException:
        engine.abort(list(requests))
        runner.cancel(set(steps))
        raise
    return play.finish(envs, pad_token_id)


class _Batched:
    """An engine's ``generate`` taken as requests (``Requests``): a ``step`` decodes every
    request submitted since the last in one batched call, each left-padded, to the largest of
    their budgets (an action past its own room is cut by ``_Play.act``), and ends them all.
    Sampled from the process's random stream: a request's seed is not read."""

    def __init__(self, engine: Rollout, pad_token_id: int) -> None:
        self.engine, self.pad_token_id = engine, pad_token_id
        self.eos_token_id = engine.eos_token_id
        self.waiting: list[tuple[int, list[int], Sampling]] = []
        self.keys = itertools.count()

    def turns(self) -> ContextManager[None]:
        return self.engine.turns()

    def submit(self, context: list[int], sampling: Sampling, seed: int | None) -> int:
        key = next(self.keys)
        self.waiting.append((key, context, sampling))
        return key

    def step(self) -> list[tuple[int, list[int], list[float] | None]]:
        waiting, self.waiting = self.waiting, []
        batch = self.engine.generate(
            PromptBatch.left_padded([context for _, context, _ in waiting], self.pad_token_id),
            dataclasses.replace(waiting[0][2], max_new_tokens=max(
                sampling.max_new_tokens for _, _, sampling in waiting)))
        ended = []
        for row, (key, _, _) in enumerate(waiting):
            keep = batch.action_mask[row].bool()
            ended.append((key, batch.responses[row][keep].tolist(),
                          None if batch.logprobs is None else batch.logprobs[row][keep].tolist()))
        return ended

    def abort(self, keys: list[int]) -> None:
        gone = set(keys)
        self.waiting = [w for w in self.waiting if w[0] not in gone]


# How long the episode loop waits for an environment step when the engine has nothing to
# decode, before it looks for steps past their deadline.
_WAIT_S = 0.05


def action_seed(sample_seed: int, turn: int) -> int:
    """The seed of the stream that samples turn ``turn``'s action of the episode whose seed is
    ``sample_seed`` (``envs.sample_seed``): a pure function of the two, whatever the batch."""
    return (sample_seed * 1_000_003 + turn + 1) & 0x7FFFFFFF


class _Play:
    """The episodes of one rollout as they grow: what the loop does with an action and with an
    environment's answer, under either schedule, and the sums at the end."""

    def __init__(self, eos_token_id: int, runner: EnvRunner, observations: Observations,
                 sampling: Sampling, budget: Budget, where: Callable[[int], str]) -> None:
        self.eos_token_id = eos_token_id
        self.runner, self.observations = runner, observations
        self.sampling, self.budget, self.where = sampling, budget, where
        self.episodes: list[Episode] = []
        self.observed = self.dropped = 0
        self.busy_s = 0.0  # seconds the engine was decoding
        self.begin = time.monotonic()
        self.ends: list[float] = []  # seconds from the start to each episode's end

    def start(self, prompts: PromptBatch, rows: Sequence[dict[str, Any]], seeds: Sequence[int]
              ) -> tuple[list[Any], list[Episode]]:
        """(environments, episodes): each built and reset, its reset's observation after its
        prompt."""
        runner, budget = self.runner, self.budget
        runner.calls = type(runner.calls)()
        envs, first = runner.start(rows, seeds, self.where)
        self.episodes = [Episode(ids[mask.bool()].tolist())
                         for ids, mask in zip(prompts.input_ids, prompts.attention_mask)]
        for i, (episode, obs) in enumerate(zip(self.episodes, first)):
            if obs is None:
                continue
            ids = _encoded(self.observations, obs, budget.max_total_tokens - episode.length - 1,
                           f"{runner.name}.reset", self.where(i))
            if ids is None:
                raise EnvError(f"{runner.name}.reset's observation ({len(str(obs))} characters) "
                               "leaves no room for an action within env.max_total_tokens="
                               f"{budget.max_total_tokens} {self.where(i)}")
            episode.prompt += ids
            self.observed += len(ids)
        return envs, self.episodes

    def act(self, i: int, action: list[int], logprobs: list[float] | None) -> list[int] | None:
        """Episode ``i``'s action (its tokens through the first <eos>, as the engine gave them):
        added, and returned for its environment to step on; None when it met the episode's
        budget and ended it. An action cut short by the room left, not by ``max_new_tokens`` or
        its <eos>, is cut whatever else the engine decoded with it."""
        episode = self.episodes[i]
        room = self.budget.max_total_tokens - episode.length
        cut = len(action) > room or (len(action) == room < self.sampling.max_new_tokens
                                     and action[-1] != self.eos_token_id)
        episode.add(action[:room], True, None if logprobs is None else logprobs[:room])
        episode.turns += 1
        if cut:
            self._end(episode, MAX_TOKENS)
            return None
        return action

    def observe(self, i: int, result: StepResult) -> bool:
        """Episode ``i``'s environment's answer to its last action; whether it goes on."""
        episode, budget = self.episodes[i], self.budget
        name, where = self.runner.name, f"{self.where(i)} (turn {episode.turns - 1})"
        episode.score += result.reward
        if not finite32(episode.score):  # each reward is, their sum may not be
            raise EnvError(f"{name}.step's rewards sum to {episode.score:g} {where}; allowed: "
                           "step rewards whose sum an episode's score (float32) holds")
        if result.done:
            return self._end(episode, DONE)
        if episode.turns == budget.max_turns:
            return self._end(episode, MAX_TURNS)
        ids = [] if result.observation is None else _encoded(
            self.observations, result.observation, budget.max_total_tokens - episode.length - 1,
            f"{name}.step", where)
        if ids is None or episode.length + len(ids) >= budget.max_total_tokens:
            self.dropped += ids is None
            return self._end(episode, MAX_TOKENS)  # no room for another action after it
        episode.add(ids, False)
        self.observed += len(ids)
        return True

    def _end(self, episode: Episode, why: str) -> bool:
        episode.ended = why
        self.ends.append(time.monotonic() - self.begin)
        return False

    def finish(self, envs: list[Any], pad_token_id: int
               ) -> tuple[RolloutBatch, Sums]:
        """The environments closed; the rollout and its sums (``run``)."""
        self.runner.end(envs, self.where)
        episodes, calls = self.episodes, self.runner.calls
        rollout_s = time.monotonic() - self.begin
        stats = {
            "episodes": float(len(episodes)),
            "turns": float(sum(e.turns for e in episodes)),
            "truncated_max_turns": float(sum(e.ended == MAX_TURNS for e in episodes)),
            "truncated_max_total_tokens": float(sum(e.ended == MAX_TOKENS for e in episodes)),
            "steps": float(calls.steps),
            "step_time_s": calls.step_time_s,
            "observation_tokens": float(self.observed),
            "dropped_observations": float(self.dropped),
            "action_tokens": float(sum(sum(e.actions) for e in episodes)),
            "tool_calls": float(sum(getattr(env, "tool_calls", 0) for env in envs)),
            "tool_errors": float(sum(getattr(env, "tool_errors", 0) for env in envs)),
            "rollout_s": rollout_s,
            "engine_idle_s": max(rollout_s - self.busy_s, 0.0),
        }
        sums = Sums(total=stats, least={"first_sample_s": min(self.ends, default=0.0)},
                    most={"last_sample_s": max(self.ends, default=0.0)},
                    each={"step_latencies_s": list(calls.latencies_s)})
        return assemble(episodes, pad_token_id, self.sampling.greedy), sums


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
