"""Rule 12: layers point one way; no module of ``rlhf_paro`` imports from a layer above its own.

Every ``import`` and ``from`` statement counts, at the top of a module, inside a function or under
``TYPE_CHECKING``: an import deferred to call time still ties the lower layer to the upper one.

    0  comm       metered collectives and ring schedules
    1  sharding   strategies, topology, the engine and its cost model
    2  ppo        what a worker is made of, without Ray: the PPO math, the task, the reward
                  model (``ppo/``), and
                  - ``config``: the typed config of every component. It validates strategies
                    with ``sharding``, so it sits above it; every layer from here up reads it,
                    and it shares the layer with ``ppo`` so that it can take the names it
                    validates (KL estimators) from their one source.
                  - ``models``: the four ``nn.Module``s built from a config section. Nothing in
                    them is Ray or the PPO loop, so they are below ``actors``; ``ppo`` prepares
                    the reward model by building and training one, so they are not above ``ppo``.
                  - ``weights``: where a model's weights come from when it is read from files
                    (``models`` builds its reader); below ``actors`` with ``models``.
                  - ``metrics``: the per-rank report the workers fill and its fold into a row;
                    plain data that ``actors`` imports, so below it.
    3  actors     the Ray workers of the four models and their placement
    4  the PPO loop that drives the workers (``trainer``) and the entry points (``train``,
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
    "rlhf_paro.models": 2,
    "rlhf_paro.batching": 2,  # the rollout's layout and the packed one (pure torch)
    "rlhf_paro.weights": 2,
    "rlhf_paro.metrics": 2,
    "rlhf_paro.ppo": 2,
    "rlhf_paro.actors": 3,
    "rlhf_paro.trainer": 4,
    "rlhf_paro.train": 4,
    "rlhf_paro.cli": 4,
    "rlhf_paro.plan": 4,
    "rlhf_paro.report": 4,
    "rlhf_paro.reward_server": 4,  # an entry point: serves a reward function
    "rlhf_paro.runs": 4,
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


def test_the_checker_sees_deferred_and_relative_imports(tmp_path):
    # A function-level import and a relative one, both from ppo up to actors.
    path = tmp_path / "mod.py"
    path.write_text("from ..actors import worker\n\n\ndef f():\n    import rlhf_paro.trainer\n")
    assert imported_names("rlhf_paro.ppo.mod", path) == [
        (1, "rlhf_paro.actors.worker"), (5, "rlhf_paro.trainer")]
