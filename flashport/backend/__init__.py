"""Built-in backends, registered in static-priority order (the order auto-selection tries where no measured
table fits): gluon, triton, sdpa-cudnn, sdpa-flash, sdpa-efficient, sdpa-cpu (CPU only), blockwise; then sdpa
and reference, which are never chosen automatically.  flex (PyTorch's compiled FlexAttention, CUDA) follows
the SDPA backends: the GPU path for programmable calls (score_mod, mask_mod, block masks, attn_bias), which the
kernels before it refuse; named only (auto=False) until its GPU tier passes.  fa4 (FlashAttention-4, optional) comes after the SDPA
backends and is chosen automatically only where the selection table measured it (measured_only), never by this
order; flash_attn is imported only when its availability is asked on a machine with an sm_90+ card."""
from .. import dispatch
from .blockwise import BlockwiseBackend
from .fa4 import Fa4Backend
from .flex import FlexBackend
from .gluon import GluonBackend
from .reference import ReferenceBackend
from .sdpa import SDPA_KERNELS, SdpaBackend
from .sdpa_cpu import SdpaCpuBackend
from .triton import TritonBackend

for _backend in [GluonBackend(), TritonBackend(), *SDPA_KERNELS, SdpaBackend(), SdpaCpuBackend(), Fa4Backend(),
                 FlexBackend(), BlockwiseBackend(), ReferenceBackend()]:
    dispatch.register(_backend)
