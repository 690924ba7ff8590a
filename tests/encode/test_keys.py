"""Encode keys: pure, stable, and sensitive to exactly the inputs that change the stored bytes."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from diffusion_pipe.encode import keys
from diffusion_pipe.encode.keys import FORMAT_VERSION, latent_key, text_key
from diffusion_pipe.hashing import hash_json

LATENT: dict[str, Any] = {
    "content_hash": "0" * 32,
    "bucket": "512x512",
    "resize": "center-crop",
    "frames": {"count": 1},
    "vae_hash": "a" * 32,
    "vae_dtype": "bfloat16",
    "normalisation": None,
}
TEXT: dict[str, Any] = {
    "caption": "a photo of a cat",
    "template": "{caption}",
    "encoder_hashes": {"t5": "b" * 32},
    "tokenizer_hashes": {"t5": "c" * 32},
    "max_length": 512,
    "dtype": "bfloat16",
}
LATENT_CHANGES: dict[str, Any] = {
    "content_hash": "1" * 32,
    "bucket": "768x512",
    "resize": "resize-pad",
    "frames": {"count": 33},
    "vae_hash": "d" * 32,
    "vae_dtype": "float32",
    "normalisation": {"scale": 0.18215, "shift": 0.0},
}
TEXT_CHANGES: dict[str, Any] = {
    "caption": "a photo of a cat!",
    "template": "a picture: {caption}",
    "encoder_hashes": {"t5": "e" * 32},
    "tokenizer_hashes": {"t5": "f" * 32},
    "max_length": 256,
    "dtype": "float32",
    # the image a text encoder reads with the caption (none in TEXT: absent from the key, see below)
    "image": {"content_hash": "1" * 32, "bucket": "512x512", "resize": "center-crop", "frames": {"count": 1}},
}


def test_same_inputs_same_key() -> None:
    assert latent_key(**LATENT) == latent_key(**dict(LATENT))
    assert text_key(**TEXT) == text_key(**dict(TEXT))
    assert len(latent_key(**LATENT)) == 32 and int(latent_key(**LATENT), 16) >= 0


@pytest.mark.parametrize("field", sorted(LATENT_CHANGES))
def test_every_latent_field_changes_the_key(field: str) -> None:
    assert latent_key(**{**LATENT, field: LATENT_CHANGES[field]}) != latent_key(**LATENT)


@pytest.mark.parametrize("field", sorted(TEXT_CHANGES))
def test_every_text_field_changes_the_key(field: str) -> None:
    assert text_key(**{**TEXT, field: TEXT_CHANGES[field]}) != text_key(**TEXT)


def test_captions_differing_in_one_character() -> None:
    caption = TEXT["caption"]
    variants = {caption, caption.upper(), caption + " ", caption.replace("a", "à", 1), caption[:-1]}
    assert len({text_key(**{**TEXT, "caption": c}) for c in variants}) == len(variants)


def test_dict_order_does_not_matter() -> None:
    two = {"clip": "1" * 32, "t5": "2" * 32}
    assert text_key(**{**TEXT, "encoder_hashes": two}) == text_key(
        **{**TEXT, "encoder_hashes": dict(reversed(two.items()))}
    )


def test_families_are_separated_by_signature_and_tag() -> None:
    assert "caption" not in inspect.signature(latent_key).parameters
    assert not {"content_hash", "bucket", "vae_hash"} & set(inspect.signature(text_key).parameters)
    # The family tag and the format version are part of what is hashed.
    assert latent_key(**LATENT) == hash_json({"family": "latent", "format_version": FORMAT_VERSION, **LATENT})
    assert text_key(**TEXT) == hash_json({"family": "text", "format_version": FORMAT_VERSION, **TEXT})


def test_format_version_changes_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    before = latent_key(**LATENT), text_key(**TEXT)
    monkeypatch.setattr(keys, "FORMAT_VERSION", FORMAT_VERSION + 1)
    after = latent_key(**LATENT), text_key(**TEXT)
    assert before[0] != after[0] and before[1] != after[1]


def test_keys_are_keyword_only() -> None:
    with pytest.raises(TypeError, match="positional"):
        latent_key(*LATENT.values())  # type: ignore[misc]


def test_the_image_a_text_encoder_reads_keys_its_entry() -> None:
    """Every part of the image's description changes the key (another control image, the same at another bucket
    or crop); with no image the key is what it was before images could enter it (test above)."""
    image = TEXT_CHANGES["image"]
    for part, other in (("content_hash", "2" * 32), ("bucket", "768x512"), ("resize", "resize-pad"),
                        ("frames", {"count": 1, "start": 8})):
        assert text_key(**TEXT, image={**image, part: other}) != text_key(**TEXT, image=image)
