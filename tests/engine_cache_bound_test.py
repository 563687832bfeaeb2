"""The engine cache stays within its bound: least recently used entries go first, never one used within the hour,
and a killed export's leftovers are cleared (models/engines/cache_bound.py)."""

from __future__ import annotations

import os

import numpy as np

from docbeam.models.engines import cache_bound, openvino

HOUR = cache_bound.MIN_AGE_S


def write_entry(folder, key: str, used: float, blob_bytes: int = 1000) -> None:
    """A real IR pair (a ReLU over a float32 vector, saved by OpenVINO) and, unless ``blob_bytes`` is 0, a compiled
    blob of that size, last used at ``used``."""
    ov = openvino.openvino_module()
    x = ov.opset13.parameter([4], ov.Type.f32)
    ov.save_model(ov.Model([ov.opset13.relu(x)], [x], key), os.path.join(folder, f"{key}.xml"))
    if blob_bytes:
        os.makedirs(os.path.join(folder, "compiled", key), exist_ok=True)
        with open(os.path.join(folder, "compiled", key, "1.blob"), "wb") as f:
            f.write(b"\0" * blob_bytes)
    os.utime(os.path.join(folder, f"{key}.xml"), (used, used))


def test_the_least_recently_used_entries_go_until_the_cache_fits_with_their_compiled_blobs(tmp_path):
    now = 1e9
    for i, key in enumerate(["oldest", "older", "recent"]):
        write_entry(tmp_path, key, used=now - (3 - i) * 2 * HOUR, blob_bytes=10_000)
    sizes = cache_bound.entries(str(tmp_path))
    fits_two = sizes["older"][1] + sizes["recent"][1]

    assert cache_bound.prune(str(tmp_path), max_bytes=fits_two, now=now) == ["oldest"]
    assert sorted(cache_bound.entries(str(tmp_path))) == ["older", "recent"]
    assert not os.path.exists(tmp_path / "oldest.bin") and not os.path.exists(tmp_path / "compiled" / "oldest")
    assert cache_bound.prune(str(tmp_path), max_bytes=fits_two, now=now) == []  # within its bound: nothing more


def test_an_entry_used_within_the_hour_stays_whatever_the_bound(tmp_path):
    """Another process of the VM may be compiling from it; a model whose shapes outgrow the bound keeps them."""
    now = 1e9
    write_entry(tmp_path, "old", used=now - 2 * HOUR)
    write_entry(tmp_path, "this_job_1", used=now - 60)
    write_entry(tmp_path, "this_job_2", used=now)
    assert cache_bound.prune(str(tmp_path), max_bytes=0, now=now) == ["old"]
    assert sorted(cache_bound.entries(str(tmp_path))) == ["this_job_1", "this_job_2"]


def test_reading_an_entry_marks_it_used_so_a_daily_job_keeps_its_models(tmp_path):
    now = 1e9
    write_entry(tmp_path, "daily", used=now - 2 * HOUR)
    write_entry(tmp_path, "abandoned", used=now - 2 * HOUR + 1)
    one_entry = cache_bound.entries(str(tmp_path))["daily"][1]
    assert openvino.read_exported(str(tmp_path), "daily") is not None  # today's run reads it: used now
    later = os.path.getmtime(tmp_path / "daily.xml") + 2 * HOUR
    removed = cache_bound.prune(str(tmp_path), max_bytes=one_entry, now=later)
    assert removed == ["abandoned"]


def test_a_killed_exports_leftovers_go_once_they_are_an_hour_old_and_a_running_exports_stay(tmp_path):
    now = 1e9
    write_entry(tmp_path, "kept", used=now)
    stale, running = tmp_path / "tmp_killed", tmp_path / "tmp_running"
    for folder, when in ((stale, now - 2 * HOUR), (running, now)):
        folder.mkdir()
        (folder / "forward.onnx").write_bytes(b"half")
        os.utime(folder, (when, when))
    orphan = tmp_path / "compiled" / "its_ir_is_gone"
    orphan.mkdir(parents=True)
    os.utime(orphan, (now - 2 * HOUR,) * 2)
    old_layout = tmp_path / "compiled" / "123.blob"  # before each key had its own folder
    old_layout.write_bytes(b"blob")
    os.utime(old_layout, (now - 2 * HOUR,) * 2)

    removed = cache_bound.prune(str(tmp_path), now=now)
    assert sorted(removed) == sorted(str(p) for p in (stale, orphan, old_layout))
    assert running.exists() and os.path.exists(tmp_path / "compiled" / "kept")


def test_processes_pruning_one_cache_at_once_neither_fail_nor_warn_and_an_odd_folder_name_is_taken_literally(
    tmp_path, caplog
):
    """A VM's SDK processes each prune after their exports; they race over the same files. The folder's name holds
    glob characters: nothing is matched by pattern."""
    import threading

    folder = tmp_path / "cache [*?] dir"
    folder.mkdir()
    now = 1e9
    for i in range(12):
        write_entry(folder, f"k{i}", used=now - 2 * HOUR - i, blob_bytes=100)
    (tmp_path / "beside.xml").write_text("not the cache's")  # what the pattern `cache*/*.xml` would also take
    threads = [threading.Thread(target=cache_bound.prune, args=(str(folder), 0, HOUR, now)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache_bound.entries(str(folder)) == {} and os.listdir(folder / "compiled") == []
    assert "cannot be pruned" not in caplog.text and (tmp_path / "beside.xml").exists()


def test_a_cache_that_cannot_be_pruned_warns_and_the_job_goes_on(tmp_path, caplog):
    assert cache_bound.prune(str(tmp_path / "absent")) == []
    assert "cannot be pruned" in caplog.text


def test_the_compiled_blob_is_kept_under_its_keys_folder(tmp_path):
    write_entry(tmp_path, "k", used=1e9, blob_bytes=0)
    forward = openvino.compile_model(openvino.read_exported(str(tmp_path), "k"), "float32", str(tmp_path), "k", True, 0)
    assert np.asarray(forward.compiled([np.asarray([-1, 2, -3, 4], np.float32)])[0]).tolist() == [0, 2, 0, 4]
    assert os.listdir(tmp_path / "compiled" / "k")  # OpenVINO's own blob
