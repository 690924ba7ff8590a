"""Stage `train`: encoded table + store -> runs/train/lora.safetensors, reports/train.json, loss plot."""

from pathlib import Path

import click

from diffusion_pipe.cli_support import stage_command


@stage_command("train")
@click.option("--encoded", type=click.Path(path_type=Path), default="data/encoded.parquet", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default="runs/train", show_default=True)
@click.option("--report", type=click.Path(path_type=Path), default="reports/train.json", show_default=True)
@click.option("--loss-plot", type=click.Path(path_type=Path), default="reports/train_loss.csv", show_default=True)
@click.option("--samples", type=click.Path(path_type=Path), default="reports/samples", show_default=True,
              help="Where the sample grids of every sample step go at the end (DVC image plots).")
@click.option("--runs", type=click.Path(path_type=Path), default="runs", show_default=True,
              help="Where checkpoints/<run id>/ and tensorboard/<run id>/ go.")
@click.option("--resume-from", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Continue another run's checkpoints (runs/checkpoints/<run id>); refused if its data, model "
                   "or parallel layout differ.")
@click.option("--force", is_flag=True, help="With --resume-from: resume even if data, model or layout differ.")
def command(params, encoded: Path, out: Path, report: Path, loss_plot: Path, samples: Path, runs: Path,
            resume_from: Path | None, force: bool) -> None:
    """Train a LoRA with DeepSpeed pipeline parallelism; resumes an interrupted run of the same config."""
    from diffusion_pipe.store import Store
    from diffusion_pipe.train.loop import train_lora

    train_lora(params.model, params.train, params.encode, encoded, out, report, loss_plot, runs, Store.default(),
               lineage_params=params, resume_from=resume_from, force=force, samples_dir=samples,
               lora_formats=params.export.formats)
