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
from diffusion_pipe.sample.render import (check_prompt, encode_sample_texts, grid, grid_layout, png_bytes,
                                          prompt_texts, render_prompts)
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


def _cell(out: np.ndarray, box) -> np.ndarray:
    top, left, bottom, right = box
    return out[top:bottom, left:right]


def test_grid_scales_small_renders_up_and_large_ones_down_into_their_cells():
    rng = np.random.default_rng(0)
    small = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(3)]
    out = grid([small[:2], small[2:]], row_labels=["a", "b"], column_labels=["without LoRA", "with LoRA"])
    layout = grid_layout([[(32, 32)] * 2, [(32, 32)]], ["a", "b"], ["without LoRA", "with LoRA"])
    assert out.shape == (layout.height, layout.width, 3) and (layout.up, layout.down) == (4, 1)
    for img, box in zip(small, (*layout.cells[0], layout.cells[1][0])):  # nearest-neighbour: pixels kept sharp
        assert np.array_equal(_cell(out, box), img.repeat(4, axis=0).repeat(4, axis=1))
    top, left = layout.cells[0][1][0], layout.cells[0][1][1]
    assert (out[top + 130:top + 258, left:left + 128] == 255).all()  # a short row's missing cell stays white

    large = rng.integers(0, 256, (1024, 768, 3), dtype=np.uint8)  # a real-size render: box-averaged to 512
    out = grid([[large, None]], row_labels=["a"], column_labels=["step 0", "step 60"])
    (box, missing), = grid_layout([[(1024, 768), None]], ["a"], ["step 0", "step 60"]).cells
    assert missing is None and _cell(out, box).shape == (512, 384, 3)
    assert np.array_equal(_cell(out, box), np.asarray(Image.fromarray(large).reduce(2)))


def test_grid_labels_its_columns_above_and_its_rows_left_of_the_cells():
    cells = [[np.zeros((32, 32, 3), np.uint8)] * 2] * 2
    out = grid(cells, row_labels=["red", "blue"], column_labels=["step 0", "step 60"])
    layout = grid_layout([[(32, 32)] * 2] * 2, ["red", "blue"], ["step 0", "step 60"])
    header, labels = out[:layout.header_height], out[layout.header_height:, :layout.label_width]
    assert layout.header_height >= 16 and layout.label_width >= 16
    for c, box in enumerate(layout.cells[0]):  # text above each column, and nothing but text
        above = header[:, box[1]:box[3]]
        assert (above < 128).any() and (above.min(axis=-1) == above.max(axis=-1)).all()
    for (top, _, bottom, _), _ in layout.cells:  # text left of each row
        assert (labels[top - layout.header_height:bottom - layout.header_height] < 128).any()
    assert (out[:layout.header_height, :layout.label_width] == 255).all()  # the corner stays blank

    renamed = grid(cells, row_labels=["red", "bleu"], column_labels=["step 0", "step 90"])  # as wide as before
    assert renamed.shape == out.shape
    changed = np.argwhere((renamed != out).any(axis=-1))
    assert len(changed)
    second_row, second_column = layout.cells[1][0], layout.cells[0][1]
    assert all((y >= second_row[0] and x < layout.label_width) or (y < layout.header_height and x >= second_column[1])
               for y, x in changed)  # only the two labels that changed

    bare = grid(cells)
    assert bare.shape == (2 * 128 + 2, 2 * 128 + 2, 3) and (bare[:128, :128] == 0).all()  # no labels: no strips


def test_long_labels_wrap_and_end_in_an_ellipsis():
    prompt = ("a photo of sks dog on a beach in the evening light with waves and a boat far away, highly detailed, "
              "35mm film, golden hour, shallow depth of field, " * 3)
    layout = grid_layout([[(32, 32)] * 2], [prompt], [prompt, "with LoRA"])
    (row,), (column, short) = layout.row_lines, layout.column_lines
    assert 1 < len(row) <= layout.cell_height // 16 and len(column) == 3 and short == ("with LoRA",)
    for lines in (row, column):
        assert lines[-1].endswith("\u2026") and " ".join(lines)[:-1] in prompt
    assert layout.label_width < 2 * layout.cell_width + 64  # wrapped, not one long line
    word = grid_layout([[(32, 32)]], column_labels=["x" * 200]).column_lines[0]
    assert len(word) == 3 and word[-1].endswith("\u2026")  # a word wider than the cell is cut


def test_equal_inputs_give_equal_png_bytes():
    rng = np.random.default_rng(1)
    cells = [[rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(3)] for _ in range(2)]
    labels = {"row_labels": ["a red circle", "a blue square"], "column_labels": ["step 0", "step 2", "step 4"]}
    first = png_bytes(grid(cells, **labels))
    assert png_bytes(grid([[c.copy() for c in row] for row in cells], **labels)) == first
    assert png_bytes(grid(cells, **labels | {"row_labels": ["a red circle", "a blue circle"]})) != first


def test_labels_must_match_the_rows_and_columns():
    cells = [[np.zeros((8, 8, 3), np.uint8)] * 2]
    with pytest.raises(ValueError, match=r"grid: 2 row labels for 1 rows; give one per row"):
        grid(cells, row_labels=["a", "b"])
    with pytest.raises(ValueError, match=r"grid: 1 column labels for 2 columns; give one per column"):
        grid(cells, column_labels=["step 0"])
    with pytest.raises(ValueError, match=r"grid: no images to lay out"):
        grid([[None]])


def test_a_video_sample_writes_its_middle_frame_and_an_mp4(tmp_path):
    import imageio.v3 as iio

    from diffusion_pipe.sample.render import write_media

    frames = np.stack([np.full((16, 16, 3), 40 * i, np.uint8) for i in range(5)])
    written = write_media(tmp_path / "00", frames)
    assert [p.name for p in written] == ["00.png", "00.mp4"]
    assert (np.asarray(Image.open(tmp_path / "00.png")) == 80).all()  # the middle frame stands for the video
    assert iio.imread(tmp_path / "00.mp4", plugin="pyav").shape[0] == 5
    assert write_media(tmp_path / "01", frames[:1]) == [tmp_path / "01.png"]  # an image writes no video
