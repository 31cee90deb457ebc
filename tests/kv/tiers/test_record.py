"""The disk tier's record format: a record is used only if it is exactly the block asked for (its parent, its
tokens, its tensors' dtypes and shapes, its model)."""
import pytest
import torch

from kvserve.kv.tiers.record import (BlockRecord, RecordRejected, decode_record, encode_record, max_record_bytes,
                                     record_metadata)
from tests.kv.tiers.disk_records import BS, SPECS, chain, fingerprint, record, store, written


def test_a_record_is_used_only_for_its_own_parent_tokens_and_model(tmp_path):
    keys, tokens = chain(2)
    s = store(tmp_path)
    written(s, record(1, keys, tokens))
    data = s.path(keys[1]).read_bytes()
    with pytest.raises(RecordRejected, match="token_ids") as wrong_tokens:
        decode_record(data, s.fingerprint, keys[1], keys[0], [0] * BS, SPECS)
    with pytest.raises(RecordRejected, match="parent") as wrong_parent:
        decode_record(data, s.fingerprint, keys[1], keys[1], tokens[1], SPECS)
    with pytest.raises(RecordRejected, match="dtypes or shapes"):
        decode_record(data, s.fingerprint, keys[1], keys[0], tokens[1], [(torch.uint8, (4096,))])
    with pytest.raises(RecordRejected, match="another model") as other_model:
        decode_record(data, fingerprint("model-b")["digest"], keys[1], keys[0], tokens[1], SPECS)
    assert (wrong_tokens.value.kind, wrong_parent.value.kind, other_model.value.kind) == ("mismatch",) * 2 + (
        "foreign",)
    assert record_metadata(data)["token_ids"] == str(tokens[1])


def test_no_record_is_larger_than_the_bound_a_read_holds_it_to():
    """The largest header a block can carry (the largest token ids, a hash for a parent, many tensors) fits."""
    keys, _ = chain(2)
    specs = [(dtype, (3, 5)) for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.uint8)] * 16
    tensors = [torch.zeros(shape, dtype=dtype) for dtype, shape in specs]
    for num_tokens in (1, 16, 256):
        token_ids = tuple([2**63 - 1] * num_tokens)
        data = encode_record("f" * 64, BlockRecord(keys[1], keys[0], token_ids, tensors))
        assert len(data) <= max_record_bytes(specs, num_tokens)
