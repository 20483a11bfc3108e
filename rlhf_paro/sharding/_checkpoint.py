"""The engine's sharded state in a form no layout depends on, and its files
(docs/design.md, "Checkpoints").

[Note: checkpoint format]
What is stored is keyed by parameter name and element offset in the unpadded, flattened
parameter, never by unit, flat buffer or level: any strategy on any N and M reads any checkpoint.
Rank r stores its nested G-chunk of every flat buffer. That chunk lies inside every coarser shard
the rank holds (``comm/topology.py``, [Note: nested chunk order]), so each element of the model's
state is stored by exactly one rank whatever was replicated, and saving needs no collective. A
chunk crosses each parameter in at most one contiguous piece ``[start, stop)``; the piece of
kind k of parameter x is the 1-D tensor ``"k/x"``:
  params                 the parameters as held (fp32 or bf16)
  master                 the fp32 master of a bf16 model's trained parameters
                         (fp32 parameters are their own master)
  exp_avg, exp_avg_sq    AdamW's moments of the trained parameters
The JSON metadata holds every parameter's name, shape, dtype and whether it was trained, this
rank's pieces, the optimizer step count and the skipped steps, and the saving layout (strategy,
N, M, rank, precision), which only messages use. A rank that loads needs the P shard of the
parameters and the OS shard of the master and moments: it maps each to pieces the same way and
reads, from whichever saved ranks hold them, only the overlapping slices.

[Note: loading all or nothing]
``read`` checks every source against the model and finds a saved slice for every element this
rank needs, then reads them all, and only then returns; the engine writes them afterwards. A
checkpoint that does not fit raises ``CheckpointError`` before anything is read, so an engine is
never left half-loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from rlhf_paro.sharding.errors import CheckpointError
from rlhf_paro.sharding.strategy import Level

if TYPE_CHECKING:
    from rlhf_paro.sharding._flat import FlatBuffer

FORMAT = "rlhf_paro.engine/1"
META_KEY = "rlhf_paro"  # the safetensors metadata entry that holds the JSON metadata
OPTIMIZER_KINDS = ("exp_avg", "exp_avg_sq")


def file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


@dataclass(frozen=True)
class Slot:
    """One kind of state this rank holds for one flat buffer: ``tensor`` is its shard at
    ``level`` (the P shard for the parameters, the OS shard for the master and moments)."""

    kind: str
    buffer: FlatBuffer
    level: Level
    tensor: torch.Tensor


def snapshot(slots: Sequence[Slot], meta: dict[str, Any]) -> dict[str, Any]:
    """This rank's state: copies of its G-chunk pieces of every slot, and the metadata."""
    tensors: dict[str, torch.Tensor] = {}
    ranges: dict[str, list[int]] = {}
    for slot in slots:
        chunk = slot.buffer.level_slice(Level.G)
        held = slot.buffer.level_slice(slot.level)
        for name, start, stop, at in slot.buffer.pieces(chunk):
            first = chunk.start - held.start + at
            tensors[f"{slot.kind}/{name}"] = slot.tensor[first:first + stop - start].clone()
            ranges[name] = [start, stop]  # the same G-chunk for every kind
    return {"meta": {**meta, "pieces": ranges}, "tensors": tensors}


# -- sources ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Saved:
    """One saved rank's state, read lazily: ``numel(key)`` and ``read(key, a, b)`` (elements
    a..b of the 1-D tensor ``key``); ``origin`` names it in messages."""

    origin: str
    meta: dict[str, Any]
    keys: frozenset[str]
    numel: Callable[[str], int]
    read: Callable[[str, int, int], torch.Tensor]


def from_state_dict(state: Mapping[str, Any], origin: str) -> Saved:
    if not isinstance(state, Mapping) or "meta" not in state or "tensors" not in state:
        raise CheckpointError(f"{origin} is not an engine state dict (no 'meta' and 'tensors')")
    _check_meta(state["meta"], origin)
    tensors = state["tensors"]
    return Saved(origin, state["meta"], frozenset(tensors), lambda k: tensors[k].numel(),
                 lambda k, a, b: tensors[k].reshape(-1)[a:b])


def open_file(path: Path, handles: list) -> Saved:
    """A saved rank's file, opened for lazy reads (its handle is appended to ``handles``)."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="pt")
        meta = json.loads((handle.metadata() or {})[META_KEY])
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not a readable engine checkpoint file "
                              f"({type(err).__name__}: {err})") from None
    handles.append(handle)
    _check_meta(meta, str(path))

    def numel(key: str) -> int:
        return int(torch.Size(handle.get_slice(key).get_shape()).numel())

    return Saved(str(path), meta, frozenset(handle.keys()), numel,
                 lambda key, a, b: handle.get_slice(key)[a:b])


def open_directory(directory: str | os.PathLike, handles: list) -> list[Saved]:
    """Every rank file of a checkpoint directory; refuses a directory that lacks one."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory")
    files = sorted(path.glob("rank_*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {path} holds no rank_*.safetensors file")
    saved = [open_file(f, handles) for f in files]
    num_ranks = saved[0].meta["num_ranks"]
    expected = {file_name(r) for r in range(num_ranks)}
    missing = sorted(expected - {f.name for f in files})
    if missing:
        raise CheckpointError(f"checkpoint {path} was saved by {num_ranks} ranks but lacks "
                              f"{', '.join(missing)}")
    for s in saved:
        if Path(s.origin).name != file_name(s.meta["rank"]):
            raise CheckpointError(f"{s.origin} holds the state of rank "
                                  f"{s.meta['rank']} of {s.meta['num_ranks']}")
    return saved


# -- checks and reads ------------------------------------------------------------------------
# Fields every saved rank of one checkpoint has alike; a difference means mixed checkpoints.
_SHARED = ("num_ranks", "group_size", "strategy", "precision", "kinds", "step", "skipped_steps",
           "params")


def _check_meta(meta: Any, origin: str) -> None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{origin} is not in the engine's checkpoint format {FORMAT!r}")
    missing = [k for k in (*_SHARED, "rank", "pieces") if k not in meta]
    if missing:
        raise CheckpointError(f"{origin}: metadata lacks {', '.join(missing)}")


def _check_sources(saved: Sequence[Saved], table: dict[str, dict]) -> dict[str, Any]:
    """Check that the sources are one checkpoint of this model; returns its shared metadata."""
    if not saved:
        raise CheckpointError("no saved state to load")
    first = saved[0]
    for s in saved[1:]:
        for key in _SHARED:
            if s.meta[key] != first.meta[key]:
                shown = ("differ" if key == "params"
                         else f"{s.meta[key]!r} != {first.meta[key]!r}")
                raise CheckpointError(f"{s.origin} and {first.origin} are from different "
                                      f"checkpoints ({key}: {shown})")
    saved_table = first.meta["params"]
    lacking = sorted(set(table) - set(saved_table))
    unexpected = sorted(set(saved_table) - set(table))
    if lacking or unexpected:
        raise CheckpointError(
            f"{first.origin}: parameter names differ from the model's (missing: "
            f"{_few(lacking)}; not in the model: {_few(unexpected)})")
    for name, entry in table.items():
        if list(saved_table[name]["shape"]) != entry["shape"]:
            raise CheckpointError(f"{first.origin}: parameter {name!r} has shape "
                                  f"{tuple(saved_table[name]['shape'])}, the model's is "
                                  f"{tuple(entry['shape'])}")
        if entry["trained"] and not saved_table[name]["trained"]:
            raise CheckpointError(f"{first.origin}: parameter {name!r} is trained here but was "
                                  "not trained in the checkpoint: it has no optimizer state")
    for s in saved:
        for key in s.keys:
            kind, _, name = key.partition("/")
            span = s.meta["pieces"].get(name)
            if kind not in first.meta["kinds"] or span is None:
                raise CheckpointError(f"{s.origin}: tensor {key!r} is no piece of the state")
            if s.numel(key) != span[1] - span[0]:
                raise CheckpointError(f"{s.origin}: tensor {key!r} has {s.numel(key)} elements, "
                                      f"its piece [{span[0]}, {span[1]}) has {span[1] - span[0]}")
    return first.meta


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def _source_kind(kind: str, name: str, dtype: torch.dtype, meta: dict[str, Any]) -> str:
    """Which saved kind fills ``kind`` of parameter ``name`` held in ``dtype``: an fp32 value
    comes from the fp32 master where one was saved, so that precision changes lose nothing."""
    has_master = "master" in meta["kinds"] and meta["params"][name]["trained"]
    if kind == "params" and dtype == torch.float32 and has_master:
        return "master"
    if kind == "master" and not has_master:
        return "params"
    return kind


def read(slots: Sequence[Slot], table: dict[str, dict], saved: Sequence[Saved]
         ) -> tuple[list[tuple[torch.Tensor, int, torch.Tensor]], dict[str, Any]]:
    """Everything this rank needs from ``saved`` ([Note: loading all or nothing]): a list of
    (target, offset, values) to copy, and the checkpoint's shared metadata."""
    meta = _check_sources(saved, table)
    index: dict[tuple[str, str], list[tuple[int, int, Saved]]] = {}
    for s in saved:
        for key in s.keys:
            kind, _, name = key.partition("/")
            start, stop = s.meta["pieces"][name]
            index.setdefault((kind, name), []).append((start, stop, s))
    plan = []  # (target, offset, source, key, a, b): values a..b of key go to target[offset:]
    for slot in slots:
        held = slot.buffer.level_slice(slot.level)
        for name, start, stop, at in slot.buffer.pieces(held):
            kind = _source_kind(slot.kind, name, slot.tensor.dtype, meta)
            pos = start
            for s_start, s_stop, s in sorted(index.get((kind, name), []), key=lambda p: p[0]):
                if s_start <= pos < s_stop:
                    end = min(stop, s_stop)
                    plan.append((slot.tensor, at + pos - start, s, f"{kind}/{name}",
                                 pos - s_start, end - s_start))
                    pos = end
                if pos >= stop:
                    break
            if pos < stop:
                raise CheckpointError(f"no saved rank holds elements [{pos}, {stop}) of "
                                      f"{kind} of {name!r} (the checkpoint was saved by "
                                      f"{meta['num_ranks']} ranks, {len(saved)} given)")
    writes = [(target, offset, s.read(key, a, b)) for target, offset, s, key, a, b in plan]
    return writes, meta


def write(state: Mapping[str, Any], directory: str | os.PathLike, rank: int) -> Path:
    """Write one rank's state to ``<directory>/rank_<rank>.safetensors``, complete and on disk
    when this returns: written under a temporary name, fsynced, then renamed."""
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    final = path / file_name(rank)
    partial = final.with_name(final.name + ".partial")
    tensors = {k: v.detach().cpu().contiguous() for k, v in state["tensors"].items()}
    save_file(tensors, str(partial), metadata={META_KEY: json.dumps(state["meta"])})
    fsync(partial)
    os.replace(partial, final)
    fsync(path)  # the directory entry of the new name
    return final


def fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
