"""kvserve/private_files.py: what kvserve keeps between starts is read only where it is this user's own, and written
whole, for this user alone."""
from kvserve.private_files import not_private, write_private


def test_written_whole_for_this_user_alone_and_read_back_as_its_own(tmp_path):
    path = tmp_path / "kept" / "routes.json"
    assert not_private(path) is None  # nothing there yet: no reason not to write it
    write_private(path, '{"a": 1}')
    assert path.read_text() == '{"a": 1}' and not list(path.parent.glob("*.tmp"))
    assert (path.stat().st_mode & 0o777) == 0o600 and (path.parent.stat().st_mode & 0o777) == 0o700
    assert not_private(path) is None


def test_a_file_or_directory_others_may_write_is_not_this_users_own(tmp_path):
    path = tmp_path / "kept" / "routes.json"
    write_private(path, "{}")
    path.chmod(0o666)
    assert not_private(path) == f"{path} may be written by other users"
    path.chmod(0o600)
    path.parent.chmod(0o777)
    assert not_private(path) == f"{path.parent} may be written by other users"
