"""The export stage: the trained LoRA in the formats users load, each with its lineage."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from diffusion_pipe.adapter_keys import export_adapter
from diffusion_pipe.errors import UserError
from diffusion_pipe.fileio import json_bytes, naming_write_errors, published_together
from diffusion_pipe.hashing import hash_bytes, hash_file
from diffusion_pipe.lineage.record import (METADATA_KEY, export_lineage, file_input, lineage_metadata,
                                           trained_params_drift)
from diffusion_pipe.lora_keys import ema_lora_path, fold_scale
from diffusion_pipe.models import load_adapter
from diffusion_pipe.params import Params
from diffusion_pipe.tensorfile import save_deterministic


def read_trained_lora(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The PEFT-named tensors and the metadata of the train stage's `lora.safetensors`."""
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def export_lora(params: Params, repo: Path, lora_path: Path, manifest: Path, encoded: Path, train_report: Path,
                out_dir: Path) -> list[Path]:
    """Write `out_dir/<name>.<format>.safetensors` for every format asked for, `out_dir/<name>.merged/` when
    `export.merged`, and `out_dir/<name>.lineage.json` (the record plus every written file's hash). `export.ema`
    (`_read_ema`): "beside" also writes the EMA LoRA as `<name>.ema.<format>.safetensors` with its own
    `<name>.ema.lineage.json`; "instead" writes the EMA under the usual names (merged too). A full
    fine-tune (train.adapter: full) is written as `out_dir/<name>.full/<denoiser component>/` instead.
    All of an export is published or none of it (a full disk, say, fails with a WriteError naming the file):
    the files are written to temp names first and renamed into place only once every one of them was written."""
    from diffusion_pipe.export.merge import write_full, write_merged

    adapter = load_adapter(params.model)
    lora, meta = read_trained_lora(lora_path)
    kind = meta.get("diffusion_pipe.adapter", "lora")
    if kind != params.train.adapter:
        raise ValueError(f"{lora_path} holds a {kind} training, and params.yaml says train.adapter: "
                         f"{params.train.adapter}; run the train stage again (dvc repro train)")
    report = json.loads(train_report.read_text()) if train_report.is_file() else None
    trained = json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else None
    lineage = export_lineage(params, repo, lora_path, manifest, encoded, report, trained)
    drift = trained_params_drift(lineage, repo)
    if drift:
        raise UserError(f"{lora_path} was trained with other params than params.yaml holds now: {'; '.join(drift)} "
                        "(trained -> params.yaml; was it edited while train ran, after DVC recorded it?): nothing "
                        "exported. Run `dvc repro --force train` to train with params.yaml as it is, or put back the "
                        "values it was trained with")
    if kind == "full":  # the whole denoiser: a diffusers component directory, loaded with from_pretrained
        path = out_dir / f"{params.export.name}.full"
        with naming_write_errors(path):
            write_full(adapter, lora, path, lineage)
        try:
            listed = {**json.loads((path / "lineage.json").read_text())["files"],
                      "lineage.json": hash_file(path / "lineage.json")}
            with published_together() as stage:
                stage(out_dir / f"{params.export.name}.lineage.json", json_bytes(
                    {**lineage, "files": {f"{path.name}/{name}": digest for name, digest in listed.items()}}))
        except BaseException:  # the directory is not left published without the lineage file that lists it
            shutil.rmtree(path, ignore_errors=True)
            raise
        print(f"export: wrote {path}", file=sys.stderr)
        return [path]
    rank, alpha = int(meta["lora_rank"]), float(meta["lora_alpha"])
    # export.ema: (file stem, weights, lineage) of each LoRA written; "instead" puts the EMA under the usual names
    loras = [(params.export.name, fold_scale(lora, rank, alpha), lineage)]
    if params.export.ema != "off":
        ema_lora, ema_lineage = _read_ema(params, repo, lora_path, meta, manifest, encoded, report)
        ema = (params.export.name if params.export.ema == "instead" else f"{params.export.name}.ema",
               fold_scale(ema_lora, rank, alpha), ema_lineage)
        loras = [ema] if params.export.ema == "instead" else [*loras, ema]
    written = []
    with published_together() as stage:
        for name, folded, record in loras:
            files = {}
            for fmt in params.export.formats:
                tensors = export_adapter(adapter, folded, fmt)
                path = out_dir / f"{name}.{fmt}.safetensors"
                metadata = {"format": "pt", "diffusion_pipe.family": params.model.family,
                            "diffusion_pipe.export_format": fmt, **lineage_metadata(record)}
                data = save_deterministic(tensors, metadata)
                stage(path, data)
                written.append(path)
                files[path.name] = hash_bytes(data)
            stage(out_dir / f"{name}.lineage.json", json_bytes({**record, "files": files}))
        if params.export.merged:  # last: it renames itself into place, after which nothing can fail for lack of room
            merged = out_dir / f"{params.export.name}.merged"
            with naming_write_errors(merged):
                written.append(write_merged(adapter, loras[0][1], merged, loras[0][2]))
    print("export: wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return written


def _read_ema(params: Params, repo: Path, lora_path: Path, meta: dict[str, str], manifest: Path, encoded: Path,
              report: dict | None) -> tuple[dict[str, torch.Tensor], dict]:
    """The EMA LoRA the train stage wrote beside `lora_path` (train.ema_decay) and its export lineage record, which
    names its decay (`ema`); a UserError when it is missing or from another run than `lora_path`."""
    path = ema_lora_path(lora_path)
    if not path.is_file():
        raise UserError(f"export.ema: {params.export.ema} exports {path}, which does not exist: train with "
                        f"train.ema_decay > 0 writes it (dvc repro train)")
    lora, ema_meta = read_trained_lora(path)
    if ema_meta.get("diffusion_pipe.run_id") != meta.get("diffusion_pipe.run_id") or \
            "diffusion_pipe.ema_decay" not in ema_meta:
        raise UserError(f"{path} is not the EMA of the run that wrote {lora_path} (run "
                        f"{ema_meta.get('diffusion_pipe.run_id')} against {meta.get('diffusion_pipe.run_id')}): "
                        "run the train stage again (dvc repro train)")
    trained = json.loads(ema_meta[METADATA_KEY]) if METADATA_KEY in ema_meta else None
    lineage = export_lineage(params, repo, path, manifest, encoded, report, trained)
    lineage["ema"] = {"decay": float(ema_meta["diffusion_pipe.ema_decay"]), "of": file_input(repo, lora_path),
                      "weights": "moving average of the trained weights (train.ema_decay)"}
    return lora, lineage
