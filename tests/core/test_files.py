import errno
import json
import os

import pytest

from gptforge.core.errors import StorageError
from gptforge.core.files import write_json_atomic


def test_atomic_json_leaves_no_temp_files(tmp_path):
    write_json_atomic(tmp_path / "a.json", {"x": 1})
    write_json_atomic(tmp_path / "a.json", {"x": 2})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


@pytest.mark.parametrize("code, why", [(errno.ENOSPC, "no space left"), (errno.EROFS, "read-only file system"),
                                       (errno.EACCES, "no permission")])
def test_a_failed_write_is_one_error_naming_the_path_and_leaves_nothing(tmp_path, monkeypatch, code, why):
    write_json_atomic(tmp_path / "a.json", {"x": 1})

    def replace(src, dst):
        raise OSError(code, os.strerror(code), str(dst))

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(StorageError, match=rf"^cannot write {tmp_path / 'a.json'}: {why} \("):
        write_json_atomic(tmp_path / "a.json", {"x": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]  # the old file, no temp file
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}
