"""The `sample` stage: the exported LoRA loaded the way its users load it (the family's diffusers pipeline,
`load_lora_weights`), the sample prompts rendered without and with it, side by side: the look a user takes
before publishing a LoRA, and a check that the exported file really loads and changes the output."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from diffusion_pipe.config import ConfigError
from diffusion_pipe.fileio import write_bytes_atomic, write_json_atomic
from diffusion_pipe.models import load_adapter
from diffusion_pipe.models.common import resolve_device
from diffusion_pipe.params import Params
from diffusion_pipe.sample.render import (check_prompt, control_image, encode_sample_texts, grid, png_bytes, poster,
                                          prompt_texts, render_prompts, write_media)


def sample_lora(params: Params, lora_path: Path, out_dir: Path, report_path: Path, video_dir: Path,
                device_name: str = "auto") -> dict:
    """Render `train.samples.prompts` with the base model, then with the diffusers-format LoRA at `lora_path`
    loaded by `load_lora_weights` (a full fine-tune: the denoiser directory at `lora_path`, `load_trained`);
    write `<i>-without.png`, `<i>-with.png` and `comparison.png` (a row per prompt: without | with, labelled) to
    `out_dir`, videos' mp4s to `video_dir`, and per prompt the mean absolute pixel difference to `report_path`.
    Returns the report. With no prompts, or no diffusers-format export, there is nothing to render: the outputs
    are written empty and the reason printed, so `dvc repro` goes on."""
    prompts = params.train.samples.resolved()
    skip = ("train.samples.prompts is empty" if not prompts else
            "export.formats has no 'diffusers'" if "diffusers" not in params.export.formats else None)
    if skip:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(report_path, {"lora": None, "prompts": [], "skipped": skip})
        print(f"sample: nothing rendered: {skip} (list prompts under train.samples and export the 'diffusers' "
              "format to compare samples without and with the LoRA)", file=sys.stderr)
        return {"lora": None, "prompts": [], "skipped": skip}
    full = params.train.adapter == "full"
    if not (lora_path.is_dir() if full else lora_path.is_file()):
        raise FileNotFoundError(f"{lora_path}: no exported {'fine-tuned denoiser' if full else 'LoRA'} there; run "
                                "the export stage" + ("" if full else " with 'diffusers' in export.formats")
                                + " (dvc repro export)")
    adapter = load_adapter(params.model)
    if adapter.expert:
        raise ConfigError(f"model.expert: the sample stage renders with the whole model; '{adapter.expert}' is "
                          "one expert of it. Leave model.expert empty to sample")
    for prompt in prompts:
        check_prompt(adapter, prompt)
    device = resolve_device(device_name, "--device")

    encoders = adapter.load_text_encoders(device)
    texts = encode_sample_texts(adapter, encoders, prompt_texts(adapter, prompts), params.encode.text_max_length)
    del encoders  # the pipeline gets its prompts as embeddings: its text encoders are never loaded

    encoder_dirs, tokenizer_dirs = adapter.text_component_dirs()
    pipe = adapter.load_pipeline(skip=(*encoder_dirs, *tokenizer_dirs))
    pipe.set_progress_bar_config(desc="sample", unit="step", leave=False, file=sys.stderr)
    pipe.to(device)
    without = render_prompts(pipe, adapter, prompts, texts, device)
    load_trained(pipe, adapter, lora_path, full)
    with_lora = render_prompts(pipe, adapter, prompts, texts, device)

    report = {"lora": str(lora_path), "prompts": []}
    for i, (prompt, a, b) in enumerate(zip(prompts, without, with_lora)):
        for tag, pixels in (("without", a), ("with", b)):
            write_bytes_atomic(out_dir / f"{i:02d}-{tag}.png", png_bytes(poster(pixels)))
            if pixels.shape[0] > 1:
                write_media(video_dir / f"{i:02d}-{tag}", pixels)
        difference = float(np.abs(a.astype(np.float32) - b.astype(np.float32)).mean())
        report["prompts"].append({"prompt": prompt.prompt, "seed": prompt.seed, "mean_abs_difference": difference})
    rows = [[poster(a), poster(b)] for a, b in zip(without, with_lora)]
    for row, prompt in zip(rows, prompts):  # an edit family's row starts with the image the prompt edits
        if prompt.control:
            row.insert(0, np.asarray(control_image(prompt.control, prompt.width, prompt.height)))
    comparison = grid(rows, row_labels=[p.prompt for p in prompts],
                      column_labels=comparison_columns(bool(prompts[0].control), full))
    write_bytes_atomic(out_dir / "comparison.png", png_bytes(comparison))
    write_json_atomic(report_path, report)
    print(f"sample: {len(prompts)} prompts without and with {lora_path} -> {out_dir}/comparison.png; mean pixel "
          f"difference {np.mean([p['mean_abs_difference'] for p in report['prompts']]):.2f}/255", file=sys.stderr)
    return report


def comparison_columns(control: bool, full: bool) -> tuple[str, ...]:
    """The column labels of `comparison.png`: the image each prompt edits first where prompts have one (an edit
    family's all do, another family's none), then the base model's render and the trained one's."""
    trained = ("base model", "fine-tuned") if full else ("without LoRA", "with LoRA")
    return ("control image", *trained) if control else trained


def load_trained(pipe, adapter, path: Path, full: bool) -> None:
    """What was trained, into `pipe` as its users load it: a LoRA file with `load_lora_weights`; a full fine-tune
    (train.adapter: full) as the pipeline's denoiser component, `from_pretrained` of its exported directory."""
    if not full:
        pipe.load_lora_weights(str(path))
        return
    component = adapter.denoiser_dir().name
    base = getattr(pipe, component)
    trained = type(base).from_pretrained(path / component, torch_dtype=adapter.dtype).to(base.device)
    setattr(pipe, component, trained)
