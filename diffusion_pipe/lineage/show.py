"""A lineage record as readable sections (`diffusion-pipe lineage FILE`; `--json` prints the raw record)."""

from __future__ import annotations

import json

from diffusion_pipe.config import flatten

# Shown by name in the readable form; the whole environment is in the record (`--json`).
KEY_PACKAGES = ("diffusers", "transformers", "peft", "deepspeed", "safetensors", "dvc", "diffusion-pipe")


def short_hash(digest: str | None) -> str:
    """The first 12 hex digits of a hash, enough to tell two apart when read; `none` for a missing one."""
    return digest[:12] if digest else "none"


def format_value(v: object) -> str:
    """A leaf value as printed: a non-empty string as is, anything else as JSON."""
    return v if isinstance(v, str) and v else json.dumps(v)


def format_lineage(record: dict) -> str:
    """The record as readable sections (not a JSON dump; `--json` gives that)."""
    lines: list[str] = []

    def section(title: str, rows: list[tuple[str, object]]) -> None:
        lines.append(title)
        width = max((len(k) for k, _ in rows), default=0)
        lines.extend(f"  {k.ljust(width)}  {format_value(v)}" for k, v in rows)
        lines.append("")

    base, training, inputs = record.get("base_model", {}), record.get("training", {}), record.get("inputs", {})
    git, env = record.get("git", {}), record.get("environment", {})
    lines.append(f"diffusion-pipe lineage (version {record.get('lineage_version')}, {record.get('kind', '?')})")
    lines.append("")
    section("Base model", [("family", base.get("family")), ("path", base.get("path")), ("dtype", base.get("dtype")),
                           *((f"{c} weights", short_hash(h)) for c, h in sorted(base.get("weights", {}).items()))])
    order = ("run_id", "seed", "steps", "train_loss_last", "train_loss_last10", "eval_loss_start", "eval_loss_end")
    section("Training", [(k.replace("_", " "), training[k]) for k in sorted(training, key=lambda k: (
        order.index(k) if k in order else len(order), k))])
    rows: list[tuple[str, object]] = []
    for name in ("manifest", "encoded", "lora"):
        if inputs.get(name):
            rows.append((name, f"{inputs[name]['path']}  {short_hash(inputs[name]['xxh3_128'])}"))
    if inputs.get("store_keys"):
        sk = inputs["store_keys"]
        rows.append(("store keys", f"{short_hash(sk['xxh3_128'])}  ({sk.get('latent')} latent, {sk.get('text')} text; "
                                   f"splits {'+'.join(sk.get('splits', []))})"))
    for name, ds in sorted((inputs.get("datasets") or {}).items()):
        rows.append((f"dataset {name}", f"{ds.get('path')}  ({ds.get('items')} items; media "
                                        f"{short_hash(ds.get('media_xxh3'))}, captions "
                                        f"{short_hash(ds.get('captions_xxh3'))})"))
    section("Inputs", rows)
    trained = record.get("trained_lora")
    if "trained_lora" in record:
        section("Trained LoRA's own record", [("recorded", "yes" if trained else "no (the train stage wrote none)")]
                + ([("run id", trained.get("training", {}).get("run_id"))] if trained else []))
    section("Source", [("git commit", f"{git.get('commit')}{' (dirty)' if git.get('dirty') else ''}"),
                       *((f"dvc.lock {stage}", ", ".join(f"{o['path']} {o.get('md5', '')[:12]}"
                                                         for o in entry.get("outs", [])) or "-")
                         for stage, entry in sorted(record.get("dvc_lock", {}).items())),
                       *((f"dvc.lock {stage}", f"left out: {why}")
                         for stage, why in sorted((record.get("dvc_lock_omitted") or {}).items()))])
    packages = env.get("packages", {})
    section("Environment", [("python", env.get("python")), ("torch", env.get("torch")), ("cuda", env.get("cuda")),
                            ("gpu", env.get("gpu")), ("platform", env.get("platform")),
                            *((p, packages[p]) for p in KEY_PACKAGES if p in packages),
                            ("packages", f"{len(packages)} recorded (--json lists them)")])
    section("Params", list(flatten(record.get("params", {})).items()))
    if record.get("files"):
        section("Files", [(name, short_hash(h)) for name, h in sorted(record["files"].items())])
    return "\n".join(lines).rstrip() + "\n"
