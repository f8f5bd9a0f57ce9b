"""A stored directory sent as a tar (service/api/tar_stream.py): one of many files, however many,
with no more descriptors held than OPEN_AHEAD (an output of 20,000 files was a 500, "too many open
files", for its owner)."""

from __future__ import annotations

import io
import os
import resource
import tarfile

from service.api.tar_stream import OPEN_AHEAD, open_files, stream_tar


def test_a_directory_of_more_files_than_the_process_may_open_streams_whole(tmp_path):
    directory = tmp_path / "out"
    (directory / "sub").mkdir(parents=True)
    count = 4 * OPEN_AHEAD
    for number in range(count):
        (directory / ("sub" if number % 2 else "") / f"{number:05d}.txt").write_text(f"file {number}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    already = len(os.listdir("/proc/self/fd"))  # this test process's own (a pytest-xdist worker's)
    resource.setrlimit(resource.RLIMIT_NOFILE, (already + OPEN_AHEAD + 100, hard))  # fewer than the files
    try:
        files = open_files(directory)
        data = b"".join(stream_tar(files, "out"))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {member.name: tar.extractfile(member).read().decode() for member in tar.getmembers()}
    assert len(members) == count and members["out/00000.txt"] == "file 0" and members[f"out/sub/{count - 1:05d}.txt"] == f"file {count - 1}"
    assert all(stored.opened is None or stored.opened.closed for stored in files)


def test_a_file_opened_ahead_is_sent_though_it_was_deleted_meanwhile(tmp_path):
    directory = tmp_path / "out"
    directory.mkdir()
    (directory / "model.bin").write_bytes(b"weights")
    files = open_files(directory)
    (directory / "model.bin").unlink()  # retention, or a newer collection, while the answer starts
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream_tar(files, "ckpt")))) as tar:
        assert tar.extractfile("ckpt/model.bin").read() == b"weights"
