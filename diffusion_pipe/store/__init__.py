"""Content-addressed store of encoded tensors (latents, text embeddings) in immutable safetensors packs."""

from diffusion_pipe.store.pack import PackWriter, Sidecar, StoreError
from diffusion_pipe.store.remote import Remote
from diffusion_pipe.store.store import GcReport, Lease, Problem, Store, default_root, live_leases

__all__ = [
    "GcReport", "Lease", "PackWriter", "Problem", "Remote", "Sidecar", "Store", "StoreError", "default_root",
    "live_leases",
]
