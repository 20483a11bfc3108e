"""Metered collectives: native, Ring, H-Ring and HO-Ring, on a two-level topology.

Names resolve on first use, so that ``comm.meter`` and ``comm.topology`` (plain arithmetic) import
without torch.
"""

import importlib

_EXPORTS = {
    "ALGORITHM_NAMES": "meter", "CommMeter": "meter", "CommRecord": "meter", "LinkBytes": "meter",
    "SCOPES": "topology", "Topology": "topology", "TopologyError": "topology",
    "Communicator": "collectives", "DryRunCommunicator": "collectives",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlhf_paro.comm' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlhf_paro.comm.{_EXPORTS[name]}"), name)
