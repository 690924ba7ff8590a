"""The pack write protocol, step by step and deterministically: a temp file, fsynced, renamed to its hash, the
directory fsynced, the sidecar last. A failure injected at each step (a crash there, as far as the files on disk
go) leaves nothing a reader can see, and a reader looking at the store between any two steps never sees an entry
it cannot read, nor misses it for good once it is published.

The faults are raised from os.fsync / os.replace / safetensors' save_file as the pack writer calls them: no
SIGKILL has to land in a window by luck (tests/store/test_processes.py kills real writers as well).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from diffusion_pipe.store import Store, pack
from tests.store.conftest import assert_same, make_entry


@dataclass
class Event:
    """One filesystem step of a writer: ('write', temp), ('fsync', path), ('replace', src, dst)."""

    kind: str
    path: str
    dst: str = ""

    @property
    def name(self) -> str:
        return Path(self.dst or self.path).name


@dataclass
class Steps:
    """Records the writer's fsync / replace / pack-write calls in order; `at(event)` runs before each one
    (a reader's look at the store, or an injected failure)."""

    root: Path
    events: list[Event] = field(default_factory=list)
    at: Callable[[Event], None] = lambda event: None

    def seen(self, event: Event) -> None:
        self.events.append(event)
        self.at(event)

    def index(self, kind: str, suffix: str, *, src_hidden: bool | None = None) -> int:
        """Position of the first event of `kind` whose (destination) name ends with `suffix`."""
        for i, e in enumerate(self.events):
            if e.kind == kind and e.name.endswith(suffix) and (
                    src_hidden is None or Path(e.path).name.startswith(".") == src_hidden):
                return i
        raise AssertionError(f"no {kind} of a *{suffix} file in {[(e.kind, e.name) for e in self.events]}")


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Steps:
    recorder = Steps(tmp_path / "store")
    real_fsync, real_replace, real_save = os.fsync, os.replace, pack.save_file

    def fsync(fd: int) -> None:
        recorder.seen(Event("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst, *args, **kwargs) -> None:
        recorder.seen(Event("replace", os.fspath(src), os.fspath(dst)))
        real_replace(src, dst, *args, **kwargs)

    def save_file(tensors, filename, *args, **kwargs) -> None:
        recorder.seen(Event("write", os.fspath(filename)))
        real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(pack, "save_file", save_file)
    return recorder


def published(root: Path) -> list[str]:
    """The names a reader can stumble on in the latent family: everything but hidden temp files."""
    directory = root / "latent"
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) if directory.is_dir() else []


def test_the_steps_come_in_the_protocols_order(steps: Steps) -> None:
    store = Store(steps.root)
    writer = store.writer("latent")
    writer.add("k", make_entry(1))
    pack_id = writer.flush()
    assert pack_id is not None
    write = steps.index("write", "")
    temp = steps.events[write].path
    assert Path(temp).name.startswith(".") and Path(temp).parent == steps.root / "latent"  # never in place
    fsync_pack = next(i for i, e in enumerate(steps.events) if e.kind == "fsync" and e.path == temp)
    rename_pack = steps.index("replace", pack.PACK_SUFFIX)
    assert steps.events[rename_pack].path == temp and steps.events[rename_pack].name == pack_id + ".safetensors"
    fsync_dir = next(i for i, e in enumerate(steps.events)
                     if e.kind == "fsync" and e.path == str(steps.root / "latent") and i > rename_pack)
    rename_sidecar = steps.index("replace", pack.SIDECAR_SUFFIX)
    sidecar_temp = steps.events[rename_sidecar].path
    fsync_sidecar = next(i for i, e in enumerate(steps.events) if e.kind == "fsync" and e.path == sidecar_temp)
    assert write < fsync_pack < rename_pack < fsync_dir < rename_sidecar
    assert rename_pack < fsync_sidecar < rename_sidecar  # the sidecar is written (not only renamed) last
    assert published(steps.root) == sorted([pack_id + ".json", pack_id + ".safetensors"])


def test_a_reader_between_any_two_steps_sees_nothing_or_the_whole_entry(steps: Steps) -> None:
    writer_store = Store(steps.root)
    early = Store(steps.root)  # a long-lived reader (a training run) that looks at every step
    looks: list[tuple[str, bool]] = []

    def look(event: Event) -> None:
        early.refresh()
        fresh = Store(steps.root)
        for reader in (early, fresh):
            visible = reader.contains("latent", "k")
            if visible:
                assert_same(reader.get("latent", "k"), make_entry(1))
            assert reader.verify() == [], (event, reader.verify())
        looks.append((f"{event.kind} {event.name}", fresh.contains("latent", "k")))

    steps.at = look
    with writer_store.writer("latent") as writer:
        writer.add("k", make_entry(1))
    # each look runs before its step: up to the sidecar's rename nothing is visible, after it the entry is
    last = max(i for i, (step, _) in enumerate(looks) if step.startswith("replace") and step.endswith(".json"))
    assert last >= 4 and [visible for _, visible in looks] == [i > last for i in range(len(looks))], looks
    steps.at = lambda event: None
    early.refresh()  # a reader that looked in every window still finds the entry once it is published
    assert_same(early.get("latent", "k"), make_entry(1))
    assert_same(Store(steps.root).get("latent", "k"), make_entry(1))


def _fail_at(step: str) -> Callable[[Event], None]:
    """A failure (an OSError, as a full disk or a crash of the process would end the write) at one step."""
    def at(event: Event) -> None:
        name, hidden = event.name, Path(event.path).name.startswith(".")
        hit = {
            "write pack": event.kind == "write",
            "fsync pack": event.kind == "fsync" and hidden and pack.TEMP_PREFIX in name,
            "rename pack": event.kind == "replace" and name.endswith(pack.PACK_SUFFIX),
            "fsync directory": event.kind == "fsync" and Path(event.path).is_dir(),
            "write sidecar": event.kind == "fsync" and hidden and name.endswith(pack.TEMP_SUFFIX)
            and pack.TEMP_PREFIX not in name,
            "rename sidecar": event.kind == "replace" and name.endswith(pack.SIDECAR_SUFFIX),
        }[step]
        if hit:
            raise OSError(5, f"injected failure at {step}")  # EIO: a full disk (ENOSPC) is a StoreError naming the store
    return at


STEPS_BEFORE_RENAME = ["write pack", "fsync pack", "rename pack"]
STEPS_AFTER_RENAME = ["fsync directory", "write sidecar", "rename sidecar"]


@pytest.mark.parametrize("step", STEPS_BEFORE_RENAME + STEPS_AFTER_RENAME)
def test_a_failure_at_each_step_publishes_nothing_and_a_rerun_publishes_it(steps: Steps, step: str) -> None:
    store = Store(steps.root)
    with store.writer("latent") as first:
        first.add("kept", make_entry(0))  # published before the fault: must stay readable
    reader = Store(steps.root)
    assert reader.contains("latent", "kept")

    steps.at = _fail_at(step)
    writer = store.writer("latent")
    writer.add("k", make_entry(1))
    with pytest.raises(OSError, match=f"injected failure at {step}"):
        writer.flush()
    steps.at = lambda event: None

    for view in (store, reader, Store(steps.root)):
        view.refresh()
        assert view.missing("latent", ["kept", "k"]) == ["k"], view
        assert view.verify() == []
        assert_same(view.get("latent", "kept"), make_entry(0))
    names = published(steps.root)
    orphans = [n for n in names if n.endswith(".safetensors") and n[:-12] + ".json" not in names]
    assert not [n for n in names if n.endswith(".json") and n[:-5] + ".safetensors" not in names]
    if step in STEPS_BEFORE_RENAME:
        assert orphans == []  # the temp file was the only trace, and it is gone
        assert not [p for p in (steps.root / "latent").iterdir() if p.name.startswith(pack.TEMP_PREFIX)]
    else:
        assert len(orphans) == 1  # a whole pack without its sidecar: invisible, as the protocol says

    with store.writer("latent") as again:  # the rerun of an encode computes it again and publishes it
        again.add("k", make_entry(1))
    for view in (reader, Store(steps.root)):
        view.refresh()
        assert_same(view.get("latent", "k"), make_entry(1))
        assert view.verify() == []
