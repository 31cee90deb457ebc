"""MLA's latent storage: one vector per token and layer read back as both keys and values, its bytes the
planner's MLA figure, and blocks that copy, export and import whole (copy-on-write, the disk tier)."""
import pytest
import torch

from kvserve.kv.formats import KVCacheSpec, make_kv_cache
from kvserve.kv.formats.latent import LATENT_FORMATS, check_latent_settings
from kvserve.planner.layout import KVLayout
from kvserve.planner.kv_size import KV_DTYPES

BS, BLOCKS, LAYERS, RANK, ROPE = 4, 6, 2, 24, 8
# the largest error a read may carry, relative to the vector's largest element (its scale's reach)
TOLERANCE = {"float32": 0.0, "bfloat16": 2**-8, "float16": 2**-11, "int8": 0.5 / 127, "fp8_e4m3": 2**-4,
             "fp8_e5m2": 2**-3}


def latent_cache(fmt: str):
    return make_kv_cache(KVCacheSpec(fmt, KVLayout.uniform(LAYERS), BLOCKS, BS, 1, RANK + ROPE, torch.float32,
                                     latent_rope_dim=ROPE))


def written(cache, slots: torch.Tensor, layer: int = 1, seed: int = 0) -> torch.Tensor:
    vectors = torch.randn(len(slots), 1, RANK + ROPE, generator=torch.Generator().manual_seed(seed)) * 3
    cache.begin_step([], [], [slots])
    cache.write(layer, vectors, None)
    return vectors


@pytest.mark.parametrize("fmt", LATENT_FORMATS)
def test_a_read_returns_the_vectors_as_keys_and_values(fmt):
    cache = latent_cache(fmt)
    vectors = written(cache, torch.arange(2 * BS, 4 * BS))  # blocks 2 and 3
    keys, values = cache.gather(1, torch.tensor([[2, 3]]))
    assert keys.shape == (1, 2 * BS, 1, RANK + ROPE) and values is keys
    bound = TOLERANCE[fmt] * vectors.abs().amax(dim=-1, keepdim=True)
    assert ((keys[0] - vectors).abs() <= bound).all()
    assert (cache.gather(0, torch.tensor([[2, 3]]))[0] == 0).all()  # the other layer's row is untouched


@pytest.mark.parametrize("fmt", LATENT_FORMATS)
def test_bytes_are_the_planner_s_mla_figure(fmt):
    planner_name = {"fp8_e4m3": "fp8"}.get(fmt, fmt)
    per_vector = KV_DTYPES[planner_name].vector_bytes(RANK + ROPE, BS)
    assert latent_cache(fmt).nbytes == LAYERS * BLOCKS * BS * per_vector


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_blocks_copy_export_and_import_whole(fmt):
    cache = latent_cache(fmt)
    written(cache, torch.arange(0, BS), layer=0)
    written(cache, torch.arange(0, BS), layer=1, seed=1)
    cache.copy_blocks([(0, 4)])
    assert torch.equal(cache.gather(1, torch.tensor([[4]]))[0], cache.gather(1, torch.tensor([[0]]))[0])
    saved = cache.export_block(0)
    other = latent_cache(fmt)
    other.import_block(5, saved)
    for layer in range(LAYERS):
        assert torch.equal(other.gather(layer, torch.tensor([[5]]))[0], cache.gather(layer, torch.tensor([[0]]))[0])
    assert other.block_specs() == cache.block_specs()


def test_formats_mla_cannot_store_are_refused_naming_what_works():
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is not supported for MLA models; use auto, float32"):
        check_latent_settings("int4", "none")
    with pytest.raises(ValueError, match="'int4' is not supported for MLA models"):
        latent_cache("int4")
