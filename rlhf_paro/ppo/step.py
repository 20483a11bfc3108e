"""One training step as data: the calls it makes over named values, built once from the config.

A step is a list of calls ``(role, method, reads, gives)``, each in one of the stages of
``ppo/pipeline.py`` (launch, collect, experience, train), which the trainer runs for the step
whose data each stage handles. A call reads named values of its step and gives new ones; the
trainer issues a call once what it reads exists and waits only where the driver needs a value
(a stage that ends by waiting: ``WAITS``). Nothing here knows Ray: the same plan runs on Ray's
worker groups and on the in-process ones of ``actors/local.py``.

Where a value lives follows from the plan, not from a flag:

- a value a model gives and only the same model reads is **kept** in its workers, keyed by
  ``(step, name)`` (``Worker.keep``), and never leaves them;
- a value read by another role **travels**: one reference per rank, which the trainer hands on;
- a value the driver reads (``fold``, sums and reports) is waited for and folded into the row.

The speed-ups are rewrites of the synchronous plan, made when it is built (``REWRITES``), so a
reader sees what runs by printing it (``python -m rlhf_paro.train --plan-step ...``):

- ``old_logprobs_from_update``: one pass over one mini-batch without dropout or a KL in the
  reward: the update's own forwards give the old log-probs, so the producer of the engine's
  distance (``mismatch``) moves into ``actor.train`` and ``actor.old_logprobs`` goes;
- ``forward_ahead``: a reward that runs no model (a function, a server, an environment's score)
  is wall time the devices do not use: the update's first forward is inserted after the
  reference's and critic's forwards, before the scores are needed;
- ``scores_ahead``: with rollouts launched ahead on devices of their own, such a reward scores
  each rollout in the launch stage, as soon as it is generated, while another step trains.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from rlhf_paro.ppo import algorithms, pipeline
from rlhf_paro.ppo.pipeline import COLLECT, EXPERIENCE, LAUNCH, TRAIN

DRIVER, SOURCE = "driver", "source"  # roles that are not models: the trainer, the rollout source
# Stages that end by waiting for the values the driver reads (their time is the stage's own in
# the row); a launch never waits, so a rollout launched ahead generates while a step trains, and
# a collect's waiting is the source's own.
WAITS = {LAUNCH: False, COLLECT: False, EXPERIENCE: True, TRAIN: True}

# What each value of a step is, for a reader of the plan.
VALUES = {
    "prompts": "the step's prompt slices and their rows, one slice per generator",
    "generated": "each generator's rollout (token ids, masks, the engine's log-probs)",
    "prompt_rows": "the prompts' texts and columns, as the generators took them",
    "rollout": "each training rank's rollout: as generated, or dealt by real tokens",
    "rows": "the prompts' texts and columns, dealt as the rollout",
    "gen_sums": "the generators' sums: samples, response tokens, an environment's figures",
    "staleness": "updates between the policy that generated the rollout and the one it trains",
    "old_logp": "log-probs of the rollout under the policy that sampled it",
    "mismatch": "how far the engine's log-probs are from the trainer's (rollout/logprob_diff_*)",
    "ref_logp": "log-probs of the rollout under the reference policy",
    "values": "the critic's values of the rollout's response tokens",
    "scores": "one score per sample",
    "reward_sums": "the scores' sums: task score, a reward function's extras",
    "reward_report": "a reward without a model: its report, taken with its scores",
    "first_forward": "the update's first mini-batch draw and its first micro-batch's forward",
    "kl_coef": "the KL controller's coefficient for this step",
    "experience": "token rewards, advantages and returns of the rollout",
    "targets": "the critic's regression targets (the returns)",
    "exp_sums": "the experience's sums: rewards, KL, advantages, returns",
    "update_sums": "what the update measured besides its report (the KL, when it gave the old "
                   "log-probs; what rollout.mask left out)",
    "trained": "the update of the critic is done",
    "row": "the step's metrics row",
}


@dataclass(frozen=True)
class Call:
    """One call of a step: ``role``'s ``method`` reads the named values ``reads`` of the step
    and gives ``gives``; ``after``: values it waits for without reading them."""

    role: str
    method: str
    reads: tuple[str, ...] = ()
    gives: tuple[str, ...] = ()
    stage: str = EXPERIENCE
    after: tuple[str, ...] = ()

    def __str__(self) -> str:
        return (f"{self.role}.{self.method}({', '.join(self.reads)})"
                f" -> {', '.join(self.gives) or '-'}")


class PlanError(ValueError):
    """A plan whose values do not flow: one line naming the value and the calls."""


@dataclass(frozen=True)
class Plan:
    """A step's calls in the order they are issued within each stage; ``rewrites``: the
    speed-ups applied to the synchronous plan; ``max_staleness``: K of the K-step-off order."""

    calls: tuple[Call, ...]
    rewrites: tuple[str, ...] = ()
    max_staleness: int = 0

    def stage(self, name: str) -> tuple[Call, ...]:
        return tuple(c for c in self.calls if c.stage == name)

    def producer(self, value: str) -> Call:
        return next(c for c in self.calls if value in c.gives)

    def kept(self, call: Call) -> tuple[str, ...]:
        """The values ``call`` reads that its own role gave: they stay in its workers."""
        return tuple(v for v in call.reads if self.producer(v).role == call.role)

    def sent(self, call: Call) -> tuple[str, ...]:
        """The values ``call`` reads that travel to it (another role gave them)."""
        return tuple(v for v in call.reads if self.producer(v).role != call.role)

    def returned(self, call: Call) -> tuple[str, ...]:
        """The values ``call`` gives that leave its role (another role reads them)."""
        return tuple(v for v in call.gives
                     if any(v in c.reads or v in c.after for c in self.calls
                            if c.role != call.role))

    def keeps(self, call: Call) -> tuple[str, ...]:
        """The values ``call`` gives that its own role reads later: kept in its workers."""
        return tuple(v for v in call.gives
                     if any(v in c.reads for c in self.calls if c.role == call.role))

    def check(self) -> Plan:
        """The plan itself when every value flows: given once, read after it is given (by
        stage, then by order), and read by some call unless it is the row; raises
        ``PlanError`` naming the value otherwise."""
        order = {name: i for i, name in enumerate(pipeline.STAGES)}
        given: dict[str, tuple[int, int]] = {}
        for i, call in enumerate(self.calls):
            if call.stage not in order:
                raise PlanError(f"{call}: stage {call.stage!r}; allowed: "
                                f"{', '.join(pipeline.STAGES)}")
            for value in (*call.reads, *call.after):
                at = given.get(value)
                if at is None or at > (order[call.stage], i):
                    raise PlanError(f"{call} reads {value!r}, which no call before it gives")
            for value in call.gives:
                if value in given:
                    raise PlanError(f"{value!r} is given twice ({self.producer(value)}, {call})")
                if value not in VALUES:
                    raise PlanError(f"{call} gives {value!r}; allowed: {', '.join(VALUES)}")
                given[value] = (order[call.stage], i)
        for value in given:
            readers = [c for c in self.calls if value in c.reads or value in c.after]
            if not readers and value != "row":
                raise PlanError(f"{value!r} ({self.producer(value)}) is never read")
            kept_by = [c for c in readers if value in c.reads and self.producer(value).role ==
                       c.role and c.role not in (DRIVER, SOURCE)]
            if len(kept_by) > 1:
                raise PlanError(f"{value!r} is kept in {kept_by[0].role}'s workers and read "
                                f"twice ({', '.join(map(str, kept_by))}); allowed: once")
        return self

    def format(self, title: str = "") -> str:
        """The plan as a reader sees it: the stages' order, each stage's calls, which values
        stay in a model's workers (``[kept]``), the rewrites, what each value is."""
        lines = [title] if title else []
        k = self.max_staleness
        lines.append("order of step t: " + ", ".join(
            f"{s.name}(t{'+' + str(s.ahead) if s.ahead else ''})" for s in pipeline.order(k)))
        if k:
            lines.append(f"  before the first step: launch(t)"
                         f"{f' .. launch(t+{k - 1})' if k > 1 else ''}")
        lines.append("rewrites of the synchronous plan: " + (", ".join(self.rewrites) or "none"))
        lines.append("[kept]: stays in the model's workers for its later call; every other value "
                     "goes to its readers")
        for name in pipeline.STAGES:
            calls = self.stage(name)
            waits = " (then waits for what the driver reads)" if WAITS[name] else ""
            if calls:
                lines.append(f"{name}{waits}:")
            for call in calls:
                kept = self.keeps(call) if call.role not in (DRIVER, SOURCE) else ()
                gives = ", ".join(f"{v} [kept]" if v in kept and v not in self.returned(call)
                                  else v for v in call.gives)
                after = f"  (after {', '.join(call.after)})" if call.after else ""
                lines.append(f"  {call.role}.{call.method}({', '.join(call.reads)}) -> "
                             f"{gives or '-'}{after}")
        used = [v for v in VALUES if any(v in c.gives for c in self.calls)]
        lines.append("values:")
        lines.extend(f"  {v:<14}{VALUES[v]}" for v in used)
        return "\n".join(lines)


# -- the synchronous plan and its rewrites -------------------------------------------------------
def synchronous(roles: tuple[str, ...], replicas: bool, reward_report: bool) -> Plan:
    """The plan before any speed-up: the rollout launched and collected in the step that trains
    on it, then the forwards of every model that reads it, the experience, the update. ``roles``:
    the run's models (``algorithms.roles``); ``replicas``: rollouts on devices of their own,
    dealt to the training ranks as soon as they are generated; ``reward_report``: a reward that
    runs no model reports with its scores (a ``report`` call would queue behind a score of a
    rollout still generating)."""
    launch_gives = ("rollout", "rows") if replicas else ("generated", "prompt_rows")
    collect_reads = ("rollout",) if replicas else ("generated", "prompt_rows")
    collect_gives = ("gen_sums", "staleness") if replicas else (
        "rollout", "rows", "gen_sums", "staleness")
    score_gives = ("scores", "reward_sums") + (("reward_report",) if reward_report else ())
    exp_reads = ("rollout", "old_logp") + (("ref_logp",) if "ref" in roles else ()) + (
        ("values",) if "critic" in roles else ()) + ("scores", "kl_coef")
    calls = [
        Call(DRIVER, "draw", gives=("prompts",), stage=LAUNCH),
        Call(SOURCE, "launch", ("prompts",), launch_gives, LAUNCH),
        Call(SOURCE, "collect", collect_reads, collect_gives, COLLECT),
        Call("actor", "old_logprobs", ("rollout",), ("old_logp", "mismatch")),
        *([Call("ref", "logprobs", ("rollout",), ("ref_logp",))] if "ref" in roles else []),
        *([Call("critic", "values", ("rollout",), ("values",))] if "critic" in roles else []),
        Call("reward", "score", ("rollout", "rows"), score_gives),
        Call(DRIVER, "kl_coef", gives=("kl_coef",)),
        Call("actor", "make_experience", exp_reads,
             ("experience", *(("targets",) if "critic" in roles else ()), "exp_sums")),
        Call("actor", "train", ("rollout", "experience", "kl_coef"), ("update_sums",), TRAIN),
        *([Call("critic", "train", ("rollout", "values", "targets"), ("trained",), TRAIN)]
          if "critic" in roles else []),
    ]
    sums = ("gen_sums", "staleness", "mismatch", "reward_sums", "exp_sums", "update_sums",
            *(("trained",) if "critic" in roles else ()),
            *(("reward_report",) if reward_report else ()))
    calls.append(Call(DRIVER, "fold", sums, ("row",), TRAIN))
    return Plan(tuple(calls))


def _without(calls: tuple[Call, ...], role: str, method: str) -> list[Call]:
    return [c for c in calls if (c.role, c.method) != (role, method)]


def old_logprobs_from_update(plan: Plan) -> Plan:
    """The update's forwards give the old log-probs: ``old_logprobs`` goes, the experience has
    none to read, and the update gives the engine's distance and, in its sums, the KL."""
    calls = _without(plan.calls, "actor", "old_logprobs")
    calls = [replace(c, reads=tuple(v for v in c.reads if v != "old_logp"))
             if (c.role, c.method) == ("actor", "make_experience") else
             replace(c, gives=("update_sums", "mismatch"))
             if (c.role, c.method) == ("actor", "train") else c for c in calls]
    return _rewritten(plan, calls, "old_logprobs_from_update")


def forward_ahead(plan: Plan) -> Plan:
    """The update's first forward, issued after the reference's and critic's forwards (it waits
    for their values, so that it runs alone on the device) and before the scores are needed."""
    after = tuple(v for v in ("ref_logp", "values") if any(v in c.gives for c in plan.calls))
    ahead = Call("actor", "forward_ahead", ("rollout",), ("first_forward",), EXPERIENCE, after)
    calls: list[Call] = []
    for call in plan.calls:
        if (call.role, call.method) == ("reward", "score") and call.stage == EXPERIENCE:
            calls.append(call)
            calls.append(ahead)
        elif (call.role, call.method) == ("actor", "train"):
            calls.append(replace(call, reads=(*call.reads, "first_forward")))
        else:
            calls.append(call)
    if ahead not in calls:  # the scores moved to the launch: ahead of the experience's calls
        calls.insert(calls.index(next(c for c in calls if c.method == "make_experience")),
                     ahead)
    return _rewritten(plan, calls, "forward_ahead")


def scores_ahead(plan: Plan) -> Plan:
    """A rollout launched ahead on devices of its own is scored in the launch stage, as soon as
    it is generated (the reward reads nothing trained)."""
    score = next(c for c in plan.calls if (c.role, c.method) == ("reward", "score"))
    calls = _without(plan.calls, "reward", "score")
    launch = max(i for i, c in enumerate(calls) if c.stage == LAUNCH)
    calls.insert(launch + 1, replace(score, stage=LAUNCH))
    return _rewritten(plan, calls, "scores_ahead")


def _rewritten(plan: Plan, calls: list[Call], name: str) -> Plan:
    return replace(plan, calls=tuple(calls), rewrites=(*plan.rewrites, name))


# Each rewrite with what decides it from the config, in the order they apply.
REWRITES: tuple[tuple[str, Callable[[Any], bool], Callable[[Plan], Plan]], ...] = (
    ("old_logprobs_from_update", algorithms.old_logprobs_from_update, old_logprobs_from_update),
    ("scores_ahead", lambda cfg: cfg.rollout.num_devices > 0 and cfg.rollout.max_staleness > 0
     and not cfg.reward.runs_model, scores_ahead),
    ("forward_ahead", lambda cfg: not cfg.reward.runs_model, forward_ahead),
)


def build(cfg: Any, without: tuple[str, ...] = ()) -> Plan:
    """The plan of a step of the run ``cfg`` configures: the synchronous plan of its models and
    source, with every rewrite the config allows but those named in ``without`` (a test's
    comparison of a step with and without one), checked."""
    plan = synchronous(algorithms.roles(cfg), cfg.rollout.num_devices > 0,
                       not cfg.reward.runs_model)
    for name, applies, rewrite in REWRITES:
        if applies(cfg) and name not in without:
            plan = rewrite(plan)
    return replace(plan, max_staleness=cfg.rollout.max_staleness).check()


def describe(cfg: Any) -> str:
    """The plan of ``cfg``'s step, titled with what decides it."""
    alg, reward = cfg.algorithm.adv_estimator, cfg.reward
    kind = ("a reward model" if reward.runs_model else
            "an environment's score" if reward.env_score else
            "a reward server" if reward.url else "a reward function")
    devices = cfg.rollout.num_devices
    where = (f"{devices} rollout device{'s' * (devices > 1)} of their own" if devices else
             "the actor's ranks")
    return build(cfg).format(f"step plan: {alg} ({', '.join(algorithms.roles(cfg))}), scores "
                             f"from {kind}, rollouts on {where}, "
                             f"rollout.max_staleness={cfg.rollout.max_staleness}")
