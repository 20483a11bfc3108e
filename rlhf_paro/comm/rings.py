"""World-scope all-gather and reduce-scatter built on point-to-point operations.

Each algorithm takes and returns buffers in the nested chunk order of
``rlhf_paro.sharding.topology`` and returns the ``LinkBytes`` this rank actually sent.
"""

from __future__ import annotations

# name -> object with all_gather(out, shard, topo) and reduce_scatter(out, full, topo),
# each returning LinkBytes. Filled by the Ring / H-Ring / HO-Ring implementations.
ALGORITHMS: dict = {}
