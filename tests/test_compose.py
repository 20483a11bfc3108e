"""Composition: what a user types reaches the run as typed, or is refused in one line.

One parser reads override values for the sweep splitter and the value reader alike
(``compose``'s docstring states the rule); a ``~`` that starts a path is expanded once, when the
config is composed, so the lock, the definition and the outputs share one path; every float key
refuses a value that is not finite. The defects these catch are named at each test (issue 59,
defects 2, 4, 6 and 7).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import tempfile
import typing
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from rlhf_paro import cli, runs, train
from rlhf_paro.compose import load_config, sweep_values
from rlhf_paro import config
from rlhf_paro.config import Config, ConfigError
from tests.confs import INLINE

REPO = Path(__file__).resolve().parent.parent


def _documents(printed: str) -> list[dict]:
    """The configs ``--cfg job`` printed, one YAML document per job."""
    return [yaml.safe_load(doc) for doc in printed.split("# job ")[1:]] or [
        yaml.safe_load(printed)]


def test_cfg_job_prints_hash_apostrophe_and_tilde_as_a_shell_user_typed_them(tmp_path):
    # Defects 2 and 4: " #2" was a YAML comment (the run wrote to runs/exp, which may hold
    # another run), and a "~" the shell left after "key=" stayed literal.
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_paro.train", "--cfg", "job", "trainer.output_dir=runs/exp #2",
         "logger.wandb.name=it's #1 ~x=é", "trainer.resume=~/ckpt/step_2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["trainer"]["output_dir"] == "runs/exp #2"
    assert printed["trainer"]["resume"] == str(tmp_path / "ckpt" / "step_2")
    assert printed["logger"]["wandb"]["name"] == "it's #1 ~x=é"


@pytest.fixture
def started(monkeypatch, tmp_path):
    """``train.main`` as typed, up to Ray's start: ``prepare``, and ``run``'s lock, definition
    and mark of a finished run are the real ones; ``_run`` (Ray, the steps) records the config
    it was given. The working directory and the home are empty directories."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    ran = []
    monkeypatch.setattr(train, "_run", lambda cfg, argv: ran.append(cfg))
    return SimpleNamespace(home=home, cwd=cwd, ran=ran)


@pytest.mark.parametrize("typed, where, not_there", [
    # Defect 2: the run wrote to runs/exp, exit 0.
    ("runs/exp #2", "cwd/runs/exp #2", "cwd/runs/exp/run.lock"),
    # Defect 4: run.lock in the expanded folder, then a traceback (FileNotFoundError:
    # '~/runs/x/definition.yaml'): the definition was written at the literal path.
    ("~/runs/x", "home/runs/x", "cwd/~"),
])
def test_the_lock_the_definition_and_the_outputs_share_the_path_as_typed(started, capsys, typed,
                                                                         where, not_there):
    argv = [*INLINE, f"trainer.output_dir={typed}", "trainer.steps=1"]
    train.main(argv)
    root = started.home.parent
    assert len(started.ran) == 1 and started.ran[0].trainer.output_dir == str(root / where)
    assert sorted(os.listdir(root / where)) == [runs.DEFINITION_FILE, runs.FINISHED_FILE,
                                                runs.LOCK_FILE]
    assert not (root / not_there).exists()
    # The same command again reads the definition where the first wrote it: the same run, done.
    capsys.readouterr()
    train.main(argv)
    assert len(started.ran) == 1
    shown = typed.replace("~", str(started.home), 1)  # the path as composed
    assert capsys.readouterr().out.startswith(f"{shown}: finished, 1 of 1 steps")


def test_a_tilde_starts_a_path_of_every_path_key_once_and_is_text_elsewhere(monkeypatch,
                                                                             tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    typed = {"actor.path": "~/m", "actor.tokenizer": "~", "reward.function": "~/r.py:score",
             "env.tools": "~/tools.py:a,b", "data.train_files": "~/a.jsonl,b.jsonl",
             "data.val_files": "~/v.jsonl", "trainer.output_dir": "~/runs/x",
             "trainer.resume": "~/runs/x/checkpoints/step_2", "task.cache_dir": "~/cache"}
    cfg = load_config([*(f"{key}={value}" for key, value in typed.items()),
                       "logger.wandb.name=~x", "data.apply_chat_template=true"])
    home = str(tmp_path)
    assert (cfg.actor.path, cfg.actor.tokenizer, cfg.reward.function, cfg.env.tools) == (
        f"{home}/m", home, f"{home}/r.py:score", f"{home}/tools.py:a,b")
    assert (cfg.data.train_files, cfg.data.val_files) == (f"{home}/a.jsonl,b.jsonl",
                                                          f"{home}/v.jsonl")
    assert (cfg.trainer.output_dir, cfg.trainer.resume, cfg.task.cache_dir) == (
        f"{home}/runs/x", f"{home}/runs/x/checkpoints/step_2", f"{home}/cache")
    assert cfg.logger.wandb.name == "~x"  # not a path: as typed
    assert load_config(["trainer.output_dir=runs/~x"]).trainer.output_dir == "runs/~x"
    with pytest.raises(ConfigError) as info:
        load_config(["trainer.output_dir=~zq_no_such_user/x"])
    assert str(info.value).startswith("trainer.output_dir: '~zq_no_such_user/x' starts with "
                                      "~zq_no_such_user, the home of no user here; allowed:")
    # One table names every path key and its kind; each kind is expanded above.
    assert {config.PATH_KEYS[key] for key in typed} == set(config.PATH_KEYS.values())


def test_a_sweep_of_tilde_paths_names_each_job_s_directory_under_its_home(monkeypatch,
                                                                         tmp_path, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    train.main(["--cfg", "job", "-m", "trainer.output_dir=~/sweep", "trainer.seed=1,2"])
    printed = _documents(capsys.readouterr().out)
    assert [doc["trainer"]["output_dir"] for doc in printed] == [
        f"{tmp_path}/sweep/0_trainer.seed=1", f"{tmp_path}/sweep/1_trainer.seed=2"]


def test_an_apostrophe_inside_a_word_is_a_letter_so_the_comma_after_it_sweeps(capsys):
    # Defect 7: the apostrophe opened a quote, so -m ran one job named "it's,b", and without -m
    # the value was taken where "a,b" is refused as a sweep.
    train.main(["--cfg", "job", "-m", "logger.wandb.name=it's,b"])
    assert [doc["logger"]["wandb"]["name"] for doc in _documents(capsys.readouterr().out)] == [
        "it's", "b"]
    with pytest.raises(SystemExit) as info:
        train.main(["--cfg", "job", "logger.wandb.name=it's,b"])
    stdout, stderr = capsys.readouterr()
    assert info.value.code == 2 and stdout == ""
    assert stderr == ("error: logger.wandb.name: \"it's,b\" is a sweep; allowed: -m to run one "
                      "job per value, a list [it's,b], or a quoted string 'it''s,b'\n")
    train.main(["--cfg", "job", "logger.wandb.name='it''s,b'"])  # as the error says
    assert yaml.safe_load(capsys.readouterr().out)["logger"]["wandb"]["name"] == "it's,b"


@pytest.mark.parametrize("typed, says", [
    ("trainer.output_dir=runs/x ", "'runs/x ' starts or ends with a space; allowed: the value "
                                   "without it, or quoted to keep it: 'runs/x '"),
    ("logger.wandb.name='abc", "opens a quote it never closes"),
    ("logger.wandb.name='a'b", "'a'b\" goes on after its closing '"),
    ("logger.wandb.tags=[a #1]", "a # after a space inside [ ] or { } starts a YAML comment"),
    ("logger.wandb.tags=[a, b", "opens a [ it never closes"),
    ("logger.wandb.name=a\nb", "holds '\\n', a control character"),
    ("ppo.ppo_epochs=2 #3", "expected an integer, got '2 #3'"),
])
def test_what_the_parser_cannot_keep_as_typed_is_one_line_naming_the_key(capsys, typed, says):
    with pytest.raises(SystemExit) as info:
        train.main(["--cfg", "job", typed])
    stdout, stderr = capsys.readouterr()
    assert info.value.code == 2 and stdout == "" and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"error: {typed.split('=')[0]}: ") and says in stderr, stderr


def _float_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every key of the schema that holds a float: a number, a number or a word, or numbers."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += _float_keys(tp, f"{prefix}{f.name}.")
        elif float in (tp, *typing.get_args(tp)):
            keys.append(f"{prefix}{f.name}")
    return keys


FLOAT_KEYS = _float_keys()


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_refuses_inf_as_it_refuses_nan(key):
    # Defect 6: actor.optim.lr=.inf (and temperature, clip, eps, max_grad_norm, kl_coef) ran
    # and failed at step 1 blaming the actor; ppo.temperature=.inf ran three steps, exit 0.
    betas = key.endswith("betas")
    for text in (".nan", ".inf", "-.inf", "1e999", "1" + "0" * 400):
        value = f"[0.9, {text}]" if betas else text
        with pytest.raises(ConfigError) as info:
            load_config([*INLINE, f"{key}={value}"])
        message = str(info.value)
        assert message.startswith(f"{key}: got ") and "\n" not in message, message
        assert "allowed: auto or a number" in message if key.endswith("gpu_memory_utilization") \
            else "allowed: a finite number" in message, message


def test_a_non_finite_float_stops_the_command_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as info:
        train.main(["--cfg", "job", "ppo.temperature=.inf"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: ppo.temperature: got inf; allowed: a finite number\n"
    # A key without a limit takes null where the schema allows it.
    assert load_config(["ray.placement_timeout_s=null"]).ray.placement_timeout_s is None
    with pytest.raises(ConfigError, match=r"^ray.placement_timeout_s: got inf; allowed: a finite "
                                          r"number or null$"):
        load_config(["ray.placement_timeout_s=.inf"])


# --- fuzz: generated text typed after key= --------------------------------------------------------

# Characters that mean something to YAML, a shell, the sweep splitter or a path, and a few that
# are neither ASCII nor printable, with any unicode besides.
SPECIAL = list("ab07 .,#~'\"=[]{}:-/\\$!&*%@|>?`") + ["é", "漢", "😀", "\t", "\n", "\x00",
                                                       "\u2028", "\ufeff", "\udcff"]
TYPED = st.text(st.sampled_from(SPECIAL) | st.characters(), max_size=12)
# String keys: one without a ~ (optional), a path (required) and a path the definition records.
KEYS = ("logger.wandb.name", "trainer.output_dir", "actor.path")
PATHS = ("trainer.output_dir", "actor.path")
NULLS = ("", "null", "Null", "NULL")


@pytest.fixture(scope="module")
def scratch():
    """A conf of few keys (composing ppo_tiny's defaults costs most of a config), and a
    directory for definitions."""
    with tempfile.TemporaryDirectory() as root:
        conf = Path(root) / "fuzz.yaml"
        conf.write_text("actor: {config: {hidden_size: 8}}\n")
        yield SimpleNamespace(conf=f"conf={conf}", out=Path(root) / "run")


def _composed(argv: list[str], key: str) -> tuple[object, str | None]:
    """(the composed value of ``key``, None), or (None, the one-line refusal)."""
    try:
        cfg = load_config(argv)
    except ConfigError as err:
        return None, str(err)
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value, None


@settings(max_examples=250, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(key=st.sampled_from(KEYS), typed=TYPED)
@example(key="trainer.output_dir", typed="runs/exp #2")  # defect 2
@example(key="logger.wandb.name", typed="it's,b")  # defect 7
@example(key="actor.path", typed="~/m")  # defect 4
def test_typed_text_is_what_the_config_and_its_definition_hold_or_one_line(scratch, key, typed):
    """The value after composition is the text as typed (a path's leading ~ expanded) or the
    override is refused in one line naming the key; a value plain by the rule (no space at its
    ends, no control character, not a sweep, not quoted, not a list or mapping) is never
    refused; the definition a run records holds it; the sweep splitter and the value reader
    agree on how many values it is."""
    assume("${" not in typed)  # an interpolation, resolved by design
    argv = [scratch.conf, f"{key}={typed}"]
    value, refused = _composed(argv, key)
    if refused is not None:  # named by its key, or a section's check by the section
        assert key.startswith(refused.split(": ")[0]) and "\n" not in refused, refused
    try:
        values = sweep_values(key, typed)
    except ConfigError:
        values = None  # malformed for the splitter: the reader refuses it too
    if values is None or len(values) > 1:
        assert refused is not None, (typed, value)
        if values:  # -m: one job per value, none of them a sweep again
            jobs = cli._jobs(argv)
            assert len(jobs) == len(values)
            for job in jobs:
                assert "is a sweep" not in (_composed(job.argv, key)[1] or "")
        return
    plain = not (typed[:1] and typed[:1] in "'\"[{") and typed == typed.strip() and not any(
        unicodedata.category(c) in ("Cc", "Cs") for c in typed)
    if not plain:
        if refused is not None:
            return
        text = yaml.safe_load(typed)  # taken: a quoted string, YAML's quoting
    else:
        text = None if typed in NULLS else typed
    if key in PATHS and isinstance(text, str) and text.startswith("~"):
        if os.path.expanduser(text) == text:  # ~user of no user here
            assert refused is not None and "the home of no user here" in refused, refused
            return
        text = os.path.expanduser(text)
    if refused is not None:  # only null, for a key that needs a value
        assert plain and text is None and key != "logger.wandb.name", (typed, refused)
        return
    assert value == text, (typed, value)
    if key == "actor.path" and value is not None:
        cfg = load_config(argv)
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(
            cfg.trainer, output_dir=str(scratch.out)))
        scratch.out.mkdir(exist_ok=True)
        runs.record_definition(cfg)
        recorded = yaml.safe_load((scratch.out / runs.DEFINITION_FILE).read_text())
        assert recorded["actor.path"] == value


def test_the_resume_command_a_stopped_run_prints_reads_back_its_checkpoint_path():
    # Typed as printed, a checkpoint under an output directory with a comma in its name was a
    # sweep; the path is quoted only where the parser would not keep it as typed.
    for path in ("/runs/a,b/checkpoints/step_2", "/runs/exp #2/checkpoints/step_2"):
        command = train.resume_command(["trainer.output_dir=runs/x"], path)
        argv = shlex.split(command)[3:]
        assert load_config(argv).trainer.resume == path, command
    assert command.endswith(" 'trainer.resume=/runs/exp #2/checkpoints/step_2'")
