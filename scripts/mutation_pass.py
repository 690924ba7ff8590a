#!/usr/bin/env python3
"""Break the code on purpose, one small change at a time, and check that the tests notice.

Each mutation names a file, an exact text in it, its replacement, and the tests that must catch it. The pass
copies the repository's committed tree (`git archive HEAD`) once, then for each mutation makes a fresh copy,
applies the change there and runs the named tests with this repository's .venv (PYTHONPATH points at the copy,
so the copy's code is what runs, in spawned stages too). The repository's own files are never touched.

    python scripts/mutation_pass.py                  # every mutation; a Markdown table at the end
    python scripts/mutation_pass.py --list           # what would run
    python scripts/mutation_pass.py --only export-2x-alpha resume-rank0-rng
    python scripts/mutation_pass.py --baseline       # the same tests on the unmutated copy (must pass)

Exit status 1 if a mutation survived (its tests passed; unless it is marked equivalent) or could not be applied
(its text is gone: update the list), else 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    """A one-place change to `path` (repo-relative): `old` (exact, found once) becomes `new`."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str
    equivalent: bool = False  # known to change no behaviour a test can see (say why beside it): may survive


ENCODE = "diffusion_pipe/encode/encode.py"
KEYS = "diffusion_pipe/encode/keys.py"
PACK = "diffusion_pipe/store/pack.py"
STORE = "diffusion_pipe/store/store.py"
LOOP = "diffusion_pipe/train/loop.py"
CHECKPOINT = "diffusion_pipe/train/checkpoint.py"
GUARDS = "diffusion_pipe/train/guards.py"
VERIFY = "diffusion_pipe/lineage/verify.py"
RESUME = "tests/train/test_resume.py"
REMOTE_TESTS = ("tests/encode/test_remote.py::test_encode_uploads_what_it_computed_and_an_empty_store_fetches_it",)
LINEAGE_TESTS = ("tests/lineage",)
EXPORT = "diffusion_pipe/export/lora.py"
SWAP = "diffusion_pipe/train/swap.py"
SWAP_TESTS = ("tests/train/test_swap.py",)
PLAN_TESTS = ("tests/encode/test_plan.py",)
ORDER_TESTS = ("tests/store/test_write_order.py",)
OPTIMIZERS = "tests/train/test_optimizers.py"
SPIED = f"{OPTIMIZERS}::test_schedule_free_evaluates_samples_and_writes_loras_at_its_eval_weights"
EXPORT_TESTS = ("tests/export/test_export_stage.py", "tests/export/test_merge.py")

MUTATIONS: list[Mutation] = [
    # keys, and what encode feeds them
    Mutation("encode-empty-vae-hash", ENCODE, 'frames=frames_spec(row["media"], frames, start, stride), vae_hash=vae_hash,',
             'frames=frames_spec(row["media"], frames, start, stride), vae_hash="",', PLAN_TESTS,
             "latent keys ignore the VAE's weights"),
    Mutation("encode-constant-text-max-length", ENCODE, "max_length=max_length, dtype=model.dtype)",
             "max_length=512, dtype=model.dtype)", PLAN_TESTS, "text keys ignore encode.text_max_length"),
    Mutation("encode-empty-tokenizer-hashes", ENCODE, "tokenizer_hashes=tokenizer_hashes, max_length",
             "tokenizer_hashes={}, max_length", PLAN_TESTS, "text keys ignore the tokenizers"),
    Mutation("encode-empty-bucket", ENCODE, 'latent_key(content_hash=row["content_hash"], bucket=bucket,',
             'latent_key(content_hash=row["content_hash"], bucket="",', PLAN_TESTS,
             "every bucket of an item shares one latent"),
    Mutation("encode-control-key-no-bucket", ENCODE, "controls = tuple(latent_key(content_hash=h, bucket=bucket,",
             'controls = tuple(latent_key(content_hash=h, bucket="",', ("tests/encode/test_control_keys.py",),
             "a control image's latent ignores its target's bucket"),
    Mutation("kontext-control-tokens-dropped", "diffusion_pipe/models/flux_kontext.py",
             "return (torch.cat((hidden, control_tokens), dim=1), timestep, t5, pooled,",
             "return (hidden, timestep, t5, pooled,", ("tests/models/test_flux_kontext.py",),
             "Kontext's control tokens never reach the transformer"),
    Mutation("ti2v-first-frame-noised", "diffusion_pipe/models/wan.py",
             "noisy = torch.cat((latents[:, :, :1].to(noisy_latents.dtype), noisy_latents[:, :, 1:]), dim=2)",
             "noisy = noisy_latents", ("tests/models/test_wan_ti2v.py", "tests/train/test_keep_clean.py",
                                       "tests/models/test_cosmos2.py"),
             "the condition frame of Wan TI2V and Cosmos-Predict2 noised like the frames it should condition"),
    Mutation("ti2v-first-frame-timestep", "diffusion_pipe/models/wan_ti2v.py", "            mask[0] = 0",
             "            pass", ("tests/models/test_wan_ti2v.py",),
             "Wan TI2V's clean first frame gets the noisy frames' timestep"),
    Mutation("keep-clean-never-called", "diffusion_pipe/train/data.py",
             "noisy, target = self.adapter.keep_clean(noised.noisy, noised.target, latents)",
             "noisy, target = noised.noisy, noised.target", ("tests/train/test_keep_clean.py",),
             "training ignores a family's clean conditioning frames"),
    Mutation("params-lack-a-dvc-param", "params.yaml",
             "  caption_dropout: 0.0", "  # caption_dropout: 0.0", ("tests/test_config.py",),
             "the bundled params.yaml lacks a key dvc.yaml reads (dvc repro stops before encode)"),
    Mutation("kontext-sample-control-dropped", "diffusion_pipe/models/flux_kontext.py",
             'return {"image": image, "max_area": width * height, "_auto_resize": False}',
             'return {"max_area": width * height, "_auto_resize": False}', ("tests/models/test_flux_kontext.py",),
             "Kontext samples render from text alone, not the prompt's control image"),
    Mutation("window-key-ignores-start", "diffusion_pipe/encode/media.py",
             'window = {"start": start, "stride": stride} if (start, stride) != (0, 1) else {}', "window = {}",
             ("tests/encode/test_media.py", "tests/scan/test_frame_extraction.py"),
             "a clip's windows share one latent key"),
    Mutation("window-decodes-from-frame-0", "diffusion_pipe/encode/media.py",
             "picked = pictures[start:needed:stride]", "picked = pictures[:frames]",
             ("tests/encode/test_media.py",), "every window encodes the clip's first frames"),
    Mutation("encode-text-encoders-unhashed", ENCODE,
             'text_key(caption=c, template=template, encoder_hashes=encoder_hashes,',
             'text_key(caption=c, template=template, encoder_hashes={},', PLAN_TESTS,
             "text keys ignore the text encoders' weights"),
    Mutation("encode-never-uploads", ENCODE, "if remote is not None and encode.push:",
             "if remote is not None and not encode.push:", REMOTE_TESTS,
             "encode computes but never uploads to the remote"),
    Mutation("encode-never-fetches", ENCODE, "if remote is not None and mine:", "if remote is None and mine:",
             REMOTE_TESTS, "encode never looks in the remote"),
    Mutation("keys-drop-max-length", KEYS, '"max_length": max_length,', '"max_length": 0,',
             ("tests/encode/test_keys.py",), "the text key function drops max_length"),
    Mutation("keys-drop-format-version", KEYS, '"family": "latent",\n            "format_version": FORMAT_VERSION,',
             '"family": "latent",', ("tests/encode/test_keys.py",), "latent keys ignore FORMAT_VERSION"),
    # store writes and reads
    Mutation("store-no-fsync", PACK, "                os.fsync(fh.fileno())", "                fh.flush()",
             ORDER_TESTS, "the pack is renamed without being fsynced"),
    Mutation("store-no-dir-fsync", PACK, "            fsync_dir(directory)\n        except BaseException",
             "            pass\n        except BaseException", ORDER_TESTS,
             "the pack's rename is not made durable before its sidecar"),
    Mutation("store-written-in-place", PACK, "os.replace(tmp, directory / (pack_id + PACK_SUFFIX))",
             "__import__('shutil').copyfile(tmp, directory / (pack_id + PACK_SUFFIX)); tmp.unlink()",
             ORDER_TESTS, "the pack is copied into its final name (written in place), not renamed"),
    Mutation("store-sidecar-first", PACK,
             "            # Replacing an existing pack of the same id is harmless: same id, same bytes.\n"
             "            os.replace(tmp, directory / (pack_id + PACK_SUFFIX))\n"
             "            fsync_dir(directory)\n",
             "            write_bytes_atomic(directory / (pack_id + SIDECAR_SUFFIX), canonical_json(Sidecar.build("
             "self.family, pack_id, size, layouts).to_json()).encode('utf-8'))\n"
             "            os.replace(tmp, directory / (pack_id + PACK_SUFFIX))\n"
             "            fsync_dir(directory)\n",
             ORDER_TESTS, "the sidecar is published before the pack is renamed"),
    Mutation("store-no-size-check", STORE, "            if size != sidecar.size:\n                index.problems",
             "            if False:\n                index.problems", ("tests/store/test_corruption.py",),
             "a truncated pack becomes visible"),
    # equivalent as things stand: check_pack compares every header entry with the sidecar when a pack is opened
    # (store-header-unchecked), so get()'s own shape check cannot fire on a pack that opened
    Mutation("store-no-shape-check", STORE, "if tuple(t.shape) != shape or dtype_name(t.dtype) != dtype:",
             "if False:", ("tests/store/test_corruption.py",), "get() returns tensors its sidecar disagrees with",
             equivalent=True),
    Mutation("store-header-unchecked", PACK, 'if list(h["shape"]) != list(t["shape"]) or dtype != t["dtype"]:',
             "if False:", ("tests/store/test_corruption.py",),
             "a pack whose header disagrees with its sidecar is read"),
    # resume
    Mutation("resume-rank0-rng", CHECKPOINT, 'mine = f"rank{self.dist.rank % ranks}"', 'mine = "rank0"',
             (f"{RESUME}::test_data_parallel_run_killed_resumes_exactly",), "every rank restores rank 0's RNG states"),
    Mutation("resume-no-rng", CHECKPOINT, '        torch.set_rng_state(rng[f"{mine}/cpu"])\n', "",
             (f"{RESUME}::test_resumed_run_matches_uninterrupted",), "a resumed run draws from a fresh RNG"),
    Mutation("resume-no-hash-check", CHECKPOINT, "if hash_file(path / name) != digest:", "if False:",
             ("tests/train/test_checkpoint.py",), "a damaged checkpoint file is loaded"),
    Mutation("train-no-divergence-stop", GUARDS, "return math.isfinite(loss) and", "return True or",
             ("tests/train/test_checkpoint.py",), "a run at loss NaN trains on"),
    Mutation("resume-position-lost", LOOP, 'state["position"] = loader.position', 'state["position"] = 0',
             (f"{RESUME}::test_resumed_run_matches_uninterrupted",), "a resumed run restarts the data order"),
    # export scale
    Mutation("export-2x-alpha", EXPORT, "scale = alpha / rank", "scale = 2 * alpha / rank", EXPORT_TESTS,
             "the export stage folds 2 x alpha"),
    Mutation("export-no-fold", EXPORT, "folded = fold_scale(lora, rank, alpha)", "folded = lora",
             ("tests/export/test_export_stage.py",), "the export stage does not fold alpha/rank"),
    Mutation("train-alpha-metadata", LOOP, '"lora_alpha": str(train.lora_alpha),',
             '"lora_alpha": str(train.lora_rank),', ("tests/export/test_export_stage.py",),
             "the trained LoRA records rank as its alpha"),
    Mutation("export-comfyui-alpha", "diffusion_pipe/export/keys.py",
             'f"{prefix}.alpha": torch.tensor(float(a.shape[0]))',
             'f"{prefix}.alpha": torch.tensor(float(2 * a.shape[0]))', ("tests/export/test_export_stage.py",),
             "ComfyUI files carry an .alpha other than the rank"),
    # lineage verify
    Mutation("verify-skips-lora", VERIFY, '_check_file(repo, "trained LoRA", inputs.get("lora"), fix)) if c',
             "None) if c", LINEAGE_TESTS, "lineage --verify no longer re-hashes the trained LoRA"),
    Mutation("verify-skips-exported-files", VERIFY, 'Check(f"exported file {name}", actual == digest,',
             'Check(f"exported file {name}", True,', LINEAGE_TESTS, "lineage --verify accepts modified exports"),
    Mutation("verify-skips-key-set", VERIFY, 'Check("store key set", got == want,', 'Check("store key set", True,',
             LINEAGE_TESTS, "lineage --verify accepts a table pointing at other store entries"),
    # the incremental rescan (tests/scan/test_incremental.py: each rescan equals a scan without a cache)
    Mutation("scan-patch-ignores-problem-files", "diffusion_pipe/scan/scanner.py",
             "            stems.update(item_stem(lst.rels[i]) for i in lst.problems)  # not stat'ed: never in the cache\n",
             "            pass\n", ("tests/scan/test_incremental.py",),
             "a file that can't be stat'ed (a dangling symlink, fixed since) keeps its last row"),
    Mutation("scan-stem-prefix-only", "diffusion_pipe/scan/scanner.py",
             "            if item_stem(listing.rels[i]) == stem:  # not 'a.b.png' for 'a'",
             "            if True:", ("tests/scan/test_incremental.py",),
             "'3.v2.png' is rebuilt with '3.png' (more rows rebuilt than changed)"),
    Mutation("scan-cache-match-ignores-stat", "diffusion_pipe/scan/cache.py",
             "        return pc.if_else(same, rows, None).to_pylist()", "        return rows.to_pylist()",
             ("tests/scan/test_incremental.py", "tests/scan/test_scan.py"), "an edited file keeps its cached result"),
    Mutation("scan-patch-keeps-removed-items", "diffusion_pipe/scan/scanner.py",
             '                      pc.invert(pc.is_in(base["path"], value_set=media)))',
             '                      pc.is_in(base["path"], value_set=pa.array([], pa.string())))',
             ("tests/scan/test_incremental.py",), "a deleted image stays in the manifest"),
    Mutation("scan-duplicates-across-datasets", "diffusion_pipe/scan/manifest.py",
             'key = pc.binary_join_element_wise(table["dataset"], table["content_hash"],',
             'key = pc.binary_join_element_wise(table["content_hash"], table["content_hash"],',
             ("tests/scan/test_scan.py", "tests/scan/test_incremental.py"),
             "a copy in another dataset is excluded as a duplicate"),
    Mutation("scan-snapshot-rows-ignore-cache-digest", "diffusion_pipe/scan/snapshot.py",
             'if not cache_digest or record.get("inputs") != inputs or record.get("cache_digest") != cache_digest:',
             'if not cache_digest or record.get("inputs") != inputs:', ("tests/scan/test_incremental.py",),
             "after a failed scan the last rows are patched with changes the cache already holds"),
    # scan policies
    Mutation("scan-error-policy-defaults", "diffusion_pipe/scan/captions.py", '    if policy == "default":\n',
             '    if policy in ("default", "error"):\n', ("tests/scan/test_scan.py", "tests/scan/test_captions.py"),
             "caption_policy 'error' silently trains on the default caption"),
    Mutation("scan-empty-caption-is-a-caption", "diffusion_pipe/scan/captions.py",
             "    if read is not None and read.text:\n", "    if read is not None:\n",
             ("tests/scan/test_scan.py", "tests/scan/test_captions.py"), "an empty .txt trains as an empty caption"),
    # tag shuffling and per-dataset loss weights (scan.datasets[].shuffle_tags, keep_tags, loss_weight)
    Mutation("tag-orders-ignore-keep", "diffusion_pipe/scan/captions.py", "kept, rest = tags[:keep], tags[keep:]",
             "kept, rest = [], tags", ("tests/scan/test_tag_orders.py",), "kept tags are shuffled too"),
    Mutation("train-ignores-tag-orders", "diffusion_pipe/train/data.py",
             "return [rng.choice(row.variant_keys) if row.variant_keys else row.text_key for row in rows]",
             "return [row.text_key for row in rows]", ("tests/train/test_tag_shuffle.py",),
             "training always uses the caption as written"),
    Mutation("train-unchecked-tag-orders", "diffusion_pipe/train/data.py",
             '*(("text", k, text_spec) for k in row.variant_keys)', '*(("text", k, text_spec) for k in ())',
             ("tests/train/test_tag_shuffle.py",), "a tag order missing from the store is found mid-training"),
    Mutation("encode-skips-tag-orders", ENCODE,
             "captions |= {k: text for s in samples for k, text in zip(s.variant_keys, s.caption_variants)}",
             "captions |= {}", ("tests/train/test_tag_shuffle.py",), "encode embeds no tag order"),
    Mutation("loss-weight-dropped", "diffusion_pipe/train/data.py",
             "weights = dataset_weights if weights is None else weights * dataset_weights", "weights = weights",
             ("tests/train/test_objectives.py",), "datasets' loss weights never reach the loss"),
    Mutation("loss-weight-not-in-manifest", "diffusion_pipe/scan/manifest.py", "loss_weight=p.loss_weight,",
             "loss_weight=1.0,", ("tests/scan/test_tag_orders.py",), "the manifest forgets the dataset's weight"),
    Mutation("loss-weight-not-read", "diffusion_pipe/train/data.py", 'r.get("loss_weight", 1.0))', "1.0)",
             ("tests/train/test_options.py::test_a_datasets_loss_weight_scales_its_samples_loss",),
             "train reads no loss weight from the encoded table"),
    Mutation("attention-always-masked", "diffusion_pipe/models/common.py",
             "return None if mask.shape[1] == 1 else mask.bool()", "return mask.bool()",
             ("tests/models/test_lumina2.py::TestLumina2Contract::test_attention_is_unmasked_unless_an_item_is_padded",
              "tests/models/test_zimage.py::TestZImageContract::test_attention_is_unmasked_unless_an_item_is_padded"),
             "Z-Image and Lumina 2 attend through an all-ones mask (off the flash kernel)"),
    # activation checkpointing of a share of the layers; formats checked before training
    Mutation("checkpoint-share-ignored", "diffusion_pipe/train/pipeline.py",
             "recompute_in_backward(layers[i], compile_forward=compile_layers)", "pass",
             ("tests/train/test_checkpointing.py",), "a share below 1 recomputes nothing"),
    Mutation("formats-checked-only-with-step-loras", "diffusion_pipe/train/step_loras.py", "        if unknown:",
             "        if every and unknown:",
             ("tests/train/test_step_loras.py::test_a_format_the_family_cannot_write_stops_train_before_step_1",),
             "a format the family cannot write fails in export, after training"),
    # train.adapter: full
    Mutation("full-trains-nothing", "diffusion_pipe/train/build.py", "        denoiser.requires_grad_(True)\n",
             "        denoiser.requires_grad_(False)\n",
             ("tests/train/test_full.py::test_full_fine_tune_trains_every_weight_and_exports_a_denoiser_the_pipeline_loads",),
             "a full fine-tune with no trainable weight"),
    Mutation("full-not-gathered", "diffusion_pipe/train/lora.py",
             "    if not tdist.is_initialized() or tdist.get_world_size() == 1:",
             "    if full or not tdist.is_initialized() or tdist.get_world_size() == 1:",
             ("tests/test_pipeline.py::test_a_full_fine_tune_over_two_stages_matches_one",),
             "rank 0 writes only its own stage's weights"),
    Mutation("full-export-base-weights", "diffusion_pipe/export/merge.py", "        params[name].copy_(tensor)",
             "        pass",
             ("tests/train/test_full.py::test_full_fine_tune_trains_every_weight_and_exports_a_denoiser_the_pipeline_loads",),
             "the export writes the base's weights"),
    Mutation("full-sample-renders-base", "diffusion_pipe/sample/stage.py", "    setattr(pipe, component, trained)",
             "    pass",
             ("tests/train/test_full.py::test_full_fine_tune_trains_every_weight_and_exports_a_denoiser_the_pipeline_loads",),
             "the sample stage renders the base twice"),
    Mutation("full-with-fp8-base-allowed", "diffusion_pipe/params.py", "            if self.model.base_dtype:",
             "            if False:",
             ("tests/train/test_full.py::test_what_a_full_fine_tune_cannot_do_is_refused_when_params_load",),
             "fp8 frozen weights under a full fine-tune"),
    # image-to-video conditioning made by a family's rule (wan_i2v)
    Mutation("i2v-condition-key-ignores-window", ENCODE,
             'frames=conditioning_frames(adapter, row["media"], frames, start)),',
             'frames=conditioning_frames(adapter, row["media"], frames, 0)),',
             ("tests/encode/test_first_frame_conditioning.py",), "every window of a clip shares one condition"),
    Mutation("i2v-condition-key-ignores-rule", ENCODE,
             'return {"count": frames, "condition": rule, "first_frame": frames_spec(media, 1, start)}',
             'return {"count": frames, "first_frame": frames_spec(media, 1, start)}',
             ("tests/encode/test_first_frame_conditioning.py",), "a condition's key does not name its rule"),
    Mutation("i2v-condition-from-whole-clip", ENCODE, "        if s.condition_frames:\n            frames = 1\n",
             "", ("tests/encode/test_media.py", "tests/encode/test_first_frame_conditioning.py"),
             "a condition source decodes the whole window, not its first frame"),
    Mutation("i2v-condition-rule-not-applied", ENCODE,
             "                pixels = adapter.conditioning_pixels(pixels, todo[done].condition_frames)",
             "                pass", ("tests/encode/test_first_frame_conditioning.py",),
             "encode stores the first frame alone, not the rule's video"),
    Mutation("i2v-black-frames-grey", "diffusion_pipe/models/wan_i2v.py",
             "first_frame_BC1HW.new_zeros(b, c, frames - 1, h, w)", "first_frame_BC1HW.new_ones(b, c, frames - 1, h, w)",
             ("tests/models/test_wan_i2v.py",), "the frames after the first are white, not the pipeline's zeros"),
    Mutation("i2v-mask-on-last-frame", "diffusion_pipe/models/wan_i2v.py", "        mask[:, :, 0] = 1",
             "        mask[:, :, -1] = 1", ("tests/models/test_wan_i2v.py",), "the mask marks the wrong latent frame"),
    # Wan 2.1 I2V: the CLIP image embedding in the text entries (wan21_i2v)
    Mutation("wan21-i2v-last-hidden-state-keyed", "diffusion_pipe/models/wan21_i2v.py",
             '"image_embeds": "hidden_states[-2]"', '"image_embeds": "hidden_states[-1]"',
             ("tests/models/test_wan21_i2v.py",), "the text key names a hidden state the pipeline does not read"),
    Mutation("wan21-i2v-image-after-text", "diffusion_pipe/models/wan.py", "text = torch.cat((image, text), dim=1)",
             "text = torch.cat((text, image), dim=1)", ("tests/models/test_wan21_i2v.py",),
             "the image states follow the text's in the cross-attention context"),
    Mutation("wan21-i2v-image-encoder-unkeyed", "diffusion_pipe/models/wan21_i2v.py",
             '{"text_encoder": d / "text_encoder", "image_encoder": d / "image_encoder"}',
             '{"text_encoder": d / "text_encoder"}', ("tests/models/test_wan21_i2v.py",),
             "new CLIP weights reuse the old text entries"),
    Mutation("wan21-i2v-spec-without-class-token", "diffusion_pipe/models/wan21_i2v.py",
             '(clip["image_size"] // clip["patch_size"]) ** 2 + 1', '(clip["image_size"] // clip["patch_size"]) ** 2',
             ("tests/models/test_wan21_i2v.py",), "the entry check expects the patches without the class token"),
    Mutation("wan21-i2v-frames-of-another-caption", "diffusion_pipe/models/wan21_i2v.py",
             "for p in images_BC1HW]", "for p in images_BC1HW.flip(0)]", ("tests/models/test_wan21_i2v.py",),
             "a batch's captions get each other's first frames"),
    Mutation("skyreels-block-causal-mask", "diffusion_pipe/models/skyreels_v2.py",
             "hidden = self.block(hidden, text, timestep_proj, (cos, sin), None)",
             "hidden = self.block(hidden, text, timestep_proj, (cos, sin), torch.zeros(1, 1, 1, 1, dtype=torch.bool))",
             ("tests/models/test_skyreels_v2.py",), "SkyReels blocks attend under a mask the pipeline does not use"),
    Mutation("krea2-text-fusion-unmasked", "diffusion_pipe/models/krea2.py",
             "self.text_fusion(text, attention_mask=text_mask.bool()[:, None, None, :])",
             "self.text_fusion(text, attention_mask=None)", ("tests/models/test_krea2.py",),
             "the text fusion attends to the template's padding"),
    Mutation("krea2-comfyui-wq-wk-swapped", "diffusion_pipe/models/krea2.py",
             '_BLOCK_NAMES = {"attn.to_q": "attn.wq", "attn.to_k": "attn.wk",',
             '_BLOCK_NAMES = {"attn.to_q": "attn.wk", "attn.to_k": "attn.wq",', ("tests/models/test_krea2.py",),
             "ComfyUI names swap q and k"),
    Mutation("krea2-lora-on-text-fusion", "diffusion_pipe/models/krea2.py", '        return r"^text_fusion\\."',
             '        return None', ("tests/models/test_krea2.py",), "the default LoRA also wraps the text fusion"),
    Mutation("ernie-text-length-ignored", "diffusion_pipe/models/ernie_image.py",
             "valid_text = torch.arange(t_max, device=x.device).view(1, t_max) < text_lens.view(b, 1)",
             "valid_text = torch.ones((b, t_max), device=x.device, dtype=torch.bool)",
             ("tests/models/test_ernie_image.py",), "ERNIE-Image attends to the text padding"),
    Mutation("ernie-bn-eps-from-config", "diffusion_pipe/models/ernie_image.py",
             "std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + _BN_EPS).to(latents)",
             "std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-2).to(latents)",
             ("tests/models/test_ernie_image.py",), "latents normalised with another epsilon than the pipeline's"),
    Mutation("ideogram4-velocity-not-negated", "diffusion_pipe/models/ideogram4.py",
             "return -prediction[:, -h * w:]", "return prediction[:, -h * w:]", ("tests/models/test_ideogram4.py",),
             "Ideogram 4's prediction taken as the velocity, where the pipeline negates it"),
    Mutation("ideogram4-model-time-not-flipped", "diffusion_pipe/models/ideogram4.py",
             "(1 - timesteps.float()).to(self.dtype)", "timesteps.float().to(self.dtype)",
             ("tests/models/test_ideogram4.py",), "the transformer fed t where the pipeline feeds model time 1 - t"),
    Mutation("ideogram4-patch-channels-flux2-order", "diffusion_pipe/models/ideogram4.py",
             ".permute(0, 3, 5, 1, 2, 4)", ".permute(0, 1, 3, 5, 2, 4)", ("tests/models/test_ideogram4.py",),
             "latent patches packed channel-first (Flux.2's order), not the pipeline's (row, column, channel)"),
    Mutation("ideogram4-padding-attended", "diffusion_pipe/models/ideogram4.py",
             "mask = (segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)).unsqueeze(1)", "mask = None",
             ("tests/models/test_ideogram4.py",), "caption and image tokens attend to the text padding's segment"),
    Mutation("chroma-text-dirs-from-flux", "diffusion_pipe/models/chroma.py",
             "        return Adapter.text_component_dirs(self)", "        return FluxAdapter.text_component_dirs(self)",
             ("tests/models/test_chroma.py",), "Chroma's text keys hash Flux's two encoders, one of which it lacks"),
    Mutation("hunyuan-image-template-unkeyed", "diffusion_pipe/models/hunyuan_image.py",
             '"template": pipe.prompt_template_encode,', '"template": "",', ("tests/models/test_hunyuan_image.py",),
             "HunyuanImage's text keys leave out the system prompt the pipeline wraps captions in"),
    Mutation("hunyuan-image-latents-unscaled", "diffusion_pipe/models/hunyuan_image.py",
             'return latents * self.component_config("vae")["scaling_factor"]', "return latents",
             ("tests/models/test_hunyuan_image.py",), "HunyuanImage trains on latents the pipeline would not un-scale"),
    Mutation("hunyuan-image-timestep-unscaled", "diffusion_pipe/models/hunyuan_image.py", "t = timesteps * 1000",
             "t = timesteps", ("tests/models/test_hunyuan_image.py",),
             "HunyuanImage's transformer sees t in [0, 1], not the pipeline's x1000 timesteps"),
    Mutation("hunyuan-image-comfyui-mlp-width", "diffusion_pipe/models/hunyuan_image.py",
             'mlp_dim=int(inner * c["mlp_ratio"])', "mlp_dim=inner", ("tests/models/test_hunyuan_image.py",),
             "ComfyUI's linear1 fused with the wrong MLP width"),
    Mutation("hidream-llama-first-caption", "diffusion_pipe/models/hidream.py",
             '"llama": llama[:, i].contiguous().cpu()', '"llama": llama[:, 0].contiguous().cpu()',
             ("tests/models/test_hidream.py",), "every HiDream caption of a batch stores the first one's Llama states"),
    Mutation("hidream-timestep-unscaled", "diffusion_pipe/models/hidream.py",
             "(timesteps * 1000).to(self.dtype)", "timesteps.to(self.dtype)", ("tests/models/test_hidream.py",),
             "HiDream's transformer sees t in [0, 1], not the pipeline's x1000 timesteps"),
    Mutation("hidream-comfyui-transformer-prefix", "diffusion_pipe/models/hidream.py",
             'return {f"diffusion_model.{k}": v for k, v in lora.items()}',
             'return {f"transformer.{k}": v for k, v in lora.items()}', ("tests/models/test_hidream.py",),
             "HiDream's comfyui file is the diffusers one, not the diffusion_model. keys ComfyUI's loader reads"),
    Mutation("hidream-routed-experts-no-grad", "diffusion_pipe/models/hidream.py", "        moe.training = True",
             "        moe.training = moe.training", ("tests/models/test_hidream.py",),
             "HiDream's routed experts run diffusers' no-grad inference path: their LoRAs never train"),
    Mutation("flux2-system-message-unkeyed", "diffusion_pipe/models/flux2.py",
             '{"system_message": pipe.system_message, "layers"', '{"system_message": "", "layers"',
             ("tests/models/test_flux2.py",), "FLUX.2 [dev]'s text keys leave out the pipeline's system message"),
    Mutation("flux2-layers-unkeyed", "diffusion_pipe/models/flux2.py", '"layers": list(layers)})', '"layers": []})',
             ("tests/models/test_flux2.py",), "FLUX.2 [dev]'s text keys leave out the Mistral layers stacked"),
    Mutation("flux2-template-without-bos", "diffusion_pipe/models/flux2.py",
             '"{{- bos_token }}{%- for message in messages %}', '"{%- for message in messages %}',
             ("tests/models/test_flux2.py",),
             "the tiny tokenizer's chat template writes no BOS: the stand-in tokenizer's ids are not the processor's"),
    Mutation("flux2-sample-guidance-fixed", "diffusion_pipe/models/flux2.py", '"guidance_scale": guidance}',
             '"guidance_scale": 4.0}', ("tests/models/test_flux2.py",),
             "FLUX.2 [dev] samples ignore the prompt's distilled guidance"),
    Mutation("flux2-guidance-check-inherited", "diffusion_pipe/models/flux2.py",
             "    guidance_embeds: ClassVar[bool] = True\n", "", ("tests/models/test_flux2.py",),
             "family flux2 takes Klein's guidance check and refuses FLUX.2 [dev] checkpoints"),
    Mutation("flux2-train-guidance-constant", "diffusion_pipe/models/flux2_klein.py",
             "torch.full((b,), guidance, dtype=self.dtype))", "torch.full((b,), 1.0, dtype=self.dtype))",
             ("tests/models/test_flux2.py",), "FLUX.2 [dev] trains at guidance 1 whatever train.guidance says"),
    Mutation("ltx2-frame-rate-25", "diffusion_pipe/models/ltx2.py", "FRAME_RATE = 24.0", "FRAME_RATE = 25.0",
             ("tests/models/test_ltx2.py",),
             "LTX-2's rotary time coordinates at LTX-Video's 25 fps, not LTX2Pipeline's default 24"),
    Mutation("ltx2-timestep-unscaled", "diffusion_pipe/models/ltx2.py", "t = (timesteps * 1000).flatten()",
             "t = timesteps.flatten()", ("tests/models/test_ltx2.py",),
             "LTX-2's transformer sees t in [0, 1], not the pipeline's x1000 timesteps"),
    Mutation("ltx2-connectors-right-padding", "diffusion_pipe/models/ltx2.py",
             "padding_side=pipe.tokenizer.padding_side)", 'padding_side="right")', ("tests/models/test_ltx2.py",),
             "LTX-2's text connectors normalise Gemma's left-padded states as if right-padded"),
    Mutation("ltx2-comfyui-time-embed-name", "diffusion_pipe/models/ltx2.py", '"time_embed": "adaln_single", ', "",
             ("tests/models/test_ltx2.py",), "LTX-2's comfyui file keeps diffusers' time_embed, not adaln_single"),
    # Cosmos-Predict2 Video2World (cosmos2)
    Mutation("cosmos2-condition-timestep-of-the-rest", "diffusion_pipe/models/cosmos2.py",
             "            per_frame[:, 0] = T_CONDITIONING\n", "", ("tests/models/test_cosmos2.py",),
             "the conditioning frame enters at the noisy frames' timestep, not the pipeline's sigma 1e-4"),
    Mutation("cosmos2-condition-mask-unset", "diffusion_pipe/models/cosmos2.py", "            mask[:, :, 0] = 1\n",
             "", ("tests/models/test_cosmos2.py",), "no frame is marked conditioning in the condition-mask channel"),
    Mutation("cosmos2-loss-covers-the-condition", "diffusion_pipe/models/wan.py",
             "return noisy, target[:, :, 1:]", "return noisy, target",
             ("tests/models/test_cosmos2.py", "tests/models/test_wan_ti2v.py"),
             "the loss asks the clean first frame (Cosmos-Predict2's, Wan TI2V's) for a velocity it cannot know"),
    Mutation("cosmos2-rope-without-fps", "diffusion_pipe/models/cosmos2.py", "self.rope(latents, fps=FPS)",
             "self.rope(latents)", ("tests/models/test_cosmos2.py",),
             "rotary positions along time taken as an image's, not at the pipeline's fps"),
    Mutation("cosmos2-unpatchify-inverse-of-patchify", "diffusion_pipe/models/cosmos2.py",
             "x.permute(0, 7, 1, 6, 2, 4, 3, 5)", "x.permute(0, 7, 1, 6, 2, 5, 3, 4)",
             ("tests/models/test_cosmos2.py",),
             "the output unpatchified as the inverse of the patch embedding, not in the transformer's own order"),
    Mutation("cosmos2-text-padding-kept", "diffusion_pipe/models/wan.py",
             "states = states * mask.unsqueeze(-1).to(states.dtype)", "states = states",
             ("tests/models/test_cosmos2.py",),
             "T5's states of pad tokens stored where the pipeline stores zeros"),
    Mutation("cosmos2-comfyui-cross-modulation-as-self", "diffusion_pipe/models/cosmos2.py",
             r'r"blocks.\1.adaln_modulation_cross_attn.\2"', r'r"blocks.\1.adaln_modulation_self_attn.\2"',
             ("tests/models/test_cosmos2.py",),
             "the cross-attention's modulation LoRA written under the self-attention's original name"),
    Mutation("cosmos2-images-trained", "diffusion_pipe/encode/encode.py",
             'if "image" not in caps.media and row["media"] == "image":',
             'if caps.conditioning_rule and row["media"] == "image":',
             ("tests/encode/test_first_frame_conditioning.py",),
             "an image item of a clips-only family without a conditioning rule trains with nothing to generate"),
    Mutation("image-family-trains-videos", "diffusion_pipe/encode/encode.py",
             'if "video" not in caps.media and row["media"] == "video":',
             'if False and row["media"] == "video":', ("tests/encode/test_first_frame_conditioning.py",),
             "a video in an image family's dataset reaches training"),
    Mutation("cosmos2-image-takes-a-condition-mask", "diffusion_pipe/models/cosmos2_image.py",
             "    conditioned: ClassVar[bool] = False", "    conditioned: ClassVar[bool] = True",
             ("tests/models/test_cosmos2_image.py",), "Text2Image fed Video2World's condition-mask channel"),
    # MiniMax H3 (minimax_h3: text-to-video, video rows trained, audio rows pure noise)
    Mutation("minimax_h3-velocity-not-negated", "diffusion_pipe/models/minimax_h3.py", "        return -x\n",
             "        return x\n", ("tests/models/test_minimax_h3.py",),
             "H3's data-ward velocity trained as if it were the flow objective's noise - x0"),
    Mutation("minimax_h3-timestep-as-sigma", "diffusion_pipe/models/minimax_h3.py", "1.0 - sigma, NOISE_T,",
             "sigma, NOISE_T,", ("tests/models/test_minimax_h3.py",),
             "the video rows fed sigma where H3 reads t = 1 - sigma (t = 1 clean)"),
    Mutation("minimax_h3-audio-at-video-timestep", "diffusion_pipe/models/minimax_h3.py", "1.0 - sigma, NOISE_T,",
             "1.0 - sigma, 1.0 - sigma,", ("tests/models/test_minimax_h3.py",),
             "the pure-noise audio rows tagged with the video's noise level"),
    Mutation("minimax_h3-audio-tagged-clean", "diffusion_pipe/models/minimax_h3.py", "NOISE_T = 0.0", "NOISE_T = 1.0",
             ("tests/models/test_minimax_h3.py",), "the pure-noise audio rows tagged t = 1, which H3 reads as clean"),
    Mutation("minimax_h3-blocks-attend-padding", "diffusion_pipe/models/minimax_h3.py",
             "self.block(sequence[b:b + 1, :n], temb[b], adaln_indices[b, :n], (cos[b, :n], sin[b, :n]))",
             "self.block(sequence[b:b + 1], temb[b], adaln_indices[b], (cos[b], sin[b]))",
             ("tests/models/test_minimax_h3.py",),
             "a shorter caption's sample attends to the padding rows of a micro-batch's longest sequence"),
    Mutation("minimax_h3-text-layer", "diffusion_pipe/models/minimax_h3.py",
             'text_encoder_layer=pipeline_fact("text_encoder_layer"),',
             'text_encoder_layer=pipeline_fact("text_encoder_layer") - 1,', ("tests/models/test_minimax_h3.py",),
             "text entries read one Qwen3-VL layer before the pipeline's hidden state 50"),
    Mutation("minimax_h3-pixels-not-imagenet", "diffusion_pipe/models/minimax_h3.py",
             "((pixels_BCFHW.to(vae.device, torch.float32) + 1) / 2 - mean) / std",
             "(pixels_BCFHW.to(vae.device, torch.float32) - mean) / std", ("tests/models/test_minimax_h3.py",),
             "the VAE fed [-1, 1] pixels where the pipeline feeds ImageNet-normalised [0, 1] ones"),
    Mutation("minimax_h3-comfyui-fc1-halves-kept", "diffusion_pipe/models/minimax_h3.py",
             "b = torch.cat((gate, value))", "b = torch.cat((value, gate))", ("tests/models/test_minimax_h3.py",),
             "the feed-forward input's LoRA written in diffusers' [value; gate] order, not the original [gate; value]"),
    Mutation("minimax_h3-audio-head-not-loaded", "diffusion_pipe/models/minimax_h3.py",
             '"video": transformer.proj_out, "audio": transformer.audio_proj_out}',
             '"video": transformer.proj_out}', ("tests/models/test_minimax_h3.py",),
             "training's samples run the whole transformer with its audio head left on the meta device"),
    Mutation("minimax_h3-images-trained", "diffusion_pipe/models/minimax_h3.py", "        if frames == 1:",
             "        if False:", ("tests/models/test_minimax_h3.py",),
             "an image reaches the frame rule, which names no medium, instead of the clips-only refusal"),
    # Kandinsky 5 (kandinsky5: video; kandinsky5_image: image, the same layers over Flux's VAE)
    Mutation("kandinsky5-cross-attention-sees-padding", "diffusion_pipe/models/kandinsky5.py",
             "out = self.block(tokens, text[items, :n], temb[items], rope, None)",
             "out = self.block(tokens, text[items], temb[items], rope, None)", ("tests/models/test_kandinsky5.py",),
             "the visual blocks cross-attend to the text padding of a micro-batch's shorter captions"),
    Mutation("kandinsky5-template-unkeyed", "diffusion_pipe/models/kandinsky5.py", '"template": pipe.prompt_template,',
             '"template": "",', ("tests/models/test_kandinsky5.py",),
             "Kandinsky 5's text keys leave out the template the pipeline wraps captions in"),
    Mutation("kandinsky5-rope-scale-fixed", "diffusion_pipe/models/kandinsky5.py",
             "return tuple(Kandinsky5T2VPipeline._get_scale_factor(None, height, width))", "return (1.0, 2.0, 2.0)",
             ("tests/models/test_kandinsky5.py",), "the video rotary scale ignores the pipeline's size rule"),
    Mutation("kandinsky5-time-features-uncast", "diffusion_pipe/models/kandinsky5.py",
             "        cast_time_features(transformer)\n", "", ("tests/models/test_kandinsky5.py",),
             "a bfloat16 model, as training holds it, feeds its time embedding float32 sinusoids"),
    Mutation("kandinsky5-image-rope-scale-of-video", "diffusion_pipe/models/kandinsky5_image.py",
             "        return (1.0, 1.0, 1.0)", "        return Kandinsky5Adapter.rope_scale(self, height, width)",
             ("tests/models/test_kandinsky5_image.py",), "the image family takes the video pipeline's rotary scale"),
    Mutation("kandinsky5-image-frame-axis-dropped", "diffusion_pipe/models/kandinsky5_image.py",
             '[{"latents": x[:, None].contiguous().cpu()}', '[{"latents": x.contiguous().cpu()}',
             ("tests/models/test_kandinsky5_image.py",), "image latents are stored without the frame axis of one"),
    Mutation("kandinsky5-image-sample-size-snapped", "diffusion_pipe/models/kandinsky5.py",
             'self.resolutions = [(kwargs["width"], kwargs["height"])]', "self.resolutions = self.resolutions",
             ("tests/models/test_kandinsky5_image.py",),
             "image samples render at the pipeline's nearest 1K size, not the size asked for"),
    Mutation("kandinsky5-image-latents-shifted", "diffusion_pipe/models/kandinsky5.py",
             'return latents * self.component_config("vae")["scaling_factor"]',
             'return (latents - self.component_config("vae").get("shift_factor", 0.0)) * '
             'self.component_config("vae")["scaling_factor"]', ("tests/models/test_kandinsky5_image.py",),
             "latents are shifted by Flux's VAE shift, which the Kandinsky pipeline does not undo"),
    Mutation("encode-share-of-what-this-worker-finds-missing", ENCODE,
             "mine = store.missing(fam, workers.share(keys))", "mine = workers.share(missing)",
             ("tests/encode/test_processes.py::test_a_worker_that_starts_after_another_published_still_gets_every_key",),
             "workers split what each finds missing, which differs once another has published"),
    Mutation("text-key-ignores-the-image", ENCODE, "dtype=model.dtype, image=image)", "dtype=model.dtype, image=None)",
             ("tests/models/test_qwenimage_edit.py", "tests/encode/test_control_exactness.py"),
             "a caption read with a control image keyed as the caption alone"),
    Mutation("text-sources-read-no-image", ENCODE, "        if reads_image:\n", "        if False:\n",
             ("tests/encode/test_control_exactness.py", "tests/models/test_wan21_i2v.py"),
             "the text encoder of an edit family reads captions without their control image"),
    Mutation("sample-text-without-its-control", "diffusion_pipe/sample/render.py",
             "return SampleText(text, prompt.control, prompt.width, prompt.height)", "return SampleText(text)",
             ("tests/models/test_qwenimage_edit.py", "tests/models/test_wan21_i2v.py"),
             "a sample prompt's text entry made without the image its family's encoder reads"),
    Mutation("sample-shared-inputs-joined", "diffusion_pipe/sample/render.py",
             "if k not in adapter.sample_shared_inputs else", "if True else",
             ("tests/models/test_wan21_i2v.py",), "Wan 2.1 I2V's image states joined per prompt, then repeated"),
    Mutation("wan21-i2v-sample-image-states-zero", "diffusion_pipe/models/wan21_i2v.py",
             '"image_embeds": text["image_embeds"][None].to(self.dtype)}',
             '"image_embeds": text["image_embeds"][None].mul(0).to(self.dtype)}',
             ("tests/models/test_wan21_i2v.py",), "samples render without the first frame's CLIP states"),
    Mutation("keep-narrow-keeps-widening", "diffusion_pipe/train/pipeline.py",
             "return right.shape[-1] <= left.shape[-1]", "return right.shape[-1] >= left.shape[-1]",
             ("tests/train/test_checkpointing.py",), "keep: narrow keeps the widening products instead"),
    Mutation("qwenimage-edit-control-grid-of-target", "diffusion_pipe/models/qwenimage_edit.py",
             "torch.cat((grid, control_grid), dim=1))", "torch.cat((grid, grid), dim=1))",
             ("tests/models/test_qwenimage_edit.py",), "control tokens placed on the target's grid"),
    Mutation("qwenimage21-text-not-trimmed", "diffusion_pipe/models/qwenimage21.py",
             'length = longest_caption(text["prompt_mask"])', 'length = text["prompt_mask"].shape[1]',
             ("tests/models/test_qwenimage21.py",),
             "Qwen-Image 2.1's text kept at text_max_length: the padding moves the image's rotary position"),
    Mutation("qwenimage21-alpha-transparent", "diffusion_pipe/models/qwenimage21.py",
             "torch.cat((pixels, torch.ones_like(pixels[:, :1])), dim=1)",
             "torch.cat((pixels, -torch.ones_like(pixels[:, :1])), dim=1)", ("tests/models/test_qwenimage21.py",),
             "the RGBA VAE reads training images as transparent, where the pipeline's are opaque"),
    Mutation("qwenimage21-text-not-causal", "diffusion_pipe/models/qwenimage21.py",
             "segments=[(0, prefix_ids.shape[0], True)],", "segments=[(0, prefix_ids.shape[0], False)],",
             ("tests/models/test_qwenimage21.py",), "the text prefix attends bidirectionally in the pipeline layers"),
    Mutation("qwenimage21-comfyui-up-rows-first", "diffusion_pipe/models/qwenimage21.py",
             '[0 if proj == "gate_layer" else 1]', '[1 if proj == "gate_layer" else 0]',
             ("tests/models/test_qwenimage21.py",), "ComfyUI's fused gate_up LoRA with the up rows before the gate's"),
    # 2026-12-06: packs remembered as verified when written or pulled; caption dropout read with the sample's image
    Mutation("store-published-pack-not-remembered", STORE,
             "        self._remember_verified(sidecar.family, sidecar.pack_id)\n",
             "        self._verified.add((sidecar.family, sidecar.pack_id))\n", ("tests/store/test_repair.py",),
             "every incremental encode hashes the whole store again"),
    Mutation("dropout-empty-caption-without-image", ENCODE,
             'ekey = text_key_of("", image) if caption_dropout and row["split"] == "train" else ""',
             'ekey = text_key_of("") if caption_dropout and row["split"] == "train" else ""',
             ("tests/encode/test_first_frame_conditioning.py",),
             "a dropped edit / i2v sample trains on the empty caption keyed without its image"),
    Mutation("dropout-eval-rows-too", ENCODE,
             'ekey = text_key_of("", image) if caption_dropout and row["split"] == "train" else ""',
             'ekey = text_key_of("", image) if caption_dropout else ""',
             ("tests/encode/test_first_frame_conditioning.py",), "eval samples get empty-caption entries encoded"),
    Mutation("dropout-empty-source-without-image", ENCODE, 'out.setdefault(s.empty_text_key, TextSource("", image))',
             'out.setdefault(s.empty_text_key, TextSource(""))', ("tests/encode/test_first_frame_conditioning.py",),
             "the per-image empty caption is encoded without its image"),
    Mutation("dropout-ignores-the-samples-own-empty-caption", "diffusion_pipe/train/caption_dropout.py",
             "(own or self.empty_key) if rng.random()", "self.empty_key if rng.random()",
             ("tests/train/test_caption_dropout.py::test_an_edit_family_drops_each_sample_to_its_own_empty_caption",),
             "an edit family's dropped sample reads no entry"),
    Mutation("dropout-rows-without-empty-captions-accepted", "diffusion_pipe/train/caption_dropout.py",
             "            if lacking:\n", "            if False:\n",
             ("tests/train/test_caption_dropout.py::test_an_edit_family_drops_each_sample_to_its_own_empty_caption",),
             "train starts on a table encoded without the empty captions and fails mid-run"),
    Mutation("bench-contract-class-unique", "bench/bench_family.py",
             "    return min(classes, key=lambda c: len(c.__mro__))()", "    (only,) = classes\n    return only()",
             ("tests/test_bench.py",), "the plain loop of a family with a variant contract class cannot start"),
    Mutation("ltx2-sample-timestep-units", "diffusion_pipe/models/ltx2.py", "(t / 1000).expand(x.shape[0])",
             "t.expand(x.shape[0])", ("tests/models/test_ltx2.py",),
             "LTX-2 samples feed the scheduler's timestep (sigma x 1000) where training feeds sigma"),
    Mutation("ltx2-sample-guidance", "diffusion_pipe/models/ltx2.py",
             "velocity = uncond + guidance_scale * (cond - uncond)", "velocity = cond", ("tests/models/test_ltx2.py",),
             "LTX-2 samples ignore the negative prompt and the guidance scale"),
    Mutation("ltx2-sample-no-denormalise", "diffusion_pipe/models/ltx2.py",
             "            latents = self._denormalize_latents(",
             "            latents = latents if True else self._denormalize_latents(",
             ("tests/models/test_ltx2.py",), "LTX-2 samples decode normalised latents (washed-out colours)"),
    Mutation("swap-prefetch-one-direction", SWAP, "(-1 if _in_backward() else 1)", "1", SWAP_TESTS,
             "backward's recomputations copy the wrong block ahead (and wait for every copy)"),
    Mutation("swap-prefetch-ignored", SWAP, "prefetch and self.prefetch", "prefetch", SWAP_TESTS,
             "swap_prefetch: false still copies ahead (one more block's memory)"),
    Mutation("swap-prefetch-never", SWAP, "        if following is not None:\n", "        if False:\n", SWAP_TESTS,
             "no copy overlaps the compute"),
    Mutation("swap-nested-checkpoint", SWAP, "        self.checkpointed_outside = True\n", "        pass\n",
             ("tests/train/test_checkpointing.py::test_a_swapped_layer_recomputes_as_the_pipeline_says",),
             "a swapped block recomputes everything inside the pipeline's selective checkpoint"),
    Mutation("swap-prefetch-in-run-identity", LOOP, ', "swap_prefetch")', ")", ("tests/train/test_swap.py",),
             "switching swap_prefetch starts a new run instead of continuing"),
    Mutation("swap-loads-without-checkpoint", SWAP, "            if self.checkpointed_outside:\n",
             "            if True:\n", SWAP_TESTS, "a block that checkpoints itself keeps its weights until backward"),
    # README claims tested since 2026-12-06 (an audit of the README against the tests)
    Mutation("entry-check-ignores-shapes", "diffusion_pipe/train/data.py", "            if got != want:\n",
             "            if False:\n", ("tests/train/test_entry_check.py",),
             "an entry of another shape reaches the model (a tensor-shape error deep inside it)"),
    Mutation("samples-in-run-identity", LOOP,
             '"keep_checkpoints", "samples",', '"keep_checkpoints",', ("tests/train/test_resume_identity.py",),
             "editing a sample prompt restarts training from scratch"),
    Mutation("resume-ignores-layout", LOOP, '("layout", "the parallel layout"))', ")",
             ("tests/train/test_resume_identity.py",), "--resume-from continues another parallel layout's run"),
    Mutation("push-false-pushes", ENCODE, "if remote is not None and encode.push:", "if remote is not None:",
             ("tests/encode/test_remote.py::test_push_false_uploads_nothing",),
             "encode.push: false still uploads to the remote"),
    Mutation("lease-heartbeat-silent", STORE, "                os.utime(self.path)\n", "                pass\n",
             ("tests/store/test_cli.py::test_a_running_writers_heartbeat_keeps_its_lease_live_past_the_ttl",),
             "a long encode's lease expires: gc elsewhere deletes packs it has published"),
    Mutation("worker-wait-never-resets", "diffusion_pipe/encode/workers.py",
             "            last_count, last_progress = count, now\n", "            last_count = count\n",
             ("tests/encode/test_worker_wait.py",), "rank 0 gives up on workers that are still publishing"),
    Mutation("eval-takes-noise-offset", "diffusion_pipe/train/data.py",
             "        if self.noise_offset and timesteps is None:\n", "        if self.noise_offset:\n",
             ("tests/train/test_eval_batches.py",), "eval losses move with train.noise_offset"),
    Mutation("cosine-is-linear", LOOP, '        if train.lr_scheduler == "linear":\n',
             '        if train.lr_scheduler in ("linear", "cosine"):\n',
             ("tests/train/test_schedule_and_accumulation.py",), "lr_scheduler: cosine decays linearly"),
    Mutation("accumulation-ignored", LOOP,
             '        "gradient_accumulation_steps": train.gradient_accumulation_steps,\n',
             '        "gradient_accumulation_steps": 1,\n', ("tests/train/test_schedule_and_accumulation.py",),
             "gradient_accumulation_steps trains one micro-batch per step"),
    Mutation("lora-targets-partial-names", "diffusion_pipe/train/lora.py",
             'and any(name == s or name.endswith(f".{s}") for s in suffixes)',
             "and any(name.endswith(s) for s in suffixes)", ("tests/train/test_lora_targets.py",),
             "lora_targets 'q_proj' also adapts add_q_proj"),
    Mutation("fp8-weight-scale-unknown", "diffusion_pipe/models/checkpoints.py",
             '_WEIGHT_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")',
             '_WEIGHT_SCALE_SUFFIXES = (".scale_weight",)',
             ("tests/models/test_fp8_single_file.py",),
             "an fp8 file with .weight_scale loads undequantised (diffusers' converter drops unknown keys silently)"),
    Mutation("export-unknown-format-names-wan", "diffusion_pipe/models/base.py",
             "is not supported by family '{self.name}' ", "is not supported by family 'wan' ",
             ("tests/models/test_wan_i2v.py::TestWanI2VContract::test_every_format_exports",),
             "an unsupported export format's error names Wan for every Wan-derived family"),
    Mutation("transformer-export-unprefixed", "diffusion_pipe/models/base.py",
             'return {f"transformer.{k}": v for k, v in lora.items()}', "return dict(lora)",
             ("tests/models/test_ltx.py", "tests/models/test_cosmos2.py"),
             "the shared diffusers export writes bare PEFT names its pipelines do not load"),
    Mutation("padded-text-mask-covers-padding", "diffusion_pipe/models/common.py", "mask[:len(states)] = 1",
             "mask[:] = 1", ("tests/models/test_zimage.py", "tests/models/test_minimax_h3.py",
                             "tests/models/test_qwenimage21.py", "tests/models/test_qwenimage_edit.py"),
             "a padded text entry's mask marks the padding rows as the caption's"),
    Mutation("engine-marks-first-stage-inputs", "diffusion_pipe/train/pipeline.py",
             "    engine._reentrant_activation_checkpointing = lambda: False\n", "",
             ("tests/train/test_engine_step.py",),
             "under checkpointing DeepSpeed marks every float input of the first stage as requiring grad"),
    Mutation("hunyuan-video-mask-integer-sum", "diffusion_pipe/models/hunyuan_video.py",
             "text_mask.gt(0).sum(dim=1, dtype=torch.int)", "text_mask.sum(dim=1, dtype=torch.int)",
             ("tests/models/test_hunyuan_video.py",),
             "HunyuanVideo's block fails on a text mask that requires grad (sent between stages)"),
    Mutation("cosmos-image-timestep-per-token", "diffusion_pipe/models/cosmos2.py",
             "        if frames // pt > 1:", "        if frames // pt > 0:",
             ("tests/models/test_cosmos2_image.py",),
             "an image's timestep embedding is copied to every token, and every block's norms project each copy"),
    Mutation("bench-row-names-last-line", "bench/bench_family.py", "return ((errors or lines)[-1]",
             "return ((lines or errors)[-1]", ("tests/test_bench.py",),
             "a failed bench run's row names the warning printed at exit instead of the exception"),
    Mutation("attention-cudnn-allows-flash", "diffusion_pipe/train/pipeline.py",
             '"cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,',
             '"cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,',
             ("tests/train/test_attention_kernel.py",),
             "train.attention: cudnn leaves flash allowed, which compiled code then takes"),
    Mutation("attention-kernel-in-run-identity", "diffusion_pipe/train/loop.py",
             '"save_lora_every_steps", "swap_prefetch", "attention")', '"save_lora_every_steps", "swap_prefetch")',
             ("tests/train/test_resume_identity.py",),
             "switching the attention kernel (or upgrading to a version with train.attention) restarts the run"),
    Mutation("device-load-header-offset", "diffusion_pipe/models/device_load.py",
             "views[turn][:n], start + offset, path)", "views[turn][:n], offset, path)",
             ("tests/models/test_device_load.py",),
             "the tensors are read from the file's start, header included, instead of its data section"),
    Mutation("device-load-misaligned-view", "diffusion_pipe/models/device_load.py",
             "    if begin % dtype.itemsize:\n        raw = raw.clone()\n", "",
             ("tests/models/test_device_load.py",),
             "a tensor at an offset its dtype cannot view fails to load"),
    Mutation("device-load-reader-slice", "diffusion_pipe/models/device_load.py",
             "os.preadv(fd, [view[begin:end]], offset + begin)", "os.preadv(fd, [view[begin:end]], offset)",
             ("tests/models/test_device_load.py",),
             "every reader thread reads the chunk's first bytes"),
    Mutation("model-around-untied", "diffusion_pipe/models/common.py",
             "    model.tie_weights()\n", "",
             ("tests/models/test_device_load.py",),
             "a T5 built around its checkpoint's tensors keeps a separate, empty token embedding in its encoder"),
    Mutation("model-around-meta-left", "diffusion_pipe/models/common.py",
             "    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):",
             "    if False:",
             ("tests/models/test_device_load.py",),
             "a checkpoint whose names do not match is taken, leaving the model's parameters unloaded"),
    Mutation("pinned-path-any-dtype", "diffusion_pipe/models/common.py",
             "d == dtype or not d.is_floating_point", "d == dtype or d.is_floating_point",
             ("tests/models/test_device_load.py",),
             "weights stored in another dtype are streamed and converted on the GPU, holding both copies"),
    Mutation("model-around-fp16-t5", "diffusion_pipe/models/common.py",
             "    if model._get_dtype_plan(dtype):", "    if model._get_dtype_plan(torch.bfloat16):",
             ("tests/models/test_device_load.py",),
             "a float16 T5 loaded through pinned memory keeps `wo` in float16 (from_pretrained: float32)"),
    Mutation("cudnn-not-warned", "diffusion_pipe/train/loop.py",
             '    if train.attention == "cudnn":', '    if train.attention == "never":',
             ("tests/train/test_messages.py",),
             "choosing the cuDNN kernel, which crashed and was no faster, says nothing"),
    Mutation("optimizer-stale-master-grad", "diffusion_pipe/train/optim.py",
             "        for param, master in self._low:\n            master.grad = None\n",
             "        for param, master in self._low:\n",
             ("tests/train/test_optim.py",),
             "a parameter without a gradient this step is stepped again with its last step's gradient"),
    Mutation("optimizer-grads-not-copied", "diffusion_pipe/train/optim.py",
             "            torch._foreach_copy_(views, [p.grad for p, _ in pairs])\n", "",
             ("tests/train/test_optim.py",),
             "the masters step on an uninitialised buffer instead of the parameters' gradients"),
    Mutation("optimizer-one-unbounded-buffer", "diffusion_pipe/train/optim.py",
             "            if index < 0 or numel + master.numel() > _GRAD_BUFFER_NUMEL:",
             "            if index < 0:",
             ("tests/train/test_optim.py",),
             "a full fine-tune's fp32 gradients are asked of the allocator as one block"),
    Mutation("lora-fusion-backward-unscaled", "bench/bench_lora_fusion.py",
             "        grad_a = s * (g2 @ lora_b).t() @ x2", "        grad_a = (g2 @ lora_b).t() @ x2",
             ("tests/test_bench.py",),
             "the merged LoRA's A gradient misses the scale, so the fusion bench times a wrong backward"),
    Mutation("attention-check-counts-noise", "bench/bench_attention.py",
             "            if norms[n] > 1e-3 * max(norms.values())}", "            }",
             ("tests/test_bench.py",),
             "the cuDNN gradient check ranks a key bias's rounding noise first and fails on it"),
    # issue 38: params edited while a stage runs, and the lineage that would record them
    Mutation("stage-ends-with-edited-params", "diffusion_pipe/cli_support.py",
             "                check_params_unchanged(params_path, name, params)\n", "",
             ("tests/test_config.py::test_a_stage_whose_params_were_edited_while_it_ran_fails_and_dvc_records_nothing",),
             "a stage ends normally after params.yaml was edited under it: dvc.lock records values it did not use"),
    Mutation("lineage-trained-params-not-compared", "diffusion_pipe/lineage/record.py",
             'return changed_params(trained.get("params") or {}, record.get("params") or {}, keys)', "return []",
             ("tests/lineage/test_verify.py", "tests/export/test_export_stage.py::"
              "test_export_refuses_a_lora_trained_with_other_params_than_params_yaml_holds"),
             "verify and export take an export's params for the trained LoRA's, whatever it was trained with"),
    Mutation("lineage-dvc-lock-unredacted", "diffusion_pipe/lineage/record.py", '"dvc_lock": redact_obj(lock),',
             '"dvc_lock": lock,', ("tests/lineage/test_verify.py",),
             "a secret in encode.remote, copied by DVC into dvc.lock, lands in every LoRA's lineage"),
    Mutation("export-ignores-trained-params", "diffusion_pipe/export/lora.py", "    if drift:\n", "    if False:\n",
             ("tests/export/test_export_stage.py::"
              "test_export_refuses_a_lora_trained_with_other_params_than_params_yaml_holds",),
             "export stamps params.yaml's params on a LoRA trained with others"),
    # issue 36: optimizers
    Mutation("optimizer-eval-weights-not-restored", "diffusion_pipe/train/optim.py",
             "                torch._foreach_copy_(self.masters, training)\n", "                pass\n",
             (f"{OPTIMIZERS}::test_schedule_free_eval_weights_are_its_average_and_training_continues_exactly",),
             "after schedule-free's eval weights, training continues from its train() round trip, not its own weights"),
    Mutation("optimizer-schedulefree-left-in-eval-mode", "diffusion_pipe/train/optim.py",
             "        if self.has_modes:\n            self.train()\n", "        if False:\n            self.train()\n",
             (f"{OPTIMIZERS}::test_the_library_optimizer_steps_fp32_masters",),
             "a schedule-free optimizer is never put in train mode, and its first step fails"),
    Mutation("optimizer-adamw8bit-on-cpu", "diffusion_pipe/train/optim.py", '    if device.type != "cuda":',
             "    if False:", (f"{OPTIMIZERS}::test_adamw8bit_where_it_cannot_run_is_a_clear_error",),
             "adamw8bit on a CPU run fails inside bitsandbytes instead of saying what to use"),
    Mutation("optimizer-prodigy-d-coef-ignored", "diffusion_pipe/train/optim.py", "d0=args.d0, d_coef=args.d_coef,",
             "d0=args.d0, d_coef=1.0,", (f"{OPTIMIZERS}::test_every_arg_reaches_the_optimizer",),
             "train.optimizer_args.d_coef is read and never given to Prodigy"),
    Mutation("optimizer-args-unchecked", "diffusion_pipe/params.py",
             'object.__setattr__(self, "optimizer_args", from_dict(cls, args, "train.optimizer_args"))',
             'object.__setattr__(self, "optimizer_args", cls())',
             (f"{OPTIMIZERS}::test_optimizer_params_are_checked_at_load",),
             "a misspelt or mistyped optimizer arg is dropped silently and the defaults train"),
    Mutation("optimizer-schedulefree-takes-a-schedule", "diffusion_pipe/params.py",
             'if self.optimizer == "schedulefree_adamw" and (', 'if self.optimizer == "never" and (',
             (f"{OPTIMIZERS}::test_optimizer_params_are_checked_at_load",),
             "an LR schedule runs on top of a schedule-free optimizer"),
    Mutation("checkpoint-scalar-state-dropped", CHECKPOINT, '                    scalars[f"{kind}/{name}"] = value',
             "                    pass", (f"{OPTIMIZERS}::test_state_through_a_checkpoint_continues_exactly",),
             "an optimizer's per-parameter numbers (Prodigy's, Adafactor's step counts) are not checkpointed"),
    Mutation("checkpoint-group-lists-not-tuples", CHECKPOINT,
             "{k: tuple(v) if isinstance(v, list) else v for k, v in group.items()}", "{k: v for k, v in group.items()}",
             (f"{OPTIMIZERS}::test_state_through_a_checkpoint_continues_exactly",),
             "a resumed optimizer's tuple hyperparameters (betas, Muon's coefficients) come back as lists"),
    Mutation("checkpoint-other-optimizer-loaded", CHECKPOINT, "        if theirs != ours:", "        if False:",
             (f"{OPTIMIZERS}::test_a_checkpoint_of_another_optimizer_is_refused",),
             "--resume-from a run of another optimizer loads its state into this one"),
    Mutation("identity-without-optimizer", LOOP,
             'default_optimizer = ("optimizer", "optimizer_args") if train.optimizer == "adamw" else ()',
             'default_optimizer = ("optimizer", "optimizer_args")',
             ("tests/train/test_resume_identity.py::test_the_optimizer_and_its_args_are_part_of_the_run",),
             "a changed optimizer or optimizer arg resumes the old run's checkpoints"),
    Mutation("prodigy-small-lr-not-warned", LOOP, 'if train.optimizer == "prodigy" and train.learning_rate < 0.1:',
             'if train.optimizer == "never" and train.learning_rate < 0.1:',
             ("tests/train/test_messages.py::test_a_small_learning_rate_with_prodigy_is_warned_about",),
             "prodigy with an AdamW-sized learning rate trains thousands of times slower, silently"),
    Mutation("eval-at-schedulefree-training-weights", LOOP,
             "            with optimizer.eval_weights():\n                for t in train.eval_timesteps:",
             "            with optimizer.eval_weights(False):\n                for t in train.eval_timesteps:",
             (SPIED,), "evaluation with a schedule-free optimizer measures the training point, not its average"),
    Mutation("samples-at-schedulefree-training-weights", LOOP,
             '            with optimizer.eval_weights(samples.due(state["step"])):',
             "            with optimizer.eval_weights(False):", (SPIED,),
             "samples during training with a schedule-free optimizer render the training point"),
    Mutation("lora-at-schedulefree-training-weights", LOOP,
             "    with optimizer.eval_weights():  # the weights to export",
             "    with optimizer.eval_weights(False):  # the weights to export", (SPIED,),
             "the LoRA of a schedule-free run is its training point, not the average it should export"),
]


def archive(dest: Path) -> None:
    """The committed tree (HEAD) of the repository, unpacked into `dest`."""
    dest.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", "HEAD"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """Run `tests` in `tree` with the repository's interpreter; (outcome, seconds, last output line)."""
    python = REPO / ".venv" / "bin" / "python"
    env = {**os.environ, "PYTHONPATH": str(tree), "DVC_NO_ANALYTICS": "1", "PYTHONWARNINGS": "ignore",
           "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("DIFFUSION_PIPE_STORE", None)
    cmd = [str(python), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *tests]
    started = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - started, "timed out"
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    outcome = {0: "passed", 1: "failed"}.get(out.returncode, f"error (exit {out.returncode})")
    return outcome, time.monotonic() - started, str(last)


def check_copy_is_used(tree: Path) -> None:
    """The copy's package, not the repository's editable install, must be what the tests import."""
    python = REPO / ".venv" / "bin" / "python"
    where = subprocess.run([str(python), "-c", "import diffusion_pipe; print(diffusion_pipe.__file__)"], cwd="/",
                           env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                           check=True).stdout.strip()
    if not where.startswith(str(tree)):
        sys.exit(f"mutation_pass: the copy imports diffusion_pipe from {where}, not {tree}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="names of the mutations to run")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--baseline", action="store_true", help="run each mutation's tests without the mutation")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutation's test run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.only and len(chosen) != len(set(args.only)):
        sys.exit(f"mutation_pass: unknown names in {args.only}; --list shows them")
    if args.list:
        for m in chosen:
            print(f"{m.name:36} {m.path}: {m.what}  [{' '.join(m.tests)}]")
        return 0

    work = Path(tempfile.mkdtemp(prefix="mut-"))
    base = work / "base"
    archive(base)
    check_copy_is_used(base)
    rows, bad = [], 0
    try:
        for m in chosen:
            tree = work / m.name
            shutil.copytree(base, tree, symlinks=True)
            target = tree / m.path
            text = target.read_text() if target.is_file() else ""
            count = text.count(m.old)
            if count != 1:
                outcome, seconds, last = f"not applied ({count} matches)", 0.0, ""
            else:
                if not args.baseline:
                    target.write_text(text.replace(m.old, m.new))
                outcome, seconds, last = run_tests(tree, m.tests, args.timeout)
            if args.baseline:
                verdict = "ok" if outcome == "passed" else f"BASELINE {outcome}"
            else:
                verdict = {"failed": "caught", "passed": "SURVIVED"}.get(outcome, outcome)
                if m.equivalent and verdict == "SURVIVED":
                    verdict = "survived (equivalent)"
            bad += verdict not in ("caught", "ok", "survived (equivalent)")
            rows.append((m, verdict, seconds, last))
            print(f"{m.name}: {verdict} in {seconds:.0f} s ({last})", file=sys.stderr, flush=True)
            if not args.keep:
                shutil.rmtree(tree, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("| mutation | what it breaks | tests | result | seconds |")
    print("|---|---|---|---|---|")
    for m, verdict, seconds, _ in rows:
        print(f"| `{m.name}` | {m.what} | {', '.join(t.removeprefix('tests/') for t in m.tests)} | {verdict} | "
              f"{seconds:.0f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
