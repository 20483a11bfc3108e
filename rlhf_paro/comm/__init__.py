"""Metered collectives: native, Ring, H-Ring and HO-Ring.

``Communicator`` (which needs torch) loads on first use, so that the names in ``comm.meter``
(phases, algorithms) import without torch.
"""

import importlib
from typing import Any

from rlhf_paro.comm.meter import ALGORITHM_NAMES, CommMeter, CommRecord, LinkBytes

_LAZY = {"Communicator": "collectives"}

__all__ = ["ALGORITHM_NAMES", "CommMeter", "CommRecord", "Communicator", "LinkBytes"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
