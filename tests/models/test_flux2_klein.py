"""The FLUX.2 [klein] adapter: the shared contract on a tiny Klein-shaped model, and its ComfyUI export checked
through diffusers' own converter of original (BFL, ComfyUI-named) Flux.2 checkpoints."""

import re

import pytest
import torch

from diffusion_pipe.models.flux2_klein import Flux2KleinAdapter, flux2_original_module
from tests.models.comfyui_merge import assert_comfyui_merge_matches
from tests.models.contract import AdapterContract


class TestFlux2KleinContract(AdapterContract):
    adapter_cls = Flux2KleinAdapter
    pipeline_cls = "Flux2KleinPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    # Flux2KleinPipeline's loader reads diffusers keys; test_comfyui_delta_equals_diffusers_delta checks comfyui.
    roundtrip_formats = ("diffusers",)

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        full = denoiser(hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2],
                        img_ids=inputs[3], txt_ids=inputs[4], guidance=None, return_dict=False)[0]
        return adapter.prediction_to_latents(full, like)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Flux2KleinAdapter:
    out = tmp_path_factory.mktemp("flux2_klein")
    Flux2KleinAdapter.build_tiny(out, seed=0)
    return Flux2KleinAdapter(out, torch.float32)


_NORMS = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
          "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm"}


def original_flux2_state_dict(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tiny transformer's weights in BFL's original layout (the inverse of diffusers' converter)."""
    fused: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for key, value in base.items():
        module, param = key.rsplit(".", 1)
        double_norm = re.fullmatch(r"transformer_blocks\.(\d+)\.(attn\.norm_.+)", module)
        single_norm = re.fullmatch(r"single_transformer_blocks\.(\d+)\.attn\.norm_([qk])", module)
        if double_norm:
            out[f"double_blocks.{double_norm.group(1)}.{_NORMS[double_norm.group(2)]}.scale"] = value
        elif single_norm:
            index, qk = single_norm.groups()
            out[f"single_blocks.{index}.norm.{'query' if qk == 'q' else 'key'}_norm.scale"] = value
        else:
            original, part = flux2_original_module(module)
            if part is not None:
                fused.setdefault(f"{original}.{param}", {})[part] = value
            elif original == "final_layer.adaLN_modulation.1":
                first, second = value.chunk(2, dim=0)
                out[f"{original}.{param}"] = torch.cat([second, first], dim=0)
            else:
                out[f"{original}.{param}"] = value
    for key, parts in fused.items():
        out[key] = torch.cat([parts[i] for i in range(3)], dim=0)
    return out


def to_diffusers(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    return convert_flux2_transformer_checkpoint_to_diffusers(dict(original))


def test_comfyui_delta_equals_diffusers_delta(tiny):
    """Every Linear with a LoRA: merged in BFL's layout as ComfyUI merges (W += alpha / rank * up @ down) and
    converted back by diffusers == merged in diffusers' layout."""
    assert_comfyui_merge_matches(tiny, original_flux2_state_dict, to_diffusers)


def test_latents_are_stored_in_the_transformers_space(tiny):
    """Encoding applies the VAE's batch-norm statistics (non-trivial in the tiny VAE), so normalising is the
    identity; decoding those latents the way the pipeline does gives back an image of the input's size."""
    vae = tiny.load_vae(torch.device("cpu"))
    assert not torch.allclose(vae.bn.running_mean, torch.zeros_like(vae.bn.running_mean))
    pixels = torch.rand(1, 3, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    (entry,) = tiny.encode_media(vae, pixels)
    assert entry["latents"].shape == (16, 4, 4)
    assert torch.equal(tiny.normalise_latents(entry["latents"]), entry["latents"])
    raw = vae.encode(pixels[:, :, 0]).latent_dist.mode()
    mean, std = vae.bn.running_mean.view(-1, 1, 1), (vae.bn.running_var.view(-1, 1, 1) + 1e-4).sqrt()
    patched = raw.view(1, 4, 4, 2, 4, 2).permute(0, 1, 3, 5, 2, 4).reshape(16, 4, 4)
    torch.testing.assert_close(entry["latents"], (patched - mean) / std)
