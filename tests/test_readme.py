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
from pathlib import Path

import pytest

from rlhf_paro import plan, train
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
    section = dict(SECTIONS)[title]
    for key in DATA_KEYS:
        for files in _values(args, key):
            rows = _documented_rows(section)
            assert rows, f"{title!r} names {key}={files} but shows no row of it"
            for file in files.split(","):
                path = tmp_path / file
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(rows[0]) + "\n")

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
            tree = ast.parse(rewards.function_file(spec, key).read_text())
            defined = {node.name for node in tree.body
                       if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
            assert name in defined, f"{title!r}: {file} defines no {name}"
    for spec in _values(args, "reward.function"):
        cfg = load_config(args)
        row = data.first_row(cfg)
        prompt = row.pop(cfg.data.prompt_key)
        rewards.call_function(rewards.load_function(spec), spec, None, [prompt], [""],
                              {name: [value] for name, value in row.items()})


def test_the_readme_is_a_guide_under_600_lines():
    # Measurements go to docs/benchmarks.md, design to docs/design.md: the README grew to 1,409
    # lines when they sat between its how-to sections.
    assert len(README.read_text().splitlines()) < 600
