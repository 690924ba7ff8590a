"""`diffusion-pipe`: the stages as commands, plus tools around them (tiny models, lineage, store)."""

from __future__ import annotations

from pathlib import Path

import click

from diffusion_pipe.errors import error_message
from diffusion_pipe.lineage.cli import lineage_cli
from diffusion_pipe.models.cli import models_command
from diffusion_pipe.store.cli import store_group
from stages.encode import command as encode_command
from stages.export import command as export_command
from stages.sample import command as sample_command
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
main.add_command(sample_command)
main.add_command(models_command)
main.add_command(store_group)
main.add_command(lineage_cli)


@main.command("init")
@click.argument("dataset", type=click.Path(path_type=Path))
@click.option("--name", default="", help="The dataset's name in the manifest (default: the directory's name).")
@click.option("--resolution", "resolutions", type=int, multiple=True, default=(1024,), show_default=True,
              help="Bucket target side in pixels; repeat for several.")
@click.option("--repeats", type=int, default=1, show_default=True)
@click.option("--caption-policy", type=click.Choice(["error", "default", "skip"]), default="error",
              show_default=True, help="What a media file without a .txt caption gets.")
@click.option("--default-caption", default="", help="The caption for uncaptioned files (--caption-policy default).")
@click.option("--eval-fraction", type=float, default=0.05, show_default=True)
@click.option("--replace", is_flag=True, help="Replace the datasets listed now (the bundled example's) instead "
                                             "of adding this one beside them.")
@click.option("--model", default=None, help="Also point model.path here: a local diffusers directory (added to "
                                            "the deps of the stages that read it) or a hub id.")
@click.option("--family", default=None, help="With --model: the model family (`diffusion-pipe models`); also "
                                             "picks its GPU preset for this machine's card (or --vram).")
@click.option("--vram", type=click.FloatRange(min=1), default=None,
              help="With --family: the GPU's memory in GB to pick a preset for (default: this machine's first GPU).")
@click.option("--no-preset", is_flag=True, help="With --family: keep params.yaml's own train settings.")
@click.option("--repo", type=click.Path(file_okay=False, path_type=Path), default=".", show_default=True)
def init_command(dataset: Path, name: str, resolutions: tuple[int, ...], repeats: int, caption_policy: str,
                 default_caption: str, eval_fraction: float, replace: bool, model: str | None, family: str | None,
                 vram: float | None, no_preset: bool, repo: Path) -> None:
    """Add your DATASET directory (and --model) to params.yaml and dvc.yaml, keeping both files' comments; with
    --family, also the family's settings for your GPU (examples/*/params-<N>gb.yaml)."""
    from diffusion_pipe.cli_support import user_errors
    from diffusion_pipe.presets import choose_preset, detected_vram_gb, family_presets
    from diffusion_pipe.project import init_project

    if family and model is None:
        raise click.UsageError("--family goes with --model: the checkpoint of that family to train")

    entry = {"name": name, "repeats": repeats, "resolutions": list(resolutions), "caption_policy": caption_policy,
             "default_caption": default_caption, "eval_fraction": eval_fraction}
    entry = {k: v for k, v in entry.items() if v not in ("", None)}
    try:
        preset, card = None, vram or (detected_vram_gb() if family and not no_preset else None)
        if family and not no_preset and card is None:
            click.echo("no CUDA GPU here: params.yaml's train settings are kept; pass --vram N (GB) to take "
                       f"{family}'s preset for the card you will train on", err=True)
        elif family and not no_preset:
            from diffusion_pipe.models import adapter_class

            adapter_class(family)  # an unknown family is an error naming the known ones
            preset = choose_preset(family_presets(family), card, family)
        changes, survey = init_project(repo, dataset, entry, replace=replace, model=model, family=family,
                                       preset=preset)
    except user_errors() as exc:
        raise click.ClickException(error_message(exc)) from None
    if preset is not None:
        click.echo(f"preset: {preset.path.parent.name}/{preset.path.name}, for {preset.vram_gb} GB cards "
                   f"({'--vram' if vram else 'this GPU'}: {card:.1f} GB). What it says of itself:")
        click.echo("\n".join(f"  {line}" for line in preset.header.splitlines()))
    for line in changes:
        click.echo(line)
    click.echo(f"{dataset}: {survey.images} images, {survey.videos} videos, {len(survey.uncaptioned)} without a "
               "caption")
    if survey.uncaptioned and caption_policy == "error":
        shown = ", ".join(survey.uncaptioned[:5]) + (" ..." if len(survey.uncaptioned) > 5 else "")
        click.echo(f"warning: the scan will stop on the uncaptioned files ({shown}): write their .txt captions, or "
                   "set caption_policy to 'default' (with default_caption) or 'skip'", err=True)
    click.echo("next: `dvc repro`")


@main.command("make-tiny")
@click.argument("family")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--seed", default=0, show_default=True)
def make_tiny(family: str, out_dir: Path, seed: int) -> None:
    """Write a tiny random-init model of FAMILY in diffusers format to OUT_DIR (for tests and trials)."""
    from diffusion_pipe.models import adapter_class

    adapter_class(family).build_tiny(out_dir, seed=seed)
    click.echo(f"wrote a tiny {family} model to {out_dir}")


@main.command("docs")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 naming each generated page that is stale.")
def docs_command(check: bool) -> None:
    """Write the generated pages docs/params.md and docs/models.md (from params.py and the model registry)."""
    from diffusion_pipe.docs import REGENERATE, stale_pages, write_pages

    if check:
        stale = stale_pages()
        for page in stale:
            click.echo(f"{page} is stale: {REGENERATE}", err=True)
        if stale:
            raise SystemExit(1)
        click.echo("generated pages are up to date")
        return
    for page in write_pages():
        click.echo(f"wrote {page}")
