"""`lineage --verify` and the record, fast: a three-image dataset scanned for real, an encoded table whose keys a
real store holds, a LoRA file and an exported file, recorded by `export_lineage` (no training, no DVC run). Each
input changed on its own must be named by the check that owns it, and by no other."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from diffusion_pipe.hashing import hash_file
from diffusion_pipe.lineage.record import export_lineage, git_state
from diffusion_pipe.lineage.verify import format_checks, verify_lineage
from diffusion_pipe.params import load_params
from diffusion_pipe.scan.scanner import scan_to_files
from diffusion_pipe.store import PackWriter, Store

CAPTIONS = {"red": "a red square", "green": "a green square", "blue": "a blue square"}
LORA = Path("runs/train/lora.safetensors")
MANIFEST = Path("data/manifest.parquet")
ENCODED = Path("data/encoded.parquet")
EXPORTED = "items-lora.comfyui.safetensors"


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture
def small(tmp_path, tiny_flux_dir, monkeypatch) -> tuple[Path, Store, dict]:
    """(repo, store, export record) of a scanned three-image dataset, committed to git."""
    repo = tmp_path / "repo"
    (repo / "items").mkdir(parents=True)
    for name, caption in CAPTIONS.items():
        Image.new("RGB", (64, 64), name).save(repo / "items" / f"{name}.png")
        (repo / "items" / f"{name}.txt").write_text(caption)
    (repo / "params.yaml").write_text(
        f"model:\n  family: flux\n  path: {tiny_flux_dir}\n  dtype: float32\n"
        "scan:\n  datasets:\n    - path: items\n      resolutions: [64]\n  bucket_step: 16\n  workers: 1\n")
    monkeypatch.chdir(repo)
    params = load_params(repo / "params.yaml")
    scan_to_files(params.scan, MANIFEST, Path("reports/scan.json"), None)
    keys = sorted(pq.read_table(MANIFEST).column("content_hash").to_pylist())
    pq.write_table(pa.table({"sample_id": keys, "latent_key": [f"l{k}" for k in keys],
                             "text_key": [f"t{k}" for k in keys]}), ENCODED)
    store = Store(tmp_path / "store")
    for family, prefix in (("latent", "l"), ("text", "t")):
        with PackWriter(store, family) as writer:
            for i, key in enumerate(keys):
                writer.add(f"{prefix}{key}", {"x": torch.full((2,), float(i))})
    LORA.parent.mkdir(parents=True)
    save_file({"a.lora_A.weight": torch.ones(2, 2)}, str(LORA))
    (repo / "artifacts").mkdir()
    save_file({"a.lora_down.weight": torch.ones(2, 2)}, str(repo / "artifacts" / EXPORTED))
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "data")
    record = export_lineage(params, repo, LORA, MANIFEST, ENCODED, None, None)
    record["files"] = {EXPORTED: hash_file(repo / "artifacts" / EXPORTED)}
    return repo, store, record


def verify(repo: Path, store: Store, record: dict) -> str:
    return format_checks(verify_lineage(record, repo, store, lineage_dir=repo / "artifacts"))


def test_fresh_record_verifies_every_item(small):
    repo, store, record = small
    out = verify(repo, store, record)
    for item in ("dataset items: 3 items match", "manifest data/manifest.parquet",
                 "encoded table data/encoded.parquet", "trained LoRA runs/train/lora.safetensors", "store key set",
                 "store latent entries: 3 present", "store text entries: 3 present",
                 "base model component 'transformer'", f"exported file {EXPORTED}"):
        assert f"ok     {item}" in out, out
    assert out.endswith("all 12 items match\n")


def _retrain_lora(repo: Path, record: dict) -> None:
    save_file({"a.lora_A.weight": torch.zeros(2, 2)}, str(repo / LORA))


def _edit_export(repo: Path, record: dict) -> None:
    save_file({"a.lora_down.weight": torch.zeros(2, 2)}, str(repo / "artifacts" / EXPORTED))


def _rewrite_encoded(repo: Path, record: dict) -> None:
    table = pq.read_table(repo / ENCODED)
    pq.write_table(table.set_column(0, "sample_id", pa.array(["x", "y", "z"])), repo / ENCODED)


def _record_other_keys(repo: Path, record: dict) -> None:
    record["inputs"]["store_keys"]["xxh3_128"] = "0" * 32


# mutation -> the one item that must drift, and what its line must say
MUTATIONS = {
    "lora": (_retrain_lora, "DRIFT  trained LoRA runs/train/lora.safetensors: "),
    "export": (_edit_export, f"DRIFT  exported file {EXPORTED}: "),
    "encoded": (_rewrite_encoded, "DRIFT  encoded table data/encoded.parquet: "),
    "keys": (_record_other_keys, "DRIFT  store key set: the keys of data/encoded.parquet hash to "),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_each_changed_input_is_named_by_its_own_check(small, name):
    repo, store, record = small
    mutate, line = MUTATIONS[name]
    mutate(repo, record)
    out = verify(repo, store, record)
    assert line in out, out
    assert out.count("DRIFT") == 1 and "1 of 12 items drifted" in out


def test_data_drift_names_the_changed_files(small):
    repo, store, record = small
    (repo / "items/green.txt").write_text("a  lime\nsquare")
    Image.new("RGB", (64, 64), "yellow").save(repo / "items/red.png")
    Image.new("RGB", (64, 64), "white").save(repo / "items/white.png")
    (repo / "items/white.txt").write_text("a white square")
    (repo / "items/blue.png").unlink()
    out = verify(repo, store, record)
    assert ("DRIFT  dataset items: 4 change(s) since this was trained: blue.png: removed; "
            "green.txt: caption 'a green square' -> 'a lime square'; red.png: media changed; white.png: added; "
            "re-run `dvc repro`") in out, out
    assert "ok     manifest data/manifest.parquet" in out  # the scan has not re-run: only the data check sees it


def test_data_drift_without_the_recorded_manifest_says_what_changed(small):
    repo, store, record = small
    (repo / "items/green.txt").write_text("a lime square")
    scan_to_files(load_params(repo / "params.yaml").scan, MANIFEST, Path("reports/scan.json"), None)
    out = verify(repo, store, record)
    assert ("DRIFT  dataset items: its captions changed since this was trained (the manifest it was built from is "
            "not at hand to name the files: `dvc fetch` it)") in out, out


def test_record_holds_the_git_state(small):
    repo, _, record = small
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert record["git"] == {"commit": head, "dirty": False}
    (repo / "items/red.txt").write_text("edited")
    assert git_state(repo) == {"commit": head, "dirty": True}


def test_record_holds_dataset_hashes_apart_for_media_and_captions(small, monkeypatch):
    repo, _, record = small
    datasets = record["inputs"]["datasets"]
    assert set(datasets) == {"items"} and datasets["items"]["items"] == 3 and datasets["items"]["path"] == "items"
    (repo / "items/red.txt").write_text("a scarlet square")
    params = load_params(repo / "params.yaml")
    scan_to_files(params.scan, MANIFEST, Path("reports/scan.json"), None)
    again = export_lineage(params, repo, LORA, MANIFEST, ENCODED, None, None)["inputs"]["datasets"]["items"]
    assert again["captions_xxh3"] != datasets["items"]["captions_xxh3"]
    assert again["media_xxh3"] == datasets["items"]["media_xxh3"]
    assert json.dumps(again)  # plain JSON values


def _lock(stages: dict[str, dict[str, dict[str, str]]]) -> str:
    """dvc.lock text: stage -> {"deps"|"outs": {path: md5}}."""
    import yaml

    return yaml.safe_dump({"schema": "2.0", "stages": {
        name: {"cmd": f"python -m stages.{name}",
               **{kind: [{"path": p, "hash": "md5", "md5": m} for p, m in items.items()]
                  for kind, items in entry.items()}}
        for name, entry in stages.items()}})


def test_record_keeps_only_the_upstream_dvc_lock_entries_that_describe_its_inputs(small):
    from diffusion_pipe.lineage.record import checkpoint_lineage, encoded_store_keys, md5_file

    repo, store, _ = small
    md5 = {str(p): md5_file(repo / p) for p in (MANIFEST, ENCODED, LORA)}
    (repo / "dvc.lock").write_text(_lock({
        "scan": {"outs": {str(MANIFEST): md5[str(MANIFEST)]}},
        "encode": {"deps": {str(MANIFEST): md5[str(MANIFEST)]}, "outs": {str(ENCODED): "0" * 32}},  # run outside DVC
        "train": {"deps": {str(ENCODED): md5[str(ENCODED)]}, "outs": {str(LORA): md5[str(LORA)]}},
        "export": {"deps": {str(ENCODED): "1" * 32}},  # the previous export's entry
    }))
    params = load_params(repo / "params.yaml")
    record = export_lineage(params, repo, LORA, MANIFEST, ENCODED, None, None)
    assert set(record["dvc_lock"]) == {"scan", "train"}
    assert record["dvc_lock_omitted"] == {"encode": f"its out {ENCODED} has md5 {'0' * 32}, the file this was "
                                                    f"built from has md5 {md5[str(ENCODED)]}"}
    checkpoint = checkpoint_lineage(params, repo, ENCODED, encoded_store_keys(ENCODED), None)
    assert set(checkpoint["dvc_lock"]) == {"scan"}  # train is the stage writing it, export is downstream
    out = verify(repo, store, record)
    assert "ok     dvc.lock entries: scan, train describe the recorded inputs" in out, out


def test_verify_flags_dvc_lock_entries_of_other_inputs(small):
    repo, store, record = small
    record["dvc_lock"] = {"export": {"deps": [{"path": str(ENCODED), "md5": "1" * 32}]},
                          "encode": {"outs": [{"path": str(ENCODED), "md5": "0" * 32}]}}
    out = verify(repo, store, record)
    assert ("DRIFT  dvc.lock entries: stage 'export' is not upstream of this export (its entry was left by an "
            "earlier run); stage 'encode': its out data/encoded.parquet has md5 00000000000000000000000000000000, "
            "the file this was built from has md5 ") in out, out
    assert out.count("DRIFT") == 1


def test_scan_params_this_version_cannot_read_are_one_drifted_item(small):
    repo, store, record = small
    record["params"]["scan"]["bucket_stepp"] = 16
    out = verify(repo, store, record)
    assert ("DRIFT  dataset items: cannot scan it again with the recorded scan params: scan.bucket_stepp: unknown "
            "key") in out, out
    assert out.count("DRIFT") == 1


def test_a_record_whose_lora_was_trained_with_other_params_drifts_on_those_keys(small):
    """params.yaml edited while train ran: the export's params (and dvc.lock) say one lr, its LoRA's own record
    another. Verify names the key, with both values, and nothing else drifts."""
    import copy

    repo, store, record = small
    record["trained_lora"] = {"params": copy.deepcopy(record["params"])}
    assert "trained params" not in verify(repo, store, record).replace("ok     trained params", "")
    record["trained_lora"]["params"]["train"]["learning_rate"] = 0.002
    record["trained_lora"]["params"]["scan"]["workers"] = 7  # not a key train reads: no drift
    out = verify(repo, store, record)
    assert f"DRIFT  trained params: the LoRA was trained with other params than this record (and dvc.lock) state: " \
           f"train.learning_rate: 0.002 -> {record['params']['train']['learning_rate']!r} (trained -> recorded" in out, out
    assert out.count("DRIFT") == 1, out
    (repo / "dvc.yaml").write_text("stages:\n  train:\n    cmd: x\n    params: [model, train.steps]\n")
    assert "ok     trained params" in verify(repo, store, record)  # dvc.yaml says which keys train reads


def test_a_secret_in_the_dvc_lock_never_reaches_the_record(small):
    """DVC copies encode.remote into dvc.lock; the record's copy of the lock entries is redacted."""
    import yaml

    repo, store, _ = small
    remote = "s3://AKIA:secr+et@bucket/store"
    (repo / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {"encode": {
        "cmd": "python -m stages.encode", "params": {"params.yaml": {"encode.remote": remote}}}}}))
    record = export_lineage(load_params(repo / "params.yaml"), repo, LORA, MANIFEST, ENCODED, None, None)
    assert record["dvc_lock"]["encode"]["params"]["params.yaml"]["encode.remote"] == "s3://AKIA:***@bucket/store"
    assert "cr+et" not in json.dumps(record)
