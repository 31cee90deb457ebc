"""The disk tier's record format: a record is used only if it is exactly the block asked for (its parent, its
tokens, its tensors' dtypes and shapes, its model)."""
import pytest
import torch

from kvserve.kv.tiers.record import RecordRejected, decode_record, record_metadata
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
