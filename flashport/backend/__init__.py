"""Built-in backends, registered in static-priority order (the order auto-selection tries where no measured
table fits): gluon, triton, sdpa-cudnn, sdpa-flash, sdpa-efficient, sdpa-cpu (CPU only), blockwise; then sdpa
and reference, which are never chosen automatically."""
from .. import dispatch
from .blockwise import BlockwiseBackend
from .gluon import GluonBackend
from .reference import ReferenceBackend
from .sdpa import SDPA_KERNELS, SdpaBackend
from .sdpa_cpu import SdpaCpuBackend
from .triton import TritonBackend

for _backend in [GluonBackend(), TritonBackend(), *SDPA_KERNELS, SdpaBackend(), SdpaCpuBackend(),
                 BlockwiseBackend(),
                 ReferenceBackend()]:
    dispatch.register(_backend)
