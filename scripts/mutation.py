"""Mutation testing of the core (docs/testing.md): each mutant is one small change to one module
(an operator, a comparison, a constant, a boolean, a condition, a return value), run against the
quick tests that exercise that module; a mutant the tests do not fail on survives.

    nice -n 10 python scripts/mutation.py                      # every module, results below
    nice -n 10 python scripts/mutation.py --modules rlhf_paro/ppo/pipeline.py --out m.jsonl

The mutants run in a copy of the repository (the working tree is never changed), one at a time,
each in a process forked from one that has imported the third-party packages already (torch's
import alone costs seconds, more than most modules' tests), with ``pytest -x`` and a time limit.
A mutant listed in ``EQUIVALENT`` (keyed by module, function and change) behaves as the
original on every input the program can give it; it is counted apart, not as a survivor.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_LOG = "run.log"  # in the copy: the output of the latest run of the tests

# Each module and the quick tests (pytest arguments, run with ``-m "not slow"`` unless they give
# their own ``-m``, which pytest takes over the first) that exercise it, the fastest first.
MODULES = {
    "rlhf_paro/ppo/pipeline.py": ["tests/ppo/test_pipeline.py"],
    "rlhf_paro/rollout/batch.py": ["tests/rollout/test_batch.py"],
    "rlhf_paro/envs/guess.py": ["tests/envs/test_guess.py"],
    "rlhf_paro/ppo/algorithms.py": ["tests/ppo/test_algorithms.py", "tests/test_cli.py", "-k",
                                    "algorithm"],
    # And the streaming loop's tests, slow: they need a vLLM engine (built once a run).
    "rlhf_paro/rollout/episodes.py": [
        "tests/envs/test_envs.py", "-k", "not bad_environment_input", "-m", "not ray", *(
            f"tests/rollout/test_episodes.py::test_{name}" for name in (
                "greedy_episodes_streamed_are_the_turn_by_turn_ones",
                "a_sampled_episode_is_the_same_alone_as_among_others",
                "no_episode_waits_for_another_s_environment",
                "an_environment_that_fails_or_stalls_is_one_line_and_nothing_is_left_in_flight"))],
    "rlhf_paro/envs/tools.py": ["tests/envs/test_envs.py", "-k", "tool"],
    "rlhf_paro/ppo/core.py": ["tests/ppo/test_core.py"],
    "rlhf_paro/envs/__init__.py": ["tests/envs/test_envs.py", "tests/envs/test_guess.py"],
    "rlhf_paro/batching.py": ["tests/test_batching.py"],
    # Its one quick test is the missing extra's: the served environment's tests are slow (an
    # OpenEnv server a module), all but the one that also runs train on Ray.
    "rlhf_paro/envs/openenv.py": ["tests/envs/test_openenv.py", "-m", "not ray"],
}

# Mutants that cannot change what the program computes: "module:function:change" -> why.
EQUIVALENT: dict[str, str] = {
    # A rollout's tensors are 2-D (B, T) or (B, R): dimension 1 is the last one.
    "rlhf_paro/rollout/batch.py:RolloutBatch.num_tokens:-1 -> 1": "(B, T)",
    "rlhf_paro/rollout/batch.py:RolloutBatch.trimmed:-1 -> 1": "(B, T) and (B, R), twice",
    "rlhf_paro/rollout/batch.py:response_mask:-1 -> 1": "(B, R)",
    "rlhf_paro/envs/guess.py:GuessEnv.step:index < self.secret -> index <= self.secret":
        "index == secret has returned the win the line before",
    "rlhf_paro/ppo/algorithms.py:register_algorithm:return spec -> return None":
        "no caller reads the spec it returns",
    # The closing tag is searched for after the opening one: found, it is at len(OPEN_TAG) or more.
    "rlhf_paro/envs/tools.py:_bodies:end < 0 -> end <= 0": "end is -1 or > len(OPEN_TAG)",
    "rlhf_paro/envs/tools.py:_bodies:0 -> 1": "end is -1 or > len(OPEN_TAG)",
    # num % num_parts == 0 was checked: num / num_parts is the same whole number.
    "rlhf_paro/batching.py:balanced_parts:num // num_parts -> num / num_parts": "exact division",
    # A row's last column is followed by the next row's tokens: same_row excludes it already.
    "rlhf_paro/batching.py:response_predictors:cols < width - 1 -> cols <= width - 1":
        "same_row is false there",
    "rlhf_paro/batching.py:response_predictors:width - 1 -> width + 1": "same_row is false there",
    # .sum(-1) as .sum(1) of a 2-D tensor (the other -1, reshape's, is killed).
    "rlhf_paro/batching.py:balance_groups:-1 -> 1": "(groups, group_size)",
    "rlhf_paro/batching.py:rank_order:num_minis < 1 -> num_minis <= 1": "sets 1 where it is 1",
    # Every sequence is in a bin, and the loop sets its start.
    "rlhf_paro/batching.py:pack:0 -> 1": "overwritten for every sequence",
    # max(..., default=1) differs for no rows only, where no budget (at least 1) is exceeded.
    "rlhf_paro/batching.py:split_by_tokens:0 -> 1": "max_tokens_per_micro_batch >= 1",
    "rlhf_paro/batching.py:pack:-1 -> 1": "(B, T), twice",
    # Every part starts from the same sum: a common offset changes no comparison of the sums.
    "rlhf_paro/batching.py:balanced_parts:0.0 -> 1.0": "the same start for every part",
    # num_minis < 2 sets 1 where it is 1 (the assignment's own 1 -> 2 is killed).
    "rlhf_paro/batching.py:rank_order:1 -> 2": "sets 1 where it is 1",
    # A rollout's rows are whole groups, and every rank holds as many groups: exact divisions.
    "rlhf_paro/batching.py:rank_order:len(num_tokens) // group_size -> len(num_tokens) / "
    "group_size": "rows are whole groups",
    "rlhf_paro/batching.py:rank_order:len(num_tokens) // group_size // num_ranks -> "
    "len(num_tokens) // group_size / num_ranks": "each rank holds as many groups",
    # _encoded returns at most max_total_tokens - length - 1 tokens: the sum is under the budget.
    "rlhf_paro/rollout/episodes.py:_Play.observe:episode.length + len(ids) >= "
    "budget.max_total_tokens -> episode.length + len(ids) > budget.max_total_tokens":
        "never equal to the budget",
    "rlhf_paro/rollout/episodes.py:_Play.observe:episode.length + len(ids) -> episode.length - "
    "len(ids)": "under the budget either way",
    # How long the streaming loop waits for a step when the engine has nothing to decode.
    "rlhf_paro/rollout/episodes.py::0.05 -> 0.1": "a polling interval",
    # Its callers only test its truth: None is as false as False.
    "rlhf_paro/rollout/episodes.py:_Play._end:return False -> return None": "read as a condition",
    # A request asked for more than its room: act cuts the action to the room either way, and
    # with the request's own seed its first tokens are the same (the engine decodes a few more).
    "rlhf_paro/rollout/episodes.py:stream.submit:budget.max_total_tokens - len(context) -> "
    "budget.max_total_tokens + len(context)": "cut to the room in act",
    "rlhf_paro/rollout/episodes.py:run:budget.max_total_tokens - len(c) -> "
    "budget.max_total_tokens + len(c)": "cut to the room in act",
    # Whether the loop waits for a step or goes on decoding: when, not what any call returns.
    "rlhf_paro/rollout/episodes.py:stream:0 if requests else _WAIT_S -> 0 if not requests else "
    "_WAIT_S": "when the loop waits",
    # The first and last ends' defaults, for a rollout without episodes, which none is (the
    # engine's idle time, the key's third site, is killed).
    "rlhf_paro/rollout/episodes.py:_Play.finish:0.0 -> 1.0": "no rollout without episodes",
    # How often a batch of environment calls is checked for one past its deadline: when a
    # timeout is noticed, not what any call returns (the timeout tests allow for it).
    "rlhf_paro/envs/__init__.py::0.05 -> 0.1": "a polling interval",
    # Each call's time is written when it ends, and read only then.
    "rlhf_paro/envs/__init__.py:_Timing:0.0 -> 1.0": "overwritten for every call",
    # max(..., default=1) differs for an empty vocabulary only; a tokenizer has entries.
    "rlhf_paro/envs/__init__.py:Observations.__init__:1 -> 2": "no tokenizer is empty",
    # A mark found at 0 needs an empty rendering of the conversation before it, which always
    # renders its two turns first.
    "rlhf_paro/envs/__init__.py:Observations._rendered:0 -> 1": "the base renders first",
    "rlhf_paro/envs/__init__.py:Observations._rendered:at >= 0 -> at > 0":
        "the base renders first",
    # Its callers only test its truth: None is as false as False.
    "rlhf_paro/envs/__init__.py:takes_seed:return False -> return None": "read as a condition",
    # How often, and from which instant, a served environment's start is waited for: when a
    # server that never starts is given up on, not what a started one answers.
    "rlhf_paro/envs/openenv.py:serve:0.01 -> 0.02": "a polling interval",
    "rlhf_paro/envs/openenv.py:serve:time.monotonic() > deadline -> time.monotonic() >= "
    "deadline": "the deadline's one instant",
    # The per-token tensors of ppo/core.py are (B, T): dimension 1 is the last one.
    "rlhf_paro/ppo/core.py:last_token_index:-1 -> 1": "(B, T), four times",
    "rlhf_paro/ppo/core.py:gae:-1 -> 1": "(B, T)",
    "rlhf_paro/ppo/core.py:_group_outcomes:-1 -> 1": "(B, T)",
    "rlhf_paro/ppo/core.py:agg_count:-1 -> 1": "(B, T)",
    "rlhf_paro/ppo/core.py:aggregate:-1 -> 1": "(B, T), twice",
    # gae with values 0 returns advantages + 0: its two results are the same tensor's values.
    "rlhf_paro/ppo/core.py:_return_to_go:0 -> 1": "returns = advantages when V = 0",
    # masked_whiten takes moments=None as the tensor's own, which the identity passes.
    "rlhf_paro/ppo/core.py:_no_collective:return x -> return None": "None is its own moments",
}

_COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
            ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
            ast.In: ast.NotIn, ast.NotIn: ast.In}
_BINARY = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
           ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult,
           ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.LShift: ast.RShift,
           ast.RShift: ast.LShift}
_BOOL = {ast.And: ast.Or, ast.Or: ast.And}


@dataclass(frozen=True)
class Mutant:
    module: str
    index: int  # the order of its site in the module's tree
    line: int
    function: str  # the enclosing function or class, dotted; "" at module level
    change: str  # "old -> new", in source form

    @property
    def key(self) -> str:
        return f"{self.module}:{self.function}:{self.change}"


def _skipped(tree: ast.AST) -> set[int]:
    """Nodes no mutation touches: docstrings, annotations, strings and f-strings (messages),
    decorators, and the __future__ import."""
    skip: set[int] = set()

    def under(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            under(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            under(node.returns)
            for dec in node.decorator_list:
                under(dec)
        if isinstance(node, ast.ClassDef):
            for dec in node.decorator_list:
                under(dec)
        if isinstance(node, ast.arg):
            under(node.annotation)
        if isinstance(node, ast.AnnAssign):
            under(node.annotation)
        if isinstance(node, ast.JoinedStr):
            under(node)
        if isinstance(node, ast.ImportFrom):
            under(node)
    return skip


def _sites(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """Every (node, kind) a mutation applies to, in a fixed order."""
    skip = _skipped(tree)
    sites = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            sites += [(node, f"cmp{k}") for k, op in enumerate(node.ops) if type(op) in _COMPARE]
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            sites.append((node, "binop"))
        elif isinstance(node, ast.AugAssign) and type(node.op) in _BINARY:
            sites.append((node, "augop"))
        elif isinstance(node, ast.BoolOp):
            sites.append((node, "boolop"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            sites.append((node, "unary"))
        elif isinstance(node, ast.Constant) and not isinstance(node.value, (str, bytes)) \
                and node.value is not Ellipsis:
            sites.append((node, "const"))
        elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
            sites.append((node, "cond"))
        elif isinstance(node, ast.Return) and node.value is not None:
            sites.append((node, "return"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("max", "min"):
            sites.append((node, "minmax"))
    return sites


def _mutate(node: ast.AST, kind: str) -> ast.AST | None:
    """The mutated node (a new one, or ``node`` changed in place); None when the site has no
    mutation of that kind."""
    if kind.startswith("cmp"):
        k = int(kind[3:])
        node.ops[k] = _COMPARE[type(node.ops[k])]()
    elif kind in ("binop", "augop"):
        node.op = _BINARY[type(node.op)]()
    elif kind == "boolop":
        node.op = _BOOL[type(node.op)]()
    elif kind == "unary":
        return node.operand
    elif kind == "const":
        value = node.value
        if isinstance(value, bool):
            node.value = not value
        elif value is None:
            return None
        elif isinstance(value, int):
            node.value = value + 1
        elif isinstance(value, float):
            node.value = value * 2 if value else 1.0
        else:
            return None
    elif kind == "cond":
        node.test = ast.UnaryOp(ast.Not(), node.test)
    elif kind == "return":
        node.value = ast.Constant(None)
    elif kind == "minmax":
        node.func.id = "min" if node.func.id == "max" else "max"
    return node


def _enclosing(tree: ast.AST) -> dict[int, str]:
    """Each node's enclosing function or class, dotted."""
    names: dict[int, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{prefix}.{child.name}" if prefix else child.name
            names[id(child)] = inner
            visit(child, inner)

    visit(tree, "")
    return names


def mutants(module: str, source: str) -> list[tuple[Mutant, str]]:
    """Every mutant of ``module`` (its source given) with its mutated source."""
    out = []
    count = len(_sites(ast.parse(source)))
    for index in range(count):
        tree = ast.parse(source)
        names = _enclosing(tree)
        node, kind = _sites(tree)[index]
        line, function = node.lineno, names.get(id(node), "")
        before = ast.unparse(node)
        parent = _replace_target(tree, node)
        mutated = _mutate(node, kind)
        if mutated is None:
            continue
        if mutated is not node:
            parent(mutated)
        after = ast.unparse(mutated)
        if before == after:
            continue
        ast.fix_missing_locations(tree)
        out.append((Mutant(module, index, line, function, f"{_short(before)} -> {_short(after)}"),
                    ast.unparse(tree)))
    return out


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 80 else text[:77] + "..."


def _replace_target(tree: ast.AST, target: ast.AST):
    """A function that puts a node in ``target``'s place in its parent."""
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is target:
                return lambda new, p=parent, f=field: setattr(p, f, new)
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is target:
                        return lambda new, lst=value, i=i: lst.__setitem__(i, new)
    return lambda new: None


# -- running ---------------------------------------------------------------------------------
def _copy_repository(into: Path) -> Path:
    """The package, tests and what they read, without bytecode (a mutant's file may have the
    size and time of its original's, which a cached .pyc would be taken for)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".git", "wandb", "outputs")
    for name in ("rlhf_paro", "tests", "conf", "examples", "scripts", "docs"):
        if (ROOT / name).exists():
            shutil.copytree(ROOT / name, into / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, into / name)
    return into


def _preload(copy_root: Path, modules: list[str]) -> None:
    """Import the modules under test and their test files once, so that every third-party package
    they use is in memory; then forget our own modules, which each mutant imports afresh."""
    import importlib

    sys.path.insert(0, str(copy_root))
    files = modules + [a for m in modules for a in MODULES[m] if a.endswith(".py")]
    for path in files:
        importlib.import_module(path.removesuffix(".py").replace("/", ".")
                                .removesuffix(".__init__"))
    import pytest  # noqa: F401

    _forget_own()


def _forget_own() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in ("rlhf_paro", "tests"):
            del sys.modules[name]


def _run(copy_root: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    """``pytest -x`` on ``tests`` in a forked process: "passed", "failed" or "timeout", and
    the seconds it took. Its output replaces ``copy_root/run.log`` (shown when the unmutated
    tests fail)."""
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: our modules from the copy, as they are on disk now
        try:
            os.chdir(copy_root)
            log = os.open(copy_root / RUN_LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            import pytest

            # A basetemp of its own: pytest keeps only the last three of its default ones, so
            # a few hundred mutants' runs would delete the folders of a suite run beside them.
            code = pytest.main(["-x", "-q", "-m", "not slow", "-p", "no:cacheprovider",
                                "--basetemp", str(copy_root / "pytest-tmp"), *tests])
            os._exit(int(code))
        except BaseException:  # noqa: BLE001 - any error is a failed run
            os._exit(3)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return ("passed" if code == 0 else "failed"), time.monotonic() - start
        if time.monotonic() - start > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.monotonic() - start
        time.sleep(0.05)


def _report(path: str) -> int:
    """Counts per module of the lines of an earlier run (the last verdict of each mutant), and
    its survivors."""
    last: dict[tuple[str, int], dict] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            last[row["module"], row["index"]] = row
    counts: dict[str, dict[str, float]] = {}
    for row in last.values():
        c = counts.setdefault(row["module"], {"killed": 0, "survived": 0, "equivalent": 0,
                                              "timeouts": 0, "seconds": 0.0})
        verdict = ("killed" if row["run"] != "passed" else
                   "equivalent" if row["key"] in EQUIVALENT else "survived")
        c[verdict] += 1
        c["timeouts"] += row["run"] == "timeout"
        c["seconds"] += row["seconds"]
        if verdict == "survived":
            print(f"  survived  {row['module']}:{row['line']} {row['function']}: {row['change']}")
    for module, c in counts.items():
        live = c["killed"] + c["survived"]
        print(f"{module}: killed {c['killed']} ({c['timeouts']} by the time limit), survived "
              f"{c['survived']}, equivalent {c['equivalent']}, score "
              f"{c['killed'] / live if live else 1:.1%}, {c['seconds']:.0f} s of runs")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", nargs="+", default=list(MODULES), choices=list(MODULES))
    parser.add_argument("--out", default="mutation.jsonl", help="one JSON line per mutant")
    parser.add_argument("--timeout-factor", type=float, default=10.0,
                        help="a mutant's time limit: this times the unmutated run's, at least "
                             "60 s (a shared machine slows a run several times over)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="mutant keys to run (e.g. the survivors of an earlier run)")
    parser.add_argument("--report", metavar="JSONL", default=None,
                        help="no run: the counts per module of an earlier run's lines, with the "
                             "mutants EQUIVALENT lists now counted apart")
    args = parser.parse_args(argv)
    if args.report is not None:
        return _report(args.report)
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    sys.dont_write_bytecode = True
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp, open(args.out, "a") as out:
        copy_root = _copy_repository(Path(tmp))
        _preload(copy_root, args.modules)
        for module in args.modules:
            tests = MODULES[module]
            path = copy_root / module
            original = path.read_text()
            status, seconds = _run(copy_root, tests, timeout=600)
            if status != "passed":
                tail = (copy_root / RUN_LOG).read_text(errors="replace")[-3000:]
                print(f"{module}: its tests fail unmutated ({status}); skipped\n{tail}",
                      flush=True)
                continue
            limit = max(args.timeout_factor * seconds, 60.0)
            counts = {"killed": 0, "survived": 0, "equivalent": 0, "timeouts": 0}
            module_start = time.monotonic()
            todo = mutants(module, original)
            if args.only is not None:
                todo = [(m, s) for m, s in todo if m.key in args.only]
            print(f"{module}: {len(todo)} mutants, unmutated tests {seconds:.1f} s, "
                  f"limit {limit:.0f} s each", flush=True)
            try:
                for mutant, source in todo:
                    path.write_text(source)
                    status, seconds = _run(copy_root, tests, limit)
                    path.write_text(original)
                    verdict = ("killed" if status != "passed" else
                               "equivalent" if mutant.key in EQUIVALENT else "survived")
                    counts[verdict] += 1
                    counts["timeouts"] += status == "timeout"  # counted as killed too
                    out.write(json.dumps({**mutant.__dict__, "key": mutant.key,
                                          "verdict": verdict, "run": status,
                                          "seconds": round(seconds, 1)}) + "\n")
                    out.flush()
                    if verdict == "survived":
                        print(f"  survived  {module}:{mutant.line} {mutant.function}: "
                              f"{mutant.change}", flush=True)
            finally:
                path.write_text(original)
            counts["seconds"] = round(time.monotonic() - module_start)
            print(f"{module}: {counts}", flush=True)
    print(f"total {time.monotonic() - began:.0f} s; the file's counts:", flush=True)
    return _report(args.out)


if __name__ == "__main__":
    sys.exit(main())
