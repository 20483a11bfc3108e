"""The trainer's steps without Ray: every model of a one-device run in one process
(``cluster.LocalCluster``), running the same plan (``ppo/step.py``) through the same runner.

Each run is one gloo rank of its own (``run_distributed``), whose process group the in-process
models share. A PPO run (four models) and a GRPO run with a reward function (three, the old
log-probs from the update and the forward ahead: both rewrites) each take two steps here and on
Ray through the command line. Their rows must be equal to the bit: the same operations on the
same values in the same order, each worker with its own random stream, at one CPU thread
(``cluster.cpu_threads=1``, docs/design.md, "CPU threads"), so any difference is a bug. Times,
speeds and memory are the only keys left out.
"""

from __future__ import annotations

import pytest

from rlhf_paro.actors.worker import StepError
from rlhf_paro.metrics import required_keys
from tests.conftest import SMALL, demo_cache, train
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ONE = ["cluster.num_devices=1", "cluster.group_size=1", "cluster.cpu_threads=1",
       "trainer.steps=2", "trainer.save_every=0", "trainer.export_every=0",
       "trainer.eval_every=0"]
RUNS = {
    "ppo": ["conf=ppo_tiny", "algorithm.adaptive_kl=true"],
    # 8 prompts x 4 samples in one mini-batch: the update gives the old log-probs.
    "grpo": ["conf=grpo_tiny", "ppo.mini_batch_size=32", "actor.micro_batch_size=8",
             "ref.micro_batch_size=8"],
}
NOT_COMPARED = ("timing_s/", "perf/", "time_s", "tokens_per_s", "peak_bytes")


def _local(rank: int, world_size: int, argv: list[str]) -> dict:
    from rlhf_paro import plan, runs
    from rlhf_paro.cli import register_demo_resolver
    from rlhf_paro.cluster import LocalCluster
    from rlhf_paro.metrics import has_task_score, read_jsonl
    from rlhf_paro.trainer import PPOTrainer
    from tests.confs import load

    register_demo_resolver()
    cfg = load(argv)
    # As the entry point prepares it: the planner sizes the micro-batches the conf leaves open.
    cfg = plan.resolve_auto(cfg, runs.check_inputs(cfg))
    trainer = PPOTrainer(cfg, cluster=LocalCluster(cfg))
    initial = trainer.kl_ctl.value
    trainer.fit()
    return {"rows": read_jsonl(f"{cfg.trainer.output_dir}/metrics.jsonl"),
            "kl_coef": (initial, trainer.kl_ctl.value), "rewrites": trainer.plan.rewrites,
            # Every value a model kept for a later call of a step was read by it.
            "kept": {role: group.workers[0].kept() for role, group in trainer.models.items()},
            "updates": trainer.updates, "task_score": has_task_score(cfg.to_dict()),
            "issued": [c.method for c in trainer.cluster.issued]}


@pytest.fixture(scope="module", params=list(RUNS))
def runs(request, tmp_path_factory):
    cache = demo_cache()
    root = tmp_path_factory.mktemp(request.param)
    args = [*RUNS[request.param], *ONE]
    ray = train(root / "ray", *args, cache=cache)
    assert ray.returncode == 0, ray.stderr
    argv = [*SMALL, f"task.cache_dir={cache}", f"trainer.output_dir={root / 'local'}", *args]
    local = run_distributed(_local, 1, argv)[0]
    return request.param, ray, local


def _compared(row: dict) -> dict:
    return {k: v for k, v in row.items() if not any(part in k for part in NOT_COMPARED)}


def test_the_in_process_run_gives_the_ray_runs_rows_to_the_bit(runs):
    name, ray, local = runs
    assert [r["step"] for r in local["rows"]] == [r["step"] for r in ray.rows] == [0, 1]
    for theirs, ours in zip(ray.rows, local["rows"]):
        expected = _compared(theirs)
        assert len(expected) > 30 and expected["actor/grad_norm"] > 0
        assert _compared(ours) == expected


def test_whole_steps_run_without_ray_with_every_row_key_and_nothing_left_kept(runs):
    name, _, local = runs
    roles = ("actor", "critic", "reward", "ref") if name == "ppo" else ("actor", "reward", "ref")
    for row in local["rows"]:
        assert set(required_keys(roles, task_score=local["task_score"])) <= set(row)
    assert local["kept"] == {role: [] for role in roles}
    assert local["updates"] == 2
    if name == "ppo":  # the adaptive controller moved the coefficient after the steps' KL
        assert local["rewrites"] == ()
        assert local["kl_coef"][0] != local["kl_coef"][1]
    else:
        assert local["rewrites"] == ("old_logprobs_from_update", "forward_ahead")
        assert "forward_ahead" in local["issued"] and "old_logprobs" not in local["issued"]


def test_a_kept_value_read_twice_or_a_value_the_plan_does_not_name_is_an_error():
    # A worker's own bookkeeping, on a bare worker: keeping and taking values needs no model.
    from rlhf_paro.actors.worker import Worker
    from tests.confs import INLINE, load

    worker = Worker(load([*INLINE, "cluster.num_devices=1", "cluster.group_size=1"]), "ref", 0, 1)
    worker.give = lambda step, **values: {"x": step, **values}  # what a call gives
    assert worker.run("give", 3, (), ("x",)) is None and worker.kept() == [(3, "x")]
    # Taken by a later call of step 3 (and given back as it was): kept no more.
    assert worker.run("give", 3, ("x",), (), ("x",)) == 3 and worker.kept() == []
    with pytest.raises(StepError, match="step 3's 'x' was never kept here, or was read already"):
        worker.run("give", 3, ("x",), (), ("x",))
    with pytest.raises(StepError, match="ref.give at step 5 gave x; its plan names y"):
        worker.run("give", 5, ("y",))
