"""Stage `scan`: dataset directories -> data/manifest.parquet + reports/scan.json."""

from pathlib import Path

import click

from diffusion_pipe.cli_support import stage_command


@stage_command("scan")
@click.option("--manifest", type=click.Path(path_type=Path), default="data/manifest.parquet", show_default=True)
@click.option("--report", type=click.Path(path_type=Path), default="reports/scan.json", show_default=True)
def command(params, manifest: Path, report: Path) -> None:
    """Scan the datasets of params.yaml into the manifest."""
    from diffusion_pipe.scan import scan_to_files

    scan_to_files(params.scan, manifest, report, Path(".diffusion-pipe/scan-cache.parquet"))
