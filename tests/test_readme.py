"""The README's commands as a reader types them, checked without running them (no Ray).

Each ``python -m rlhf_paro.train ...`` or ``python -m rlhf_paro.plan ...`` of the README's command
blocks goes through the entry point in-process with ``--cfg job``, as ``tests/test_cli.py`` does:
the composed, validated config or the one-line error a reader would get for a key, a value or a
combination of keys (``env.reward`` with an environment and a reward model, say). The files a
command names are there: the examples' ``file.py:NAME`` in the repository (read, not imported:
an environment's file may import a large package), and the prompt files written here from the
rows its section documents (``{"prompt": ...}``), whose columns the reward function it names must
take. Model directories (``my/policy``) are the reader's own.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_paro import plan, train, usercode
from rlhf_paro.compose import load_config
from rlhf_paro.ppo import data, rewards

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
ENTRY_POINTS = {"rlhf_paro.train": train.main, "rlhf_paro.plan": plan.main}
FILE_KEYS = ("reward.function", "reward.score_function", "env.function")
DATA_KEYS = ("data.train_files", "data.val_files")
# A command that only prints (help, the composed config) writes no run's folder.
PRINTING = {"--help", "-h", "--cfg"}


def _sections(text: str) -> list[tuple[str, str]]:
    """(title, text) of each ``## `` section; its ``### `` subsections belong to it."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def _commands(section: str) -> list[list[str]]:
    """The entry-point commands of a section's fenced shell blocks, as argv from ``python``; a
    line's continuation (``\\``) joined, comments and ``NAME=value`` environment prefixes
    dropped."""
    blocks, fence, lines = [], None, []
    for line in section.splitlines():
        if line.strip().startswith("```"):
            if fence is None:
                fence, lines = line.strip()[3:], []
            else:
                if fence in ("", "bash"):
                    blocks.append("\n".join(lines))
                fence = None
        elif fence is not None:
            lines.append(line)
    found = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                words.pop(0)
            if words[:2] == ["python", "-m"] and words[2:3] and words[2] in ENTRY_POINTS:
                found.append(words)
    return found


def _documented_rows(section: str) -> list[dict]:
    """The prompt rows a section shows inline (```{"prompt": ...}```), in order."""
    rows = []
    for span in re.findall(r"`(\{[^`]*\})`", section):
        try:
            row = json.loads(span)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "prompt" in row:
            rows.append(row)
    return rows


def _values(argv: list[str], key: str) -> list[str]:
    return [arg.partition("=")[2] for arg in argv if arg.partition("=")[0] == key]


def _write_prompt_files(root: Path, title: str, argv: list[str], copies: int) -> None:
    """Each prompt file ``argv`` names, under ``root``: the first row its section shows,
    ``copies`` times."""
    for key in DATA_KEYS:
        for files in _values(argv, key):
            rows = _documented_rows(dict(SECTIONS)[title])
            assert rows, f"{title!r} names {key}={files} but shows no row of it"
            for file in files.split(","):
                path = root / file
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text((json.dumps(rows[0]) + "\n") * copies)


SECTIONS = _sections(README.read_text())
COMMANDS = [(title, argv) for title, text in SECTIONS for argv in _commands(text)]


def test_the_readme_has_its_commands():
    # The extraction finds the commands that are there: one per task section at least.
    assert len(COMMANDS) >= 15
    titled = {title for title, _ in COMMANDS}
    for task in ("Quick start", "Your own model", "Rewards", "Algorithms", "Rollouts",
                 "Multi-turn agents", "Asynchronous rollouts", "Strategies per model",
                 "Planning a cluster", "Running on a GPU cluster", "Checkpoints and resume"):
        assert any(title.startswith(task) for title in titled), f"no command in {task!r}"


def test_every_run_command_names_a_folder_of_its_own_section():
    # A run in a conf's default folder resumes or collides with whatever ran there before; one
    # folder shared by two sections mixes two readers' tasks in it.
    owner: dict[str, str] = {}
    for title, argv in COMMANDS:
        if argv[2] != "rlhf_paro.train" or PRINTING & set(argv):
            continue
        folders = _values(argv, "trainer.output_dir")
        assert folders, f"{title!r}: {shlex.join(argv)} names no trainer.output_dir"
        for folder in folders:
            assert owner.setdefault(folder, title) == title, \
                f"{folder} is the folder of commands in {owner[folder]!r} and {title!r}"


@pytest.mark.parametrize("title,argv", COMMANDS, ids=[f"{t}:{' '.join(a[3:])[:60]}"
                                                      for t, a in COMMANDS])
def test_each_readme_command_resolves_as_written(title, argv, monkeypatch, tmp_path, capsys):
    # Catches a command that fails as written on its keys: the Blackjack command without
    # env.reward=env next to the default conf's reward model, the one-step-off command on one
    # device without cluster.group_size=1, a misspelt file.py:NAME, a row its function refuses.
    # The reader's folder: the repository's examples, and the prompt files the command names,
    # written from the rows its section documents.
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    args = argv[3:]
    _write_prompt_files(tmp_path, title, args, copies=1)

    monkeypatch.setattr(train, "run", lambda cfg, job: pytest.fail("--cfg job ran a job"))
    shown = args if PRINTING & set(args) else ["--cfg", "job", *args]
    try:
        ENTRY_POINTS[argv[2]](shown)
    except SystemExit as stop:
        pytest.fail(f"{title!r}: {shlex.join(argv)} exits {stop.code}: "
                    f"{capsys.readouterr().err.strip()}")
    assert capsys.readouterr().out.strip()

    if "-m" in args or PRINTING & set(args):  # a sweep's values are not one config
        return
    for key in FILE_KEYS:
        for spec in _values(args, key):
            file, _, name = spec.rpartition(":")
            tree = ast.parse(usercode.function_file(spec, key).read_text())
            defined = {node.name for node in tree.body
                       if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
            assert name in defined, f"{title!r}: {file} defines no {name}"
    for spec in _values(args, "reward.function"):
        cfg = load_config(args)
        row = data.first_row(cfg)
        prompt = row.pop(cfg.data.prompt_key)
        rewards.call_function(usercode.load_function(spec), spec, None, [prompt], [""],
                              {name: [value] for name, value in row.items()})


def test_the_readme_is_a_guide_under_600_lines():
    # Measurements go to docs/benchmarks.md, design to docs/design.md: the README grew to 1,409
    # lines when they sat between its how-to sections.
    assert len(README.read_text().splitlines()) < 600


# --- the commands run, in order (pytest -m guide) ---------------------------------------------

# Commands this machine cannot run as written, and why; the test fails on any other it skips.
NOT_HERE = {
    "Running on a GPU": "needs a CUDA device",
    "Running on a GPU cluster": "needs the reader's Ray cluster (HEAD_IP) and /shared models",
}
# The checkpoints section's run lengths at 1/25 (its saves every 10 steps of 50, the run taken on
# to 60, a resume from step_50): the same sequence of saves, extension and resumes in 3 steps.
SHORTER = {"trainer.save_every=10": "trainer.save_every=1", "trainer.steps=60": "trainer.steps=3"}
RESUMED = ("step_50", "step_2")  # the checkpoint a resume names, inside its path
STEPS = 2
# What the reader's terminal shows is not under test here: no wandb run, no progress bar.
QUIET = ["logger.wandb.mode=disabled", "logger.progress=false"]
SERVER = re.compile(r"^python -m rlhf_paro\.reward_server .*$", re.M)


def _reader_files(root: Path) -> None:
    """What the README's commands name that a reader brings: ``my/policy`` (a causal LM with a
    text tokenizer), ``my/reward_model`` (a sequence classifier with one label, the same
    tokenizer), and each prompt file a command names, the rows its section shows, repeated."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from tests.hf_assets import bpe_tokenizer, llama_config

    tokenizer = bpe_tokenizer()
    for name, cls, extra in (("policy", LlamaForCausalLM, {}),
                             ("reward_model", LlamaForSequenceClassification, {"num_labels": 1})):
        config = llama_config(len(tokenizer), **extra)
        # Room for an episode of six Blackjack hands and the prompts the sections show.
        config.max_position_embeddings = 1024
        directory = root / "my" / name
        cls(config).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    (root / "examples").symlink_to(REPO / "examples")
    for title, argv in COMMANDS:
        _write_prompt_files(root, title, argv, copies=64)


def _not_here(title: str) -> str | None:
    """The ``NOT_HERE`` entry of a section's title: the longest that begins it ("Running on a
    GPU" begins "Running on a GPU cluster" too)."""
    return max((s for s in NOT_HERE if title.startswith(s)), key=len, default=None)


def test_each_section_this_machine_cannot_run_is_its_own_entry():
    assert {_not_here(title) for title, _ in COMMANDS} - {None} == set(NOT_HERE)
    assert _not_here("Running on a GPU cluster") == "Running on a GPU cluster"


def _shortened(argv: list[str]) -> list[str]:
    """``argv`` as the test runs it: the checkpoints section's lengths at 1/25 (``SHORTER``,
    ``RESUMED``), a run ``STEPS`` steps long unless it names its length or resumes a saved step
    (one more), and ``QUIET``."""
    args = [SHORTER.get(arg, arg) for arg in argv]
    args = [sys.executable, *(arg.replace(*RESUMED) for arg in args[1:])]
    if argv[2] != "rlhf_paro.train" or PRINTING & set(args):
        return args
    resumes = [v for v in _values(args, "trainer.resume") if v not in ("none", "auto")]
    if not _values(args, "trainer.steps"):
        args.append(f"trainer.steps={STEPS + 1 if resumes else STEPS}")
    return [*args, *QUIET]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.guide
@pytest.mark.timeout(3600)  # some twenty runs, one after another
def test_the_readme_s_commands_run_in_order_as_a_reader_types_them(tmp_path):
    # Catches a command that resolves but fails as a run (a file it names that its section does
    # not describe, an engine or an environment that breaks at run time, a resume the previous
    # command's folder does not allow) and a section whose runs collide in one folder tree.
    import torch

    from tests.conftest import rows, shared_env

    _reader_files(tmp_path)
    env = shared_env()
    skipped = set()
    for k, (title, argv) in enumerate(COMMANDS):
        section = _not_here(title)
        if section is not None and not (section == "Running on a GPU"
                                        and torch.cuda.is_available()):
            skipped.add(section)
            continue
        args = _shortened(argv)
        # Progress for `pytest -s`: some twenty runs take about 20 minutes.
        print(f"[guide] {k + 1}/{len(COMMANDS)} {title}: {shlex.join(argv[1:])}", flush=True)
        server = None
        if _values(args, "reward.url"):  # the section's server, in the reader's other terminal
            line = SERVER.search(dict(SECTIONS)[title]).group(0)
            server = subprocess.Popen([sys.executable, *shlex.split(line)[1:]], cwd=tmp_path, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True)
            _wait_for_port(8000, server)
        try:
            run = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=900)
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=30)
        where = f"{title!r}: {shlex.join(args)}"
        assert run.returncode == 0, f"{where} exits {run.returncode}:\n{run.stderr[-3000:]}"
        assert run.stdout.strip(), f"{where} printed nothing"
        if argv[2] != "rlhf_paro.train" or PRINTING & set(args):
            continue
        out = tmp_path / _values(args, "trainer.output_dir")[0]
        if "-m" in args[3:]:  # a sweep: a run of the given length per combination
            runs = sorted(out.rglob("metrics.jsonl"))
            assert len(runs) == 6, f"{where} left {len(runs)} runs"
            assert all(rows(r.parent)[-1]["step"] == STEPS - 1 for r in runs), where
            continue
        last = int(_values(args, "trainer.steps")[-1]) - 1  # steps count from 0
        assert rows(out) and rows(out)[-1]["step"] == last, \
            f"{where}: the last metrics row is not step {last}"
    assert skipped == set(NOT_HERE) - ({"Running on a GPU"} if torch.cuda.is_available()
                                       else set())


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the reward server exited: {proc.stderr.read()[-2000:]}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the reward server did not listen on {port} in {timeout_s} s")
