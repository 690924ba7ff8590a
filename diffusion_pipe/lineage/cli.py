"""`diffusion-pipe lineage`: print a lineage record, verify it against the repository and the store, or diff
two."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from diffusion_pipe.errors import error_text


def lineage_command(file: Path, *, verify: bool, repo: Path, other: Path | None, as_json: bool) -> tuple[str, int]:
    """What `diffusion-pipe lineage` prints and its exit status (1: drift or differences; 2: unreadable)."""
    from diffusion_pipe.lineage.diff import diff_lineage, format_diff
    from diffusion_pipe.lineage.record import read_lineage
    from diffusion_pipe.lineage.show import format_lineage
    from diffusion_pipe.lineage.verify import format_checks, verify_lineage

    try:
        record = read_lineage(file)
        other_record = read_lineage(other) if other is not None else None
    except ValueError as exc:
        return f"{error_text(exc)}\n", 2
    if verify:
        lineage_dir = file if file.is_dir() else file.parent if file.suffix == ".json" else None
        checks = verify_lineage(record, repo, lineage_dir=lineage_dir)
        return format_checks(checks), 0 if all(c.ok for c in checks) else 1
    if other_record is not None:
        diffs = diff_lineage(record, other_record)
        return format_diff(diffs, str(file), str(other)), 1 if diffs else 0
    return (json.dumps(record, indent=2, sort_keys=True) + "\n") if as_json else format_lineage(record), 0


@click.command("lineage")
@click.argument("file", type=click.Path(exists=True, path_type=Path))
@click.option("--verify", is_flag=True, help="Check the record against the repository and the store; exit 1 on drift.")
@click.option("--repo", type=click.Path(file_okay=False, path_type=Path), default=".", show_default=True,
              help="The repository --verify checks against.")
@click.option("--diff", "other", type=click.Path(exists=True, path_type=Path),
              help="Compare with another export's lineage; exit 1 if they differ.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw record.")
def lineage_cli(file: Path, verify: bool, repo: Path, other: Path | None, as_json: bool) -> None:
    """Print the lineage record of an exported LoRA (FILE: a .safetensors, a lineage.json or a merged directory)."""
    text, status = lineage_command(file, verify=verify, repo=repo, other=other, as_json=as_json)
    click.echo(text, nl=False, err=status == 2)
    sys.exit(status)
