"""Built-in backends, registered in auto-priority order: triton, sdpa, blockwise (reference last,
never auto-selected)."""
from .. import dispatch
from .blockwise import BlockwiseBackend
from .reference import ReferenceBackend
from .sdpa import SdpaBackend
from .triton import TritonBackend

# This list IS the auto order.  TritonBackend and SdpaBackend go in front of BlockwiseBackend.
for _cls in [TritonBackend, SdpaBackend, BlockwiseBackend, ReferenceBackend]:
    dispatch.register(_cls())
