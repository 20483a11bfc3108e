"""Metered collectives: native, Ring, H-Ring and HO-Ring."""

from rlhf_paro.comm.collectives import Communicator, algorithm_names
from rlhf_paro.comm.meter import CommMeter, CommRecord, LinkBytes

__all__ = ["CommMeter", "CommRecord", "Communicator", "LinkBytes", "algorithm_names"]
