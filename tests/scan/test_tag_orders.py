"""Tag shuffling (scan.datasets[].shuffle_tags): a caption's tag orders, drawn by a pure function of its text,
listed in the manifest for encode to embed and train to pick from; and the dataset's loss weight beside them."""

from __future__ import annotations

from itertools import permutations
from pathlib import Path

import pytest

from diffusion_pipe.config import ConfigError, from_dict
from diffusion_pipe.params import ScanParams
from diffusion_pipe.scan.captions import tag_orders
from tests.scan.conftest import make_image, params_for
from tests.scan.test_scan import by_path, run

TAGS = "sks, red, circle, white background, photo, centered, flat, vector art"


def split(order: str) -> list[str]:
    return order.split(", ")


def test_orders_keep_the_kept_tags_in_front_and_every_tag_once():
    orders = tag_orders(TAGS, 6, 2, ",")
    assert len(orders) == 6 == len(set(orders))
    for order in orders:
        tags = split(order)
        assert tags[:2] == ["sks", "red"] and sorted(tags) == sorted(split(TAGS))
    assert len({tuple(split(o)[2:]) for o in orders}) == 6  # the rest really is reordered
    assert tag_orders(TAGS, 6, 2, ",") == orders  # pure: the same orders on every run and machine
    assert any(split(o)[0] != "sks" for o in tag_orders(TAGS, 6, 0, ","))  # keep_tags 0: every tag moves


def test_more_orders_keep_the_orders_already_drawn():
    """Raising shuffle_tags embeds only the new orders; each caption draws its own (seeded by its text)."""
    assert tag_orders(TAGS, 12, 1, ",")[:4] == tag_orders(TAGS, 4, 1, ",")
    other = TAGS.replace("sks", "xyz")
    mine = [tuple(split(TAGS).index(t) for t in split(o)) for o in tag_orders(TAGS, 4, 0, ",")]
    theirs = [tuple(split(other).index(t) for t in split(o)) for o in tag_orders(other, 4, 0, ",")]
    assert mine != theirs


def test_orders_are_rejoined_as_written_and_listed_once():
    assert set(tag_orders("a;b;c", 30, 0, ";")) == {";".join(p) for p in permutations("abc")}
    assert set(tag_orders("a; b ;c", 30, 1, ";")) == {"a; b; c", "a; c; b"}  # a space after a separator
    assert tag_orders("a red circle", 5, 0, ",") == ("a red circle",)  # one tag: one order
    assert tag_orders("a, , b", 1, 2, ",") == ("a, b",)  # blank tags are dropped


def test_the_scan_lists_each_captions_orders_behind_its_prefix(tmp_path: Path, ds: Path) -> None:
    make_image(ds / "a.png", caption="red, circle, white background, photo")
    make_image(ds / "b.png", caption="a blue square", color=(0, 0, 200))
    rows, report, _ = run(tmp_path, params_for(ds, shuffle_tags=3, keep_tags=1, caption_prefix="sks, ",
                                               loss_weight=2.5))
    r = by_path(rows)
    assert r["a.png"]["caption"] == "sks, red, circle, white background, photo"  # eval trains the caption as written
    orders = r["a.png"]["caption_variants"]
    assert len(orders) == 3
    assert orders == ["sks, " + o for o in tag_orders("red, circle, white background, photo", 3, 1, ",")]
    assert all(o.startswith("sks, red, ") for o in orders)
    assert r["b.png"]["caption_variants"] == ["sks, a blue square"]
    assert report["tag_orders"] == 4 and report["datasets"]["ds"]["loss_weight"] == 2.5
    assert {row["loss_weight"] for row in rows} == {2.5}
    assert not report["warnings"]

    plain, report, _ = run(tmp_path, params_for(ds))
    assert [row["caption_variants"] for row in plain] == [[], []] and report["tag_orders"] == 0
    assert {row["loss_weight"] for row in plain} == {1.0}


def test_a_separator_no_caption_has_is_warned(tmp_path: Path, ds: Path) -> None:
    make_image(ds / "a.png", caption="red, circle, photo")
    _, report, _ = run(tmp_path, params_for(ds, shuffle_tags=4, tag_separator=";"))
    assert report["tag_orders"] == 1
    assert any("shuffle_tags is 4, but no caption has more than keep_tags (0) + 1 tags separated by ';'" in w
               for w in report["warnings"])


@pytest.mark.parametrize("dataset, error", [
    ({"keep_tags": 1}, r"keep_tags and tag_separator apply to tag shuffling, but shuffle_tags is 0"),
    ({"shuffle_tags": 2, "tag_separator": " "}, r"tag_separator ' ' is blank"),
    ({"loss_weight": 0}, r"scan.datasets\[0\].loss_weight: 0 is out of range \(0, 1000\]"),
    ({"shuffle_tags": -1}, r"scan.datasets\[0\].shuffle_tags: -1 is out of range"),
])
def test_bad_shuffle_and_weight_params_name_the_param(dataset: dict, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        from_dict(ScanParams, {"datasets": [{"path": "d", **dataset}]}, "scan")
