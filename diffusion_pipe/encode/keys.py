"""Content keys of the store's two families: pure functions of what determines the stored bytes.

A key is xxh3-128 over the canonical JSON of a dict that carries a family tag and FORMAT_VERSION, and every
input that changes what the encoder would write. Paths and names never enter a key: a key made on one machine
finds the same entry on another, and moving a dataset or a model directory invalidates nothing.
"""

from __future__ import annotations

from typing import Any

from diffusion_pipe.hashing import hash_json

# Bumped by hand whenever the encoding code changes what it stores for the same inputs (a new crop rule, a
# different latent layout): every key changes, so entries written by the old code can no longer be read.
FORMAT_VERSION: int = 1


def latent_key(
    *,
    content_hash: str,
    bucket: str,
    resize: str,
    frames: dict[str, Any],
    vae_hash: str,
    vae_dtype: str,
    normalisation: dict[str, Any] | None = None,
) -> str:
    """Key of one media item's latents.

    `content_hash` is the xxh3-128 of the media file's bytes; `bucket` the assigned resolution/frames bucket;
    `resize` the crop/resize rule; `frames` the frame-sampling spec (empty for images); `vae_hash` the VAE's
    component hash; `vae_dtype` the dtype the VAE ran in; `normalisation` the scale/shift applied before storing,
    or None when latents are stored raw (the preferred way: normalising at load time keeps keys stable).
    """
    return hash_json(
        {
            "family": "latent",
            "format_version": FORMAT_VERSION,
            "content_hash": content_hash,
            "bucket": bucket,
            "resize": resize,
            "frames": frames,
            "vae_hash": vae_hash,
            "vae_dtype": vae_dtype,
            "normalisation": normalisation,
        }
    )


def text_key(
    *,
    caption: str,
    template: str,
    encoder_hashes: dict[str, str],
    tokenizer_hashes: dict[str, str],
    max_length: int,
    dtype: str,
    image: dict[str, Any] | None = None,
) -> str:
    """Key of one caption's text embeddings.

    `caption` is the text exactly as fed to the encoders (after any caption processing); `template` the
    prompt template/prefix; `encoder_hashes` and `tokenizer_hashes` map each encoder's role (e.g. "clip", "t5")
    to its component / tokenizer hash; `max_length` the token length; `dtype` the encoders' dtype. `image` names
    the pixels the encoders also read, for families whose text encoder sees the sample's conditioning image
    (Qwen-Image-Edit): its content hash, size and resize rule. None (no image) leaves it out of the key, so the
    keys of every other family are what they were.
    """
    return hash_json(
        {
            "family": "text",
            "format_version": FORMAT_VERSION,
            "caption": caption,
            "template": template,
            "encoder_hashes": encoder_hashes,
            "tokenizer_hashes": tokenizer_hashes,
            "max_length": max_length,
            "dtype": dtype,
            **({"image": image} if image is not None else {}),
        }
    )


def mask_key(*, mask_hash: str, bucket: str, resize: str, latent_factor: int) -> str:
    """Key of one loss mask at one bucket, at latent resolution.

    `mask_hash` is the xxh3-128 of the mask file's bytes; `bucket` the bucket its image trains at; `resize` the
    mask's crop/resize/downsampling rule (`encode.media.MASK_RESIZE_SPEC`); `latent_factor` the pixels per latent
    cell along a side. The VAE's weights do not change a mask's bytes, so they are not part of its key: editing a
    mask recomputes that one entry, and no latent.
    """
    return hash_json(
        {
            "family": "mask",
            "format_version": FORMAT_VERSION,
            "mask_hash": mask_hash,
            "bucket": bucket,
            "resize": resize,
            "latent_factor": latent_factor,
        }
    )
