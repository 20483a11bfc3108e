"""Where the weights of a model read from a directory come from, parameter by parameter: a tensor
of the directory's safetensors files, a value given in memory (a saved value head), or seeded
fresh values (a new value head, LoRA adapters). ``file_source`` turns that into the reader that
``shard(..., source=...)`` fills each rank's shards from, so that a model built with its
parameters on the meta device (``models.build_model(..., lazy=True)``) is never whole on a rank.

[Note: names in the module and in the files]
The module wraps the Hugging Face model (``lm.`` for a causal LM, ``backbone.`` for a value
model's base model), PEFT wraps it again (``base_model.model.``, and ``.base_layer`` inside an
adapted layer), and the files name tensors as the class that saved them did: a causal LM's
base model under its ``base_model_prefix`` (``model.``, ``transformer.``), a base model without
it. So a parameter is looked up under its name with the wrappers taken off, then with the
prefix added, then with it taken off, under each of its names: a tied weight (``lm_head``
sharing ``embed_tokens``) is saved once, under either.

[Note: fresh parameters]
A parameter that no file holds starts fresh: LoRA adapters as PEFT starts them (A uniform in
+-1/sqrt(fan_in), B zero) and a value head as ``models.build_value_model`` starts one (weight
normal with std 1/(hidden + 1), bias zero). The values come from a generator seeded by the
run's seed and the parameter's name, so any rank can make any parameter alone, the same on
every rank, for actor and ref alike, and for the model built whole (``start_fresh``).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from rlhf_paro.sharding import TensorFiles

# PEFT's module names around the wrapped model and inside an adapted layer.
_PEFT_ROOT = "base_model.model."
_PEFT_LAYER = ".base_layer"


def _start(name: str) -> str | None:
    """How parameter ``name`` starts fresh ([Note: fresh parameters]), or None: from the files."""
    if ".lora_A." in name:
        return "fan_in"
    if ".lora_B." in name or ".lora_embedding_A." in name or name == "value_head.bias":
        return "zero"
    if ".lora_embedding_B." in name:
        return "normal"
    return "head" if name == "value_head.weight" else None


def fresh(name: str, shape: Iterable[int], seed: int) -> torch.Tensor | None:
    """The fresh fp32 value of parameter ``name`` ([Note: fresh parameters]), or None for a
    parameter that has to come from the files."""
    start, shape = _start(name), tuple(shape)
    if start is None:
        return None
    if start == "zero":
        return torch.zeros(shape)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    if start == "fan_in":
        bound = 1.0 / math.sqrt(shape[1])  # kaiming-uniform with a = sqrt(5), PEFT's choice
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    std = 1.0 if start == "normal" else 1.0 / (shape[-1] + 1)
    return torch.empty(shape).normal_(std=std, generator=gen)


@torch.no_grad()
def start_fresh(model: nn.Module, seed: int) -> None:
    """Give every parameter of ``model`` that starts fresh its value, in place."""
    for name, p in model.named_parameters():
        value = fresh(name, p.shape, seed)
        if value is not None:
            p.copy_(value)


def model_files(directory: str | Path) -> list[Path] | None:
    """The safetensors files of a Hugging Face model directory (as ``from_pretrained`` picks
    them: the index's files, or ``model.safetensors``), or None where it has none."""
    directory = Path(directory).expanduser()
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else None


def _file_names(name: str, wrapper: str, base_prefix: str) -> list[str]:
    """Where parameter or buffer ``name`` may be in the files ([Note: names in the module and
    in the files])."""
    inner = name.removeprefix(wrapper).removeprefix(_PEFT_ROOT).replace(_PEFT_LAYER + ".", ".")
    out = [inner, f"{base_prefix}.{inner}"]
    if inner.startswith(base_prefix + "."):
        out.append(inner[len(base_prefix) + 1:])
    return out


class MissingWeights(ValueError):
    """Parameters that neither the files, the given values nor a fresh start account for."""


def file_source(model: nn.Module, files: TensorFiles, *, wrapper: str, base_prefix: str,
                seed: int, given: dict[str, torch.Tensor] | None = None
                ) -> Callable[[str, int, int], torch.Tensor]:
    """The reader of every parameter of ``model`` (names as ``named_parameters()`` gives them):
    ``given`` values first, then the files, then a fresh start. Loads the persistent buffers
    the files hold (small: position tables and the like) into the module now. Raises
    ``MissingWeights`` naming a parameter found nowhere, ``ValueError`` for one of another
    shape in the files."""
    given = given or {}
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    readers: dict[str, Callable[[int, int], torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if name in given:
            readers[name] = _slicer(given[name], name, p.shape)
            continue
        key = next((k for alias in aliases[id(p)]
                    for k in _file_names(alias, wrapper, base_prefix) if k in files), None)
        if key is not None:
            if tuple(files.shape(key)) != tuple(p.shape):
                raise ValueError(f"{key!r} has shape {list(files.shape(key))} in the files, "
                                 f"the model's {name!r} {list(p.shape)}")
            readers[name] = lambda a, b, key=key: files.read(key, a, b)
            continue
        if _start(name) is None:
            raise MissingWeights(f"{name!r} is in none of the files")
        readers[name] = lambda a, b, name=name, shape=p.shape: fresh(name, shape, seed
                                                                     ).reshape(-1)[a:b]
    _load_buffers(model, files, wrapper, base_prefix)
    return lambda name, start, stop: readers[name](start, stop)


def _slicer(value: torch.Tensor, name: str, shape: torch.Size
            ) -> Callable[[int, int], torch.Tensor]:
    if value.numel() != math.prod(shape):
        raise ValueError(f"{name!r}: {value.numel()} values given for shape {list(shape)}")
    flat = value.reshape(-1)
    return lambda a, b: flat[a:b]


@torch.no_grad()
def _load_buffers(model: nn.Module, files: TensorFiles, wrapper: str, base_prefix: str) -> None:
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = dict(model.named_buffers())
    for name in model.state_dict(keep_vars=True):
        if name in params or name not in buffers:
            continue
        key = next((k for k in _file_names(name, wrapper, base_prefix) if k in files), None)
        if key is not None:
            buf = buffers[name]
            buf.copy_(files.read(key, 0, buf.numel()).reshape(buf.shape))
