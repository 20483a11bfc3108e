"""The training command line: bad input fails in one line, before anything is written; an
output directory in use by another run is left alone; a signal before the run starts is one
line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from rlhf_paro import runs
from rlhf_paro.compose import CONF_DIR
from tests.confs import INLINE
from tests.test_runs import hold


# Every test here runs the command line in a fresh interpreter (seconds each).
pytestmark = pytest.mark.slow


def _train(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_paro.train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, names", [
    (["actor.strategy=GNN"], "actor.strategy"),  # breaks Principle 1
    (["actor.strategyy=IGG"], "actor.strategyy"),  # unknown key
    (["trainer.steps=many"], "trainer.steps"),  # wrong type
    (["cluster.group_size=3"], "group_size"),  # M does not divide N
    (["ppo.rollout_batch_size=-8"], "rollout_batch_size"),
    (["conf=no_such_conf"], "conf"),
    (["actor.config=null", "actor.path=/no/such/model"], "actor.path"),
    ([*INLINE, "actor.config.num_hidden_layerz=2"], "actor.config.num_hidden_layerz"),  # by HF
    ([*INLINE, "actor.config.hidden_size={a: 1}"], "actor.config.hidden_size"),  # HF's type
    ([*INLINE, "actor.config.num_attention_heads=-0.5"], "actor.config.num_attention_heads"),
    (["task.model.num_hidden_layerz=2"], "task.model.num_hidden_layerz"),  # the demo's model
    (["actor.config.hidden_size=32"], "data.train_files"),  # the demo's files need a tokenizer
    (["rollout.mask=product", "rollout.mask_high=2"], "rollout.mask"),  # the math's names
    (["rollout.mask=sequence", "rollout.mask_high=1"], "rollout.mask_high"),  # an empty band
])
def test_bad_input_exits_with_one_line_and_writes_nothing(tmp_path, args, names):
    out = tmp_path / "out"
    proc = _train(*args, f"trainer.output_dir={out}", cwd=tmp_path)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists() and os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    """A user's model directory, prompt file and reward functions (tests/hf_assets.py)."""
    from tests import hf_assets

    root = tmp_path_factory.mktemp("user")
    return {"llama": hf_assets.save_llama(root / "llama", hf_assets.word_tokenizer()),
            "prompts": hf_assets.write_prompts(root / "prompts.jsonl", 8),
            "fns": hf_assets.write_reward_functions(root / "fns.py")}


# A user's file that stops the interpreter on import. Before, SystemExit(0) from a reward file
# ended the run with exit 0, no output and no training.
EXITS = {"exit_0": "raise SystemExit(0)", "base_exception": "class Stop(BaseException):\n"
                                                           "    pass\nraise Stop('here')"}


@pytest.mark.parametrize("key", ["reward.function", "reward.score_function"])
@pytest.mark.parametrize("body", list(EXITS))
def test_a_reward_file_that_exits_on_import_is_one_line_and_exit_2(tmp_path, user_files, key,
                                                                     body):
    file = tmp_path / "exits.py"
    file.write_text(EXITS[body] + "\n\ndef score(prompts, responses, **columns):\n"
                                  "    return [1.0] * len(responses)\n")
    function = f"{file}:score" if key == "reward.function" else f"{user_files['fns']}:length"
    out = tmp_path / "out"
    proc = _train(f"actor.path={user_files['llama']}", f"data.train_files={user_files['prompts']}",
                  f"reward.function={function}", f"{key}={file}:score",
                  f"trainer.output_dir={out}", cwd=tmp_path)
    said = "SystemExit: 0" if body == "exit_0" else "Stop: here"
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.strip() == f"error: {key}: {file} fails on import: {said}", proc.stderr
    assert not out.exists()


def test_a_bad_prompt_row_is_one_line_and_exit_2(tmp_path, user_files):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(user_files["prompts"].read_bytes() + b'{"prompt": null, "start": 1}\n')
    out = tmp_path / "out"
    proc = _train(f"actor.path={user_files['llama']}", f"data.train_files={prompts}",
                  f"reward.function={user_files['fns']}:length", f"trainer.output_dir={out}",
                  cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.strip() == (f"error: data.prompt_key: {str(prompts)!r} row 9: 'prompt' is "
                                   "null; allowed: a string, or chat messages with "
                                   "data.apply_chat_template=true"), proc.stderr
    assert not out.exists()


def test_gpu_conf_without_gpus_says_what_it_needs(tmp_path):
    conf = "ppo_llama7b" if (CONF_DIR / "ppo_llama7b.yaml").is_file() else "ppo_tiny"
    out = tmp_path / "out"
    # ray.address=null: this machine's GPUs are counted, no Ray cluster is looked for.
    proc = _train(f"conf={conf}", "cluster.device=cuda", "ray.address=null",
                  f"trainer.output_dir={out}", cwd=tmp_path)
    assert proc.returncode != 0
    message = proc.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert "CUDA GPUs" in message and "ppo_tiny" in message and "rlhf_paro.plan" in message
    assert not out.exists()


def test_help_and_cfg_job_exit_0_and_write_nothing(tmp_path):
    proc = _train("--help", cwd=tmp_path)
    assert proc.returncode == 0 and "actor.strategy=IGG" in proc.stdout, proc.stderr
    proc = _train("--cfg", "job", "trainer.steps=3", cwd=tmp_path)
    assert proc.returncode == 0 and "  steps: 3\n" in proc.stdout, proc.stderr
    assert os.listdir(tmp_path) == []


# ray.address=auto reads RAY_ADDRESS first, and ray.address=null takes it as ray.init does: a
# driver started for a cluster (a Ray job, emulate_cluster.py --ray) joins that cluster.
@pytest.mark.parametrize("address", [["ray.address=auto"], []])
def test_a_dead_ray_address_fails_in_seconds_in_one_line(tmp_path, address):
    # What `ray.address=auto` finds after a cluster on this machine stopped: an address where
    # nothing answers any more (here through RAY_ADDRESS).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "rlhf_paro.train", *address,
                           f"trainer.output_dir={out}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert time.monotonic() - start < 30
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ray.address: no Ray cluster answers "
                                                   "at "), proc.stderr
    assert f":{port}" in lines[0] and not out.exists()


def _tree(root) -> dict[str, tuple[int, int]]:
    """(size, mtime) of everything under ``root``: what a run that touches nothing leaves as
    it was."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_an_output_dir_in_use_stops_a_second_run_in_one_line_touching_nothing(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoints" / "step_1").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    holder = hold(out)  # the run that uses it
    try:
        before = _tree(out)
        proc = _train(*INLINE, "trainer.save_every=1", f"trainer.output_dir={out}", cwd=tmp_path)
        assert _tree(out) == before
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: trainer.output_dir: {out} is in use by the run of "
                                   f"process {holder.pid} (it holds {runs.LOCK_FILE} there); "
                                   "allowed: another trainer.output_dir, or the same once that "
                                   "run ends")


def test_an_output_dir_under_a_file_fails_before_ray_starts(tmp_path):
    (tmp_path / "notes").write_text("x")
    start = time.monotonic()
    proc = _train(*INLINE, f"trainer.output_dir={tmp_path}/notes/run", cwd=tmp_path)
    assert proc.returncode == 2 and time.monotonic() - start < 60
    assert proc.stderr.strip() == (f"error: trainer.output_dir: {tmp_path}/notes/run is under "
                                   f"{tmp_path}/notes, which is a file, not a directory; "
                                   "allowed: a directory, or a path to make one at")
    assert os.listdir(tmp_path) == ["notes"]


# While the command line is read, transformers imported, the models checked, Ray started: a
# signal at any of these moments is one line and the signal's exit status, no traceback.
@pytest.mark.parametrize("signum, after_s", [(signal.SIGINT, 0.5), (signal.SIGINT, 3.0),
                                             (signal.SIGTERM, 3.0)])
def test_a_signal_before_the_steps_is_one_line_from_the_first_second(tmp_path, signum, after_s):
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_paro.train", *INLINE,
                             f"trainer.output_dir={tmp_path}/out"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    ours = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and stderr.strip().splitlines()[-1] == ours[0], stderr
    assert "Traceback" not in stderr
    word = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
    assert ours[0].startswith(f"error: {word} "), ours[0]
