"""The HiDream-I1 adapter: the shared contract on a tiny HiDream-shaped model (exports round-trip into
HiDreamImagePipeline in diffusers' names and in the `diffusion_model.` names ComfyUI reads), its text entries as the
pipeline encodes them, its latents as the pipeline un-normalises them, a pipeline step against the adapter's
velocity, the mixture of experts' gradients, and samples batching prompts."""

import pytest
import torch

from diffusion_pipe.models.hidream import HiDreamAdapter, routed_experts_with_grad
from tests.models.contract import AdapterContract, random_like_spec


class TestHiDreamContract(AdapterContract):
    adapter_cls = HiDreamAdapter
    pipeline_cls = "HiDreamImagePipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))  # square latents go unpadded, non-square ones pad to max_seq
    roundtrip_formats = ("diffusers", "comfyui")

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        """As HiDreamImagePipeline calls the transformer (Llama's layers first), the output negated as it negates
        it; routed experts take their differentiable branch while gradients are recorded, as in training."""
        latents, timesteps, t5, llama, pooled = inputs
        with routed_experts_with_grad(denoiser):
            out = denoiser(hidden_states=latents, timesteps=timesteps, encoder_hidden_states_t5=t5,
                           encoder_hidden_states_llama3=llama.transpose(0, 1), pooled_embeds=pooled,
                           return_dict=False)[0]
        return adapter.prediction_to_latents(out, like)

    def test_text_entries_are_the_pipelines_own_encoding(self, adapter):
        """Each caption's entry is what HiDreamImagePipeline.encode_prompt returns for it: T5's states, Llama's
        states of every layer (the pipeline's layer-first layout, one item of it), the two CLIP projections."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        captions = ["a cat", "a red circle on a white background"]
        entries = adapter.encode_text(encoders, captions, 16)
        t5, _, llama, _, pooled, _ = encoders.pipeline.encode_prompt(
            captions, device=torch.device("cpu"), do_classifier_free_guidance=False, max_sequence_length=16)
        assert llama.shape[:2] == (3, 2)  # (the tiny Llama's 3 layers, the 2 captions, ...)
        for i, entry in enumerate(entries):
            assert torch.equal(entry["t5"], t5[i]) and torch.equal(entry["llama"], llama[:, i])
            assert torch.equal(entry["pooled"], pooled[i])
        pipe = encoders.pipeline
        clip_2 = pipe._get_clip_prompt_embeds(pipe.tokenizer_2, pipe.text_encoder_2, captions[:1], 16)
        torch.testing.assert_close(entries[0]["pooled"][16:], clip_2[0])  # [CLIP-L's 16, CLIP-G's 24], in order

    def test_stored_latents_decode_as_the_pipeline_decodes_them(self, adapter):
        """HiDreamImagePipeline divides by the VAE's scaling factor and adds its shift before decoding: that of a
        stored entry, normalised as training loads it, is the VAE's own latent."""
        vae = adapter.load_vae(torch.device("cpu"))
        pixels = torch.rand(1, 3, 1, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
        (entry,) = adapter.encode_media(vae, pixels)
        trained = adapter.normalise_latents(entry["latents"][None])
        assert vae.config.scaling_factor != 1 and vae.config.shift_factor != 0
        decoded = trained / vae.config.scaling_factor + vae.config.shift_factor
        torch.testing.assert_close(decoded, vae.encode(pixels[:, :, 0]).latent_dist.mode(), rtol=0, atol=1e-6)

    def test_a_pipeline_step_moves_by_the_adapters_velocity(self, adapter, lora_model):
        """One Euler step of HiDreamImagePipeline from pure noise (t = 1) lands where the adapter's velocity at
        t = 1 takes it: the timestep's units (x 1000), the negated output and Llama's layout are the pipeline's."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        denoiser, _ = lora_model
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        (text,) = adapter.encode_text(encoders, ["a red circle"], 16)
        noise = torch.randn(1, 4, 8, 12, generator=torch.Generator().manual_seed(1))
        pipe = adapter.sample_pipeline(denoiser, adapter.load_vae(torch.device("cpu")))
        pipe.scheduler = FlowMatchEulerDiscreteScheduler()
        with torch.no_grad():
            stepped = pipe(num_inference_steps=1, latents=noise, width=48, height=32, output_type="latent",
                           **adapter.sample_inputs(text, text, 0.0, 1.0)).images
            x = adapter.model_inputs(noise, torch.tensor([1.0]), {k: v[None] for k, v in text.items()}, 1.0)
            for layer in adapter.pipeline_layers(denoiser):
                x = layer(x)
        torch.testing.assert_close(stepped, noise - adapter.prediction_to_latents(x, noise), rtol=0, atol=1e-5)

    def test_routed_experts_train_through_their_differentiable_branch(self, adapter, lora_model):
        """diffusers routes tokens through a no-grad `moe_infer` outside training mode; the layers take the MoE's
        training branch while gradients are recorded, which predicts the same, and every routed expert's LoRA
        gets a gradient (in training mode as well as in eval mode)."""
        denoiser, _ = lora_model
        latents, _, inputs = self._inputs(adapter, seed=9)
        layers = adapter.pipeline_layers(denoiser)

        def run():
            x = inputs
            for layer in layers:
                x = layer(x)
            return x

        with torch.no_grad():
            inferred = run()  # moe_infer
        for training in (False, True):
            denoiser.train(training)
            try:
                predicted = run()
                torch.testing.assert_close(predicted, inferred, rtol=0, atol=1e-5)
                predicted.square().mean().backward()
            finally:
                denoiser.eval()
            experts = {n: p.grad for n, p in denoiser.named_parameters() if ".ff_i.experts." in n and "lora_A" in n}
            assert experts and all(g is not None and g.abs().sum() > 0 for g in experts.values()), training
            denoiser.zero_grad(set_to_none=True)
        assert not any(m.training for m in denoiser.modules())  # the switch leaves no module in training mode

    def test_training_layers_leave_out_the_gates_unused_loss(self, adapter, monkeypatch):
        """The engine runs the layers in training mode, where diffusers' MoE gates compute a load-balancing loss
        (one-hot counts of the chosen experts) that the feed-forward discards: the layers' gates leave it out, as
        the transformer's own forward outside training mode does, and route and weigh the tokens as before."""
        denoiser = adapter.load_denoiser(torch.device("cpu"))
        _, _, inputs = self._inputs(adapter, seed=4)

        def run(layers):
            x = inputs
            for layer in layers:
                x = layer(x)
            return x

        with torch.no_grad():
            before = run(adapter.pipeline_layers(denoiser))  # eval mode: no loss either way
        one_hot = torch.nn.functional.one_hot
        calls = []
        monkeypatch.setattr(torch.nn.functional, "one_hot", lambda *a, **k: calls.append(a) or one_hot(*a, **k))
        layers = torch.nn.ModuleList(adapter.pipeline_layers(denoiser)).train()
        torch.testing.assert_close(run(layers), before, rtol=0, atol=1e-5)
        assert not calls

    @pytest.mark.parametrize("size", [(32, 32), (48, 32)])
    def test_what_layers_pass_on_crosses_a_stage_boundary(self, adapter, lora_model, size):
        """At any boundary between two layers (before the output layer's), as a pipeline stage sends it: every
        tensor is contiguous, and every float one gets a gradient from the layers after it (the key mask, unused for
        square latents, travels as integers); the split run predicts what the whole does."""
        denoiser, _ = lora_model
        latents = torch.randn(2, 4, size[1] // 4, size[0] // 4, generator=torch.Generator().manual_seed(2))
        text = random_like_spec(adapter.text_spec(self.text_max_length), 2, 3)
        inputs = adapter.model_inputs(latents, torch.tensor([0.2, 0.9]), text, 1.0)
        layers = adapter.pipeline_layers(denoiser)
        with torch.no_grad():
            whole = inputs
            for layer in layers:
                whole = layer(whole)
        for boundary in range(1, len(layers) - 1):
            x = inputs
            for layer in layers[:boundary]:
                x = layer(x)
            assert all(t.is_contiguous() for t in x), boundary
            sent = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in x)
            out = sent
            for layer in layers[boundary:]:
                out = layer(out)
            out.square().mean().backward()
            assert all(t.grad is not None for t in sent if t.is_floating_point()), boundary
            torch.testing.assert_close(out.detach(), whole, rtol=0, atol=1e-5)
        denoiser.zero_grad(set_to_none=True)

    def test_batched_samples_render_as_each_prompt_alone(self, adapter, lora_model):
        """Samples batch prompts item-first; the pipeline takes Llama's states layer-first: two prompts rendered
        together give what each renders alone, at the size asked for (HiDreamImagePipeline alone would scale the
        request to its default area)."""
        from diffusion_pipe.params import SamplePrompt
        from diffusion_pipe.sample.render import encode_sample_texts, prompt_texts, render_prompts

        cpu = torch.device("cpu")
        prompts = tuple(SamplePrompt(text, seed=seed, width=48, height=32, steps=2, guidance=2.0)
                        for text, seed in (("a red circle", 1), ("a blue square on a black background", 2)))
        texts = encode_sample_texts(adapter, adapter.load_text_encoders(cpu), prompt_texts(adapter, prompts), 16)
        pipe = adapter.sample_pipeline(lora_model[0], adapter.load_vae(cpu))
        together = render_prompts(pipe, adapter, prompts, texts, cpu)
        alone = [render_prompts(pipe, adapter, (p,), texts, cpu)[0] for p in prompts]
        assert together[0].shape == (1, 32, 48, 3)
        for both, one in zip(together, alone):
            assert abs(both.astype(int) - one.astype(int)).max() <= 1


    def test_comfyui_keys_are_the_modules_under_diffusion_model(self, adapter, lora_model):
        """ComfyUI's HiDream model names its modules as diffusers does (double_stream_blocks.N.block.attn1.to_q,
        ff_i.experts.N.w1; comfy/ldm/hidream/model.py), and its loader reads `diffusion_model.<module>` keys with
        lora_A/lora_B (comfy/lora.py): the comfyui file is the PEFT keys under that prefix, without `.alpha`."""
        _, lora = lora_model
        out = adapter.export_lora(lora, "comfyui")
        assert out.keys() == {f"diffusion_model.{k}" for k in lora}
        assert "diffusion_model.double_stream_blocks.0.block.ff_i.experts.2.w1.lora_A.weight" in out
        assert all(torch.equal(out[f"diffusion_model.{k}"], v) for k, v in lora.items())


def test_default_targets_cover_both_streams_and_every_expert(tmp_path):
    """Attention of the image and text streams, and the three linears of every routed expert, the shared expert
    and the text feed-forward; the experts' gate (a bare weight) gets no LoRA."""
    from diffusion_pipe.train.lora import target_module_names

    HiDreamAdapter.build_tiny(tmp_path, seed=0)
    adapter = HiDreamAdapter(tmp_path, torch.float32)
    names = set(target_module_names(adapter.load_denoiser(torch.device("cpu")), adapter.default_lora_targets))
    block = "double_stream_blocks.1.block"
    assert {f"{block}.attn1.{p}" for p in ("to_q", "to_k", "to_v", "to_out", "to_q_t", "to_k_t", "to_v_t",
                                          "to_out_t")} <= names
    assert {f"{block}.ff_i.experts.{e}.w{i}" for e in range(4) for i in (1, 2, 3)} <= names
    assert {f"{block}.ff_i.shared_experts.w{i}" for i in (1, 2, 3)} | {f"{block}.ff_t.w{i}" for i in (1, 2, 3)} \
        <= names
    assert "single_stream_blocks.0.block.ff_i.experts.3.w2" in names
    assert not any("gate" in n or "adaLN" in n or "caption_projection" in n for n in names)


def test_a_non_square_bucket_past_max_resolution_is_refused(tmp_path):
    HiDreamAdapter.build_tiny(tmp_path, seed=0)
    adapter = HiDreamAdapter(tmp_path, torch.float32)
    assert adapter.latent_spec(256, 256, 1)  # square: never padded, any size
    assert adapter.latent_spec(96, 64, 1)  # 12 x 8 patches, padded to 12 x 12
    with pytest.raises(ValueError, match="bucket 104x96: 156 patches, but HiDream-I1 pads non-square images to 144"):
        adapter.latent_spec(104, 96, 1)


def test_a_model_without_its_llama_names_what_to_add(tmp_path):
    """HiDream-ai's repositories leave Llama 3.1 8B Instruct out: the error says where it goes."""
    import shutil

    HiDreamAdapter.build_tiny(tmp_path, seed=0)
    shutil.rmtree(tmp_path / "text_encoder_4")
    with pytest.raises(FileNotFoundError, match=r"text_encoder_4: missing.*Llama-3.1-8B-Instruct's model into "
                                                r"text_encoder_4/ and its tokenizer into tokenizer_4/"):
        HiDreamAdapter(tmp_path, torch.float32).text_component_dirs()


def test_a_transformer_forced_to_inference_output_is_refused(tmp_path):
    """force_inference_output keeps diffusers' MoE on its no-grad path in training mode too."""
    import json

    HiDreamAdapter.build_tiny(tmp_path, seed=0)
    config = tmp_path / "transformer" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"force_inference_output": True}))
    adapter = HiDreamAdapter(tmp_path, torch.float32)
    with pytest.raises(ValueError, match="force_inference_output is true.*Set it to false"):
        adapter.pipeline_layers(adapter.load_denoiser(torch.device("cpu")))
