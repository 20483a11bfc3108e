"""A step's plan (``ppo/step.py``): built from the config, each speed-up a rewrite of the
synchronous plan, every value given once and read after it is given, and printed for a reader
(``--cfg step``) as docs/design.md shows it."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from rlhf_paro import cli
from rlhf_paro.compose import load_config
from rlhf_paro.ppo import step
from rlhf_paro.ppo.pipeline import COLLECT, EXPERIENCE, LAUNCH, TRAIN
from rlhf_paro.ppo.step import DRIVER, SOURCE, Call, Plan, PlanError

ROOT = Path(__file__).resolve().parents[2]
CONFS = sorted(p.stem for p in (ROOT / "conf").glob("*.yaml"))
# The question docs/design.md answers from the printed plan alone: a GRPO step with a reward
# function, one step off.
ONE_STEP_OFF = ["conf=grpo_tiny", "rollout.num_devices=1", "rollout.max_staleness=1"]


@pytest.fixture(scope="module", autouse=True)
def demo_resolver():
    cli.register_demo_resolver()


def _plan(*argv: str) -> Plan:
    return step.build(load_config(list(argv)))


def _calls(plan: Plan) -> list[str]:
    return [f"{c.stage}:{c.role}.{c.method}" for c in plan.calls]


@pytest.mark.parametrize("conf", CONFS)
def test_every_shipped_confs_plan_is_checked_and_prints(conf):
    plan = _plan(f"conf={conf}")
    printed = plan.format()
    # Every call is printed, in each stage in the order issued, and every value it gives named.
    for call in plan.calls:
        assert f"  {call.role}.{call.method}({', '.join(call.reads)}) -> " in printed
        assert all(f"  {v:<14}" in printed for v in call.gives)
    assert plan.calls[-1] == step.Call(DRIVER, "fold", plan.calls[-1].reads, ("row",), TRAIN)


def test_the_synchronous_ppo_plan_reads_each_models_forward_and_trains_actor_and_critic():
    plan = _plan("conf=ppo_tiny")
    assert plan.rewrites == ()
    assert _calls(plan) == [
        "launch:driver.draw", "launch:source.launch", "collect:source.collect",
        "experience:actor.old_logprobs", "experience:ref.logprobs", "experience:critic.values",
        "experience:reward.score", "experience:driver.kl_coef",
        "experience:actor.make_experience", "train:actor.train", "train:critic.train",
        "train:driver.fold"]
    # Where values live: the old log-probs and the experience stay in the actor, the values go
    # to the actor and stay in the critic, the returns travel to the critic.
    make = plan.producer("experience")
    assert plan.kept(make) == ("old_logp",) and plan.keeps(make) == ("experience",)
    assert plan.returned(make) == ("targets", "exp_sums")
    values = plan.producer("values")
    assert plan.keeps(values) == ("values",) and plan.returned(values) == ("values",)


def test_old_logprobs_from_the_update_moves_the_engines_distance_into_train():
    before = _plan("conf=grpo_tiny", "ppo.ppo_epochs=2")  # two passes: not allowed
    after = _plan("conf=grpo_tiny")
    assert "old_logprobs_from_update" not in before.rewrites
    assert after.rewrites == ("old_logprobs_from_update", "forward_ahead")
    assert before.producer("mismatch").method == "old_logprobs"
    assert after.producer("mismatch") == Call(
        "actor", "train", ("rollout", "experience", "kl_coef", "first_forward"),
        ("update_sums", "mismatch"), TRAIN)
    assert not any(c.method == "old_logprobs" for c in after.calls)
    assert "old_logp" not in after.producer("experience").reads
    # The rewrite alone, on the synchronous plan: what it changes and nothing else.
    base = step.synchronous(("actor", "reward", "ref"), False, True)
    rewritten = step.old_logprobs_from_update(base).check()
    assert set(_calls(base)) - set(_calls(rewritten)) == {"experience:actor.old_logprobs"}


def test_the_forward_ahead_waits_for_the_models_forwards_and_runs_before_the_experience():
    plan = _plan("conf=ppo_tiny", "reward.function=examples/math_reward.py:score")
    assert plan.rewrites == ("forward_ahead",)
    ahead = plan.producer("first_forward")
    assert ahead.after == ("ref_logp", "values") and ahead.stage == EXPERIENCE
    order = [c.method for c in plan.stage(EXPERIENCE)]
    assert order.index("score") < order.index("forward_ahead") < order.index("make_experience")
    assert "first_forward" in plan.producer("update_sums").reads
    # A reward model computes on the same devices: no forward ahead.
    assert "forward_ahead" not in _plan("conf=ppo_tiny").rewrites


def test_scores_ahead_score_a_rollout_launched_ahead_in_its_launch():
    plan = _plan(*ONE_STEP_OFF)
    assert plan.rewrites == ("old_logprobs_from_update", "scores_ahead", "forward_ahead")
    assert plan.max_staleness == 1
    score = plan.producer("scores")
    assert score.stage == LAUNCH and score.reads == ("rollout", "rows")
    assert plan.producer("rollout") == Call(SOURCE, "launch", ("prompts",), ("rollout", "rows"),
                                            LAUNCH)
    # Synchronous on its replica, the score waits for the experience's stage as before.
    assert _plan("conf=grpo_tiny", "rollout.num_devices=1").producer("scores").stage == \
        EXPERIENCE


@pytest.mark.parametrize("edit, problem", [
    (lambda calls: [c for c in calls if c.method != "kl_coef"],
     "reads 'kl_coef', which no call before it gives"),
    (lambda calls: calls[:-1], "'gen_sums' (source.collect(generated, prompt_rows) -> "
                               "rollout, rows, gen_sums, staleness) is never read"),
    (lambda calls: [replace(c, gives=(*c.gives, "mismatch")) if c.method == "make_experience"
                    else c for c in calls], "'mismatch' is given twice"),
    (lambda calls: [replace(c, stage=COLLECT) if c.method == "make_experience" else c
                    for c in calls], "reads 'old_logp', which no call before it gives"),
    (lambda calls: [*calls, Call("actor", "again", ("experience",), (), TRAIN)],
     "'experience' is kept in actor's workers and read twice"),
])
def test_a_plan_whose_values_do_not_flow_is_refused_naming_the_value(edit, problem):
    plan = step.synchronous(("actor", "reward", "ref"), False, True)
    with pytest.raises(PlanError, match=re.escape(problem)):
        replace(plan, calls=tuple(edit(list(plan.calls)))).check()


@pytest.mark.parametrize("conf", ["grpo_tiny", "ppo_tiny"])
def test_the_plan_of_the_composed_config_is_the_resolved_runs(conf):
    # --cfg step prints the plan before anything is resolved (nothing is made or read); what
    # decides it is the user's keys, which resolving leaves as they are.
    from tests.confs import load

    assert step.build(load([f"conf={conf}"], engine_check=False)) == _plan(f"conf={conf}")


def test_cfg_step_prints_the_plan_and_docs_design_shows_the_one_step_off_grpo_step(capsys):
    from rlhf_paro import train

    train.main(["--cfg", "step", *ONE_STEP_OFF])
    printed = capsys.readouterr().out
    assert printed == step.describe(load_config(ONE_STEP_OFF)) + "\n"
    design = (ROOT / "docs" / "design.md").read_text()
    assert printed.strip() in design, "docs/design.md's printed plan is not the plan"
    with pytest.raises(SystemExit) as done:
        train.main(["--cfg", "plan", "conf=grpo_tiny"])
    assert done.value.code == 2
    assert "--cfg: got 'plan'; allowed: job, step" in capsys.readouterr().err
