"""`diffusion-pipe models`: the capability table of every registered family, generated from the registry, so
the supported-models table of docs/models.md (this command's output) can never claim more than the code does."""

from __future__ import annotations

from pathlib import Path

import click

OBJECTIVE_NAMES = {"flow": "flow matching", "epsilon": "epsilon", "v": "v-prediction"}


# A source checkout's root: where the tests and bundled examples that the "tested" column names live.
_REPO = Path(__file__).resolve().parents[2]


def tested_by(family: str, root: Path = _REPO) -> str:
    """What tests a family, as files of the checkout: its contract suite (`tests/models/test_<family>.py`: encode
    specs, pipeline layers composed equal to the unsplit forward, which is what makes any pipeline split and block
    swap exact, every export round-tripped into the diffusers pipeline, samples) and its tiny example through
    `dvc repro` (tests/test_examples.py; the bundled example's own params.yaml, tests/test_pipeline.py). '-' where
    neither is there (an installed package without its tests)."""
    from ruamel.yaml import YAML

    bundled = root / "params.yaml"
    example = (root / "examples" / f"{family}-tiny" / "params.yaml").is_file() or (bundled.is_file() and (
        YAML(typ="safe", pure=True).load(bundled.read_text()) or {}).get("model", {}).get("family") == family)
    contract = (root / "tests" / "models" / f"test_{family}.py").is_file()
    return ", ".join(name for name, there in (("contract", contract), ("dvc repro", example)) if there) or "-"


def capability_table() -> str:
    """A Markdown table: family, media, tasks, objectives, default LoRA targets, export formats, whether it renders
    samples, and what tests it."""
    import torch

    from diffusion_pipe.models import REGISTRY, adapter_class
    from diffusion_pipe.models.base import Adapter

    rows = ["| family | media | tasks | objective | LoRA targets (default) | export formats | samples | tested |",
            "|---|---|---|---|---|---|---|---|"]
    for family in sorted(REGISTRY):
        cls = adapter_class(family)
        caps = cls.capabilities
        # Adapters do no work in __init__ and their default targets are constants: no model files needed.
        targets = cls(Path(), torch.float32).default_lora_targets
        samples = "yes" if cls.pipeline_class is not Adapter.pipeline_class else "-"
        media = ", ".join(caps.media) + "".join(f" (no {m})" for m in caps.untrained_media)
        rows.append(f"| {family} | {media} | {', '.join(caps.tasks)} | "
                    f"{', '.join(OBJECTIVE_NAMES[o] for o in caps.all_objectives)} | "
                    f"{', '.join(f'`{t}`' for t in targets)} | {', '.join(caps.export_formats)} | {samples} | "
                    f"{tested_by(family)} |")
    return "\n".join(rows)


@click.command("models")
def models_command() -> None:
    """List the model families: media, tasks, objectives, LoRA targets, export formats, samples, tests."""
    click.echo(capability_table())
