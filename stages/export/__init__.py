"""Stage `export`: runs/train/lora.safetensors -> artifacts/<name>.<format>.safetensors (+ <name>.merged/ when
export.merged), each with its lineage, and artifacts/<name>.lineage.json."""

from pathlib import Path

import click

from diffusion_pipe.cli_support import stage_command


@stage_command("export")
@click.option("--lora", type=click.Path(path_type=Path), default="runs/train/lora.safetensors", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default="artifacts", show_default=True)
def command(params, lora: Path, out: Path) -> None:
    """Write the trained LoRA in every format of export.formats (and merged, if asked), each with its lineage."""
    from diffusion_pipe.export.lora import export_lora

    export_lora(params, Path.cwd(), lora, Path("data/manifest.parquet"), Path("data/encoded.parquet"),
                Path("reports/train.json"), out)
