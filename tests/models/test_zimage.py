"""The Z-Image adapter: the shared contract on a tiny Z-Image-shaped model (both export formats load into
ZImagePipeline), captions of different lengths in one micro-batch, and the chat template."""

import pytest
import torch

from diffusion_pipe.models.zimage import ZImageAdapter
from tests.models.contract import AdapterContract


class TestZImageContract(AdapterContract):
    adapter_cls = ZImageAdapter
    pipeline_cls = "ZImagePipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    roundtrip_formats = ("diffusers", "comfyui")

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        """As ZImagePipeline calls it: a list of (C, 1, H, W) latents and of the real tokens' states; the output
        negated."""
        latents, timesteps, text, mask = inputs
        out = denoiser(list(latents.unsqueeze(2).unbind(0)), timesteps, [t[m.bool()] for t, m in zip(text, mask)],
                       return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    def test_captions_of_different_lengths_share_a_micro_batch(self, adapter, lora_model):
        """A short and a long caption together predict what each predicts alone (padding is masked)."""
        denoiser, _ = lora_model
        texts = adapter.encode_text(adapter.load_text_encoders(torch.device("cpu")),
                                    ["a cat", "a red circle and a blue square on a white background"], 32)
        assert texts[0]["prompt_mask"].sum() < texts[1]["prompt_mask"].sum()
        latents = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
        t = torch.tensor([0.3, 0.7])

        def run(rows):
            batch = {k: torch.stack([texts[i][k] for i in rows]) for k in texts[0]}
            inputs = adapter.model_inputs(latents[rows], t[rows], batch, 1.0)
            x = inputs
            with torch.no_grad():
                for layer in adapter.pipeline_layers(denoiser):
                    x = layer(x)
            return adapter.prediction_to_latents(x, latents[rows])

        together = run([0, 1])
        torch.testing.assert_close(together[0:1], run([0]), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(together[1:2], run([1]), rtol=1e-4, atol=1e-5)

    def test_attention_is_unmasked_unless_an_item_is_padded(self, adapter, lora_model):
        """As ZImageTransformer2DModel: equal-length captions leave the main layers' attention unmasked (a mask,
        even all ones, keeps SDPA off its flash kernel); captions of different lengths mask the padding."""
        denoiser, _ = lora_model
        texts = adapter.encode_text(adapter.load_text_encoders(torch.device("cpu")),
                                    ["a cat", "a dog", " ".join(["a red circle on a white background"] * 8)], 96)
        assert texts[2]["prompt_mask"].sum() > 32  # past Z-Image's padding of captions to multiples of 32 tokens
        layers = adapter.pipeline_layers(denoiser)
        seen = []
        hook = layers[1].block.register_forward_pre_hook(lambda _m, args: seen.append(args[1]))
        try:
            for rows in ([0, 1], [0, 2]):
                batch = {k: torch.stack([texts[i][k] for i in rows]) for k in texts[0]}
                x = adapter.model_inputs(torch.randn(2, 4, 4, 4), torch.tensor([0.3, 0.7]), batch, 1.0)
                with torch.no_grad():
                    for layer in layers[:2]:
                        x = layer(x)
        finally:
            hook.remove()
        assert seen[0] is None
        assert seen[1].dtype == torch.bool and not seen[1].all() and seen[1].any()

    def test_caption_is_wrapped_in_the_chat_template(self, adapter):
        pipe = adapter.load_text_encoders(torch.device("cpu")).pipeline
        wrapped = pipe.tokenizer.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=False,
                                                     add_generation_prompt=True, enable_thinking=True)
        assert wrapped == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
        (entry,) = adapter.encode_text(adapter.load_text_encoders(torch.device("cpu")), ["a cat"], 32)
        assert entry["prompt_mask"].sum() == len(pipe.tokenizer(wrapped).input_ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> ZImageAdapter:
    out = tmp_path_factory.mktemp("zimage")
    ZImageAdapter.build_tiny(out, seed=0)
    return ZImageAdapter(out, torch.float32)


def test_comfyui_keys_are_diffusers_names_under_diffusion_model(tiny):
    lora = {"layers.0.attention.to_q.lora_A.weight": torch.ones(4, 32),
            "layers.0.attention.to_q.lora_B.weight": torch.ones(32, 4)}
    prefix = "diffusion_model.layers.0.attention.to_q"
    out = tiny.export_lora(lora, "comfyui")
    assert set(out) == {f"{prefix}.lora_down.weight", f"{prefix}.lora_up.weight", f"{prefix}.alpha"}
    with pytest.raises(ValueError, match="export.formats: 'kohya' is not supported by family 'zimage'"):
        tiny.export_lora(lora, "kohya")


def test_time_and_sign_follow_the_pipeline(tiny):
    """One ZImagePipeline step from latents x at noise level s ends at x - s * v, v being what the adapter
    predicts for x at t = s: the adapter's time flip and negation are the pipeline's."""
    cpu = torch.device("cpu")
    text, negative = tiny.encode_text(tiny.load_text_encoders(cpu), ["a red circle", ""], 16)
    denoiser, vae = tiny.load_denoiser(cpu), tiny.load_vae(cpu)
    pipe = tiny.sample_pipeline(denoiser, vae)
    seen = []
    denoiser.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone()))
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    out = pipe(height=32, width=32, num_inference_steps=1, output_type="latent", latents=x.clone(),
               **tiny.sample_inputs(text, negative, 0.0, 1.0)).images
    (t_model,) = seen
    sigma = 1 - t_model
    with torch.no_grad():
        inputs = tiny.model_inputs(x, sigma, {k: v[None] for k, v in text.items()}, 1.0)
        for layer in tiny.pipeline_layers(denoiser):
            inputs = layer(inputs)
        v = tiny.prediction_to_latents(inputs, x)
    torch.testing.assert_close(out.float(), x - sigma.view(-1, 1, 1, 1) * v, rtol=1e-4, atol=1e-5)


def test_prompts_render_as_one_batch(tiny):
    """ZImagePipeline takes a list of embeddings per prompt: prompts batched together each get their own image,
    the same as rendered alone."""
    from diffusion_pipe.params import SamplePrompt
    from diffusion_pipe.sample.render import encode_sample_texts, prompt_texts, render_prompts

    cpu = torch.device("cpu")
    prompts = tuple(SamplePrompt(prompt=p, seed=s, width=32, height=32, frames=1, steps=2, guidance=0.0,
                                 cfg_scale=1.0) for p, s in (("a red circle", 1), ("a blue square", 2)))
    texts = encode_sample_texts(tiny, tiny.load_text_encoders(cpu), prompt_texts(tiny, prompts), 16)
    pipe = tiny.sample_pipeline(tiny.load_denoiser(cpu), tiny.load_vae(cpu))
    together = render_prompts(pipe, tiny, prompts, texts, cpu)
    alone = [render_prompts(pipe, tiny, (p,), texts, cpu)[0] for p in prompts]
    assert all(a is not None and a.shape == (1, 32, 32, 3) for a in together)
    assert all((a.astype(int) - b.astype(int)).__abs__().max() <= 1 for a, b in zip(together, alone))
