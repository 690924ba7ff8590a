"""One prompt -> pixels through the family's diffusers pipeline, deterministically; grids and files of them.

Prompts come as text-store entries (the encode stage embeds them like captions), so rendering needs neither
text encoders nor tokenizers. Noise comes from a CPU generator seeded by the prompt's seed: the same prompt
gives the same starting noise at every step of a run, on any device.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from diffusion_pipe.fileio import write_bytes_atomic
from diffusion_pipe.models.base import Adapter, TensorDict
from diffusion_pipe.params import SamplePrompt


class SampleText(NamedTuple):
    """A text a sample prompt renders from, with what the family's text encoder reads beside it: for a family
    with `text_reads_conditioning`, the prompt's control image at the sample's size (its text entry is keyed and
    made with it); else nothing, and prompts share the entries of equal texts."""

    text: str
    control: str = ""
    width: int = 0
    height: int = 0


def sample_text(adapter: Adapter, prompt: SamplePrompt, text: str) -> SampleText:
    """`text` (the prompt's or its negative prompt) as `prompt` renders from it."""
    if adapter.capabilities.text_reads_conditioning:
        return SampleText(text, prompt.control, prompt.width, prompt.height)
    return SampleText(text)


def prompt_texts(adapter: Adapter, prompts: tuple[SamplePrompt, ...]) -> tuple[SampleText, ...]:
    """Every text the resolved `prompts` render from (the family decides whether negative prompts count)."""
    return tuple(sorted({sample_text(adapter, p, text) for p in prompts for text in adapter.sample_texts(p)}))


def encode_sample_texts(adapter: Adapter, encoders: object, texts: tuple[SampleText, ...],
                        max_length: int) -> dict[SampleText, TensorDict]:
    """The text entries of `texts` made by the family's text encoders, as encode makes them: a text read with a
    control image is read with it as `control_image` crops it to the sample's size."""
    from diffusion_pipe.encode.media import load_pixels_uint8, to_unit_range

    alone = [t for t in texts if not t.control]
    out = dict(zip(alone, adapter.encode_text(encoders, [t.text for t in alone], max_length))) if alone else {}
    for t in (t for t in texts if t.control):
        pixels = to_unit_range(load_pixels_uint8(Path(t.control), "image", t.width, t.height, 1))[None]
        (out[t],) = adapter.encode_conditioned_text(encoders, [t.text], pixels, max_length)
    return out


def check_prompt(adapter: Adapter, prompt: SamplePrompt) -> None:
    """A prompt the model cannot render is an error naming the prompt and what to change: a size that is not a
    multiple the family needs, frames for an image family, a control image missing for an edit family (or given to
    another family, or not a file)."""
    from diffusion_pipe.config import ConfigError

    edits = adapter.samples_need_control
    if edits and not prompt.control:
        raise ConfigError(f"train.samples.prompts: prompt {prompt.prompt!r} has no control image; family "
                          f"'{adapter.name}' renders from one: give the prompt `control: path/to/image.png`")
    if prompt.control and not edits:
        raise ConfigError(f"train.samples.prompts: prompt {prompt.prompt!r} has a control image, but family "
                          f"'{adapter.name}' renders from text alone; remove `control`")
    if prompt.control and not Path(prompt.control).is_file():
        raise ConfigError(f"train.samples.prompts: prompt {prompt.prompt!r}: control image {prompt.control} is not a "
                          "file; give the path of an image (relative to the repository)")
    m = adapter.sample_size_multiple()
    if prompt.width % m or prompt.height % m:
        raise ConfigError(f"train.samples: prompt {prompt.prompt!r} is {prompt.width}x{prompt.height}; family "
                          f"'{adapter.name}' renders sides that are multiples of {m}: set width and height to such")
    if prompt.frames > 1 and "video" not in adapter.capabilities.media:
        raise ConfigError(f"train.samples: prompt {prompt.prompt!r} asks for {prompt.frames} frames but family "
                          f"'{adapter.name}' renders images; set frames to 1")


@torch.no_grad()
def render_prompts(pipe: object, adapter: Adapter, prompts: tuple[SamplePrompt, ...],
                   texts: dict[SampleText, TensorDict], device: torch.device) -> list[np.ndarray]:
    """Pixels (frames, height, width, 3) uint8 of each resolved prompt, in order; `texts` holds the stored text
    entry of every prompt and negative prompt. Prompts that share size, frames, steps, guidance and control image
    render as one batch (one pass of the pipeline), each from the noise of its own seed."""
    out: list[np.ndarray | None] = [None] * len(prompts)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault((p.width, p.height, p.frames, p.steps, p.guidance, p.cfg_scale, p.control), []).append(i)
    for (width, height, frames, steps, guidance, cfg_scale, control), members in groups.items():
        calls = [adapter.sample_inputs(texts[sample_text(adapter, p, p.prompt)],
                                       texts.get(sample_text(adapter, p, p.negative_prompt)), guidance, cfg_scale)
                 for p in (prompts[i] for i in members)]
        kwargs = {k: _join([c[k] for c in calls], device) if k not in adapter.sample_shared_inputs else
                  calls[0][k].to(device) for k in calls[0]}
        if control:  # the image the group's prompts edit (or start from), read once for the batch
            kwargs |= adapter.sample_control_inputs(control_image(control, width, height))
        if "video" in adapter.capabilities.media:
            kwargs["num_frames"] = frames
        result = pipe(height=height, width=width, num_inference_steps=steps, output_type="np",
                      generator=[torch.Generator("cpu").manual_seed(prompts[i].seed) for i in members], **kwargs)
        # (B, F, H, W, 3) for video pipelines, (B, H, W, 3) for image ones; values in [0, 1]
        pixels = np.asarray(result.frames) if hasattr(result, "frames") else np.asarray(result.images)[:, None]
        for i, item in zip(members, pixels):
            out[i] = (np.clip(item, 0.0, 1.0) * 255).round().astype(np.uint8)
    return out


def control_image(path: str, width: int, height: int) -> object:
    """A sample prompt's control image as a PIL image at the sample's size, cropped as encode crops a training
    control image to its target's bucket (cover, centre)."""
    from PIL import Image

    from diffusion_pipe.encode.media import load_pixels_uint8

    pixels = load_pixels_uint8(Path(path), "image", width, height, 1)  # (3, 1, H, W)
    return Image.fromarray(pixels[:, 0].permute(1, 2, 0).numpy())


def _join(values: list, device: torch.device) -> object:
    """One pipeline argument from the prompts of a batch: tensors concatenated, lists (a tensor per prompt, as
    ZImagePipeline takes its embeddings) joined, anything else (a scale) the first prompt's."""
    if isinstance(values[0], torch.Tensor):
        return torch.cat(values).to(device)
    if isinstance(values[0], list):
        return [t.to(device) for value in values for t in value]
    return values[0]


def grid(rows: list[list[np.ndarray]], gap: int = 2) -> np.ndarray:
    """Images (H, W, 3) uint8 laid out in rows on a white background; cells take the largest size."""
    height = max(img.shape[0] for row in rows for img in row)
    width = max(img.shape[1] for row in rows for img in row)
    columns = max(len(row) for row in rows)
    out = np.full((len(rows) * (height + gap) - gap, columns * (width + gap) - gap, 3), 255, dtype=np.uint8)
    for r, row in enumerate(rows):
        for c, img in enumerate(row):
            y, x = r * (height + gap), c * (width + gap)
            out[y:y + img.shape[0], x:x + img.shape[1]] = img
    return out


def png_bytes(image: np.ndarray) -> bytes:
    """PNG of an (H, W, 3) uint8 image; no timestamps or text chunks, so equal pixels give equal bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def write_media(path_stem: Path, pixels: np.ndarray, fps: int = 16) -> list[Path]:
    """Write one rendered prompt atomically: `<stem>.png` (the middle frame of a video) and, for more than one
    frame, `<stem>.mp4` too. Returns the paths written."""
    written = [path_stem.with_suffix(".png")]
    write_bytes_atomic(written[0], png_bytes(poster(pixels)))
    if pixels.shape[0] > 1:
        import imageio.v3 as iio

        video = iio.imwrite("<bytes>", pixels, extension=".mp4", plugin="pyav", codec="libx264", fps=fps)
        written.append(path_stem.with_suffix(".mp4"))
        write_bytes_atomic(written[1], video)
    return written


def poster(pixels: np.ndarray) -> np.ndarray:
    """The frame that stands for a rendered prompt in grids: the middle one."""
    return pixels[pixels.shape[0] // 2]
