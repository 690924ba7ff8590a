"""The deterministic micro-batch order: buckets, repeats, data-parallel shares, positions."""

import torch

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


def test_each_data_parallel_rank_draws_its_own_noise_tag_orders_and_caption_dropout(tmp_path):
    """Every random stream of a micro-batch (noise and timesteps, tag order, caption dropout) is drawn for the
    rank's own data-parallel index: rank 0's draws on every rank would drop the same positions' captions and
    correlate the noise across ranks. The same rank draws the same again (resume)."""
    from diffusion_pipe.config import from_dict
    from diffusion_pipe.models import load_adapter
    from diffusion_pipe.params import ModelParams
    from diffusion_pipe.store import Store
    from diffusion_pipe.train.caption_dropout import CaptionDropout
    from diffusion_pipe.train.data import MicroBatches
    from tests.conftest import REPO

    adapter = load_adapter(from_dict(ModelParams, {"family": "flux", "path": str(REPO / "examples/flux-tiny/model")},
                                     "model"))
    data = [Row(f"s{i}", "64x64x1", 1, f"l{i}", f"t{i}", variant_keys=(f"t{i}a", f"t{i}b", f"t{i}c"))
            for i in range(16)]

    def loader(dp_rank: int, dropout: float) -> MicroBatches:
        return MicroBatches(data, Store(tmp_path), adapter, micro_batch_size=2, seed=0, dp_rank=dp_rank,
                            dp_world=2, timestep_sampling="uniform", flow_shift=1.0, guidance=1.0,
                            caption_dropout=CaptionDropout(dropout, 0, "EMPTY") if dropout else None)

    def draws(dp_rank: int) -> tuple[list, list, list]:
        positions = range(24)
        dropped, kept = loader(dp_rank, 0.5), loader(dp_rank, 0.0)
        return ([[k == "EMPTY" for k in dropped.text_keys_at(p)] for p in positions],  # which samples dropped
                [[k[-1] for k in kept.text_keys_at(p)] for p in positions],  # which tag order each took
                [torch.rand(4, generator=kept.generator_at(p)).tolist() for p in positions])

    rank0, rank1 = draws(0), draws(1)
    assert draws(1) == rank1
    dropped, orders, noise = (a != b for a, b in zip(rank0, rank1))
    assert dropped and orders and noise
    assert 0.3 < sum(sum(d) for d in rank1[0]) / 48 < 0.7


def test_noise_offsets_come_from_each_micro_batchs_own_generator(tmp_path):
    """train.noise_offset's per-channel offsets are drawn from the micro-batch's generator, like its noise: a
    fresh default generator would give the same offsets to every micro-batch of every run, whatever the seed."""
    from diffusion_pipe.config import from_dict
    from diffusion_pipe.models import load_adapter
    from diffusion_pipe.params import ModelParams
    from diffusion_pipe.store import Store
    from diffusion_pipe.train.data import MicroBatches
    from diffusion_pipe.train.objectives import offset_noise
    from tests.conftest import REPO

    adapter = load_adapter(from_dict(ModelParams, {"family": "flux", "path": str(REPO / "examples/flux-tiny/model")},
                                     "model"))
    loader = MicroBatches(rows(4, 0), Store(tmp_path), adapter, micro_batch_size=1, seed=3, dp_rank=0, dp_world=1,
                          timestep_sampling="uniform", flow_shift=1.0, guidance=1.0, noise_offset=0.1)
    shape = torch.Size((1, 4, 8, 8))
    offsets = []
    for position in range(3):
        generator = loader.generator_at(position)
        expected = offset_noise(torch.randn(shape, generator=generator), 0.1, generator)
        noise = loader.draw_noise(shape, loader.generator_at(position))
        assert torch.equal(noise, expected)
        offsets.append(noise.mean(dim=(2, 3)))
    assert not torch.allclose(offsets[0], offsets[1]) and not torch.allclose(offsets[1], offsets[2])
