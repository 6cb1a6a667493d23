"""torch_xla: one device, an SPMD mesh, or whole components placed on different devices."""

from tpugen.backends.xla.placed import PlacedBackend
from tpugen.backends.xla.single import XlaBackend
from tpugen.backends.xla.spmd import SpmdBackend
from tpugen.sharding import mesh_shape

__all__ = ["PlacedBackend", "SpmdBackend", "XlaBackend", "mesh_shape"]
