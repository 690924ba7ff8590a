"""Regenerate the bundled example (dataset and tiny Flux-style model) and the edit example (pairs and a tiny
Flux Kontext-style model). Its output is committed; run this only to change it: `python examples/make_example.py`."""

from pathlib import Path

from diffusion_pipe.example import make_edit_dataset, make_shapes_dataset
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.models.flux_kontext import FluxKontextAdapter

if __name__ == "__main__":
    root = Path(__file__).parent / "flux-tiny"
    print(make_shapes_dataset(root / "data"), "items written to", root / "data")
    FluxAdapter.build_tiny(root / "model", seed=0)
    print("tiny Flux model written to", root / "model")

    edit = Path(__file__).parent / "flux_kontext-tiny"
    print(make_edit_dataset(edit / "data", edit / "control"), "edit pairs written to", edit / "data", "and",
          edit / "control")
    FluxKontextAdapter.build_tiny(edit / "model", seed=0)
    print("tiny Flux Kontext model written to", edit / "model")
