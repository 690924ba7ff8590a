"""Regenerate the bundled example (dataset and tiny Flux-style model). Its output is committed; run this only to
change it: `python examples/make_example.py`."""

from pathlib import Path

from diffusion_pipe.example import make_shapes_dataset
from diffusion_pipe.models.flux import FluxAdapter

if __name__ == "__main__":
    root = Path(__file__).parent / "flux-tiny"
    print(make_shapes_dataset(root / "data"), "items written to", root / "data")
    FluxAdapter.build_tiny(root / "model", seed=0)
    print("tiny Flux model written to", root / "model")
