"""Built-in backends, registered in auto-priority order: triton, sdpa, blockwise (reference last,
never auto-selected)."""
from .. import dispatch
from .reference import ReferenceBackend

for _cls in [ReferenceBackend]:
    dispatch.register(_cls())
