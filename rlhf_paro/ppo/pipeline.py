"""The order of a training step's stages, as data: the trainer runs it, the planner reads it
(docs/design.md, "Asynchronous rollouts").

A step t runs four stages, each on the data of one step, ``t + ahead``:

    launch      that step's prompts drawn, the actor's weights sent to a rollout that holds a
                copy of its own (when they changed), its generation started; a reward that
                reads nothing trained (a function, a server, the environment's) starts
                scoring it as soon as it is generated
    collect     the driver waits for that step's rollout and deals it to the training ranks
    experience  old log-probs, reference log-probs, values and scores; advantages
    train       the update of the actor (and critic): the policy's version goes up by one

The synchronous order launches step t's rollout at step t, with the policy after t updates.
The K-step-off order (``rollout.max_staleness=K``, replicas on devices of their own) launches
step t + K's rollout at step t, right after collecting step t's, so it is generated with the
policy after exactly t updates while step t trains: the rollout of step t comes from the policy
after update t - K, whatever the timing, and a run is reproducible and resumable row for row.
The first K rollouts (steps 0 to K - 1) are launched before step 0, with the initial policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

LAUNCH, COLLECT, EXPERIENCE, TRAIN = "launch", "collect", "experience", "train"
STAGES = (LAUNCH, COLLECT, EXPERIENCE, TRAIN)


@dataclass(frozen=True)
class Stage:
    name: str  # one of STAGES
    ahead: int = 0  # the step whose data it handles: the step that runs it + ahead


def order(max_staleness: int) -> tuple[Stage, ...]:
    """The stages one step runs, in order: synchronous for 0, K-step-off for K > 0."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness}; allowed: 0 or more")
    if max_staleness == 0:
        return (Stage(LAUNCH), Stage(COLLECT), Stage(EXPERIENCE), Stage(TRAIN))
    return (Stage(COLLECT), Stage(LAUNCH, max_staleness), Stage(EXPERIENCE), Stage(TRAIN))


def prologue(max_staleness: int, start: int) -> range:
    """The steps launched before step ``start`` runs (with the policy of that moment): those a
    step before it would have launched ahead."""
    return range(start, start + max_staleness)


def run_step(step: int, start: int, max_staleness: int,
             stages: Mapping[str, Callable[..., None]], *args: Any) -> None:
    """Step ``step`` of a run that starts at step ``start``: the prologue's launches on its first
    step, then the stages of ``order(max_staleness)``, each called with the step whose data it
    handles (and ``args``). ``stages`` maps each name of ``STAGES`` to what runs it (the
    trainer's stages; a test's records)."""
    if step == start:
        for ahead in prologue(max_staleness, step):
            stages[LAUNCH](ahead, *args)
    for stage in order(max_staleness):
        stages[stage.name](step + stage.ahead, *args)


def overlaps(stages: tuple[Stage, ...]) -> bool:
    """Whether a launched rollout is generated while the step's experience and training run
    (it is launched ahead of the step that collects it)."""
    return any(s.name == LAUNCH and s.ahead > 0 for s in stages)


def staleness(trained_version: int, generated_version: int) -> int:
    """Updates between the policy that generated a rollout and the one it trains."""
    return trained_version - generated_version


def step_seconds(stages: tuple[Stage, ...], sync_s: float, generate_s: float,
                 train_s: float) -> float:
    """A step's seconds from its parts: the weights' sync, the rollout's generation (and
    scoring where it runs with it), and experience plus training. The synchronous order runs
    them one after another; the K-step-off order generates one step while training another, so
    the longer of the two sets the pace, after the sync that starts each generation."""
    if overlaps(stages):
        return sync_s + max(generate_s, train_s)
    return sync_s + generate_s + train_s
