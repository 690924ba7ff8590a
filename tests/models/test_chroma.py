"""The Chroma adapter: the shared contract on a tiny Chroma-shaped model, the text mask, and its ComfyUI export
checked through diffusers' own converter of original (BFL/ComfyUI-named) Chroma checkpoints."""

import inspect

import pytest
import torch

from diffusion_pipe.models.chroma import ChromaAdapter
from diffusion_pipe.models.flux import original_flux_state_dict, unpack_latents
from tests.models.comfyui_merge import assert_comfyui_merge_matches
from tests.models.contract import AdapterContract

INNER, MLP = 32, 128  # the tiny model's widths: 2 heads x 16, mlp_ratio 4


class TestChromaContract(AdapterContract):
    adapter_cls = ChromaAdapter
    pipeline_cls = "ChromaPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    # ChromaPipeline's loader (Flux's) splits fused ComfyUI qkv LoRAs by the real width (3072), so it cannot load
    # a tiny model's; test_comfyui_delta_equals_diffusers_delta below checks that format instead.
    roundtrip_formats = ("diffusers",)

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        full = denoiser(hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2],
                        attention_mask=inputs[3], img_ids=inputs[4][0], txt_ids=inputs[5][0], return_dict=False)[0]
        return unpack_latents(full, like.shape[-2], like.shape[-1])

    def test_text_mask_keeps_one_padding_token(self, adapter):
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        short, long = adapter.encode_text(encoders, ["a cat", "the quick brown fox jumps over the lazy dog " * 4], 16)
        tokens = encoders.pipeline.tokenizer("a cat").input_ids
        assert short["t5_mask"].tolist() == [1.0] * (len(tokens) + 1) + [0.0] * (16 - len(tokens) - 1)
        assert long["t5_mask"].tolist() == [1.0] * 16  # truncated: no padding to keep


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> ChromaAdapter:
    out = tmp_path_factory.mktemp("chroma")
    ChromaAdapter.build_tiny(out, seed=0)
    return ChromaAdapter(out, torch.float32)


def original_chroma_state_dict(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tiny model in the original layout ComfyUI loads: Flux's names, plus the approximator's own."""
    approximator = {k: v for k, v in base.items() if k.startswith("distilled_guidance_layer.")}
    renamed = {k.replace(".linear_1.", ".in_layer.").replace(".linear_2.", ".out_layer.")
               .replace(".weight", ".scale") if ".norms." in k else
               k.replace(".linear_1.", ".in_layer.").replace(".linear_2.", ".out_layer."): v
               for k, v in approximator.items()}
    rest = {k: v for k, v in base.items() if k not in approximator}
    return {**original_flux_state_dict(rest, INNER, MLP), **renamed}


def to_diffusers(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' own original -> diffusers Chroma converter, its hard-coded width (3072) set to the tiny one."""
    import diffusers.loaders.single_file_utils as sfu

    source = inspect.getsource(sfu.convert_chroma_transformer_checkpoint_to_diffusers)
    assert "inner_dim = 3072" in source
    namespace = dict(vars(sfu))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {INNER}"), namespace)
    return namespace["convert_chroma_transformer_checkpoint_to_diffusers"](dict(original))


def test_comfyui_delta_equals_diffusers_delta(tiny):
    """Every exported key lands on a module of the original model, and merged there (as ComfyUI merges:
    W += alpha / rank * up @ down), converted back by diffusers == merged in diffusers' layout."""
    modules = [n for n, m in tiny.load_denoiser(torch.device("cpu")).named_modules()
               if isinstance(m, torch.nn.Linear) and not n.startswith("distilled_guidance_layer.")]
    exported = assert_comfyui_merge_matches(tiny, original_chroma_state_dict, to_diffusers, modules=modules,
                                            exact_round_trip=False)
    assert len(exported) == 3 * len({k.rsplit(".", 2)[0] for k in exported if k.endswith(".lora_down.weight")})


def test_no_guidance_input_and_images_only(tiny):
    text = {"t5": torch.zeros(1, 8, 32), "t5_mask": torch.ones(1, 8)}
    inputs = tiny.model_inputs(torch.zeros(1, 4, 4, 6), torch.zeros(1), text, guidance=4.0)
    assert len(inputs) == 6 and inputs[3].shape == (1, 8 + 2 * 3)
    with pytest.raises(ValueError, match="family 'chroma' trains on images only"):
        tiny.encode_media(None, torch.zeros(1, 3, 5, 32, 32))


def test_samples_render_from_stored_embeddings(tiny):
    """The sample side: ChromaPipeline over the denoiser and VAE alone, fed stored text entries with their masks
    (real CFG over the negative prompt)."""
    cpu = torch.device("cpu")
    text, negative = tiny.encode_text(tiny.load_text_encoders(cpu), ["a red circle", ""], 16)
    pipe = tiny.sample_pipeline(tiny.load_denoiser(cpu), tiny.load_vae(cpu))
    assert type(pipe).__name__ == "ChromaPipeline" and pipe.text_encoder is None
    image = pipe(height=32, width=32, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0), **tiny.sample_inputs(text, negative, 4.0, 1.0)).images
    assert image.shape == (1, 32, 32, 3) and bool(torch.isfinite(torch.from_numpy(image)).all())
