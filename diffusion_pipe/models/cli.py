"""`diffusion-pipe models`: the capability table of every registered family, generated from the registry, so
the README's supported-models table (this command's output) can never claim more than the code does."""

from __future__ import annotations

from pathlib import Path

import click

OBJECTIVE_NAMES = {"flow": "flow matching", "epsilon": "epsilon", "v": "v-prediction"}


def capability_table() -> str:
    """A Markdown table: family, media, tasks, objectives, default LoRA targets, export formats."""
    import torch

    from diffusion_pipe.models import REGISTRY, adapter_class

    rows = ["| family | media | tasks | objective | LoRA targets (default) | export formats |",
            "|---|---|---|---|---|---|"]
    for family in sorted(REGISTRY):
        cls = adapter_class(family)
        caps = cls.capabilities
        # Adapters do no work in __init__ and their default targets are constants: no model files needed.
        targets = cls(Path(), torch.float32).default_lora_targets
        rows.append(f"| {family} | {', '.join(caps.media)} | {', '.join(caps.tasks)} | "
                    f"{', '.join(OBJECTIVE_NAMES[o] for o in caps.all_objectives)} | "
                    f"{', '.join(f'`{t}`' for t in targets)} | {', '.join(caps.export_formats)} |")
    return "\n".join(rows)


@click.command("models")
def models_command() -> None:
    """List the model families: media, tasks, objectives, LoRA targets and export formats."""
    click.echo(capability_table())
