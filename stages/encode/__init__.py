"""Stage `encode`: manifest -> latents and text embeddings in the store -> data/encoded.parquet."""

from pathlib import Path

import click

from diffusion_pipe.cli_support import stage_command


@stage_command("encode")
@click.option("--manifest", type=click.Path(path_type=Path), default="data/manifest.parquet", show_default=True)
@click.option("--encoded", type=click.Path(path_type=Path), default="data/encoded.parquet", show_default=True)
@click.option("--report", type=click.Path(path_type=Path), default="reports/encode.json", show_default=True)
def command(params, manifest: Path, encoded: Path, report: Path) -> None:
    """Encode every latent and text embedding the manifest needs that the store lacks."""
    from diffusion_pipe.encode.encode import encode_manifest
    from diffusion_pipe.store import Store

    encode_manifest(params.model, params.scan, params.encode, manifest, encoded, report, Store.default(),
                    sample_prompts=params.train.samples.resolved(),
                    caption_dropout=params.train.caption_dropout)
