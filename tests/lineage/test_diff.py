"""`lineage A --diff B`: differences grouped by what changed, root causes first, derived hashes last."""

from __future__ import annotations

import copy

from diffusion_pipe.lineage.diff import classify, diff_lineage, format_diff


def record() -> dict:
    """A record shaped as `export_lineage` writes it, with a dvc.lock entry per upstream stage."""
    dep = lambda path, md5: {"path": path, "hash": "md5", "md5": md5}  # noqa: E731
    return {
        "lineage_version": 3, "kind": "export",
        "params": {"train": {"learning_rate": 0.002}},
        "inputs": {"manifest": {"path": "data/manifest.parquet", "xxh3_128": "m1", "md5": "mm1"},
                   "encoded": {"path": "data/encoded.parquet", "xxh3_128": "e1", "md5": "em1"},
                   "store_keys": {"xxh3_128": "k1", "latent": 3, "text": 3},
                   "lora": {"path": "runs/train/lora.safetensors", "xxh3_128": "l1", "md5": "lm1"},
                   "datasets": {"shapes": {"path": "data", "items": 3, "media_xxh3": "d1", "captions_xxh3": "c1"}}},
        "base_model": {"weights": {"transformer": "w1"}},
        "dvc_lock": {
            "scan": {"cmd": "python -m stages.scan", "deps": [dep("data", "dd1.dir"), dep("diffusion_pipe/scan", "s1")],
                     "outs": [dep("data/manifest.parquet", "mm1")]},
            "encode": {"deps": [dep("data/manifest.parquet", "mm1")], "outs": [dep("data/encoded.parquet", "em1")]},
            "train": {"deps": [dep("data/encoded.parquet", "em1")],
                      "outs": [dep("runs/train/lora.safetensors", "lm1")]},
        },
        "git": {"commit": "abc", "dirty": False},
        "environment": {"packages": {"torch": "2.13.0"}},
        "training": {"train_loss_last": 0.5},
    }


def caption_edit(a: dict) -> dict:
    """What one edited caption changes in a record: the caption hash and everything derived from it."""
    b = copy.deepcopy(a)
    b["inputs"]["datasets"]["shapes"]["captions_xxh3"] = "c2"
    b["inputs"]["manifest"].update(xxh3_128="m2", md5="mm2")
    b["inputs"]["encoded"].update(xxh3_128="e2", md5="em2")
    b["inputs"]["store_keys"]["xxh3_128"] = "k2"
    b["inputs"]["lora"].update(xxh3_128="l2", md5="lm2")
    b["training"]["train_loss_last"] = 0.4
    lock = b["dvc_lock"]
    lock["scan"]["deps"][0]["md5"] = "dd2.dir"
    lock["scan"]["outs"][0]["md5"] = lock["encode"]["deps"][0]["md5"] = "mm2"
    lock["encode"]["outs"][0]["md5"] = lock["train"]["deps"][0]["md5"] = "em2"
    lock["train"]["outs"][0]["md5"] = "lm2"
    return b


def test_a_caption_edit_is_one_root_cause_before_its_derived_hashes():
    a = record()
    b = caption_edit(a)
    b["params"]["train"]["learning_rate"] = 0.001
    text = format_diff(diff_lineage(a, b), "A", "B")
    lines = text.splitlines()
    assert lines[2] == ("16 differences: params 1, captions 1; derived: encodings 5, training 3, dvc.lock 6")
    headers = [line for line in lines if line and not line.startswith((" ", "---", "+++", "16 "))]
    assert headers == ["params (1)", "captions (1)", "encodings (5, derived)", "training (3, derived)",
                       "dvc.lock (6, derived)"]
    assert "  params.train.learning_rate: 0.002 -> 0.001" in lines
    assert "  inputs.datasets.shapes.captions_xxh3: c1 -> c2" in lines
    assert "  dvc_lock.scan.deps.data.md5: dd1.dir -> dd2.dir" in lines


def test_dvc_lock_deps_are_compared_by_path_not_position():
    a = record()
    b = copy.deepcopy(a)
    b["dvc_lock"]["scan"]["deps"].insert(0, {"path": "another/folder", "hash": "md5", "md5": "x.dir"})
    assert diff_lineage(a, b) == [("dvc_lock.scan.deps.another/folder.hash", "<absent>", "md5"),
                                  ("dvc_lock.scan.deps.another/folder.md5", "<absent>", "x.dir")]


def test_each_part_of_a_record_has_its_group():
    assert classify("params.scan.bucket_step") == "params"
    assert classify("inputs.datasets.shapes.media_xxh3") == "data"
    assert classify("inputs.datasets.shapes.items") == "data"
    assert classify("inputs.datasets.shapes.captions_xxh3") == "captions"
    assert classify("base_model.weights.vae") == "weights"
    assert classify("git.commit") == "code"
    assert classify("dvc_lock.train.deps.diffusion_pipe/train.md5") == "code"
    assert classify("dvc_lock.train.cmd") == "code"
    assert classify("environment.packages.torch") == "environment"
    assert classify("inputs.encoded.xxh3_128") == "encodings"
    assert classify("inputs.store_keys.latent") == "encodings"
    assert classify("inputs.lora.md5") == "training"
    assert classify("training.eval_loss_end") == "training"
    assert classify("dvc_lock.scan.outs.data/manifest.parquet.md5") == "dvc.lock"


def test_identical_records():
    assert format_diff(diff_lineage(record(), record()), "A", "B") == "A and B: lineage records are identical\n"


def test_an_entry_one_record_lacks_is_no_code_change():
    a = record()
    b = copy.deepcopy(a)
    del b["dvc_lock"]["scan"]
    b["dvc_lock_omitted"] = {"scan": "its out data/manifest.parquet has md5 ..."}
    text = format_diff(diff_lineage(a, b), "A", "B")
    assert text.splitlines()[2] == "2 differences: derived: dvc.lock 2", text
    assert "  dvc_lock.scan: recorded (2 deps, 1 outs) -> <absent>" in text
