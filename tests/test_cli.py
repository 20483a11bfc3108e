"""The command line of the entry points: --help, --cfg job, -m, and bad input fuzzed.

Everything runs in-process through ``train.main`` / ``plan.main``, the functions the commands
call; ``train.run`` (the only step that starts Ray and writes) is replaced by a recorder, so a
bad input that got through would show up as a recorded job instead of a training run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_paro import plan, runs, train
from rlhf_paro.cli import _leaves
from rlhf_paro.compose import load_config, quoted
from rlhf_paro.config import PPOConfig, TaskConfig
from rlhf_paro.ppo import demo
from tests.confs import INLINE, TINY_MODEL

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def jobs(monkeypatch, tmp_path):
    """The configs ``train.main`` hands to ``run``, in order; the cwd is an empty directory."""
    ran = []
    monkeypatch.setattr(train, "run", lambda cfg, argv: ran.append(cfg))
    monkeypatch.chdir(tmp_path)
    return ran


def test_help_lists_every_key_with_its_value_and_a_comment(jobs, capsys):
    train.main(["--help", "ppo.ppo_epochs=3"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m rlhf_paro.train")
    keys = [key for key, _, _ in _leaves(load_config([]), "")]
    lines = {line.split("=")[0].strip(): line for line in out.splitlines() if "  # " in line}
    assert set(keys) <= set(lines)
    assert all(lines[key].split("  # ")[1].strip() for key in keys), "a key without a comment"
    assert "ppo.ppo_epochs=3 " in out and "actor.strategy=IGG " in out
    assert jobs == []


def test_cfg_job_prints_the_resolved_config_and_runs_nothing(jobs, capsys):
    argv = ["conf=ppo_llama7b", "cluster.nodes=4", "trainer.output_dir=runs/${cluster.nodes}"]
    train.main(["--cfg", "job", *argv])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(load_config(argv).to_dict()))  # tuples as lists
    assert (printed["cluster"]["num_devices"], printed["trainer"]["output_dir"]) == (32, "runs/4")
    assert jobs == []
    plan.main(["--cfg", "job", *argv])
    assert yaml.safe_load(capsys.readouterr().out) == printed


def _command(home, *args):
    """``python -m rlhf_paro.train ARGS`` in a fresh process whose home is ``home`` (the demo's
    cache defaults to ``~/.cache/rlhf_paro``), its working directory ``home`` too."""
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "rlhf_paro.train", *args], cwd=home, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_help_and_cfg_job_on_an_empty_cache_make_and_write_nothing(tmp_path):
    # Making the demo trains two models (a minute or more) and writes them under the cache: here
    # neither command may, so the home and working directory stay empty and the conf's
    # ${demo:NAME} is printed as it is written.
    printed = yaml.safe_load(_command(tmp_path, "--cfg", "job"))
    assert (printed["actor"]["path"], printed["reward"]["path"]) == ("${demo:actor}",
                                                                     "${demo:reward}")
    assert printed["data"]["train_files"] == "${demo:train}"
    assert "actor.path=${demo:actor} " in _command(tmp_path, "--help")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == []
    # Once the cache holds the demo (its meta.json is written last), they print its paths.
    task, ppo = TaskConfig(**printed["task"]), PPOConfig(**printed["ppo"])
    entry = tmp_path / ".cache" / "rlhf_paro" / f"demo-{demo.cache_key(task, ppo.max_new_tokens)}"
    entry.mkdir(parents=True)
    (entry / "meta.json").write_text("{}")
    printed = yaml.safe_load(_command(tmp_path, "--cfg", "job"))
    assert (printed["actor"]["path"], printed["data"]["val_files"]) == (str(entry / "actor"),
                                                                       str(entry / "val.jsonl"))


def test_multirun_runs_the_product_of_the_swept_values_each_in_its_own_directory(jobs, capsys):
    train.main(["-m", "actor.strategy=IGG,zero3", "trainer.seed=1",
                "critic.strategy=NIG,GGG,III", "trainer.output_dir=runs"])
    assert [(c.actor.strategy, c.critic.strategy) for c in jobs] == [
        ("IGG", "NIG"), ("IGG", "GGG"), ("IGG", "III"),
        ("GGG", "NIG"), ("GGG", "GGG"), ("GGG", "III")]
    assert {c.trainer.seed for c in jobs} == {1}
    # Absolute, from the directory the command was typed in: the workers run elsewhere.
    assert jobs[4].trainer.output_dir == os.path.abspath(
        "runs/4_actor.strategy=zero3,critic.strategy=GGG")
    assert capsys.readouterr().out.count("[rlhf_paro.train] job ") == 6


def test_a_swept_job_records_the_definition_its_next_run_is_checked_against(monkeypatch,
                                                                           tmp_path, capsys):
    # ``run`` records each job's definition as composed from the job's argv, which names the
    # job's directory (commas in it): composed again, it must be the job's own,
    # so that the same sweep typed again finds each job finished, not another run or a sweep.
    ran = []

    def run(cfg, argv):
        ran.append(argv)
        Path(cfg.trainer.output_dir).mkdir(parents=True)  # as ``runs.locked`` makes it
        runs.record_definition(load_config(argv))
        runs.mark_finished(cfg.trainer.output_dir, cfg.trainer.steps)

    monkeypatch.setattr(train, "run", run)
    monkeypatch.chdir(tmp_path)
    command = ["-m", "actor.strategy=IGG,GGG", "critic.strategy=NIG,III",
               "trainer.output_dir=sweep"]
    train.main(command)
    assert len(ran) == 4
    capsys.readouterr()
    train.main(command)
    assert len(ran) == 4
    assert capsys.readouterr().out.count("finished") == 4


@pytest.mark.parametrize("text", ["a,b", "it's,x", "1e-5", "null", "[a, b]", "''"])
def test_a_quoted_value_reads_back_as_the_text_itself(text):
    assert load_config([f"trainer.output_dir={quoted(text)}"]).trainer.output_dir == text


def test_multirun_checks_every_job_before_running_the_first(jobs, capsys):
    with pytest.raises(SystemExit) as info:
        train.main(["-m", "actor.strategy=IGG,XYZ"])
    assert info.value.code == 2 and jobs == []
    assert capsys.readouterr().err.startswith("error: actor.strategy: unknown strategy 'XYZ'")


def test_plan_help(capsys):
    plan.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m rlhf_paro.plan")


# --- fuzzing bad overrides ------------------------------------------------------------------------

# Keys with values no junk below can satisfy (optional keys, whose null is valid, are left out).
POSITIVE_INTS = ["trainer.steps", "ppo.rollout_batch_size", "actor.micro_batch_size",
                 "cluster.num_devices", "task.num_symbols", "algorithm.kl_horizon", "critic.lora.r"]
NUMBERS = ["actor.optim.lr", "ppo.gamma", "ppo.lam", "critic.optim.eps", "task.reward_lr"]
BOOLS = ["actor.gradient_checkpointing", "algorithm.adaptive_kl", "logger.progress", "actor.lora.enabled"]
CHOICES = ["actor.precision", "comm.algorithm", "logger.wandb.mode",
           "cluster.device", "actor.strategy", "critic.strategy", "ref.strategy"]
INLINE_SIZES = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings"]
MALFORMED = ["actor.config.=GGGG", "=3", "actor..strategy=IGG", ".x=1", "ppo.gamma", "~",
             "+actor.strategy=IGG", "~actor.strategy=IGG", "+nosuch.key=1", "+conf=ppo_tiny",
             "actor.strategy=${nosuch.key}", "trainer.output_dir=${oops", "actor.strategy=IGG,NNG",
             "-z", "--cfg=hydra", "conf=no_such_conf", "cluster.num_devices.x=1",
             "~actor.config.no_such_key", "actor.config.hidden_size.x=1"]


def _word(rng: random.Random) -> str:
    # "zq" starts no field name, so the word is never a known key.
    return "zq" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(1, 8)))


def _junk(rng: random.Random, *, numbers: bool) -> str:
    """The text of a value that is not an integer, boolean or known choice (nor, unless
    ``numbers``, a number)."""
    control = "".join(chr(rng.randint(1, 31)) for _ in range(rng.randint(1, 3)))
    kinds = [
        f"{{{_word(rng)}: {rng.randint(-9, 9)}}}",  # a mapping
        f"[{rng.randint(0, 9)}, {_word(rng)}]",  # a list
        f"{_word(rng)}{control}",  # control characters (YAML refuses most of them)
        "\\x00", "''", "{}", "[]", _word(rng),
    ]
    if numbers:
        kinds += [str(rng.randint(-10 ** 6, 0)), f"{rng.uniform(-100, 100):.3f}", "true", ".nan"]
    return rng.choice(kinds)


def bad_override(rng: random.Random) -> list[str]:
    kind = rng.randrange(7)
    if kind == 0:  # an unknown key, somewhere in the schema
        section = rng.choice(["", "actor.", "ppo.", "logger.wandb.", "cluster.", "actor.lora."])
        return [f"{rng.choice(['', '+'])}{section}{_word(rng)}={_junk(rng, numbers=True)}"]
    if kind == 1:  # an integer that is not a positive integer
        return [f"{rng.choice(POSITIVE_INTS)}={_junk(rng, numbers=True)}"]
    if kind == 2:  # a number that is not one, or out of range
        bad = rng.choice([_junk(rng, numbers=False), "-1.5", "true", ".nan", "[0.5]"])
        return [f"{rng.choice(NUMBERS)}={bad}"]
    if kind == 3:  # a boolean that is not one
        return [f"{rng.choice(BOOLS)}={rng.choice([_junk(rng, numbers=False), '2', '0.5'])}"]
    if kind == 4:  # a choice outside the allowed ones
        return [f"{rng.choice(CHOICES)}={rng.choice([_junk(rng, numbers=False), 'GNN', 'fp16'])}"]
    if kind == 5:  # an inline model config: a size that is not a positive integer, or no key
        key = rng.choice(INLINE_SIZES + [_word(rng)])
        value = rng.choice([_junk(rng, numbers=True), str(-rng.randint(0, 99)), "1.5"])
        return [f"{rng.choice(['actor', 'critic', 'ref'])}.config.{key}={value}"]
    return [rng.choice(MALFORMED)]


BAD = [bad_override(rng) for rng in [random.Random(2024)] for _ in range(80)]


@pytest.mark.parametrize("bad", BAD, ids=[ascii(b[0])[1:-1][:60] for b in BAD])
def test_every_bad_override_exits_2_with_one_line_and_writes_nothing(jobs, capsys, tmp_path,
                                                                      bad):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        train.main([f"trainer.output_dir={out}", *bad])
    stdout, stderr = capsys.readouterr()
    assert info.value.code == 2, (bad, stderr)
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert stdout == "" and jobs == []
    assert list(tmp_path.iterdir()) == []


REWARD_ONLY = ("function", "score_function", "url", "timeout_s", "token_env", "env_score")


@pytest.mark.parametrize("bad, says", [
    # Before: "actor.lr: unknown key (did you mean lora?)", and reward-only keys allowed.
    ("actor.lr=1e-4", "actor.lr: unknown key (did you mean actor.optim.lr?)"),
    ("critic.learning_rate=1e-4", "critic.learning_rate: unknown key (did you mean "
                                  "critic.optim.lr?)"),
    ("actor.weight_decay=0.1", "actor.weight_decay: unknown key (did you mean "
                               "actor.optim.weight_decay?)"),
    ("actor.batch_size=2", "actor.batch_size: unknown key (did you mean actor.micro_batch_size?)"),
    ("ppo.epochs=2", "ppo.epochs: unknown key (did you mean ppo.ppo_epochs?)"),
    ("ppo.batch_size=8", "ppo.batch_size: unknown key (did you mean ppo.rollout_batch_size?)"),
    ("trainer.max_steps=8", "trainer.max_steps: unknown key (did you mean trainer.steps?)"),
    ("lr=1e-4", "lr: unknown key (did you mean actor.optim.lr?)"),
    ("epochs=2", "epochs: unknown key (did you mean ppo.ppo_epochs?)"),
    ("rollout.num_samples=4", "rollout.num_samples: unknown key (did you mean rollout.n?)"),
    ("actor.tokenizr=t", "actor.tokenizr: unknown key (did you mean actor.tokenizer?)"),
    ("ref.tokenizer=t", "ref.tokenizer: is a key of actor.* only; allowed: actor.tokenizer, "
                        "or ref.tokenizer unset"),
    ("actor.url=http://x", "actor.url: is a key of reward.* only; allowed: reward.url, or "
                           "actor.url unset"),
])
def test_an_unknown_key_is_suggested_from_its_own_section_and_its_aliases(jobs, capsys, bad,
                                                                          says):
    with pytest.raises(SystemExit):
        train.main([bad])
    stderr = capsys.readouterr().err
    assert stderr.startswith(f"error: {says}"), stderr
    if "allowed: path, " in stderr:  # a model's section lists its role's keys only
        allowed = stderr.split("allowed: ")[1].strip().split(", ")
        role = bad.split(".")[0]
        assert ("tokenizer" in allowed) == (role == "actor"), allowed
        assert not set(REWARD_ONLY) & set(allowed), allowed


def test_a_reward_only_key_is_listed_and_taken_in_the_reward_section(jobs, capsys):
    with pytest.raises(SystemExit):
        train.main(["reward.lr=1"])
    allowed = capsys.readouterr().err.split("allowed: ")[1].strip().split(", ")
    assert set(REWARD_ONLY) <= set(allowed) and "tokenizer" not in allowed


@pytest.mark.parametrize("good", [
    [],
    [*INLINE, "+actor.config.rms_norm_eps=1e-5", "~actor.config.num_key_value_heads"],
    ["~algorithm.kl_coef", "ppo.mini_batch_size=${ppo.rollout_batch_size}"],
    [*INLINE, "actor.config.hidden_act=gelu", "critic.strategy=zero3", "ref.strategy=IGG"],
    ["actor.strategy=auto", "conf=ppo_tiny", "logger.wandb.tags=[a, b]", "logger.wandb.name=7"],
])
def test_good_overrides_still_reach_the_run(jobs, capsys, good):
    train.main(good)
    assert len(jobs) == 1 and jobs[0].actor.strategy != "auto"
    assert capsys.readouterr().err == ""


# --- algorithms: combinations the math cannot run ------------------------------------------------

@pytest.mark.parametrize("bad, key, says", [
    (["conf=grpo_tiny", "critic.config={hidden_size: 8}"], "critic", "trains no critic"),
    (["algorithm.adv_estimator=rloo", "rollout.n=2", "critic.config={hidden_size: 8}"], "critic",
     "trains no critic"),
    (["conf=grpo_tiny", "rollout.n=1", "ppo.mini_batch_size=16", "actor.micro_batch_size=4"],
     "rollout.n",
     "allowed: 2 or more, got 1"),
    (["algorithm.adv_estimator=ppo2"], "algorithm.adv_estimator", "allowed: gae, "),
    (["algorithm.kl_estimator=k9"], "algorithm.kl_estimator", "allowed: null, k1, k2, k3"),
    # k1 as a loss term: its expected gradient is 0, the KL grows unchecked.
    (["conf=grpo_tiny", "algorithm.kl_estimator=k1"], "algorithm.kl_estimator",
     "zero expected gradient"),
    (["algorithm.kl_in_loss=true", "algorithm.kl_estimator=k1"], "algorithm.kl_estimator",
     "allowed: k3 or k2 (null: k3), or k1 with kl_in_loss=false"),
    (["algorithm.loss_agg_mode=seq_sum"], "algorithm.loss_agg_mode", "token_mean"),
    (["conf=grpo_tiny", "algorithm.adaptive_kl=true"], "algorithm.adaptive_kl", "allowed: false"),
])
def test_an_algorithm_that_cannot_run_exits_2_with_one_line_naming_the_key(jobs, capsys,
                                                                          tmp_path, bad, key,
                                                                          says):
    with pytest.raises(SystemExit) as info:
        train.main([f"trainer.output_dir={tmp_path / 'out'}", *INLINE, *bad])
    stderr = capsys.readouterr().err
    assert info.value.code == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"error: {key}: ") and says in stderr, stderr
    assert jobs == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra, roles", [
    ([], ("actor", "reward", "ref")),
    # The conf's KL is a loss term; kl_coef=0 drops it and the reference with it.
    (["algorithm.kl_coef=0"], ("actor", "reward")),
    (["algorithm.adv_estimator=gae", "rollout.n=1", "ppo.mini_batch_size=16",
      "actor.micro_batch_size=4",
      "reward.function=null", f"reward.config={TINY_MODEL}"],
     ("actor", "critic", "reward", "ref")),
])
def test_grpo_tiny_reaches_the_run_with_the_models_its_algorithm_needs(jobs, capsys, extra,
                                                                        roles):
    from rlhf_paro.ppo import algorithms

    train.main(["conf=grpo_tiny", *INLINE, *extra])
    assert capsys.readouterr().err == ""
    assert len(jobs) == 1 and algorithms.roles(jobs[0]) == roles


def test_packing_on_an_architecture_that_cannot_pack_is_one_line_naming_the_model_type(
        jobs, capsys, tmp_path):
    opt = ("{model_type: opt, hidden_size: 32, ffn_dim: 64, num_hidden_layers: 2, "
           "num_attention_heads: 4, word_embed_proj_dim: 32, max_position_embeddings: 64}")
    with pytest.raises(SystemExit) as info:
        train.main([f"trainer.output_dir={tmp_path / 'out'}", *INLINE, f"ref.config={opt}",
                    "ref.packing=true"])
    stderr = capsys.readouterr().err
    assert info.value.code == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith("error: ref.packing: model type 'opt' does not read packed"), stderr
    # Left to the default, the same model runs padded.
    train.main([*INLINE, f"ref.config={opt}"])
    assert len(jobs) == 1 and capsys.readouterr().err == ""


@pytest.mark.parametrize("value", ["0", "9", "-3"])
def test_an_expected_response_length_outside_1_to_max_new_tokens_is_one_line(jobs, capsys,
                                                                             value):
    # ppo_tiny: ppo.max_new_tokens=8. The planner and the trainer read the same key.
    for main in (train.main, plan.main):
        with pytest.raises(SystemExit) as info:
            main([*INLINE, f"ppo.expected_response_length={value}"])
        stdout, stderr = capsys.readouterr()
        assert info.value.code == 2 and stdout == "" and stderr.count("\n") == 1, stderr
        assert stderr == (f"error: ppo.expected_response_length: got {value}; allowed: null or "
                          "an integer from 1 to ppo.max_new_tokens=8\n")
    assert jobs == []
    plan.main([*INLINE, "ppo.expected_response_length=8"])
    assert "ppo.expected_response_length=8)" in capsys.readouterr().out


# GPT-2 indexes a table of 64 positions: a longer sequence fails at its first forward.
GPT2_64 = ("{model_type: gpt2, n_embd: 64, n_layer: 2, n_head: 2, n_positions: 64, "
           "bos_token_id: 1, eos_token_id: 2}")
SHORT_MODEL = TINY_MODEL.replace("max_position_embeddings: 64", "max_position_embeddings: 12")


@pytest.mark.parametrize("argv, says", [
    ([*INLINE, f"actor.config={GPT2_64}", "ppo.max_new_tokens=60"],
     "68 tokens (data.max_prompt_length=8 + ppo.max_new_tokens=60) exceed actor's "
     "max_position_embeddings=64; allowed: at most 64 tokens in all (ppo.max_new_tokens=56 "
     "here), or a model with more positions"),
    # Every model the run builds: here the reward model has fewer positions than the actor.
    ([*INLINE, f"reward.config={SHORT_MODEL}"],
     "16 tokens (data.max_prompt_length=8 + ppo.max_new_tokens=8) exceed reward's "
     "max_position_embeddings=12; allowed: at most 12 tokens in all (ppo.max_new_tokens=4 here)"),
    # Prompts from files are bounded by data.max_prompt_length (the demo's models: 64 positions).
    (["data.max_prompt_length=60"], "68 tokens (data.max_prompt_length=60 + "
                                    "ppo.max_new_tokens=8) exceed actor's "
                                    "max_position_embeddings=64; allowed: at most 64 tokens in "
                                    "all (ppo.max_new_tokens=4 here)"),
])
def test_a_sequence_longer_than_a_model_takes_is_one_line_before_anything_starts(
        jobs, capsys, tmp_path, argv, says):
    for main in (train.main, plan.main):
        with pytest.raises(SystemExit) as info:
            main([f"trainer.output_dir={tmp_path / 'out'}", *argv])
        stdout, stderr = capsys.readouterr()
        assert info.value.code == 2 and stderr.count("\n") == 1, stderr
        assert stderr.startswith(f"error: ppo.max_new_tokens: {says}"), stderr
    assert jobs == [] and list(tmp_path.iterdir()) == []


VLLM_MODEL = ("{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
              "num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 64}")
VLLM_RUN = [f"actor.config={VLLM_MODEL}", "reward.path=null", "data.train_files=null",
            "data.max_prompt_length=8", "rollout.engine=vllm"]
GEMMA2 = ("{{model_type: gemma2, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
          "num_attention_heads: 2, num_key_value_heads: 2, head_dim: 32, "
          "max_position_embeddings: 64, tie_word_embeddings: {tied}}}")


@pytest.mark.parametrize("bad, named", [
    (["rollout.gpu_memory_utilization=0"], "rollout.gpu_memory_utilization"),
    (["rollout.gpu_memory_utilization=1.5"], "rollout.gpu_memory_utilization"),
    (["rollout.gpu_memory_utilization=most"], "rollout.gpu_memory_utilization: got 'most'; "
                                              "allowed: auto or a number"),
    (["rollout.max_num_seqs=0"], "rollout.max_num_seqs"),
])
def test_a_rollout_value_out_of_range_is_one_line_naming_the_key(jobs, capsys, bad, named):
    with pytest.raises(SystemExit) as info:
        train.main([*VLLM_RUN, *bad])
    stderr = capsys.readouterr().err
    assert info.value.code == 2 and stderr.count("\n") == 1 and named in stderr, stderr
    assert jobs == []


def test_vllm_not_installed_is_one_line_naming_the_extra(jobs, capsys, monkeypatch):
    from rlhf_paro.rollout import vllm

    monkeypatch.setattr(vllm, "installed", lambda: False)
    with pytest.raises(SystemExit) as info:
        train.main(VLLM_RUN)
    stderr = capsys.readouterr().err
    assert info.value.code == 2 and stderr.count("\n") == 1, stderr
    assert "rollout.engine" in stderr and '.[vllm]' in stderr and jobs == []


def _needs_vllm():
    from rlhf_paro.rollout import vllm

    if not vllm.installed():
        pytest.skip('needs the vllm extra: pip install -e ".[vllm]"')


@pytest.mark.parametrize("bad, named, says", [
    # vLLM implements no BioGPT.
    (["actor.config={model_type: biogpt, hidden_size: 64, intermediate_size: 64, "
      "num_hidden_layers: 1, num_attention_heads: 2, max_position_embeddings: 64}"],
     "rollout.engine", "BioGptForCausalLM"),
    # Four heads of 16: below what its CPU attention takes.
    ([f"actor.config={TINY_MODEL}"], "rollout.engine", "head size 16"),
    (["rollout.tensor_parallel_size=3"], "rollout.tensor_parallel_size", "allowed: 1, 2"),
    (["rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size", "allowed: 1"),
    # vLLM's Gemma2 has no output head of its own: an untied actor's would fail at the first sync.
    ([f"actor.config={GEMMA2.format(tied='false')}"], "rollout.engine",
     "vllm's Gemma2ForCausalLM always ties the output head to the embeddings and the actor's is "
     "its own (tie_word_embeddings=false); allowed: hf for this model, or a model with tied "
     "embeddings"),
])
def test_a_run_vllm_cannot_serve_is_one_line_before_anything_starts(jobs, capsys, bad, named,
                                                                      says):
    _needs_vllm()
    with pytest.raises(SystemExit) as info:
        train.main([*VLLM_RUN, *bad])
    stderr = capsys.readouterr().err
    assert info.value.code == 2 and stderr.count("\n") == 1, stderr
    assert named in stderr and says in stderr and jobs == []


@pytest.mark.parametrize("model", [[], [f"actor.config={GEMMA2.format(tied='true')}"]])
def test_a_run_vllm_serves_reaches_the_run(jobs, capsys, model):
    _needs_vllm()
    train.main([*VLLM_RUN, *model])
    assert len(jobs) == 1 and jobs[0].rollout.engine == "vllm"


def test_a_sequence_longer_than_vllm_takes_the_model_at_is_one_line(jobs, capsys, tmp_path):
    # vLLM reads a model's length from several keys of its config and takes the shortest; here
    # seq_length=32 under 64 positions: vLLM would refuse max_model_len=38 when it starts.
    _needs_vllm()
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_paro.rollout import vllm
    from tests import hf_assets

    tokenizer = hf_assets.word_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, seq_length=32)
    assert vllm.engine_max_len(config) == (
        32, "rollout.engine=vllm's max_model_len (the actor config's seq_length)")
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    capsys.readouterr()  # save_pretrained's progress bar
    argv = [*VLLM_RUN[1:], f"actor.path={tmp_path / 'model'}", f"reward.config={VLLM_MODEL}",
            "ppo.max_new_tokens=30"]
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    stderr = capsys.readouterr().err
    assert info.value.code == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith("error: ppo.max_new_tokens: 38 tokens (data.max_prompt_length=8 + "
                             "ppo.max_new_tokens=30) exceed rollout.engine=vllm's "
                             "max_model_len (the actor config's seq_length)=32; "), stderr
    # The hf engine has no limit of its own: the model's 64 positions hold 38 tokens.
    train.main([*argv, "rollout.engine=hf"])
    assert len(jobs) == 1


# An entry point that ends with ``code`` after writing unflushed output, with an exit handler
# and, with ``thread``, a non-daemon thread that writes a file when it ends 0.3 s later.
ENDS = '''
import atexit, sys, threading, time
from pathlib import Path
from rlhf_paro.cli import exit_when_done

out, code, thread = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "thread"
atexit.register(lambda: (out / "atexit").write_text("ran"))

def main():
    sys.stdout.write("unflushed")
    sys.stderr.write("err")
    if thread:
        threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("done")),
                         daemon=False).start()
    if code != "none":
        raise SystemExit(int(code) if code.isdigit() else code)

exit_when_done(main)
'''


@pytest.mark.parametrize("code, status", [("none", 0), ("3", 3), ("a message", 1)])
@pytest.mark.parametrize("thread", [False, True])
def test_an_entry_point_ends_with_its_status_its_output_and_its_exit_handlers(tmp_path, code,
                                                                             status, thread):
    # Buffered output, as a user's pipe gets it (PYTHONUNBUFFERED would hide a lost buffer).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", ENDS, str(tmp_path), code,
                           "thread" if thread else "no"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=env)
    assert done.returncode == status, done.stderr
    assert done.stdout == "unflushed"
    assert done.stderr == "err" + ("a message\n" if code == "a message" else "")
    assert (tmp_path / "atexit").read_text() == "ran"
    # A thread still running is waited for, as Python's own exit does.
    assert (tmp_path / "thread").is_file() == thread
