"""Rendering sample prompts: deterministic, seeded per prompt, sizes checked; the params that drive it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_pipe.config import ConfigError, from_dict
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.params import SampleParams, TrainParams
from diffusion_pipe.models.sdxl import SDXLAdapter
from diffusion_pipe.sample.render import (check_prompt, encode_sample_texts, grid, png_bytes, prompt_texts,
                                          render_prompts)
from diffusion_pipe.train.samples import sample_steps
from tests.sample.helpers import sample_params


def test_sample_steps_are_zero_every_n_and_the_end():
    assert sample_steps(sample_params(every_steps=4), 10) == [0, 4, 8, 10]
    assert sample_steps(sample_params(every_steps=5), 10) == [0, 5, 10]
    assert sample_steps(sample_params(every_steps=0), 10) == [0, 10]
    assert sample_steps(sample_params(prompts=[]), 10) == []


def test_prompt_defaults_and_the_texts_each_family_renders_from(tiny_flux_dir):
    samples = sample_params(prompts=[{"prompt": "a", "negative_prompt": "blurry", "width": 64, "guidance": 0.0},
                                     {"prompt": "b", "seed": 7}, {"prompt": "c", "cfg_scale": 2.0}])
    a, b, c = samples.resolved()
    assert (a.width, a.height, a.steps, a.guidance) == (64, 32, 3, 0.0)
    assert (b.width, b.seed, b.guidance, b.cfg_scale) == (32, 7, 3.5, 1.0)
    # Flux's distilled guidance needs no negative prompt; its true CFG (cfg_scale > 1) needs one, empty or not
    texts = prompt_texts(FluxAdapter(tiny_flux_dir, torch.float32), samples.resolved())
    assert [t.text for t in texts] == ["", "a", "b", "c"] and not any(t.control for t in texts)
    # a CFG family embeds every negative prompt
    assert [t.text for t in prompt_texts(SDXLAdapter(tiny_flux_dir, torch.float32), samples.resolved())] == [
        "", "a", "b", "blurry", "c"]


def test_samples_are_checked_like_every_param():
    with pytest.raises(ConfigError, match=r"train\.samples\.prompts\[0\]\.promt: unknown key; did you mean 'prompt'"):
        from_dict(TrainParams, {"samples": {"prompts": [{"promt": "a cat"}]}}, "train")
    with pytest.raises(ConfigError, match="a sample prompt is empty"):
        from_dict(SampleParams, {"prompts": [{"prompt": " "}]}, "train.samples")
    with pytest.raises(ConfigError, match=r"train\.samples\.every_steps: -1 is out of range \[0, inf\)"):
        from_dict(SampleParams, {"every_steps": -1}, "train.samples")


def test_a_size_the_model_cannot_render_is_an_error(tiny_flux_dir):
    adapter = FluxAdapter(tiny_flux_dir, torch.float32)
    prompt = sample_params(width=36).resolved()[0]
    with pytest.raises(ConfigError, match=r"36x32; family 'flux' renders sides that are multiples of 8"):
        check_prompt(adapter, prompt)
    with pytest.raises(ConfigError, match="asks for 5 frames but family 'flux' renders images"):
        check_prompt(adapter, sample_params(frames=5).resolved()[0])


def test_rendering_is_deterministic_and_each_prompt_keeps_its_seed(tiny_flux_dir):
    adapter = FluxAdapter(tiny_flux_dir, torch.float32)
    cpu = torch.device("cpu")
    pipe = adapter.sample_pipeline(adapter.load_denoiser(cpu), adapter.load_vae(cpu))
    samples = sample_params()
    encoders = adapter.load_text_encoders(cpu)
    texts = encode_sample_texts(adapter, encoders, prompt_texts(adapter, samples.resolved()), 32)
    prompts = samples.resolved()

    first = render_prompts(pipe, adapter, prompts, texts, cpu)
    again = render_prompts(pipe, adapter, prompts, texts, cpu)
    assert first[0].shape == (1, 32, 32, 3) and first[0].dtype == np.uint8
    assert all(png_bytes(a[0]) == png_bytes(b[0]) for a, b in zip(first, again))
    # the first prompt alone starts from the same noise as in the batch: its seed, not its position, decides
    alone = render_prompts(pipe, adapter, prompts[:1], texts, cpu)[0]
    assert np.abs(alone.astype(int) - first[0].astype(int)).max() <= 1
    reseeded = render_prompts(pipe, adapter, (prompts[0].__class__(**{**prompts[0].__dict__, "seed": 99}),),
                              texts, cpu)[0]
    assert np.abs(reseeded.astype(int) - first[0].astype(int)).mean() > 5


def test_grid_lays_out_rows():
    red, blue = np.zeros((4, 6, 3), np.uint8), np.full((4, 6, 3), 200, np.uint8)
    out = grid([[red, blue], [blue]], gap=2)
    assert out.shape == (10, 14, 3)
    assert (out[:4, :6] == 0).all() and (out[:4, 8:] == 200).all() and (out[6:, :6] == 200).all()
    assert (out[6:, 8:] == 255).all()  # a missing cell stays background


def test_a_video_sample_writes_its_middle_frame_and_an_mp4(tmp_path):
    import imageio.v3 as iio

    from diffusion_pipe.sample.render import write_media

    frames = np.stack([np.full((16, 16, 3), 40 * i, np.uint8) for i in range(5)])
    written = write_media(tmp_path / "00", frames)
    assert [p.name for p in written] == ["00.png", "00.mp4"]
    assert (np.asarray(Image.open(tmp_path / "00.png")) == 80).all()  # the middle frame stands for the video
    assert iio.imread(tmp_path / "00.mp4", plugin="pyav").shape[0] == 5
    assert write_media(tmp_path / "01", frames[:1]) == [tmp_path / "01.png"]  # an image writes no video
