"""The disk tier's directory: created 0700; refused at start when another user owns it or group or others may
write it (as ssh refuses such a ~/.ssh), with the owner, the mode and the fix in the error; the start-up scan
counts only regular files and follows no symlink."""
import os

import pytest

from kvserve.kv.tiers.directory import scan_records
from tests.kv.tiers.disk_records import BS, chain, record, store, written

OTHER_UID = 4242  # no one's: the directory is someone else's (root, which the tests run as, may chown to it)


def test_a_directory_the_tier_creates_is_owner_only(tmp_path):
    s = store(tmp_path / "new" / "kv")
    assert (tmp_path / "new" / "kv").stat().st_mode & 0o777 == 0o700
    assert s.directory.stat().st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory someone else's takes root")
def test_a_world_writable_directory_of_another_user_is_refused(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, OTHER_UID, OTHER_UID)
    foreign.chmod(0o777)
    with pytest.raises(ValueError) as refused:
        store(foreign)
    message = str(refused.value)
    assert f"--kv-disk-cache {foreign}:" in message and f"owner uid {OTHER_UID}" in message
    assert "mode 0777" in message and f"chmod 700 {foreign}" in message and "a directory you own" in message
    assert list(foreign.iterdir()) == []  # nothing written there


def test_a_directory_group_or_others_may_write_is_refused_even_if_ours(tmp_path):
    for mode in (0o770, 0o707, 0o1777):
        (tmp_path / "kv").mkdir()
        (tmp_path / "kv").chmod(mode)
        with pytest.raises(ValueError, match=f"writable by group or others .*mode {mode:04o}.*chmod 700"):
            store(tmp_path / "kv")
        (tmp_path / "kv").rmdir()
    (tmp_path / "kv").mkdir(mode=0o755)  # others may read, not write: trusted
    (tmp_path / "kv").chmod(0o755)
    store(tmp_path / "kv")


def test_a_model_directory_made_writable_by_others_is_refused(tmp_path):
    s = store(tmp_path)
    s.directory.chmod(0o777)
    with pytest.raises(ValueError, match=f"{s.directory} is writable by group or others"):
        store(tmp_path)


def test_the_scan_counts_regular_files_only_and_follows_no_symlink(tmp_path):
    keys, tokens = chain(2)
    s = store(tmp_path / "kv")
    written(s, record(0, keys, tokens), record(1, keys, tokens))
    big = tmp_path / "big"
    with open(big, "wb") as file:
        file.truncate(1 << 40)
    (s.directory / ("a" * 64 + ".kvblock")).symlink_to(big)
    (s.directory / ("b" * 64 + ".kvblock")).mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ("c" * 64 + ".kvblock")).write_bytes(b"x" * 100)
    (tmp_path / "kv" / "linked-model").symlink_to(elsewhere, target_is_directory=True)
    assert sorted(size for _, _, size in scan_records(tmp_path / "kv")) == sorted(
        p.stat().st_size for p in s.directory.glob("*.kvblock") if p.is_file() and not p.is_symlink())
    again = store(tmp_path / "kv")
    assert again.index.nbytes < 1 << 20 and again.start_line(BS, 1).endswith("2 blocks (32 tokens) from earlier runs")


def test_the_gauges_drop_to_zero_when_the_directory_is_removed(tmp_path):
    keys, tokens = chain(2)
    s = store(tmp_path / "kv")
    written(s, record(0, keys, tokens), record(1, keys, tokens))
    assert s.stats()["disk_cache_blocks"] == 2 and s.stats()["disk_cache_bytes"] > 0
    for path in s.directory.iterdir():
        path.unlink()
    s.directory.rmdir()
    assert s.stats()["disk_cache_blocks"] == 0 and s.stats()["disk_cache_bytes"] == 0
