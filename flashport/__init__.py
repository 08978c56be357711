"""flashport: exact, IO-aware attention behind one contract, with native backends per platform."""
from .api import attention, attention_varlen, attention_with_kvcache, merge_attention_states
from .block_mask import BlockMask, create_block_mask
from .contents import DeviceError, check_errors
from .dispatch import BackendInfo, UnsupportedError, backends, use_backend
from .monitor import reset_stats, rewrites, stats
from .rollout import guard, quarantined, release_quarantine
from . import backend as _backend  # noqa: F401  (registers the built-in backends, in auto order)
from . import mods  # noqa: F401  (ready-made score_mod / mask_mod: flashport.mods.causal, ...)
from . import compat  # noqa: F401  (FlashAttention-2's API: flashport.compat.flash_attn_func, ...)
from . import distributed  # noqa: F401  (ring attention over torch.distributed: flashport.distributed.ring_attention)
from .integrations import sdpa as _sdpa

# torch.nn.attention.activate_flash_attention_impl("flashport") then routes SDPA's flash path to flashport.
_sdpa.register()   # stores a function, never raises (`flashport info` shows why where it could not)

__version__ = "0.1.0"

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "merge_attention_states",
           "backends", "use_backend", "UnsupportedError", "BackendInfo", "DeviceError", "check_errors",
           "stats", "rewrites", "reset_stats", "guard", "quarantined", "release_quarantine", "create_block_mask", "BlockMask",
           "__version__"]
