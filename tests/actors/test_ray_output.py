"""What Ray prints, kept off the console (``group.RayOutput``), and a Ray that does not start,
in one line: no Ray is started here (``ray.init`` is replaced)."""

from __future__ import annotations

import os

import pytest
import ray

from rlhf_paro import train
from rlhf_paro.actors.group import RayOutput, RayStartError, init_ray
from tests.confs import INLINE

# What ray.init raised after a start-up timeout on a loaded machine, under 30 lines of its own.
TIMEOUT = ("The current node timed out during startup. This could happen because some of the "
           "raylet failed to startup or the GCS has become overloaded.")


@pytest.fixture
def start_times_out(monkeypatch):
    """``ray.init`` prints as Ray does (Python and C++ lines, on both streams), then fails."""
    def init(**kwargs):
        print("2026-11-26 13:45:00,775\tINFO worker.py:1841 -- Starting a local Ray instance")
        os.write(2, b"[2026-11-26 13:45:31 W 4711] gcs_client.cc:210: Failed to get cluster ID\n")
        raise Exception(TIMEOUT)

    monkeypatch.setattr(ray, "init", init)
    # What a private start sets for itself, put back after the test.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER",
                        ray._private.ray_constants.ENABLE_RAY_CLUSTER)


def test_a_private_ray_that_does_not_start_is_one_line_and_its_output_goes_to_the_log(
        start_times_out, tmp_path, capfd):
    log = RayOutput(tmp_path / "workers.log")
    try:
        with pytest.raises(RayStartError) as info:
            init_ray(None, num_cpus=1, num_devices=1, output=log)
    finally:
        log.close()
    assert str(info.value) == (f"Ray did not start on this machine (Exception: {TIMEOUT}) (Ray's "
                               f"messages: {tmp_path / 'workers.log'})")
    console = capfd.readouterr()
    assert console.out == console.err == ""
    text = (tmp_path / "workers.log").read_text()
    assert "Starting a local Ray instance" in text and "Failed to get cluster ID" in text


def test_the_command_line_says_so_in_one_line(start_times_out, tmp_path, capsys):
    # Before: a 30-line traceback.
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        train.main([f"trainer.output_dir={out}", *INLINE, "logger.wandb.mode=disabled"])
    stderr = capsys.readouterr().err
    assert info.value.code == 1 and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"error: Ray did not start on this machine (Exception: {TIMEOUT}) "
                             f"(Ray's messages: {out / train.WORKERS_LOG}); resume with: "), stderr


def test_forwarded_lines_are_prefixed_as_ray_prints_them_and_the_console_is_given_back(
        tmp_path):
    from ray._private import worker as ray_worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    original = ray_worker.print_to_stdstream
    log = RayOutput(tmp_path / "workers.log")
    log.attach()
    assert ray_worker.print_to_stdstream == log.write
    dispatcher.emit({"pid": 4711, "actor_name": "ActorWorker", "ip": "10.0.0.2",
                     "localhost": "10.0.0.1", "lines": ["[WARNING] a library's own warning"]})
    dispatcher.emit({"pid": 4712, "task_name": "score", "ip": "10.0.0.1",
                     "localhost": "10.0.0.1", "lines": ["a reward function's print"]})
    ray_worker.print_to_stdstream({"pid": "raylet", "lines": ["Raylet is terminated.",
                                                              "    [state-dump] ..."]})
    log.close()
    assert ray_worker.print_to_stdstream is original
    assert not any(name == "rlhf_paro" for name, _ in dispatcher.handlers)
    assert (tmp_path / "workers.log").read_text().splitlines() == [
        "(ActorWorker pid=4711, ip=10.0.0.2) [WARNING] a library's own warning",
        "(score pid=4712) a reward function's print",
        "(raylet) Raylet is terminated.",
        "(raylet)     [state-dump] ...",
    ]


# What the vLLM demo's workers print (conf=grpo_tiny rollout.engine=vllm), abridged: known-harmless
# lines of every kind, a real warning and a real Python warning with its source line among them.
VLLM_LINES = [
    (1, "(MainProcess pid=1) WARNING 11-27 23:50:23 [base.py:380] Chat template warmup failed"),
    (1, "(MainProcess pid=1) WARNING 11-27 23:50:23 [base.py:380] Traceback (most recent call "
        "last):"),
    (2, "(MainProcess pid=2) WARNING 11-27 23:50:41 [layerwise.py:266] RotaryEmbedding: Failed "
        "to load weights"),
    (1, "(MainProcess pid=1) WARNING 11-27 23:50:23 [base.py:380]   File \"base.py\", line 373"),
    (1, "(MainProcess pid=1) WARNING 11-27 23:50:23 [base.py:380] ValueError: Tokenizer not "
        "available"),
    (1, "(MainProcess pid=1) WARNING 11-27 23:50:24 [model.py:12] a real warning of vLLM's"),
    (2, "/venv/vllm/triton_utils/dispatcher.py:138: FutureWarning: `torch.distributed.reduce_op` "
        "is deprecated, please use `torch.distributed.ReduceOp` instead"),
    (2, "  if hasattr(value, \"__dict__\"):"),
    (2, "/venv/lib/x.py:9: UserWarning: a real warning of a library's"),
    (2, "  x = y()"),
    (1, "(MainProcess pid=1) WARNING 11-27 23:50:41 [layerwise.py:266] RotaryEmbedding: Failed "
        "to load weights"),
    (2, "(MainProcess pid=2) INFO 11-27 23:50:41 [block_pool.py:861] Successfully reset prefix "
        "cache"),
]


def test_known_harmless_lines_are_summarised_one_line_a_kind_and_real_warnings_kept(tmp_path):
    # Before: 812 lines in workers.log of the vLLM demo, 334 of them warnings or tracebacks
    # (RotaryEmbedding's 204 times, a chat template traceback per rank) of a run that is right.
    log = RayOutput(tmp_path / "workers.log")
    for pid, line in VLLM_LINES:  # one line a batch, the ranks' lines interleaved
        log.write({"pid": pid, "actor_name": "ActorWorker", "lines": [line]})
    log.close()
    kept = [f"(ActorWorker pid={pid}) {line}" for pid, line in VLLM_LINES
            if "real warning" in line or line == "  x = y()"]
    assert len(kept) == 3
    lines = (tmp_path / "workers.log").read_text().splitlines()
    assert lines[:3] == kept
    assert lines[3:] == [
        "(rlhf_paro) 1 message: vLLM's chat template warmup and EOS notes, harmless (the engine "
        "runs without a tokenizer, by design: token ids in, token ids out); in "
        "workers.noise.log",
        "(rlhf_paro) 3 messages: vLLM's weight reload notes, harmless (the actor's weights are "
        "loaded into the engine in place after every update (a rotary embedding has no weights "
        "to load); rollout/logprob_diff_* measures the engine against the trainer); in "
        "workers.noise.log",
        "(rlhf_paro) 1 message: torch deprecation warnings inside vLLM, harmless (vLLM's own "
        "code, not the run's); in workers.noise.log"]
    # The raw text of each, prefixed as in workers.log: nothing is lost.
    assert (tmp_path / "workers.noise.log").read_text().splitlines() == [
        f"(ActorWorker pid={pid}) {line}" for pid, line in VLLM_LINES
        if f"(ActorWorker pid={pid}) {line}" not in kept]
