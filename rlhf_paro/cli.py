"""The command line of the entry points (``rlhf_paro.train``, ``rlhf_paro.plan``).

    python -m rlhf_paro.<entry> [-h|--help] [--cfg job|step] [-m|--multirun] [conf=NAME]
                                [override ...]

``--help`` lists every key with the value this command line gives it and its comment from
``config.py``; ``--cfg job`` prints the config as YAML and runs nothing; ``--cfg step`` prints
the plan of one training step (``ppo/step.py``: its calls, what each reads and gives, the
speed-ups the config allows) and runs nothing. They show the config as composed, before
``prepare`` resolves it: a demo asset not made yet is ``${demo:NAME}``, and nothing is made or
written. ``-m`` runs one job per combination of the values of every swept override
``key=a,b,c`` (the cartesian product, the first swept key varying slowest), one after another;
job k writes to
``<trainer.output_dir>/<k>_<key=value,...>``, the swept overrides as typed, with every character
a file name should not hold made ``_`` (``0_actor.strategy=IGG,critic.strategy=NIG``).
Every job is built and checked before the first one runs.
"""

from __future__ import annotations

import ast
import atexit
import dataclasses
import inspect
import io
import itertools
import os
import re
import sys
import threading
import tokenize
from pathlib import Path
from typing import Any, Callable, NamedTuple, NoReturn

import yaml
from omegaconf import OmegaConf

from rlhf_paro.compose import (
    available_confs, load_config, parse_overrides, quoted, register_resolver, sweep_values,
)
from rlhf_paro.config import Config, ConfigError, NothingToRun, cli_errors

OVERRIDES = """\
overrides, applied in order:
  key=value            set a key (inside a model's inline config, add one too)
  +key=value           add a key to a model's inline config, e.g. +actor.config.rms_norm_eps=1e-5
  ~key                 delete a key; a key of the schema is back at its default
  key=${other.key}     interpolation: another key's value; ${oc.env:NAME}: an environment variable
values, as typed after the first "=" (# ~ = : spaces, it's and unicode are kept):
  text, 3, 1e-5, true  a string key's value is its text (007 stays 007); another key's a number,
                       true/false or text; null (or nothing) is null
  'a b' "a b"          a quoted string: the quote starts the value and ends it ('it''s')
  [a, b]  {a: 1}       a list or mapping (YAML's flow syntax)
  a,b                  commas outside quotes, [ ], { } and ${ } separate a sweep's values (-m)
  ~/path               a path key's leading ~ is the home directory (~user: that user's)
  refused, in one line: a space at a value's start or end (quote it), an unclosed quote or
  bracket, text after a closing one, a control character
options:
  -h, --help           this text
  --cfg job            print the config of this command line as YAML; runs nothing
  --cfg step           print the plan of one training step (its calls); runs nothing
  -m, --multirun       one job per combination of the values of every key=a,b,c (the product),
                       one after another; job k writes to <trainer.output_dir>/<k>_<key=value,...>"""


class Job(NamedTuple):
    name: str  # the swept overrides, "key=value,..."; "" when nothing is swept
    argv: list[str]  # conf and overrides, one value each


def main(argv: list[str], *, prog: str, about: str, prepare: Callable[[Config, str], Config],
         execute: Callable[[Config, list[str]], None]) -> None:
    """Run ``prog``'s command line: ``prepare(cfg, conf)`` checks one job and returns the
    config to run (raising ``ConfigError`` for a user's mistake), ``execute(cfg, job_argv)``
    runs it; ``job_argv`` is the command line of that job alone (a multirun job's values and
    output directory). A job whose ``prepare`` raises ``NothingToRun`` is skipped, its line
    printed. ``--help`` and ``--cfg`` stop before ``prepare``: they make and write
    nothing."""
    register_demo_resolver()
    with cli_errors():
        show_help, show_cfg, multirun, args = _options(argv)
        jobs = _jobs(args) if multirun else [Job("", args)]
        if show_help:
            print(help_text(prog, about, jobs[0].argv))
            return
        configs = [load_config(job.argv) for job in jobs]
        if multirun:
            for k, (job, cfg) in enumerate(zip(jobs, configs)):
                cfg.trainer.output_dir = str(Path(cfg.trainer.output_dir) / _job_dir(k, job.name))
        if show_cfg:
            for k, (job, cfg) in enumerate(zip(jobs, configs)):
                header = f"# job {k}: {job.name or 'nothing swept'}\n" if multirun else ""
                if show_cfg == "step":  # torch's import: a second no other command line waits
                    from rlhf_paro.ppo import step
                shown = (OmegaConf.to_yaml(cfg.to_dict()) if show_cfg == "job" else
                         step.describe(cfg) + "\n")
                print(header + shown, end="")
            return
        ready: list[Config | None] = []
        for job, cfg in zip(jobs, configs):
            try:
                ready.append(prepare(cfg, parse_overrides(job.argv)[0]))
            except NothingToRun as done:  # said in its line, and skipped
                print(done, flush=True)
                ready.append(None)
        for k, (job, cfg) in enumerate(zip(jobs, ready)):
            if cfg is None:
                continue
            job_argv = job.argv
            if multirun:
                print(f"[{prog}] job {k}: {job.name or 'nothing swept'}", flush=True)
                # Quoted: the job's directory names its values, commas and all, which would
                # read as a sweep when ``run`` composes the job's definition from its argv.
                job_argv = [*job.argv, f"trainer.output_dir={quoted(cfg.trainer.output_dir)}"]
            execute(cfg, job_argv)


def exit_when_done(main: Callable[[], None]) -> NoReturn:
    """Run an entry point's ``main`` as ``python -m`` does, then end the process with its exit
    status without Python's teardown of the interpreter.

    When ``main`` returns or exits, the command's work is done: its files are closed, its Ray
    workers stopped, its lines printed. What Python does after that is free the modules of
    torch, Ray and transformers one object at a time: about a second a run spent on nothing
    (1.1 s of a 12 s ``rlhf_paro.train`` run, 1.8 s of a vLLM one, on a 2-core machine). The exit
    handlers still run (``atexit``: logging's flush among them) and the standard streams are
    flushed. A thread of a library still running, or an exit that is not a status (an
    exception, Ctrl-C, a message), gets Python's usual exit instead.
    """
    try:
        main()
        status: Any = 0
    except SystemExit as done:
        status = 0 if done.code is None else done.code
    others = [t for t in threading.enumerate()
              if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if others or not isinstance(status, int):
        raise SystemExit(status)
    atexit._run_exitfuncs()  # noqa: SLF001 - the handlers Python would run at exit
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def register_demo_resolver() -> None:
    """``${demo:NAME}`` in the confs: the demo asset's cached path, or the reference itself until
    ``prepare`` makes it (``rlhf_paro.resolve``)."""
    from rlhf_paro.ppo import demo

    register_resolver("demo", demo.resolver)


def _options(argv: list[str]) -> tuple[bool, str, bool, list[str]]:
    """(--help, what --cfg shows: "job", "step" or "", -m, the other arguments)."""
    show_help = multirun = False
    show_cfg = ""
    args = []
    rest = iter(argv)
    for arg in rest:
        if arg in ("-h", "--help"):
            show_help = True
        elif arg in ("-m", "--multirun"):
            multirun = True
        elif arg in ("-c", "--cfg") or arg.startswith("--cfg="):
            what = arg.partition("=")[2] if "=" in arg else next(rest, "")
            if what not in ("job", "step"):
                raise ConfigError("--cfg", f"got {what!r}; allowed: job, step")
            show_cfg = what
        elif arg.startswith("-"):
            raise ConfigError(arg, "unknown option; allowed: -h/--help, --cfg job|step, "
                                          "-m/--multirun, then conf=NAME and overrides")
        else:
            args.append(arg)
    return show_help, show_cfg, multirun, args


def _jobs(args: list[str]) -> list[Job]:
    """One job per combination of the values of the swept arguments, the first slowest."""
    choices = []
    for arg in args:
        head, sep, text = arg.partition("=")
        sweep = sep and not arg.startswith("~")
        values = sweep_values(head.lstrip("+").strip(), text) if sweep else [text]
        choices.append([(arg, False)] if len(values) == 1 else
                       [(f"{head}={value}", True) for value in values])
    return [Job(",".join(a for a, swept in combo if swept), [a for a, _ in combo])
            for combo in itertools.product(*choices)]


def _job_dir(k: int, name: str) -> str:
    # One path component (no "/"), and within the 255 bytes a file name may have.
    safe = re.sub(r"[^\w.,=+-]", "_", name, flags=re.ASCII)[:200]
    return f"{k}_{safe}" if safe else str(k)


# --- --help -------------------------------------------------------------------------------------

def help_text(prog: str, about: str, argv: list[str]) -> str:
    cfg = load_config(argv)
    rows = [(f"{key}={_flow(value)}", comment) for key, value, comment in _leaves(cfg, "")]
    width = min(max(len(left) for left, _ in rows), 44)
    return "\n".join([
        f"usage: python -m {prog} [-h] [--cfg job|step] [-m] [conf=NAME|conf=FILE.yaml] "
        "[override ...]", "", about.strip(), "", OVERRIDES, "",
        f"confs (conf=NAME): {', '.join(available_confs())}", "",
        f"keys, with their values under conf={parse_overrides(argv)[0]} and the overrides given:",
        *(f"  {left:<{width}}  # {comment}" for left, comment in rows)])


def _leaves(obj: Any, prefix: str) -> list[tuple[str, Any, str]]:
    """(dotted key, value, comment) of every field below the dataclass ``obj``, in order."""
    comments = field_comments(type(obj))
    rows = []
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            rows += _leaves(value, f"{key}.")
        else:
            rows.append((key, value, comments.get(f.name, "")))
    return rows


def _flow(value: Any) -> str:
    """A value as YAML on one line, as it would be written on the command line."""
    value = list(value) if isinstance(value, tuple) else value
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), sort_keys=False)
    return text.removesuffix("...\n").strip()  # a bare scalar comes with an end-of-document mark


def field_comments(cls: type) -> dict[str, str]:
    """The comment of each field of a dataclass in its source: the one on the field's line, or
    else the comment lines right above it. The source stays the one place a key is explained."""
    lines, _ = inspect.getsourcelines(cls)
    source = "".join(lines)
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    found = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        line = node.lineno
        above = []
        while line - 1 in comments and lines[line - 2].lstrip().startswith("#"):
            line -= 1
            above.insert(0, comments[line])
        found[node.target.id] = comments.get(node.lineno) or " ".join(above)
    return found
