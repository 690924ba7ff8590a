"""Loss masks in encode (issue 36): each mask is a store entry of its own at latent resolution, cropped with its
image's geometry, keyed by the mask's bytes, bucket, rule and latent factor (not the VAE's weights), so an edited
mask recomputes that one entry and no latent or text entry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from diffusion_pipe.config import from_dict
from diffusion_pipe.encode.encode import encode_manifest, plan_samples
from diffusion_pipe.encode.keys import mask_key
from diffusion_pipe.encode.media import MASK_RESIZE_SPEC, MediaError, load_mask
from diffusion_pipe.models import load_adapter
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.params import EncodeParams, ModelParams, load_params
from diffusion_pipe.scan import scan_to_files
from diffusion_pipe.store import Store

FACTOR = 4  # the tiny Flux VAE's pixels per latent cell (three blocks: two halvings)


def _params(tmp_path: Path, model_dir: Path, data: Path, resolution: int = 64):
    path = tmp_path / "params.yaml"
    path.write_text(f"model: {{family: flux, path: {model_dir}, dtype: float32}}\n"
                    f"scan:\n  datasets: [{{path: {data}, resolutions: [{resolution}]}}]\n  bucket_step: 16\n"
                    "encode: {text_max_length: 16, remote: '', batch_size: 4}\n")
    return load_params(path)


def _run(tmp_path: Path, params, store: Path) -> tuple[dict, list[dict]]:
    """Scan, then encode in this process; (encode report, encoded table rows)."""
    out = tmp_path / "out"
    scan_to_files(params.scan, out / "manifest.parquet", out / "scan.json", out / "scan-cache.parquet")
    report = encode_manifest(params.model, params.scan, params.encode, out / "manifest.parquet",
                             out / "encoded.parquet", out / "encode.json", Store(store), repo_root=tmp_path)
    return report, pq.read_table(out / "encoded.parquet").to_pylist()


def _image(path: Path, size: tuple[int, int], caption: str, fill=(90, 120, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, fill).save(path)
    path.with_suffix(".txt").write_text(caption)


def _square_mask(path: Path, size: tuple[int, int], box: tuple[int, int, int, int]) -> None:
    """A black mask of `size` with the white rectangle `box` (left, top, right, bottom), pixels."""
    a = np.zeros((size[1], size[0]), dtype=np.uint8)
    a[box[1]:box[3], box[0]:box[2]] = 255
    Image.fromarray(a).save(path)


def test_a_mask_lands_where_its_image_is_cropped(tmp_path: Path) -> None:
    """A 128x64 image in a 96x48 bucket is resized by 3/4 and not cropped; in a square bucket it is cropped left
    and right. The mask's white square lands on the latent cells its pixels cover, computed here by hand; a
    transposed or uncropped mask would not."""
    mask = tmp_path / "m.mask.png"
    _square_mask(mask, (128, 64), (96, 16, 112, 32))  # near the right edge, in the upper half
    # 96x48: scale 0.75, no crop: the square covers x 72..84, y 12..24 -> cells x 18..21, y 3..6 exactly
    got = load_mask(mask, 96, 48, FACTOR)
    assert got.shape == (1, 12, 24) and got.dtype == torch.float32
    want = torch.zeros(1, 12, 24)
    want[:, 3:6, 18:21] = 1.0
    assert torch.allclose(got, want, atol=1e-6)
    # 64x64: scale 1 (128x64 covers it), 32 px cropped left and right: the square's x 96..112 becomes 64..80,
    # past the bucket's 64 columns: cropped away with the image's right edge
    assert torch.equal(load_mask(mask, 64, 64, FACTOR), torch.zeros(1, 16, 16))
    _square_mask(mask, (128, 64), (40, 16, 56, 32))  # 40..56 - 32 = 8..24 -> cells 2..6
    want = torch.zeros(1, 16, 16)
    want[:, 4:8, 2:6] = 1.0
    assert torch.allclose(load_mask(mask, 64, 64, FACTOR), want, atol=1e-6)


def test_a_mask_is_averaged_over_each_latent_cell(tmp_path: Path) -> None:
    mask = tmp_path / "m.mask.png"
    _square_mask(mask, (16, 16), (0, 0, 2, 4))  # half of the first 4x4 cell
    got = load_mask(mask, 16, 16, FACTOR)
    assert got[0, 0, 0].item() == pytest.approx(0.5) and got.sum().item() == pytest.approx(0.5)
    # a mask at half its image's size covers the same cells (the box filter upsamples it without ringing)
    _square_mask(mask, (8, 8), (0, 0, 2, 2))
    got = load_mask(mask, 16, 16, FACTOR)
    assert got[0, 0, 0].item() == pytest.approx(1.0) and got.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode, fill, match", [
    ("RGB", (255, 0, 0), "a loss mask in colour"),
    ("RGBA", (255, 255, 255, 128), "a loss mask with transparency"),
])
def test_a_mask_that_is_not_greyscale_is_an_error_naming_it(tmp_path: Path, mode, fill, match) -> None:
    path = tmp_path / "cat.mask.png"
    Image.new(mode, (8, 8), fill).save(path)
    with pytest.raises(MediaError, match=f"{path}: {match}"):
        load_mask(path, 8, 8, FACTOR)
    Image.new("RGB", (8, 8), (255, 255, 255)).save(path)  # grey in RGB is fine
    assert torch.equal(load_mask(path, 8, 8, FACTOR), torch.ones(1, 2, 2))


ROW = {"dataset": "d", "path": "a.png", "status": "ok", "media": "image", "content_hash": "1" * 32,
       "caption": "a cat", "buckets": ["64x64x1", "80x48x1"], "split": "train", "repeats": 1}


def _plan(model_dir: Path, rows: list[dict]):
    model = from_dict(ModelParams, {"family": "flux", "path": str(model_dir), "dtype": "float32"}, "model")
    encode = from_dict(EncodeParams, {"text_max_length": 16}, "encode")
    return plan_samples(pa.Table.from_pylist(rows), load_adapter(model), model, encode)


def test_mask_keys_are_the_masks_bytes_bucket_and_latent_factor_not_the_vae(tmp_path: Path, store_env) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    FluxAdapter.build_tiny(a, seed=0)
    FluxAdapter.build_tiny(b, seed=1)  # another VAE (and denoiser): other latent keys
    masked = {**ROW, "mask_path": "a.mask.png", "mask_hash": "m" * 32}
    sa, sb = _plan(a, [masked]), _plan(b, [masked])
    assert [s.mask_key for s in sa] == [mask_key(mask_hash="m" * 32, bucket=bucket, resize=MASK_RESIZE_SPEC,
                                                 latent_factor=FACTOR) for bucket in ("64x64x1", "80x48x1")]
    assert [s.mask_key for s in sa] == [s.mask_key for s in sb]
    assert [s.latent_key for s in sa] != [s.latent_key for s in sb]
    assert all(s.mask_path == "a.mask.png" for s in sa)
    # an edited mask: its keys only; a manifest from before masks (no mask columns) plans unmasked samples
    edited = _plan(a, [{**masked, "mask_hash": "n" * 32}])
    assert [(s.latent_key, s.text_key) for s in edited] == [(s.latent_key, s.text_key) for s in sa]
    assert all(e.mask_key != s.mask_key for e, s in zip(edited, sa))
    assert [(s.mask_key, s.latent_key) for s in _plan(a, [ROW])] == [("", s.latent_key) for s in sa]


def test_editing_one_mask_recomputes_that_mask_entry_only(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data, store = tmp_path / "data", tmp_path / "store"
    _image(data / "cat.png", (64, 64), "a cat")
    _image(data / "dog.png", (64, 64), "a dog", fill=(10, 200, 60))
    _image(data / "owl.png", (64, 64), "an owl", fill=(200, 10, 60))
    _square_mask(data / "cat.mask.png", (64, 64), (0, 0, 32, 64))  # left half
    _square_mask(data / "dog.mask.png", (64, 64), (32, 0, 64, 64))  # right half
    params = _params(tmp_path, tiny_flux_dir, data)

    report, table = _run(tmp_path, params, store)
    counts = {fam: (report[fam]["computed"], report[fam]["reused_local"]) for fam in ("latent", "text", "mask")}
    assert counts == {"latent": (3, 0), "text": (3, 0), "mask": (2, 0)}
    assert report["masked_samples"] == 2
    rows = {r["path"]: r for r in table}
    assert rows["owl.png"]["mask_key"] == "" and rows["cat.png"]["mask_key"] and rows["dog.png"]["mask_key"]
    stored = Store(store).get("mask", rows["cat.png"]["mask_key"])["mask"]
    want = torch.zeros(1, 16, 16)
    want[..., :8] = 1.0  # the left half of the latent grid
    assert torch.equal(stored, want)

    _square_mask(data / "cat.mask.png", (64, 64), (0, 0, 16, 64))  # the cat's mask edited
    report, after = _run(tmp_path, params, store)
    counts = {fam: (report[fam]["computed"], report[fam]["reused_local"]) for fam in ("latent", "text", "mask")}
    assert counts == {"latent": (0, 3), "text": (0, 3), "mask": (1, 1)}
    before = {r["path"]: r for r in table}
    changed = {r["path"]: {k for k in r if r[k] != before[r["path"]][k]} for r in after}
    assert changed == {"cat.png": {"mask_key"}, "dog.png": set(), "owl.png": set()}

    # the masks removed: the table is again what a dataset without masks gives (no mask_key column)
    for name in ("cat", "dog"):
        (data / f"{name}.mask.png").unlink()
    report, table = _run(tmp_path, params, store)
    assert "mask" not in report and "masked_samples" not in report
    assert "mask_key" not in pq.read_schema(tmp_path / "out/encoded.parquet").names
    assert report["latent"]["computed"] == 0 and report["text"]["computed"] == 0


def test_a_colour_mask_stops_encode_naming_it(tmp_path: Path, tiny_flux_dir: Path) -> None:
    data, store = tmp_path / "data", tmp_path / "store"
    _image(data / "cat.png", (64, 64), "a cat")
    Image.new("RGB", (64, 64), (255, 0, 0)).save(data / "cat.mask.png")
    with pytest.raises(MediaError, match=r"cat\.mask\.png: a loss mask in colour"):
        _run(tmp_path, _params(tmp_path, tiny_flux_dir, data), store)
