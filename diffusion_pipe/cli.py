"""`diffusion-pipe`: the stages as commands, plus tools around them (tiny models, lineage, store)."""

from __future__ import annotations

from pathlib import Path

import click

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


@main.command("make-tiny")
@click.argument("family")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--seed", default=0, show_default=True)
def make_tiny(family: str, out_dir: Path, seed: int) -> None:
    """Write a tiny random-init model of FAMILY in diffusers format to OUT_DIR (for tests and trials)."""
    from diffusion_pipe.models import adapter_class

    adapter_class(family).build_tiny(out_dir, seed=seed)
    click.echo(f"wrote a tiny {family} model to {out_dir}")


@main.command("lineage")
@click.argument("file", type=click.Path(exists=True, path_type=Path))
@click.option("--verify", is_flag=True, help="Check the record against the repository and the store; exit 1 on drift.")
@click.option("--repo", type=click.Path(file_okay=False, path_type=Path), default=".", show_default=True,
              help="The repository --verify checks against.")
@click.option("--diff", "other", type=click.Path(exists=True, path_type=Path),
              help="Compare with another export's lineage; exit 1 if they differ.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw record.")
def lineage(file: Path, verify: bool, repo: Path, other: Path | None, as_json: bool) -> None:
    """Print the lineage record of an exported LoRA (FILE: a .safetensors, a lineage.json or a merged directory)."""
    import sys

    from diffusion_pipe.export.verify import lineage_command

    text, status = lineage_command(file, verify=verify, repo=repo, other=other, as_json=as_json)
    click.echo(text, nl=False, err=status == 2)
    sys.exit(status)
