"""`diffusion-pipe`: the stages as commands, plus tools around them (tiny models, lineage, store)."""

from __future__ import annotations

from pathlib import Path

import click

from diffusion_pipe.lineage.cli import lineage_cli
from diffusion_pipe.models.cli import models_command
from diffusion_pipe.store.cli import store_group
from stages.encode import command as encode_command
from stages.export import command as export_command
from stages.scan import command as scan_command
from stages.train import command as train_command


@click.group()
@click.version_option(package_name="diffusion-pipe")
def main() -> None:
    """Train LoRA adapters for diffusion models as a DVC pipeline: scan -> encode -> train -> export.

    Run the whole pipeline with `dvc repro`; each stage is also a command here."""


main.add_command(scan_command)
main.add_command(encode_command)
main.add_command(train_command)
main.add_command(export_command)
main.add_command(models_command)
main.add_command(store_group)
main.add_command(lineage_cli)


@main.command("make-tiny")
@click.argument("family")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--seed", default=0, show_default=True)
def make_tiny(family: str, out_dir: Path, seed: int) -> None:
    """Write a tiny random-init model of FAMILY in diffusers format to OUT_DIR (for tests and trials)."""
    from diffusion_pipe.models import adapter_class

    adapter_class(family).build_tiny(out_dir, seed=seed)
    click.echo(f"wrote a tiny {family} model to {out_dir}")
