"""The Qwen-Image 2.1 adapter: the shared contract on a tiny Qwen-Image 2.1-shaped model (diffusers exports round-trip
into QwenImage21Pipeline), the first layer's inputs and the prediction as QwenImage21Pipeline feeds and reads its
transformer, its text entries as the pipeline encodes a prompt (its system prompt in the text key), samples from stored
entries as the pipeline renders the prompt, and the ComfyUI file merged as ComfyUI merges it into its fused layout."""

import pytest
import torch

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.common import image_only_qwen_vl_processor
from diffusion_pipe.models.qwenimage21 import QwenImage21Adapter
from tests.models.comfyui_merge import assert_comfyui_merge_matches
from tests.models.contract import AdapterContract, module_calls, random_like_spec


def full_inputs(inputs: tuple) -> dict:
    """The transformer's keyword arguments for the adapter's first-layer inputs, as the pipeline passes them for a
    text-to-image call: the target's shape, its VL slots (one per 2x2 latent tokens) after the text's, the text mask
    or None when nothing is padded."""
    tokens, timestep, text, mask, grid = inputs
    b, n = text.shape[:2]
    slots = torch.cat((torch.zeros(b, n, dtype=torch.bool), torch.ones(b, tokens.shape[1] // 4, dtype=torch.bool)), 1)
    return {"hidden_states": tokens, "timestep": timestep, "encoder_hidden_states": text,
            "encoder_hidden_states_mask": None if mask.shape[1] == 1 else mask,
            "img_shapes": [[tuple(grid[0, -1].tolist())]] * b, "img_mask": slots}


class TestQwenImage21Contract(AdapterContract):
    adapter_cls = QwenImage21Adapter
    pipeline_cls = "QwenImage21Pipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (64, 32, 1))
    roundtrip_formats = ("diffusers",)  # ComfyUI's fused gate_up: checked by its own merge test below

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        out = denoiser(**full_inputs(inputs), return_dict=False)[0]
        return adapter.prediction_to_latents(out, like)

    def test_exported_lora_round_trips_into_diffusers_pipeline(self, adapter, lora_model, model_dir):
        # transformers builds the stock Qwen3VLProcessor only with torchvision: the pipeline takes ours
        processor = image_only_qwen_vl_processor(model_dir / "processor", "Qwen3VLProcessor")
        self.pipeline_load_kwargs = {"processor": processor}
        super().test_exported_lora_round_trips_into_diffusers_pipeline(adapter, lora_model, model_dir)

    def _pipeline(self, model_dir):
        from diffusers import QwenImage21Pipeline

        processor = image_only_qwen_vl_processor(model_dir / "processor", "Qwen3VLProcessor")
        pipe = QwenImage21Pipeline.from_pretrained(model_dir, dtype=torch.float32, processor=processor)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def test_first_layer_inputs_are_what_the_pipeline_feeds_its_transformer(self, adapter, model_dir):
        """QwenImage21Pipeline, given a prompt and latents, calls its transformer with the prompt's encoding, the
        latents' tokens, t, the target's shape and VL slots and no mask: the adapter's inputs from the stored entry are
        those, and the composed layers predict what the transformer returns for the image tokens."""
        pipe = self._pipeline(model_dir)
        (entry,) = adapter.encode_text(adapter.load_text_encoders(torch.device("cpu")), ["a red circle"], 24)
        text = {k: v[None] for k, v in entry.items()}
        noisy = random_like_spec(adapter.latent_spec(64, 32, 1), 1, seed=2)["latents"]
        tokens = adapter.model_inputs(noisy, torch.zeros(1), text, 1.0)[0]
        with module_calls(pipe.transformer) as calls:
            pipe("a red circle", height=32, width=64, num_inference_steps=1, latents=tokens, output_type="latent")
        call, out = calls[0].kwargs, calls[0].out[0]
        ours = adapter.model_inputs(noisy, pipe.scheduler.sigmas[:1], text, 1.0)
        theirs = full_inputs(ours)
        assert theirs["encoder_hidden_states_mask"] is None and call["encoder_hidden_states_mask"] is None
        assert call["img_shapes"] == theirs["img_shapes"] == [[(1, 2, 4)]]
        for name in ("hidden_states", "timestep", "encoder_hidden_states", "img_mask"):
            torch.testing.assert_close(theirs[name], call[name], rtol=0, atol=1e-6, msg=name)
        x = ours
        with torch.no_grad():
            for layer in adapter.pipeline_layers(pipe.transformer):
                x = layer(x)
        want = pipe._unpack_latents(out[:, -8:], 32, 64, pipe.vae_scale_factor)[:, :, 0]
        torch.testing.assert_close(adapter.prediction_to_latents(x, noisy), want, rtol=0, atol=1e-5)

    def test_text_entries_are_the_pipelines_prompt_encoding(self, adapter):
        """An entry is QwenImage21Pipeline.encode_prompt of the caption alone (the system message's tokens dropped,
        the rest of the template kept), zero-padded, with the mask of its tokens; the system prompt keys the entry."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        pipe = encoders.pipeline
        captions = ["a cat", "a red circle on a white background"]
        entries = adapter.encode_text(encoders, captions, 24)
        for caption, entry in zip(captions, entries):
            states, mask, _ = pipe.encode_prompt(caption)
            n = states.shape[1]
            assert mask is None and entry["prompt_mask"].tolist() == [1] * n + [0] * (24 - n)
            assert torch.equal(entry["prompt_embeds"][:n], states[0]) and entry["prompt_embeds"][n:].abs().sum() == 0
            kept = len(pipe.processor.tokenizer(pipe.prompt_template_t2i.format(caption)).input_ids) - pipe._drop_idx
            assert n == kept
        assert pipe._drop_idx == len(pipe.processor.tokenizer(f"<|im_start|>system\n{pipe.sys_prompt}<|im_end|>\n"
                                                              ).input_ids)
        assert "Comprehend and analyze the provided prompt." in adapter.text_template()

    def test_a_caption_longer_than_text_max_length_names_the_param(self, adapter):
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        with pytest.raises(ConfigError, match="encode.text_max_length: 8 tokens cannot hold the caption 'a red "
                                              "circle on a white background'"):
            adapter.encode_text(encoders, ["a red circle on a white background"], 8)

    def test_a_micro_batch_is_trimmed_to_its_longest_caption(self, adapter, lora_model):
        """Entries stored at any length give the same prediction: the text is trimmed to the micro-batch's longest
        caption, the shorter ones right-padded and masked, as the pipeline pads a batch of prompts. Unlike
        Qwen-Image's, that padding is not free: the image's rotary frame position is the padded text's length, so a
        caption alone predicts otherwise than beside a longer one (as in the pipeline)."""
        denoiser, _ = lora_model
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        latents = torch.randn(2, *adapter.latent_spec(32, 32, 1)["latents"][0],
                              generator=torch.Generator().manual_seed(0))
        t = torch.tensor([0.4, 0.6])

        def predict(entries, noisy, timesteps):
            text = {k: torch.stack([e[k] for e in entries]) for k in entries[0]}
            x = adapter.model_inputs(noisy, timesteps, text, 1.0)
            n = int(text["prompt_mask"].sum(dim=1).max())
            assert x[2].shape[1] == n and (x[3].shape[1] == 1) == bool((text["prompt_mask"][:, :n] == 1).all())
            with torch.no_grad():
                for layer in adapter.pipeline_layers(denoiser):
                    x = layer(x)
            return adapter.prediction_to_latents(x, noisy)

        captions = ["a cat", "a red circle on a white background"]
        short16, long16 = adapter.encode_text(encoders, captions, 16)
        short24, long24 = adapter.encode_text(encoders, captions, 24)
        pair = predict([short16, long16], latents, t)
        torch.testing.assert_close(pair, predict([short24, long24], latents, t), rtol=0, atol=1e-6)
        alone = predict([short16], latents[:1], t[:1])
        torch.testing.assert_close(alone, predict([short24], latents[:1], t[:1]), rtol=0, atol=1e-6)
        assert (pair[:1] - alone).abs().max() > 1e-4

    def test_samples_from_stored_entries_are_the_pipelines_render_of_the_prompt(self, adapter, model_dir):
        """The sampling pipeline, given a prompt's stored entries and no text encoder, renders what
        QwenImage21Pipeline renders from the prompt itself (same seed, steps and true CFG)."""
        from diffusers import QwenImage21Pipeline

        entry, negative = adapter.encode_text(adapter.load_text_encoders(torch.device("cpu")), ["a red circle",
                                                                                                "blurry"], 16)
        common = {"height": 32, "width": 32, "num_inference_steps": 3, "output_type": "np"}
        want = self._pipeline(model_dir)("a red circle", negative_prompt="blurry", true_cfg_scale=3.0,
                                         generator=torch.Generator().manual_seed(1), **common).images
        cpu = torch.device("cpu")
        pipe = adapter.sample_pipeline(adapter.load_denoiser(cpu), adapter.load_vae(cpu))
        assert isinstance(pipe, QwenImage21Pipeline) and pipe.text_encoder is None
        got = pipe(generator=torch.Generator().manual_seed(1), **common,
                   **adapter.sample_inputs(entry, negative, 1.0, 3.0)).images
        assert want.shape[-1] == 4 and got.shape[-1] == 3  # the RGBA VAE's alpha dropped
        assert abs(want - 0.5).max() > 0
        torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want[..., :3]), rtol=0, atol=1e-5)
        # the sample stage loads it from the model directory without its text components
        staged = adapter.pipeline_class().from_pretrained(model_dir, dtype=torch.float32, text_encoder=None,
                                                           processor=None)
        staged.set_progress_bar_config(disable=True)
        assert staged.processor is None
        again = staged(generator=torch.Generator().manual_seed(1), **common,
                       **adapter.sample_inputs(entry, negative, 1.0, 3.0)).images
        torch.testing.assert_close(torch.from_numpy(again), torch.from_numpy(got), rtol=0, atol=1e-5)

    def test_stored_latents_decode_as_the_pipeline_decodes_them(self, adapter, model_dir):
        """The pipeline un-normalises its final latents per channel and decodes them: given a stored entry
        (normalised as training loads it) as its final latents, what it decodes is the VAE's own latent of the opaque
        RGBA image."""
        pipe = self._pipeline(model_dir)
        vae = pipe.vae
        pixels = torch.rand(1, 3, 1, 32, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
        (entry,) = adapter.encode_media(vae, pixels)
        stored = adapter.model_inputs(adapter.normalise_latents(entry["latents"])[None], torch.zeros(1), {
            "prompt_embeds": torch.zeros(1, 4, 32), "prompt_mask": torch.ones(1, 4)}, 1.0)[0]
        decoded = {}
        decode = vae.decode
        vae.decode = lambda z, **kwargs: (decoded.setdefault("z", z), decode(z, **kwargs))[1]
        pipe("a cat", height=32, width=64, num_inference_steps=1, output_type="np",
             callback_on_step_end=lambda *_: {"latents": stored})
        rgba = torch.cat((pixels, torch.ones_like(pixels[:, :1])), dim=1)
        torch.testing.assert_close(decoded["z"], vae.encode(rgba).latent_dist.mode(), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> QwenImage21Adapter:
    out = tmp_path_factory.mktemp("qwenimage21")
    QwenImage21Adapter.build_tiny(out, seed=0)
    return QwenImage21Adapter(out, torch.float32)


def to_comfyui_layout(diffusers_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' Qwen-Image 2.1 weights in ComfyUI's layout: each block's SwiGLU gate and up projections fused into
    `img_mlp.gate_up`, gate rows first (what diffusers' single-file converter splits); every other name the same."""
    out = {}
    for key, value in diffusers_sd.items():
        if key.endswith(".img_mlp.gate_layer.weight"):
            up = diffusers_sd[key.replace(".gate_layer.", ".proj.")]
            out[key.replace(".gate_layer.", ".gate_up.")] = torch.cat((value, up))
        elif not key.endswith(".img_mlp.proj.weight"):
            out[key] = value
    return out


def test_comfyui_delta_equals_diffusers_delta(tiny):
    """Every Linear with a LoRA: merged in ComfyUI's layout as ComfyUI merges (W += alpha / rank * up @ down) and
    converted back by diffusers' own `convert_qwen_image21_transformer_checkpoint_to_diffusers` == merged in
    diffusers' layout; the keys are ComfyUI's names."""
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers

    exported = assert_comfyui_merge_matches(tiny, to_comfyui_layout,
                                            convert_qwen_image21_transformer_checkpoint_to_diffusers)
    assert {"diffusion_model.transformer_blocks.1.img_mlp.gate_up.lora_down.weight",
            "diffusion_model.transformer_blocks.1.img_mlp.gate_up.alpha",
            "diffusion_model.transformer_blocks.0.attn.to_q.lora_up.weight",
            "diffusion_model.transformer_blocks.0.img_mlp.out.lora_down.weight",
            "diffusion_model.txt_in.in_layer.lora_down.weight"} <= set(exported)
    assert not any(".gate_layer." in k or ".img_mlp.proj." in k for k in exported)


def test_the_template_keys_text_entries(tiny):
    """encode keys a caption's text entry by the family's template (its system prompt) too."""
    from diffusion_pipe.encode.encode import caption_text_keys
    from diffusion_pipe.params import ModelParams

    class OtherTemplate(QwenImage21Adapter):
        def text_template(self) -> str:
            return "another system prompt"

    model = ModelParams(family="qwenimage21", path=str(tiny.model_dir), dtype="float32")
    ours = caption_text_keys(tiny, model, 16, ("a cat",))
    other = caption_text_keys(OtherTemplate(tiny.model_dir, torch.float32), model, 16, ("a cat",))
    assert ours["a cat"] != other["a cat"]


def test_samples_render_with_blocks_on_another_stage(tiny):
    """With several pipeline stages, rank 0 renders training's samples with stand-ins for the other stages' blocks
    (modules whose call runs the block elsewhere, none of its attributes): the sampling pipeline renders through them,
    without the prefix KV cache (a stand-in's would fill on its own rank), as the pipeline renders without it."""
    cpu = torch.device("cpu")
    text, negative = tiny.encode_text(tiny.load_text_encoders(cpu), ["a red circle", ""], 16)
    denoiser = tiny.load_denoiser(cpu)
    pipe = tiny.sample_pipeline(denoiser, tiny.load_vae(cpu))
    common = {"height": 32, "width": 32, "num_inference_steps": 2, "output_type": "np",
              **tiny.sample_inputs(text, negative, 1.0, 1.0)}
    want = pipe(generator=torch.Generator().manual_seed(0), use_kv_cache=False, **common).images

    class StandIn(torch.nn.Module):  # as diffusion_pipe.train.samples' _RemoteModule: the call, no attributes
        def __init__(self, block: torch.nn.Module) -> None:
            super().__init__()
            object.__setattr__(self, "call", block)

        def forward(self, *args, **kwargs):
            return self.call(*args, **kwargs)

    block = denoiser.transformer_blocks[1]
    denoiser.transformer_blocks[1] = StandIn(block)
    try:
        got = pipe(generator=torch.Generator().manual_seed(0), **common).images
    finally:
        denoiser.transformer_blocks[1] = block
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=0, atol=1e-6)
