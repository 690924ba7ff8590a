"""The Lumina 2 adapter: the shared contract on a tiny Lumina-Image-2.0-shaped model, the pipeline's time and
sign conventions, and its ComfyUI export checked through diffusers' own converter of original NextDiT
checkpoints (the names ComfyUI loads)."""

import inspect
import re

import pytest
import torch

from diffusion_pipe.models.lumina2 import Lumina2Adapter, lumina2_original_module
from tests.models.comfyui_merge import assert_comfyui_merge_matches
from tests.models.contract import AdapterContract


class TestLumina2Contract(AdapterContract):
    adapter_cls = Lumina2Adapter
    pipeline_cls = "Lumina2Pipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    # Lumina2Pipeline's loader reads diffusers keys; test_comfyui_delta_equals_diffusers_delta checks comfyui.
    roundtrip_formats = ("diffusers",)
    text_max_length = 48  # the pipeline's system prompt comes first: 16 tokens would leave no room for a caption

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        return -denoiser(hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2],
                         encoder_attention_mask=inputs[3].bool(), return_dict=False)[0]


    def test_attention_is_unmasked_unless_an_item_is_padded(self, adapter, lora_model):
        """As Lumina2Transformer2DModel: equal-length captions leave the main layers' attention unmasked (the
        first layer says so by the mask's shape, so no layer waits on the device); captions of different lengths
        mask the padding, and both give the unsplit forward's prediction."""
        denoiser, _ = lora_model
        texts = adapter.encode_text(adapter.load_text_encoders(torch.device("cpu")),
                                    ["a cat", "a dog", "a red circle on a white background"], 48)
        layers = adapter.pipeline_layers(denoiser)
        latents = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
        seen, split = [], []
        for rows in ([0, 1], [0, 2]):
            batch = {k: torch.stack([texts[i][k] for i in rows]) for k in texts[0]}
            x = adapter.model_inputs(latents, torch.tensor([0.3, 0.7]), batch, 1.0)
            with torch.no_grad():
                plain = self.unsplit_forward(adapter, denoiser, x, latents)
                hook = layers[1].block.register_forward_pre_hook(lambda _m, args: seen.append(args[1]))
                try:
                    for layer in layers:
                        x = layer(x)
                finally:
                    hook.remove()
            torch.testing.assert_close(adapter.prediction_to_latents(x, latents), plain, rtol=1e-4, atol=1e-5)
            split.append(x)
        assert texts[0]["prompt_mask"].sum() == texts[1]["prompt_mask"].sum() != texts[2]["prompt_mask"].sum()
        assert seen[0] is None
        assert seen[1].dtype == torch.bool and not seen[1].all() and seen[1].any()
        assert not torch.allclose(split[0][1], split[1][1])  # the second item's caption changed its prediction


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Lumina2Adapter:
    out = tmp_path_factory.mktemp("lumina2")
    Lumina2Adapter.build_tiny(out, seed=0)
    return Lumina2Adapter(out, torch.float32)


def test_time_and_sign_follow_the_pipeline(tiny):
    """One Lumina2Pipeline step from latents x at noise level s ends at x - s * v, v being what the adapter predicts
    for x at t = s: the adapter's time flip and negation are the pipeline's."""
    cpu = torch.device("cpu")
    text, negative = tiny.encode_text(tiny.load_text_encoders(cpu), ["a red circle", ""], 48)
    denoiser = tiny.load_denoiser(cpu)
    pipe = tiny.sample_pipeline(denoiser, tiny.load_vae(cpu))
    seen = []
    denoiser.register_forward_pre_hook(lambda _m, _args, kwargs: seen.append(kwargs["timestep"].clone()),
                                       with_kwargs=True)
    x = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    out = pipe(height=32, width=32, num_inference_steps=1, output_type="latent", latents=x.clone(),
               **tiny.sample_inputs(text, negative, 1.0, 1.0)).images
    (t_model,) = seen
    sigma = 1 - t_model
    with torch.no_grad():
        inputs = tiny.model_inputs(x, sigma, {k: v[None] for k, v in text.items()}, 1.0)
        for layer in tiny.pipeline_layers(denoiser):
            inputs = layer(inputs)
        v = tiny.prediction_to_latents(inputs, x)
    torch.testing.assert_close(out.float(), x - sigma.view(-1, 1, 1, 1) * v, rtol=1e-4, atol=1e-5)


_NORMS = {"attn.norm_q": "attention.q_norm", "attn.norm_k": "attention.k_norm", "norm1.norm": "attention_norm1",
          "norm1": "attention_norm1", "norm2": "attention_norm2", "ffn_norm1": "ffn_norm1", "ffn_norm2": "ffn_norm2"}


def original_lumina2_state_dict(base: dict[str, torch.Tensor], q_dim: int, kv_dim: int) -> dict[str, torch.Tensor]:
    """The tiny transformer's weights in the original NextDiT layout (the inverse of diffusers' converter)."""
    fused: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for key, value in base.items():
        module, param = key.rsplit(".", 1)
        norm = re.fullmatch(r"((?:layers|context_refiner|noise_refiner)\.\d+)\.(attn\.norm_[qk]|norm1\.norm|norm1|"
                            r"norm2|ffn_norm1|ffn_norm2)", module)
        if key == "time_caption_embed.caption_embedder.0.weight":
            out["cap_embedder.0.weight"] = value
        elif norm:
            out[f"{norm.group(1)}.{_NORMS[norm.group(2)]}.{param}"] = value
        else:
            original, part = lumina2_original_module(module)
            if part is not None:
                fused.setdefault(f"{original}.{param}", {})[part] = value
            else:
                out[f"{original}.{param}"] = value
    for key, parts in fused.items():
        out[key] = torch.cat([parts[i] for i in range(3)], dim=0)
    return out


def to_diffusers(original: dict[str, torch.Tensor], q_dim: int, kv_dim: int) -> dict[str, torch.Tensor]:
    """diffusers' own original -> diffusers converter, its hard-coded Lumina-Image-2.0 widths set to the tiny one."""
    import diffusers.loaders.single_file_utils as sfu

    source = inspect.getsource(sfu.convert_lumina2_to_diffusers)
    assert "q_dim = 2304" in source and "k_dim = v_dim = 768" in source
    namespace = dict(vars(sfu))
    exec(source.replace("q_dim = 2304", f"q_dim = {q_dim}").replace("k_dim = v_dim = 768", f"k_dim = v_dim = {kv_dim}"),
         namespace)
    return namespace["convert_lumina2_to_diffusers"](dict(original))


def test_comfyui_delta_equals_diffusers_delta(tiny):
    """Every Linear with a LoRA: merged in the original layout as ComfyUI merges (W += alpha / rank * up @ down)
    and converted back by diffusers == merged in diffusers' layout."""
    q_dim, kv_dim = 32, 16  # the tiny model: 2 query heads and 1 key/value head of 16
    assert_comfyui_merge_matches(tiny, lambda sd: original_lumina2_state_dict(sd, q_dim, kv_dim),
                                 lambda sd: to_diffusers(sd, q_dim, kv_dim))
