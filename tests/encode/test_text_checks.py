"""What encode checks about the text side before and while it encodes captions: a tokenizer that cannot tell words
apart is refused before anything is encoded or reused, and captions longer than an encoder reads are counted per
tokenizer in reports/encode.json and named in a warning (they are cut there, silently, by the pipelines)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from diffusion_pipe.config import from_dict
from diffusion_pipe.encode.encode import encode_manifest
from diffusion_pipe.model_folder import ModelFolderError
from diffusion_pipe.params import EncodeParams, ModelParams, ScanParams
from diffusion_pipe.scan import scan_to_files
from diffusion_pipe.store import Store
from tests.conftest import REPO

IMAGES = sorted((REPO / "examples/flux-tiny/data").glob("*.png"))[:3]
LONG = " ".join(["a red circle on a white background"] * 1500)  # 10,500 characters
MEDIUM = "a small green square and a big blue triangle on a gray background next to an orange ring"


def _encode(tmp_path: Path, model_dir: Path, store: Path, captions: list[str]) -> dict:
    """Scan three example images captioned `captions` and encode them with the Flux at `model_dir` (T5 read at 16
    tokens, CLIP at its 77); the report."""
    data = tmp_path / "data"
    data.mkdir()
    for image, caption in zip(IMAGES, captions):
        shutil.copy(image, data / image.name)
        (data / image.name).with_suffix(".txt").write_text(caption)
    scan = from_dict(ScanParams, {"datasets": [{"path": str(data), "name": "shapes", "resolutions": [32],
                                                "eval_fraction": 0.0}], "bucket_step": 16}, "scan")
    scan_to_files(scan, tmp_path / "manifest.parquet", tmp_path / "scan.json", None)
    model = from_dict(ModelParams, {"family": "flux", "path": str(model_dir), "dtype": "float32"}, "model")
    encode = from_dict(EncodeParams, {"text_max_length": 16, "workers": 0, "device": "cpu", "remote": ""}, "encode")
    return encode_manifest(model, scan, encode, tmp_path / "manifest.parquet", tmp_path / "encoded.parquet",
                           tmp_path / "encode.json", Store(store), repo_root=tmp_path)


def test_a_tokenizer_without_its_vocabulary_stops_encode_before_anything_is_encoded(
        tiny_flux_dir: Path, tmp_path: Path, store_env: Path) -> None:
    """Flux's own loader takes such a folder (a 2-token CLIP tokenizer mapping every word to <unk>, so every
    caption's pooled embedding is the same): encode checks every family's tokenizers itself, first."""
    model_dir = Path(shutil.copytree(tiny_flux_dir, tmp_path / "model"))
    (model_dir / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(ModelFolderError, match=rf"{model_dir}/tokenizer: its tokenizer .* alike, so every caption "
                                               r"would train as the same text"):
        _encode(tmp_path, model_dir, store_env, ["a red circle", "a blue square", "a green ring"])
    assert not (tmp_path / "encoded.parquet").exists()
    assert all(not Store(store_env).packs(fam) for fam in ("latent", "text"))


def test_captions_longer_than_an_encoder_reads_are_counted_and_named(
        tiny_flux_dir: Path, tmp_path: Path, store_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = _encode(tmp_path, tiny_flux_dir, store_env, [LONG, MEDIUM, "a red circle"])
    long_item, medium_item = (f"shapes/{p.name} ({p.with_suffix('.txt').name})" for p in IMAGES[:2])
    # CLIP reads 77 tokens whatever encode.text_max_length says: only the 10,000-character caption is cut there.
    assert report["truncated_captions"] == {
        "tokenizer": {"limit": 77, "captions": 1, "first": [long_item]},
        "tokenizer_2": {"limit": 16, "captions": 2, "first": [long_item, medium_item]},
    }
    assert json.loads((tmp_path / "encode.json").read_text())["truncated_captions"] == report["truncated_captions"]
    err = capsys.readouterr().err
    assert (f"encode: warning: the encoder of tokenizer reads 77 tokens of a caption and cuts off the rest; captions "
            f"longer than that: 1 ({long_item}).") in err
    assert f"the encoder of tokenizer_2 reads 16 tokens of a caption and cuts off the rest; captions longer than " \
           f"that: 2 ({long_item}, {medium_item})." in err


@pytest.mark.parametrize(("family", "limits"), [
    ("flux", {"tokenizer": 77, "tokenizer_2": 512}),  # CLIP at its 77 positions, T5 at encode.text_max_length
    ("sdxl", {"tokenizer": 77, "tokenizer_2": 77}),  # two CLIPs: text_max_length does not apply
    ("hidream", {"tokenizer": 218, "tokenizer_2": 218, "tokenizer_3": 512, "tokenizer_4": 512}),  # Long-CLIP: 218
    ("hunyuan_image", {"tokenizer": 512}),  # ByT5 reads only the quoted text, never cutting the caption
    ("minimax_h3", {}),  # never cuts: encode_text refuses a longer caption
])
def test_each_family_counts_against_the_length_its_pipeline_reads(family: str, limits: dict[str, int]) -> None:
    from diffusion_pipe.models import adapter_class

    adapter = adapter_class(family)(REPO / f"examples/{family}-tiny/model", torch.float32)
    assert adapter.caption_token_limits(adapter.load_tokenizers(), 512) == limits
