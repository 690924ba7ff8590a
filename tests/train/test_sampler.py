"""The deterministic micro-batch order: buckets, repeats, data-parallel shares, positions."""

from diffusion_pipe.train.data import Row, epoch_order


def rows(n_square: int, n_wide: int, repeats: int = 1) -> list[Row]:
    return ([Row(f"s{i}", "64x64x1", repeats, f"l{i}", f"t{i}") for i in range(n_square)]
            + [Row(f"w{i}", "96x64x1", repeats, f"lw{i}", f"tw{i}") for i in range(n_wide)])


def test_batches_hold_one_bucket_and_are_full():
    data = rows(7, 5)
    for batch in epoch_order(data, 2, seed=0, epoch=0):
        assert len(batch) == 2
        assert len({data[i].bucket for i in batch}) == 1
    # 7 // 2 + 5 // 2 full micro-batches; the odd ones are dropped
    assert len(epoch_order(data, 2, seed=0, epoch=0)) == 3 + 2


def test_order_depends_only_on_seed_and_epoch():
    data = rows(10, 6)
    assert epoch_order(data, 2, 0, 0) == epoch_order(data, 2, 0, 0)
    assert epoch_order(data, 2, 0, 0) != epoch_order(data, 2, 0, 1)
    assert epoch_order(data, 2, 0, 0) != epoch_order(data, 2, 1, 0)


def test_repeats_multiply_each_row():
    data = rows(4, 0, repeats=3)
    seen = [i for b in epoch_order(data, 1, 0, 0) for i in b]
    assert sorted(seen) == sorted(list(range(4)) * 3)
