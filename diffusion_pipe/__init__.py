"""diffusion-pipe: LoRA training for diffusion models as a DVC pipeline (scan, encode, train, export)."""

__version__ = "0.1.0"
