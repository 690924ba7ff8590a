"""The Ideogram 4 adapter: the shared contract on a tiny Ideogram 4-shaped model (exports round-trip into
Ideogram4Pipeline in diffusers' names and in the original names ComfyUI reads), the first layer's inputs and the
prediction as Ideogram4Pipeline feeds and reads its transformer, its text entries as the pipeline encodes them, its
latents as the pipeline decodes them, and samples from stored entries as the pipeline renders the prompt."""

import pytest
import torch

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.ideogram4 import Ideogram4Adapter
from tests.models.comfyui_merge import assert_comfyui_merge_matches
from tests.models.contract import AdapterContract, module_calls, random_like_spec


def full_inputs(inputs: tuple) -> dict:
    """The transformer's keyword arguments for the adapter's first-layer inputs: the packed sequence as the
    pipeline feeds it, zeros over the text region of the latents and over the image region of the text."""
    tokens, timestep, text, position_ids, segment_ids, indicator = inputs
    b, n_text = text.shape[:2]
    return {"hidden_states": torch.cat((tokens.new_zeros(b, n_text, tokens.shape[-1]), tokens), dim=1),
            "timestep": timestep,
            "encoder_hidden_states": torch.cat((text, text.new_zeros(b, tokens.shape[1], text.shape[-1])), dim=1),
            "position_ids": position_ids, "segment_ids": segment_ids, "indicator": indicator}


class TestIdeogram4Contract(AdapterContract):
    adapter_cls = Ideogram4Adapter
    pipeline_cls = "Ideogram4Pipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    roundtrip_formats = ("diffusers", "comfyui")

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        out = denoiser(**full_inputs(inputs), return_dict=False)[0]
        return adapter.prediction_to_latents(out, like)

    def test_first_layer_inputs_are_what_the_pipeline_feeds_its_transformer(self, adapter, model_dir):
        """Ideogram4Pipeline, given a prompt and latents, calls its transformer with the entry's text region and
        the latents' tokens in its packed sequence (zeros elsewhere), model time 1 - t and the ids of [padding,
        caption, image]: the adapter's inputs are those, and the composed layers predict minus what the
        transformer returns for the image tokens."""
        from diffusers import Ideogram4Pipeline

        pipe = Ideogram4Pipeline.from_pretrained(model_dir, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        (entry,) = adapter.encode_text(adapter.load_text_encoders(torch.device("cpu")), ["a red circle"], 16)
        text = {k: v[None] for k, v in entry.items()}
        noisy = random_like_spec(adapter.latent_spec(48, 32, 1), 1, seed=2)["latents"]
        tokens = adapter.model_inputs(noisy, torch.zeros(1), text, 1.0)[0]
        with module_calls(pipe.transformer) as calls:
            pipe("a red circle", height=32, width=48, num_inference_steps=1, guidance_scale=2.0,
                 guidance_schedule=None, max_sequence_length=16, latents=tokens, output_type="latent")
        call, out = calls[0].kwargs, calls[0].out[0]
        sigma = pipe.scheduler.sigmas[:1]
        ours = adapter.model_inputs(noisy, sigma, text, 1.0)
        theirs = full_inputs(ours)
        assert set(theirs) <= set(call)
        for name, value in theirs.items():
            torch.testing.assert_close(value, call[name], rtol=0, atol=1e-6, msg=name)
        assert int(entry["text_len"]) == int((call["indicator"] == 3).sum()) < 16  # a caption, left-padded
        x = ours
        with torch.no_grad():
            for layer in adapter.pipeline_layers(pipe.transformer):
                x = layer(x)
        velocity = out[:, 16:].reshape(1, 4, 6, 16).permute(0, 3, 1, 2)
        torch.testing.assert_close(adapter.prediction_to_latents(x, noisy), -velocity, rtol=0, atol=1e-5)

    def test_text_entries_are_the_pipelines_prompt_encoding(self, adapter):
        """An entry is the text region of Ideogram4Pipeline.encode_prompt's sequence and the caption's token count;
        a longer region only adds padding in front, the caption's features unchanged."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        captions = ["a cat", "a red circle on a white background"]
        short, long = adapter.encode_text(encoders, captions, 16)
        embeds, _, _, indicator = encoders.pipeline.encode_prompt(captions, grid_h=2, grid_w=3,
                                                                  max_sequence_length=16, device=torch.device("cpu"))
        for i, entry in enumerate((short, long)):
            assert torch.equal(entry["text"], embeds[i, :16])
            assert int(entry["text_len"]) == int((indicator[i] == 3).sum())
        assert int(short["text_len"]) < int(long["text_len"]) <= 16
        n = int(short["text_len"])
        assert short["text"][:16 - n].abs().sum() == 0 and short["text"][16 - n:].abs().sum() > 0
        (wider,) = adapter.encode_text(encoders, ["a cat"], 24)
        assert int(wider["text_len"]) == n and wider["text"][:24 - n].abs().sum() == 0
        torch.testing.assert_close(wider["text"][24 - n:], short["text"][16 - n:], rtol=0, atol=1e-5)

    def test_a_caption_longer_than_the_text_region_names_the_param(self, adapter):
        """Ideogram4Pipeline refuses a prompt longer than its text region; encode names the caption and the
        param rather than cut it."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        with pytest.raises(ConfigError, match="encode.text_max_length: 12 tokens cannot hold the caption 'a red "
                                              "circle on a white background'"):
            adapter.encode_text(encoders, ["a cat", "a red circle on a white background"], 12)

    def test_padding_changes_no_prediction(self, adapter, lora_model):
        """The padding in front of a caption is a segment of its own, which no caption or image token attends to:
        the same caption stored at 16 or 24 tokens gives the same prediction."""
        denoiser, _ = lora_model
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        latents = torch.randn(1, *adapter.latent_spec(32, 32, 1)["latents"][0])
        outs = []
        for length in (16, 24):
            (entry,) = adapter.encode_text(encoders, ["a red circle"], length)
            x = adapter.model_inputs(latents, torch.tensor([0.4]), {k: v[None] for k, v in entry.items()}, 1.0)
            with torch.no_grad():
                for layer in adapter.pipeline_layers(denoiser):
                    x = layer(x)
            outs.append(adapter.prediction_to_latents(x, latents))
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)

    def test_stored_latents_decode_as_the_pipeline_decodes_them(self, adapter, model_dir):
        """Ideogram4Pipeline un-normalises its final latents by the VAE's batch-norm statistics and unpatches them
        before decoding: given a stored entry as its final latents, what it decodes is the VAE's own latent of the
        image (the tiny VAE's statistics differ per channel, so the channel order matters)."""
        from diffusers import Ideogram4Pipeline

        pipe = Ideogram4Pipeline.from_pretrained(model_dir, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        vae = pipe.vae
        assert vae.bn.running_mean.std() > 0.1 and vae.bn.running_var.std() > 0.1
        pixels = torch.rand(1, 3, 1, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
        (entry,) = adapter.encode_media(vae, pixels)
        stored = adapter.model_inputs(entry["latents"][None], torch.zeros(1), {
            "text": torch.zeros(1, 4, 104), "text_len": torch.tensor([1])}, 1.0)[0]
        decoded = {}
        decode = vae.decode
        vae.decode = lambda z, **kwargs: (decoded.setdefault("z", z), decode(z, **kwargs))[1]
        pipe("a cat", height=32, width=48, num_inference_steps=1, guidance_scale=1.0, guidance_schedule=None,
             max_sequence_length=16, callback_on_step_end=lambda *_: {"latents": stored}, output_type="np")
        torch.testing.assert_close(decoded["z"], vae.encode(pixels[:, :, 0]).latent_dist.mode(), rtol=0, atol=1e-5)

    def test_samples_from_stored_entries_are_the_pipelines_render_of_the_prompt(self, adapter, model_dir):
        """The sampling pipeline, given a prompt's stored entry and no text encoder, renders what
        Ideogram4Pipeline renders from the prompt itself (same seed, steps and guidance)."""
        import diffusers

        (entry,) = adapter.encode_text(adapter.load_text_encoders(torch.device("cpu")), ["a red circle"], 16)
        common = {"height": 32, "width": 32, "num_inference_steps": 3, "output_type": "np"}
        full = diffusers.Ideogram4Pipeline.from_pretrained(model_dir, dtype=torch.float32)
        full.set_progress_bar_config(disable=True)
        want = full("a red circle", max_sequence_length=16, guidance_scale=3.0, guidance_schedule=None,
                    generator=torch.Generator().manual_seed(1), **common).images
        sampling = adapter.pipeline_class().from_pretrained(model_dir, dtype=torch.float32, text_encoder=None,
                                                            tokenizer=None)
        sampling.set_progress_bar_config(disable=True)
        got = sampling(generator=[torch.Generator().manual_seed(1)], **common,
                       **adapter.sample_inputs(entry, None, 3.0, 1.0)).images
        assert abs(want - 0.5).max() > 0  # not a blank render
        torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("ideogram4")
    Ideogram4Adapter.build_tiny(out, seed=0)
    return Ideogram4Adapter(out, torch.float32)


_FUSED = {"to_q": 0, "to_k": 1, "to_v": 2}


def original_ideogram4_state_dict(diffusers_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' Ideogram 4 weights in the original layout ComfyUI's model has: each block's q/k/v stacked into
    `attention.qkv`, its output projection `attention.o`; every other name the same."""
    out, fused = {}, {}
    for key, value in diffusers_sd.items():
        head, _, tail = key.rpartition(".attention.")
        proj = tail.split(".")[0]
        if head and proj in _FUSED:
            fused.setdefault(f"{head}.attention.qkv.weight", {})[_FUSED[proj]] = value
        elif head and tail == "to_out.0.weight":
            out[f"{head}.attention.o.weight"] = value
        else:
            out[key] = value
    out.update({key: torch.cat([parts[i] for i in range(3)]) for key, parts in fused.items()})
    return out


def to_diffusers(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse (diffusers has no single-file converter for Ideogram 4: its loaders read diffusers' names)."""
    out = {}
    for key, value in original.items():
        if key.endswith(".attention.qkv.weight"):
            head = key.removesuffix(".qkv.weight")
            for proj, part in zip(_FUSED, value.chunk(3)):
                out[f"{head}.{proj}.weight"] = part
        elif key.endswith(".attention.o.weight"):
            out[key.replace(".attention.o.", ".attention.to_out.0.")] = value
        else:
            out[key] = value
    return out


def test_comfyui_delta_equals_diffusers_delta(tiny):
    """Every Linear with a LoRA: merged in the original layout as ComfyUI merges (W += alpha / rank * up @ down)
    and converted back == merged in diffusers' layout; the keys are ComfyUI's Ideogram 4 names."""
    exported = assert_comfyui_merge_matches(tiny, original_ideogram4_state_dict, to_diffusers)
    assert {"diffusion_model.layers.1.attention.qkv.lora_down.weight", "diffusion_model.layers.1.attention.o.alpha",
            "diffusion_model.layers.0.feed_forward.w2.lora_up.weight",
            "diffusion_model.llm_cond_proj.lora_down.weight"} <= set(exported)
    assert not any(".to_q." in k or ".to_out." in k for k in exported)


def test_comfyui_export_refuses_a_module_comfyui_does_not_name(tiny):
    lora = {"layers.0.attention.norm_q.lora_A.weight": torch.zeros(2, 16),
            "layers.0.attention.norm_q.lora_B.weight": torch.zeros(16, 2)}
    with pytest.raises(ValueError, match="export.formats: comfyui has no ComfyUI Ideogram 4 name for LoRA module "
                                         "'layers.0.attention.norm_q'"):
        tiny.export_lora(lora, "comfyui")


def test_samples_guide_with_the_models_unconditional_transformer(tiny):
    """Samples during training load the model's own unconditional transformer beside the one being trained, and
    take no negative prompt."""
    from diffusion_pipe.params import SamplePrompt

    from diffusers import Ideogram4Transformer2DModel

    denoiser = tiny.load_denoiser(torch.device("cpu"))
    pipe = tiny.sample_pipeline(denoiser, tiny.load_vae(torch.device("cpu")))
    assert pipe.transformer is denoiser
    own = Ideogram4Transformer2DModel.from_pretrained(tiny.model_dir / "unconditional_transformer").state_dict()
    uncond, trained = pipe.unconditional_transformer.state_dict(), denoiser.state_dict()
    assert all(torch.equal(uncond[k], own[k]) for k in own)
    assert not all(torch.equal(uncond[k], trained[k]) for k in own)
    assert tiny.sample_texts(SamplePrompt("a cat", negative_prompt="blurry")) == ("a cat",)
