"""make_kv_cache builds the storage one KVCacheSpec describes (kvserve/kv/formats/__init__.py): a frozen spec, the
old argument list still accepted in its fields' order, an unknown format named."""
import dataclasses

import pytest
import torch

from kvserve.kv.formats import KVCacheSpec, make_kv_cache
from kvserve.planner.layout import KVLayout


def test_the_old_argument_list_builds_what_its_spec_builds():
    layout = KVLayout.uniform(2)
    old = make_kv_cache("int4", layout, 8, 4, 2, 16, torch.float32, "cpu", 3, compile=False)
    new = make_kv_cache(KVCacheSpec("int4", layout, 8, 4, 2, 16, torch.float32, "cpu", 3, compile=False))
    assert type(old) is type(new) and old.describe() == new.describe()
    assert old.staging_rows == new.staging_rows == 2 * 3  # two per sequence, for max_num_seqs sequences


def test_a_spec_is_frozen_and_an_unknown_format_is_named():
    spec = KVCacheSpec("int3", KVLayout.uniform(1), 8, 4, 2, 16, torch.float32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_blocks = 9
    with pytest.raises(ValueError, match="unknown KV cache format 'int3'"):
        make_kv_cache(spec)
