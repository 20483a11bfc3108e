"""How a model is cut into units, and how big each unit's flat buffers are.

A unit is a wrapped module (a transformer block, found through Hugging Face's
``_no_split_modules`` or given explicitly) plus one root unit for every parameter outside the
blocks. Each parameter belongs to exactly one unit; a parameter shared by several modules
(tied embeddings) goes to the root unit, which is gathered for the whole forward and backward.
The engine and the cost model both use this module, so their unit sizes cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from torch import nn


@dataclass(frozen=True)
class UnitSizes:
    """Number of trainable and frozen parameter elements of one unit (before padding)."""

    trainable: int
    frozen: int


@dataclass
class UnitSpec:
    """One unit: its name, its module (the model itself for the root) and its own parameters."""

    name: str
    module: nn.Module
    params: list[nn.Parameter]

    @property
    def sizes(self) -> UnitSizes:
        trainable = sum(p.numel() for p in self.params if p.requires_grad)
        frozen = sum(p.numel() for p in self.params if not p.requires_grad)
        return UnitSizes(trainable, frozen)


def padded(numel: int, multiple: int) -> int:
    """``numel`` rounded up to a multiple of ``multiple`` (flat buffers are padded to N)."""
    return -(-numel // multiple) * multiple


def _unit_class_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def split_units(model: nn.Module, unit_classes: Iterable[str] | None = None) -> list[UnitSpec]:
    """The root unit first, then the blocks in module order.

    Blocks are the outermost modules whose class name is in ``unit_classes`` (default: the
    ``_no_split_modules`` of any Hugging Face model inside ``model``).
    """
    class_names = set(unit_classes) if unit_classes is not None else _unit_class_names(model)
    blocks: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside or module is model:
            continue
        if type(module).__name__ in class_names:
            blocks.append((name, module))
            inside.update(id(m) for m in module.modules())

    owners: dict[int, list[int]] = {}  # parameter id -> indices of the blocks that use it
    params_by_id: dict[int, nn.Parameter] = {}
    for index, (_, module) in enumerate(blocks):
        for p in module.parameters():
            owners.setdefault(id(p), []).append(index)
            params_by_id[id(p)] = p
    in_block = {pid for pid, idx in owners.items() if len(idx) == 1}
    # A parameter used outside its block (or by two blocks) must be gathered whenever either
    # user runs, so it lives in the root unit, which stays gathered through forward/backward.
    outside: set[int] = set()
    block_modules = {id(m) for _, b in blocks for m in b.modules()}
    for module in model.modules():
        if id(module) in block_modules:
            continue
        for p in module.parameters(recurse=False):
            outside.add(id(p))
    in_block -= outside

    root_params = [p for p in model.parameters() if id(p) not in in_block]
    units = [UnitSpec("root", model, root_params)]
    for index, (name, module) in enumerate(blocks):
        own = [p for p in module.parameters() if id(p) in in_block and owners[id(p)] == [index]]
        units.append(UnitSpec(name, module, own))
    return units


def unit_sizes(model: nn.Module, unit_classes: Iterable[str] | None = None) -> list[UnitSizes]:
    """Trainable/frozen element counts per unit; works on meta-device models."""
    return [unit.sizes for unit in split_units(model, unit_classes)]
