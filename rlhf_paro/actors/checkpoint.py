"""Checkpoint directories of a run: layout, manifest, publication, discovery, pruning, RNG states.

    <output_dir>/checkpoints/
      step_<k>/                       the state after k PPO steps
        manifest.json                 written last: every other file, its size and SHA-256
        trainer.json                  the driver: step, KL coefficient, prompt generator, RNG
                                      states, wandb run id
        config.yaml                   the resolved config of the run that wrote it
        actor/ critic/ reward/ ref/   engine.save_checkpoint of every rank of that model
        workers/<role>_rank_<r>.json  each worker's RNG states and skipped-step counters
      .step_<k>-<random>/             a checkpoint being written: never read, removed later

Everything is plain data: JSON, YAML and the engine's own files; loading never unpickles.

[Note: a checkpoint is complete or absent]  (docs/design.md, "Run checkpoints and resume")
A checkpoint is written into a scratch directory; every file is flushed to disk (fsync) as it is
hashed, the manifest goes in last, and one rename makes ``step_<k>`` appear. A run killed at any
moment leaves either no ``step_<k>`` or a complete one, and the newest complete checkpoint is
the newest ``step_<k>`` with a manifest. Before a resume reads anything, every file is held to
the manifest (``check`` for sizes, then the hashes), so a checkpoint damaged later is refused
whole, never half-loaded.
"""

from __future__ import annotations

import base64
import hashlib
import dataclasses
import json
import os
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from rlhf_paro.config import MANIFEST, ConfigError
from rlhf_paro.sharding._checkpoint import fsync

CHECKPOINTS = "checkpoints"
TRAINER_FILE = "trainer.json"
CONFIG_FILE = "config.yaml"
WORKERS_DIR = "workers"
_STEP_DIR = re.compile(r"step_(\d+)")
_SCRATCH_PREFIX = ".step_"
_CHUNK = 16 << 20  # bytes hashed at a time


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step_{step}"


def worker_file(directory: str | Path, role: str, rank: int) -> Path:
    return Path(directory) / WORKERS_DIR / f"{role}_rank_{rank:05d}.json"


def complete(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint of a run, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    found = []
    for path in root.iterdir() if root.is_dir() else []:
        match = _STEP_DIR.fullmatch(path.name)
        if match and (path / MANIFEST).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def newest(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    found = complete(output_dir)
    return found[-1][1] if found else None


def scratch(output_dir: str | Path, step: int) -> Path:
    """A new, empty directory to write the checkpoint of ``step`` into."""
    root = Path(output_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{step}-", dir=root))
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)  # mkdtemp's 0700 would make the checkpoint private
    return path


def files(directory: str | Path) -> list[str]:
    """Every file below ``directory`` but the manifest, as sorted relative POSIX paths."""
    directory = Path(directory)
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def file_digest(path: str | Path) -> tuple[int, str]:
    """(bytes, SHA-256) of a file, flushed to disk first: hashing is the last time a checkpoint
    writer touches its files."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return os.path.getsize(path), sha.hexdigest()


ROLLOUTS_DIR = "rollouts"  # rollouts launched ahead of the step a checkpoint resumes at


def write_rollouts(directory: Path, step: int, batches: list[Any], meta: dict[str, Any]
                   ) -> None:
    """Step ``step``'s rollout, launched ahead and generated already (one batch per training
    rank), and what else its collection needs (``meta``: JSON), under ``directory``: tensors in
    safetensors files, nothing pickled. [Note: rollouts launched ahead]"""
    from safetensors.torch import save_file

    where = Path(directory) / ROLLOUTS_DIR / f"step_{step}"
    where.mkdir(parents=True, exist_ok=True)
    for rank, batch in enumerate(batches):
        tensors = {f.name: getattr(batch, f.name).contiguous()
                   for f in dataclasses.fields(batch) if getattr(batch, f.name) is not None}
        save_file(tensors, str(where / f"rank_{rank}.safetensors"))
    write_json(where / "meta.json", meta)


def read_rollouts(directory: Path, batch_type: type) -> dict[int, tuple[list[Any], dict]]:
    """The rollouts ``write_rollouts`` put under ``directory``: step -> (batches, meta)."""
    from safetensors.torch import load_file

    out = {}
    root = Path(directory) / ROLLOUTS_DIR
    for where in sorted(root.glob("step_*")) if root.is_dir() else []:
        meta = json.loads((where / "meta.json").read_text())
        batches = [batch_type(**load_file(str(where / f"rank_{rank}.safetensors")))
                   for rank in range(meta["num_ranks"])]
        out[int(where.name.removeprefix("step_"))] = (batches, meta)
    return out


def write_json(path: str | Path, data: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f)


def publish(scratch_dir: Path, target: Path, step: int,
            digests: dict[str, tuple[int, str]]) -> None:
    """Write the manifest into ``scratch_dir`` and rename it to ``target`` (replacing a
    checkpoint of the same step). [Note: a checkpoint is complete or absent]"""
    manifest = {"step": step, "files": {name: {"bytes": size, "sha256": sha}
                                        for name, (size, sha) in sorted(digests.items())}}
    with open(scratch_dir / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for directory in [p for p in scratch_dir.rglob("*") if p.is_dir()] + [scratch_dir]:
        fsync(directory)
    if target.exists():
        # Out of the way first: a kill between the renames leaves the older checkpoints.
        old = Path(tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{step}-", dir=target.parent))
        os.replace(target, old / target.name)
        os.replace(scratch_dir, target)
        shutil.rmtree(old)
    else:
        os.replace(scratch_dir, target)
    fsync(target.parent)


class DamagedCheckpoint(ConfigError):
    """A checkpoint whose files do not match its manifest; ``problem`` says how, in a few
    words. A ``ConfigError`` of ``trainer.resume``: one line."""

    def __init__(self, directory: Path, problem: str) -> None:
        super().__init__("trainer.resume", f"checkpoint {directory} does not match its "
                         f"manifest: {problem}; allowed: an intact checkpoint (trainer.resume="
                         "PATH of an older step_<k>) or trainer.resume=none")
        self.directory, self.problem = directory, problem

    def __reduce__(self) -> tuple:
        return DamagedCheckpoint, (self.directory, self.problem)


def check(directory: str | Path) -> dict[str, dict[str, Any]]:
    """The manifest's files (name -> bytes, sha256), after checking that each is there with its
    size; raises ``DamagedCheckpoint`` when one is not. The caller checks the hashes."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        listed = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DamagedCheckpoint(directory,
                                f"unreadable {MANIFEST} ({type(err).__name__})") from None
    # Any JSON parses: a manifest of another shape is as damaged as one cut short.
    if not isinstance(listed, dict) or not all(
            isinstance(entry, dict) and type(entry.get("bytes")) is int
            and isinstance(entry.get("sha256"), str) for entry in listed.values()):
        raise DamagedCheckpoint(directory, f"malformed {MANIFEST} (its files are not name -> "
                                           "{bytes, sha256})")
    for name, entry in listed.items():
        path = directory / name
        if not path.is_file():
            raise DamagedCheckpoint(directory, f"{name} is missing")
        if path.stat().st_size != entry["bytes"]:
            raise DamagedCheckpoint(directory, f"{name} has {path.stat().st_size} bytes, the "
                                               f"manifest says {entry['bytes']}")
    return listed


def refuse_changed(directory: str | Path, listed: dict[str, dict[str, Any]],
                   digests: dict[str, tuple[int, str]]) -> None:
    """Raise ``DamagedCheckpoint`` for the first file whose hash differs from the manifest."""
    for name, entry in listed.items():
        if digests[name][1] != entry["sha256"]:
            raise DamagedCheckpoint(Path(directory), f"{name} has changed (SHA-256 differs)")


def prune(output_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (0 keeps all) and the scratch of
    any save that did not finish; returns the checkpoints deleted."""
    root = Path(output_dir) / CHECKPOINTS
    for path in root.glob(f"{_SCRATCH_PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)
    found = complete(output_dir)
    stale = [path for _, path in found[:-keep]] if keep else []
    for path in stale:
        shutil.rmtree(path)
    return stale


def discard_after(output_dir: str | Path, step: int) -> list[Path]:
    """Delete the checkpoints of steps after ``step``: they belong to the run that a fresh start
    or a resume from ``step`` replaces, as do its metrics rows after ``step``."""
    stale = [path for k, path in complete(output_dir) if k > step]
    for path in stale:
        shutil.rmtree(path)
    return stale


# --- random number generators -------------------------------------------------------------------

def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def generator_state(generator: torch.Generator) -> str:
    return _encode(generator.get_state())


def set_generator_state(generator: torch.Generator, text: str) -> None:
    generator.set_state(_decode(text))


def rng_state() -> dict[str, Any]:
    """This process's random number generators as plain data: torch (and CUDA), Python's
    ``random``, and numpy's global generator when numpy is loaded."""
    state: dict[str, Any] = {"torch": _encode(torch.get_rng_state()),
                             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    if "numpy" in sys.modules:
        kind, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Undo ``rng_state`` (after a JSON round trip)."""
    torch.set_rng_state(_decode(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode(s) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
