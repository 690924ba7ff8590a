"""Stage `sample`: the exported LoRA -> reports/lora_samples/ (the sample prompts without and with it)."""

from pathlib import Path

import click

from diffusion_pipe.cli_support import stage_command


@stage_command("sample")
@click.option("--lora", type=click.Path(path_type=Path), default=None,
              help="A diffusers-format LoRA file [default: artifacts/<export.name>.diffusers.safetensors], or with "
                   "train.adapter: full the exported directory [default: artifacts/<export.name>.full].")
@click.option("--out", type=click.Path(path_type=Path), default="reports/lora_samples", show_default=True)
@click.option("--report", type=click.Path(path_type=Path), default="reports/sample.json", show_default=True)
@click.option("--videos", type=click.Path(path_type=Path), default="runs/lora_samples", show_default=True,
              help="Where video families' mp4s go.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
def command(params, lora: Path | None, out: Path, report: Path, videos: Path, device: str) -> None:
    """Render train.samples.prompts without and with the exported LoRA, loaded with load_lora_weights."""
    from diffusion_pipe.sample.stage import sample_lora

    lora = lora or Path("artifacts") / (f"{params.export.name}.full" if params.train.adapter == "full" else
                                        f"{params.export.name}.diffusers.safetensors")
    sample_lora(params, lora, out, report, videos, device)
