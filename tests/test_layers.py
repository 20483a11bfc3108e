"""Rule 12: layers point one way; no module of ``rlhf_paro`` imports from a layer above its own,
and no modules import one another in a cycle, in a layer or across.

Every ``import`` and ``from`` statement counts, at the top of a module, inside a function or under
``TYPE_CHECKING``: an import deferred to call time still ties the lower layer to the upper one.

    0  comm       metered collectives and ring schedules
    1  sharding   strategies, topology, the engine and its cost model
    2  config     the typed config of every component (``config``: the schema) and how it is
                  composed from confs and the command line (``compose``). It validates
                  strategies with ``sharding``, so it sits above it; every layer from here up
                  reads it. Names it cannot check without the math (KL estimators) are checked
                  when the config is resolved. ``usercode``: the user's ``file.py:NAME``
                  (reward functions, environments, tools) loaded, below both ``ppo`` and
                  ``envs``, which read it.
    3  ppo        what a worker is made of, without Ray: the PPO math, the task, the reward
                  model (``ppo/``), and
                  - ``resolve``: the config's last step, which makes the demo's assets, checks
                    the files and sets the values the algorithm and the models derive.
                  - ``models``: the four ``nn.Module``s built from a config section. Nothing in
                    them is Ray or the PPO loop, so they are below ``actors``; ``ppo`` prepares
                    the reward model by building and training one, so they are not above ``ppo``.
                  - ``weights``: where a model's weights come from when it is read from files
                    (``models`` builds its reader); below ``actors`` with ``models``.
                  - ``rollout``: the engines that generate on an actor rank and the batches
                    they make; the task's score reads their layout, so below ``ppo`` (and
                    ``resolve``): nothing of them is imported there (``BELOW``).
                  - ``metrics``: the per-rank report the workers fill and its fold into a row;
                    plain data that ``actors`` imports, so below it.
    4  actors     the Ray workers of the four models and their placement, and the same workers
                  in one process (``actors/local.py``)
    5  the PPO loop that drives the workers (``trainer``), where they live (``cluster``: Ray's
       groups or this process) and its checkpoints (``resume``), where its rollouts come from
       (``sources``: the actor's ranks or replicas of their own), the entry points (``train``,
       ``plan``, ``report``) with their command line (``cli``), and what a run reads and
       writes besides metrics (``runs``: prompts, evaluation, exports)

Modules of one layer may import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "rlhf_paro"

# A module's layer is that of the longest entry its dotted name starts with.
LAYERS = {
    "rlhf_paro": 0,  # the package root runs before any of its modules: it imports nothing of ours
    "rlhf_paro.comm": 0,
    "rlhf_paro.sharding": 1,
    "rlhf_paro.config": 2,
    "rlhf_paro.compose": 2,
    "rlhf_paro.usercode": 2,  # file.py:NAME of the command line, loaded for ppo and envs alike
    "rlhf_paro.resolve": 3,
    "rlhf_paro.models": 3,
    "rlhf_paro.batching": 3,  # the rollout's layout and the packed one (pure torch)
    "rlhf_paro.weights": 3,
    "rlhf_paro.metrics": 3,
    "rlhf_paro.ppo": 3,
    "rlhf_paro.rollout": 3,  # the rollout engines and their batches (no Ray)
    "rlhf_paro.envs": 3,  # multi-turn environments: the contract and its runner (no Ray)
    "rlhf_paro.actors": 4,
    "rlhf_paro.trainer": 5,
    "rlhf_paro.sources": 5,  # the trainer's rollout sources (Ray groups of actors)
    "rlhf_paro.cluster": 5,  # where the trainer's workers live: Ray's groups or this process
    "rlhf_paro.resume": 5,  # the trainer's checkpoints: saved, verified, loaded
    "rlhf_paro.ends": 5,  # how a run ends early, in one line
    "rlhf_paro.train": 5,
    "rlhf_paro.cli": 5,
    "rlhf_paro.plan": 5,
    "rlhf_paro.report": 5,
    "rlhf_paro.reward_server": 5,  # an entry point: serves a reward function
    "rlhf_paro.runs": 5,
}

def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_entry(name: str) -> str:
    """The LAYERS key that decides ``name``'s layer."""
    return max((key for key in LAYERS if _within(name, key)), key=len)


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported_names(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of everything ``module`` imports from ``rlhf_paro``, anywhere in it.

    ``from a.b import c`` yields ``a.b.c``: ``c`` may be a module (``from rlhf_paro import
    models``) or a name in ``a.b``; the layer lookup by prefix treats both alike.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, minus one level per extra dot
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in names if _within(name, "rlhf_paro")]


def test_every_module_has_a_layer():
    # A new top-level module or subpackage must be placed in LAYERS, not fall to the root's 0.
    unplaced = [name for name in modules()
                if name != "rlhf_paro" and layer_entry(name) == "rlhf_paro"]
    assert not unplaced, f"add to LAYERS: {unplaced}"


def test_nothing_imports_from_a_layer_above_its_own():
    upward = []
    for module, path in modules().items():
        entry = layer_entry(module)
        for line, name in imported_names(module, path):
            target = layer_entry(name)
            if LAYERS[target] <= LAYERS[entry]:
                continue
            where = f"{path.relative_to(PACKAGE_DIR.parent)}:{line}"
            upward.append(f"{where} imports {name} (layer {LAYERS[target]}, {target}) "
                          f"from layer {LAYERS[entry]} ({entry})")
    assert not upward, "imports pointing up a layer:\n" + "\n".join(upward)


# Inside layer 3 the rollout sits below ppo: the task and the demo read the rollout's layout
# (``rollout.batch``), so what an engine needs of ppo or of resolve (the actor's vocabulary, its
# Hugging Face config) comes in as an argument (``rollout.check``), never by an import.
BELOW = {"rlhf_paro.rollout": ("rlhf_paro.ppo", "rlhf_paro.resolve")}


def test_the_rollout_imports_nothing_of_ppo_or_resolve():
    upward = []
    for module, path in modules().items():
        for lower, uppers in BELOW.items():
            if not _within(module, lower):
                continue
            upward += [f"{path.relative_to(PACKAGE_DIR.parent)}:{line} imports {name}"
                       for line, name in imported_names(module, path)
                       if any(_within(name, upper) for upper in uppers)]
    assert not upward, "imports pointing up inside layer 3:\n" + "\n".join(upward)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports through any chain of imports of ``graph``."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_rollout_reaches_nothing_of_ppo_or_resolve_through_any_chain():
    # The direct check above misses a chain through a third package: rollout/episodes.py
    # imported envs, which loaded the user's environment through ppo.rewards.
    graph = import_graph(modules())
    upward = [f"{module} reaches {target}" for module in graph for lower, uppers in BELOW.items()
              if _within(module, lower) for target in sorted(reachable(graph, module))
              if any(_within(target, upper) for upper in uppers)]
    assert not upward, "chains of imports pointing up inside layer 3:\n" + "\n".join(upward)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph of the LAYERS entries: an edge where a module of one imports a module
    of another."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        entry = layer_entry(module)
        packages.setdefault(entry, set()).update(
            layer_entry(t) for t in targets if layer_entry(t) != entry)
    return packages


def test_no_packages_import_one_another_in_a_cycle():
    # Modules may form no cycle, and neither may the packages of one layer: envs and ppo did
    # (ppo.demo imports envs.guess; envs loaded the user's environment through ppo.rewards).
    found = cycles(package_graph(import_graph(modules())))
    assert not found, "package cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_chain_and_package_checks_find_the_envs_ppo_loop():
    # The layout before usercode: each edge alone points sideways or down, the chain does not.
    graph = {"rlhf_paro.rollout.episodes": {"rlhf_paro.envs"},
             "rlhf_paro.envs": {"rlhf_paro.ppo.rewards"},
             "rlhf_paro.ppo.demo": {"rlhf_paro.envs.guess"},
             "rlhf_paro.envs.guess": set(), "rlhf_paro.ppo.rewards": {"rlhf_paro.config"}}
    assert reachable(graph, "rlhf_paro.rollout.episodes") == {
        "rlhf_paro.envs", "rlhf_paro.ppo.rewards", "rlhf_paro.config"}
    assert cycles(package_graph(graph)) == [["rlhf_paro.envs", "rlhf_paro.ppo"]]


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``found`` it imports: for ``from a.b import c`` the module
    ``a.b.c`` if there is one, else ``a.b`` (where the name ``c`` is defined)."""
    graph = {}
    for module, path in found.items():
        targets = set()
        for _, name in imported_names(module, path):
            while name not in found:
                name = name.rpartition(".")[0]
            # A package's own submodules name it when they import a sibling through it
            # (``from rlhf_paro.sharding import _checkpoint``); that edge is no dependency.
            if name != module and not _within(module, name):
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_modules_import_one_another_in_a_cycle():
    # Layers only order the layers; inside one (ppo, models and resolve share one) modules may
    # import each other, but never round a cycle, deferred imports included.
    found = cycles(import_graph(modules()))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_check_finds_a_cycle_across_layers_and_a_deferred_one(tmp_path):
    # The cycle this project once had: config imported ppo/demo (in a function), which imports
    # models, which imports config; and a plain two-module cycle inside one layer.
    files = {"config": "def f():\n    from rlhf_paro.ppo import demo\n",
             "ppo/demo": "from rlhf_paro.models import build\n",
             "models": "from rlhf_paro.config import Config\n",
             "ppo/a": "from . import b\n", "ppo/b": "import rlhf_paro.ppo.a\n",
             "ppo/c": "from rlhf_paro.ppo import a\n"}
    found = {}
    for name, text in files.items():
        path = tmp_path / f"{name.replace('/', '_')}.py"
        path.write_text(text)
        found["rlhf_paro." + name.replace("/", ".")] = path
    found["rlhf_paro.ppo"] = tmp_path / "__init__.py"
    found["rlhf_paro.ppo"].write_text("")
    assert cycles(import_graph(found)) == [
        ["rlhf_paro.config", "rlhf_paro.models", "rlhf_paro.ppo.demo"],
        ["rlhf_paro.ppo.a", "rlhf_paro.ppo.b"]]


def test_the_checker_sees_deferred_and_relative_imports(tmp_path):
    # A function-level import and a relative one, both from ppo up to actors.
    path = tmp_path / "mod.py"
    path.write_text("from ..actors import worker\n\n\ndef f():\n    import rlhf_paro.trainer\n")
    assert imported_names("rlhf_paro.ppo.mod", path) == [
        (1, "rlhf_paro.actors.worker"), (5, "rlhf_paro.trainer")]


def bare_deferred_imports(path: Path) -> list[int]:
    """Lines of the imports inside a function of ``path`` with no comment on their line or the
    line above to say why they wait for the call."""
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, (ast.Import, ast.ImportFrom)):
                said = "#" in lines[inner.lineno - 1] or \
                    lines[inner.lineno - 2].lstrip().startswith("#")
                if not said:
                    found.append(inner.lineno)
    return sorted(set(found))


PLANNER = "rlhf_paro.plan"
# The planner's command line, the one part of it that runs the entry points' shared ``cli``;
# the cost model, the search, the step and the printout are a library that train.py imports.
PLANNER_COMMAND = ("rlhf_paro.plan.command", "rlhf_paro.plan.__main__")


def test_the_planner_defers_no_import_without_saying_why():
    bare = [f"{path.relative_to(PACKAGE_DIR.parent)}:{line}"
            for module, path in modules().items() if _within(module, PLANNER)
            for line in bare_deferred_imports(path)]
    assert not bare, "function-level imports without a comment saying why:\n" + "\n".join(bare)


def test_the_planner_library_imports_nothing_of_the_command_line():
    found = [f"{path.relative_to(PACKAGE_DIR.parent)}:{line} imports {name}"
             for module, path in modules().items()
             if _within(module, PLANNER) and module not in PLANNER_COMMAND
             for line, name in imported_names(module, path) if _within(name, "rlhf_paro.cli")]
    assert not found, "\n".join(found)
    graph = import_graph(modules())
    # Nor the other way round: cli runs the planner's command, it never reaches the planner.
    assert not [t for t in reachable(graph, "rlhf_paro.cli") if _within(t, PLANNER)]


def test_the_deferred_import_check_finds_a_bare_one_and_passes_a_said_one(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("import math\n\n\ndef f():\n    import torch\n\n\ndef g():\n"
                    "    # only this path needs vllm\n    import vllm\n"
                    "    from x import y  # heavy\n")
    assert bare_deferred_imports(path) == [5]
