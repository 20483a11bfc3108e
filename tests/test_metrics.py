"""Folding per-rank reports into the metrics of docs/design.md, and where the rows go."""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from rlhf_paro.metrics import (
    LOOP_KEYS, TASK_SCORE_KEY, MetricsLogger, RankReport, Sums, engine_mask, has_task_score,
    logprob_diff, missing_steps, model_metrics, padding_fraction, read_jsonl, required_keys,
    reward_extras,
)


def _report(rank: int) -> RankReport:
    # Rank r sent 100*(r+1) bytes inside its group in forward and 10 across groups at the
    # boundary, held 1000*(r+1) parameter bytes, and was busy 1 + r seconds.
    return RankReport(
        tokens=50,
        time_s={"inference": 0.5, "train": 0.5 + rank},
        comm={"forward": {"intra_bytes": 100 * (rank + 1), "inter_bytes": 0, "calls": 2,
                          "seconds": 0.1},
              "boundary": {"intra_bytes": 0, "inter_bytes": 10, "calls": 1, "seconds": 0.2}},
        memory={"params": 1000 * (rank + 1), "grads": 10, "optim": 0, "host_optim": 60},
        peak_bytes=5000 + rank,
        # offload=optimizer: one step's OS gradient out and masters back, 40 bytes each way.
        offload={"d2h_bytes": 40, "h2d_bytes": 40, "transfers": 2},
        train={"loss": float(rank), "grad_norm": 1.0, "lr": 1e-3, "vf_clipfrac": 0.5,
               "skipped_steps": 0.0},
    )


def test_comm_is_summed_over_ranks_and_memory_is_the_largest_rank():
    row = model_metrics("critic", [_report(0), _report(1)])
    assert row["critic/comm/intra_bytes"] == 100 + 200
    assert row["critic/comm/inter_bytes"] == 20
    assert row["critic/comm/forward/intra_bytes"] == 300
    assert row["critic/comm/boundary/inter_bytes"] == 20
    assert row["critic/comm/backward/intra_bytes"] == 0  # every phase has a column
    assert row["critic/comm/calls"] == 6
    assert abs(row["critic/comm/time_s"] - 0.3) < 1e-12  # slowest rank, not the sum
    assert row["critic/mem/params_bytes"] == 2000
    assert row["critic/mem/peak_bytes"] == 5001
    # Host memory per rank like the device's; host copies summed like link bytes, apart from them.
    assert row["critic/mem/optim_bytes"] == 0 and row["critic/mem/host_optim_bytes"] == 60
    assert row["critic/mem/host_params_bytes"] == 0  # a key the report lacks is 0
    assert (row["critic/offload/d2h_bytes"], row["critic/offload/transfers"]) == (80, 4)
    # 100 tokens over the slowest rank's 2 busy seconds.
    assert row["critic/tokens_per_s"] == 50.0
    assert row["critic/time_s/train"] == 1.5
    assert row["critic/loss"] == 0.5
    assert row["critic/vf_clipfrac"] == 0.5
    assert set(row) >= {k for k in required_keys() if k.startswith("critic/")}


def test_required_keys_cover_design_section_9():
    keys = set(required_keys())
    for role in ("actor", "critic", "reward", "ref"):
        for name in ("tokens_per_s", "comm/intra_bytes", "comm/inter_bytes", "comm/time_s",
                     "comm/calls", "mem/params_bytes", "mem/grads_bytes", "mem/optim_bytes",
                     "mem/peak_bytes", "mem/host_params_bytes", "mem/host_grads_bytes",
                     "mem/host_optim_bytes", "offload/d2h_bytes", "offload/h2d_bytes",
                     "offload/transfers"):
            assert f"{role}/{name}" in keys
        assert any(k.startswith(f"{role}/time_s/") for k in keys)
    for name in ("actor/loss", "actor/grad_norm", "actor/lr", "critic/loss", "critic/grad_norm",
                 "critic/lr", "actor/clipfrac", "critic/vf_clipfrac", *LOOP_KEYS):
        assert name in keys
    assert "reward/loss" not in keys


@pytest.mark.slow
def test_logger_writes_one_row_per_step_and_an_offline_wandb_run(tmp_path):
    out = tmp_path / "run"
    logger = MetricsLogger(str(out), num_steps=2, run_info={"name": "t"}, wandb_mode="offline",
                           show_progress=False)
    row = {k: 0.25 for k in required_keys()}
    logger.log(0, row)
    logger.log(1, row)
    logger.close()
    rows = read_jsonl(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1]
    assert all(set(required_keys()) <= set(r) for r in rows)
    assert json.loads((out / "run.json").read_text()) == {"name": "t"}
    assert list((out / "wandb").glob("offline-run-*")), "wandb should have written an offline run"


@pytest.mark.slow
def test_a_resumed_logger_replaces_the_rows_after_its_step_and_goes_on_with_the_wandb_run(
        tmp_path):
    out = tmp_path / "run"
    row = {k: 0.25 for k in required_keys()}
    first = MetricsLogger(str(out), num_steps=3, run_info={}, wandb_mode="offline",
                          show_progress=False)
    for step in range(3):
        first.log(step, row)
    first.close()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "ppo/k')  # a kill in the middle of a line
    resumed = MetricsLogger(str(out), num_steps=3, run_info={}, wandb_mode="offline",
                            show_progress=False, start_step=1, wandb_id=first.wandb_id)
    resumed.log(1, {**row, "ppo/kl": 0.5})
    resumed.close()
    rows = read_jsonl(str(out / "metrics.jsonl"))
    assert [(r["step"], r["ppo/kl"]) for r in rows] == [(0, 0.25), (1, 0.5)]
    assert resumed.wandb_id == first.wandb_id
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(first.wandb_id in r.name for r in runs)  # one run id


def test_padding_fraction_is_the_padding_share_of_every_position_computed_on():
    # A packed model computes on its real tokens only; a padded one on 100 positions of which
    # 40 are real; generation (actor) on 60 padded positions of which 30 are real.
    def report(tokens, real):
        return RankReport(tokens=tokens, real_tokens=real, time_s={}, comm={}, memory={},
                          peak_bytes=0)

    reports = {"critic": [report(40, 40), report(20, 20)], "ref": [report(100, 40)],
               "actor": [report(60, 30)]}
    # (60 + 30) padding positions of 220.
    assert padding_fraction(reports) == pytest.approx(90 / 220)
    assert padding_fraction({"critic": reports["critic"]}) == 0.0
    assert padding_fraction({"reward": [report(0, 0)]}) == 0.0  # nothing computed, nothing padded
    assert {"perf/tokens_per_s", "perf/padding_fraction"} <= set(LOOP_KEYS)


def test_logprob_diff_is_the_largest_rank_s_max_and_the_token_weighted_mean():
    # Rank 0: 3 tokens, |diffs| summing to 3e-6, largest 2e-6; rank 1: 1 token of 6e-6.
    # The mean is over tokens, (3e-6 + 6e-6) / 4, not a mean of the ranks' means.
    ranks = [Sums(total={"logprob_diff_sum": 3e-6, "logprob_diff_count": 3.0},
                  most={"logprob_diff": 2e-6}),
             Sums(total={"logprob_diff_sum": 6e-6, "logprob_diff_count": 1.0},
                  most={"logprob_diff": 6e-6})]
    row = logprob_diff(Sums.fold(ranks))
    assert row["rollout/logprob_diff_max"] == 6e-6
    assert row["rollout/logprob_diff_mean"] == pytest.approx(9e-6 / 4)
    assert logprob_diff(None) == {}  # an engine that gives no log-probs: no keys
    assert logprob_diff(Sums.fold([])) == {}


def test_the_masked_fraction_is_the_ranks_masked_samples_over_their_samples():
    import torch

    from rlhf_paro.actors.actor import mask_sums

    # Eight samples' log ratios against the band [e^-1, e^0.5]: two above, one below, one at
    # each edge (kept). Folded from any split over ranks, the row is the whole batch's: 3 of 8
    # masked, 2 above and 1 below, the log ratios' mean, least and most.
    log_ratio = torch.tensor([0.0, 0.9, -0.2, 0.5, -1.5, 0.1, 2.0, -1.0], dtype=torch.float64)
    low, high = math.exp(-1.0), math.exp(0.5)
    # (The sum of 8 log ratios below 2 in other groupings: within 7 u 8 x 2 = 1.2e-14.)
    whole = {"rollout/masked_fraction": 3 / 8, "rollout/masked_fraction_high": 2 / 8,
             "rollout/masked_fraction_low": 1 / 8,
             "rollout/mask_log_ratio_mean": pytest.approx(0.8 / 8, rel=0, abs=2e-15),
             "rollout/mask_log_ratio_min": -1.5, "rollout/mask_log_ratio_max": 2.0}
    for split in ([8], [1, 7], [3, 3, 2], [2, 1, 4, 1]):
        ranks = [mask_sums(part, low, high) for part in log_ratio.split(split)]
        assert engine_mask(Sums.fold(ranks)) == whole, split
    # The ranks' fractions averaged would be (1/1 + 2/7) / 2 for the first split, not 3/8.
    ranks = [mask_sums(part, low, high) for part in log_ratio.split([1, 7])]
    fractions = [engine_mask(r)["rollout/masked_fraction"] for r in ranks]
    assert sum(fractions) / 2 != 3 / 8
    assert engine_mask(Sums()) == {}  # no mask: no keys


def test_sums_fold_each_kind_its_own_way_and_survive_a_checkpoint():
    # Rank 0 has a reward extra on 2 of its samples and an environment; rank 1 neither.
    zero = Sums(total={"count": 4.0, "reward/format": 1.5}, counts={"reward/format": 2.0},
                least={"first_sample_s": 0.5}, most={"last_sample_s": 3.0},
                each={"step_latencies_s": [0.1, 0.2]},
                env=Sums(total={"episodes": 4.0}, least={"first_sample_s": 0.5}))
    one = Sums(total={"count": 4.0}, least={"first_sample_s": 0.2}, most={"last_sample_s": 2.0},
               each={"step_latencies_s": [0.3]})
    folded = Sums.fold([zero, one])
    assert folded.total == {"count": 8.0, "reward/format": 1.5}
    assert folded.counts == {"reward/format": 2.0}
    assert folded.least == {"first_sample_s": 0.2} and folded.most == {"last_sample_s": 3.0}
    assert folded.each == {"step_latencies_s": [0.1, 0.2, 0.3]}
    assert folded.env.total == {"episodes": 4.0} and folded.env.least == {"first_sample_s": 0.5}
    # The mean of an extra is over the samples that have it, not over all of them.
    assert reward_extras(folded) == {"reward/format": 0.75}
    assert Sums.from_dict(json.loads(json.dumps(folded.to_dict()))) == folded


def test_missing_steps_are_those_without_a_row_before_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert missing_steps(str(path), 3) == [0, 1, 2]  # the file deleted
    # Rows of steps 0 and 2, a line a kill cut short, and a row after the resumed step.
    path.write_text('{"step": 0}\n{"step": 2}\n{"step": 3, "ppo/kl\n{"step": 5}\n')
    assert missing_steps(str(path), 4) == [1, 3]
    assert missing_steps(str(path), 0) == []


@pytest.mark.parametrize("num_steps", [1, 3])
def test_the_progress_bar_draws_each_step_once_and_its_last_state_once(tmp_path, capsys,
                                                                      num_steps):
    # Into a pipe each redraw is a line: close() draws the bar's final state, which the last
    # step's update had drawn already, so a run's last progress line came twice.
    logger = MetricsLogger(str(tmp_path / "run"), num_steps=num_steps, run_info={},
                           wandb_mode="disabled", show_progress=True)
    row = {k: 0.25 for k in required_keys()}
    for step in range(num_steps):
        time.sleep(0.15)  # a step takes seconds: past tqdm's 0.1 s between two redraws
        logger.log(step, row)
    logger.close()
    redraws = [part for part in re.split(r"[\r\n]", capsys.readouterr().err) if part.strip()]
    done = [f" {k}/{num_steps} " for k in range(num_steps + 1)]
    assert [sum(mark in part for part in redraws) for mark in done] == [1] * (num_steps + 1), \
        redraws
    assert "score=0.250" in redraws[-1]


@pytest.mark.parametrize("config, says, has_score", [
    # The demo: the task's own rule scores its own prompts.
    ({"reward": {"function": None}, "data": {"train_files": None}}, "rm_score=", True),
    # Prompt files and a reward function, no score function: the reward is all there is.
    ({"reward": {"function": "f.py:score", "score_function": None},
      "data": {"train_files": ["p.jsonl"]}}, "fn_reward=", False),
    ({"reward": {"url": "http://127.0.0.1:9/", "score_function": "f.py:exact"},
      "data": {"train_files": ["p.jsonl"]}}, "server_reward=", True),
    ({"reward": {"env_score": True}, "data": {"train_files": ["p.jsonl"]}}, "env_score=", False),
])
def test_the_bar_shows_a_task_score_only_where_one_exists_and_names_the_reward_s_kind(
        tmp_path, capsys, config, says, has_score):
    # Without reward.score_function on prompt files, ppo/task_score and the bar's score= were
    # the reward again under a name that claims a ground truth.
    assert has_task_score(config) is has_score
    assert (TASK_SCORE_KEY in required_keys(task_score=has_task_score(config))) is has_score
    logger = MetricsLogger(str(tmp_path / "run"), num_steps=1, run_info={"config": config},
                           wandb_mode="disabled", show_progress=True)
    row = {k: 0.25 for k in required_keys(task_score=has_score)}
    logger.log(0, row)
    logger.close()
    last = [part for part in re.split(r"[\r\n]", capsys.readouterr().err) if part.strip()][-1]
    assert f"{says}0.25 " in last and ("score=0.250" in last) is has_score, last
