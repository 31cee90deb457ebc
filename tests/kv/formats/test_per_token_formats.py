"""FP8 (E4M3, E5M2) and INT8 KV storage: what is written reads back within the format's error bound, also for
outlier-heavy vectors and values far beyond FP8's range (never inf or NaN), and scales travel with their blocks.
FP8 stores vectors rotated by an orthonormal Hadamard matrix and reads them back rotated."""
import pytest
import torch

from kvserve.kv.formats import KVCacheSpec, make_kv_cache
from kvserve.planner.layout import KVLayout

LAYERS, BLOCKS, BS, HEADS, DIM = 2, 4, 4, 3, 16
FORMATS = ["fp8_e4m3", "fp8_e5m2", "int8"]


def make(fmt: str):
    return make_kv_cache(KVCacheSpec(fmt, KVLayout.uniform(LAYERS), BLOCKS, BS, HEADS, DIM, torch.float32))


def write(cache, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    cache.begin_step([], [], [slots])
    cache.write(layer, k, v)


def samples() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(BLOCKS * BS, HEADS, DIM, generator=g)
    outliers = normal.clone()
    outliers[:, :, 3] *= 80  # one channel 80x the others, as real keys have
    huge = normal * 1e5  # far beyond FP8 E4M3's 448 and E5M2's 57,344
    tiny = normal * 1e-6
    return {"normal": normal, "outliers": outliers, "huge": huge, "tiny": tiny}


def error_bound(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """Largest rounding error per element: half a step of the vector's scale (int8) or of the fp8 grid."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    if fmt == "int8":
        return amax / 127 / 2 * 1.01 + 1e-12
    mantissa_bits, max_value, smallest_step = (3, 448.0, 2.0**-9) if fmt == "fp8_e4m3" else (2, 57344.0, 2.0**-16)
    scale = amax / max_value
    return (x.abs() * 2.0 ** -(mantissa_bits + 1) + scale * smallest_step) * 1.01 + 1e-12


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["normal", "outliers", "huge", "tiny"])
def test_round_trip_within_the_format_error_bound(fmt, kind):
    x = samples()[kind]
    cache = make(fmt)
    slots = torch.arange(BLOCKS * BS)
    write(cache, 1, slots, x, -x)
    k, v = cache.gather(1, torch.arange(BLOCKS)[None, :])
    k, v = k[0], v[0]
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    stored = x @ cache.rotation if cache.rotation is not None else x  # fp8 keeps (and reads back) rotated vectors
    bound = error_bound(fmt, stored)
    assert ((k - stored).abs() <= bound).all()
    assert ((v + stored).abs() <= bound).all()


def test_fp8_rotation_is_orthonormal_so_attention_can_undo_it():
    rotation = make("fp8_e4m3").rotation
    assert torch.allclose(rotation @ rotation.T, torch.eye(DIM), atol=1e-6)
    assert make("int8").rotation is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_blocks_copies_elements_and_scales(fmt):
    cache = make(fmt)
    x = samples()["outliers"]
    write(cache, 0, torch.arange(BS), x[:BS], x[:BS])  # block 0
    cache.copy_blocks([(0, 3)])
    k0, _ = cache.gather(0, torch.tensor([[0]]))
    k3, _ = cache.gather(0, torch.tensor([[3]]))
    assert torch.equal(k0, k3)
    other_layer, _ = cache.gather(1, torch.tensor([[3]]))
    assert not other_layer.any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_token_reads_the_same_whatever_else_was_written(fmt):
    """Per-token scales: a slot's bytes depend only on its own vector (what prefix sharing relies on)."""
    x = samples()["normal"]
    alone, together = make(fmt), make(fmt)
    write(alone, 0, torch.tensor([5]), x[5:6], x[5:6])
    write(together, 0, torch.arange(BLOCKS * BS), x * torch.linspace(0.1, 50, BLOCKS * BS)[:, None, None], x)
    write(together, 0, torch.tensor([5]), x[5:6], x[5:6])
    table = torch.tensor([[1]])  # slot 5 is block 1 offset 1
    assert torch.equal(alone.gather(0, table)[0][0, 1], together.gather(0, table)[0][0, 1])


@pytest.mark.parametrize("fmt, stored_bytes", [("fp8_e4m3", 1), ("fp8_e5m2", 1), ("int8", 1)])
def test_storage_is_one_byte_per_element_plus_an_fp16_scale_per_vector(fmt, stored_bytes):
    vectors = 2 * LAYERS * BLOCKS * BS * HEADS
    assert make(fmt).nbytes == vectors * (DIM * stored_bytes + 2)


@pytest.mark.parametrize("fmt, fp8_dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_reads_every_code_as_pytorchs_own_cast_does(fmt, fp8_dtype):
    cache = make(fmt)
    codes = torch.arange(256, dtype=torch.uint8)
    finite = torch.isfinite(codes.view(fp8_dtype).float())  # the NaN/inf codes are never written (values saturate)
    codes = codes[finite].view(-1, 1, 1).expand(-1, HEADS, DIM).contiguous()  # signs, subnormals, extremes
    scale = torch.full(codes.shape[:-1], 0.75, dtype=torch.bfloat16)
    expected = codes.view(fp8_dtype).float() * 0.75
    assert torch.equal(cache.dequantize(codes, scale), expected)
