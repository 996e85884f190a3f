"""dpvr.persistence: atomic, durable writes; the checkpoint codec and its refusals; write-ahead journals."""

import hashlib
import io
import json
import os
import stat

import numpy as np
import pytest
import torch

from dpvr.persistence import (
    CHECKPOINT_MAGIC,
    Journal,
    atomic_write,
    decode_checkpoint,
    encode_checkpoint,
    read_checkpoint,
    write_checkpoint,
)


def state():
    return {
        "steps_done": 3,
        "params": [
            torch.arange(6, dtype=torch.float64).reshape(2, 3),
            torch.tensor([1.5], dtype=torch.float32),
        ],
        "buffers": {"momentum": [torch.tensor([-1, 2], dtype=torch.int64)]},
        "extra": {"name": "run", "flags": (True, None), "rate": 0.25},
    }


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


# ---- atomic_write ----------------------------------------------------------------------------------


class DiskFull:
    """A file whose write stores two bytes and fails."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, data):
        self.f.write(data[:2])
        self.f.flush()
        raise OSError("write failed")


@pytest.mark.parametrize("failing", ["write", "fsync", "replace"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, failing):
    path = tmp_path / "result.json"
    atomic_write(path, b"old")

    def fail(*args, **kwargs):
        raise OSError(f"{failing} failed")

    if failing == "write":  # midway: part of the data reaches the file, then the disk is full
        real = os.fdopen
        monkeypatch.setattr(os, "fdopen", lambda fd, mode: DiskFull(real(fd, mode)))
    else:
        monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError, match=f"{failing} failed"):
        atomic_write(path, b"new contents")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["result.json"]


def test_the_directory_is_flushed_after_the_rename(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "state.bin"  # the parent is created
    real, flushed = os.fsync, []

    def record(fd):
        info = os.fstat(fd)
        flushed.append(
            (stat.S_ISDIR(info.st_mode), info.st_ino, path.read_bytes() if path.exists() else None)
        )
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    atomic_write(path, b"data")
    # first the temporary file's bytes, then, once the new file is in place, its directory
    assert [(is_dir, content) for is_dir, _, content in flushed] == [(False, None), (True, b"data")]
    assert flushed[1][1] == os.stat(path.parent).st_ino


def test_permissions(tmp_path):
    atomic_write(tmp_path / "private", b"x", private=True)
    atomic_write(tmp_path / "shared", b"x")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "private").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "shared").st_mode) == 0o666 & ~umask


def test_result_files_are_written_whole(tmp_path):
    """JSON, CSV and figures: complete, in their own format, and no temporary file left beside them."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from dpvr.results import Record, write_figure, write_json
    from dpvr_lab.experiments.common import write_csv

    write_json(tmp_path / "out" / "r.json", {"spent": np.float64(0.5)})
    write_csv(tmp_path / "out" / "r.csv", [Record("DP-SGD", "adult", metrics={"test": {"auc": 0.75}})])
    figure = Figure()
    figure.subplots().plot([0, 1], [1, 0])
    write_figure(tmp_path / "out" / "r.png", figure, dpi=50)
    write_figure(tmp_path / "out" / "r.pdf", figure, dpi=50)
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["r.csv", "r.json", "r.pdf", "r.png"]
    assert json.loads((out / "r.json").read_text()) == {"spent": 0.5}
    assert (out / "r.csv").read_bytes().splitlines()[1].endswith(b",0.75")
    assert (out / "r.png").read_bytes().startswith(b"\x89PNG") and (out / "r.pdf").read_bytes().startswith(
        b"%PDF"
    )


# ---- checkpoints -----------------------------------------------------------------------------------


def test_a_checkpoint_round_trips_a_state_with_tensors(tmp_path):
    path = tmp_path / "run.ckpt"
    write_checkpoint(path, state(), "DP-SGD")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # it holds the noise seed
    assert_same(read_checkpoint(path), state())
    assert_same(read_checkpoint(path, "DP-SGD"), state())


def test_the_byte_format_is_fixed():
    """Files written before this module existed must still load: magic line, JSON header, torch.save."""
    buffer = io.BytesIO()
    torch.save(state(), buffer)
    payload = buffer.getvalue()
    header = {
        "version": 2,
        "algorithm": "DIFF2",
        "length": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    data = b"DPVR-CHECKPOINT\n" + json.dumps(header).encode() + b"\n" + payload
    assert_same(decode_checkpoint(data, "old.ckpt", "DIFF2"), state())
    written = encode_checkpoint(state(), "DIFF2")
    magic, head, _ = written.split(b"\n", 2)
    assert magic + b"\n" == CHECKPOINT_MAGIC
    assert json.loads(head).keys() == header.keys() and json.loads(head)["version"] == 2


class Payload:
    """Unpickling it would call ``print``: a checkpoint must never be able to run code."""

    def __reduce__(self):
        return (print, ("unpickled",))


def test_each_damage_is_refused_with_its_own_message(capsys):
    good = encode_checkpoint(state(), "DP-SGD")
    magic, head, payload = good.split(b"\n", 2)
    header = json.loads(head)

    def with_header(**changes):
        return magic + b"\n" + json.dumps({**header, **changes}).encode() + b"\n" + payload

    def sealed(body):  # an intact file whose payload is not a state
        h = {**header, "length": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        return magic + b"\n" + json.dumps(h).encode() + b"\n" + body

    buffer = io.BytesIO()
    torch.save({"x": Payload()}, buffer)
    cases = {
        "bad magic": (b"hello", None),
        "unreadable header": (good[: len(magic) + 10], None),
        "format version 99, this dpvr reads 2": (with_header(version=99), None),
        "truncated or padded": (good[:-10], None),
        "checksum mismatch": (good[:-5] + bytes([good[-5] ^ 1]) + good[-4:], None),
        "written by 'DP-SGD', not DIFF2": (good, "DIFF2"),
        "not a state of tensors": (sealed(buffer.getvalue()), None),
    }
    messages = set()
    for problem, (data, algorithm) in cases.items():
        with pytest.raises(ValueError) as refused:
            decode_checkpoint(data, "run.ckpt", algorithm)
        message = str(refused.value)
        assert message.startswith("checkpoint 'run.ckpt': ") and problem in message, message
        messages.add(message)
    assert len(messages) == len(cases)
    assert "unpickled" not in capsys.readouterr().out


def test_read_checkpoint_names_the_file(tmp_path):
    path = tmp_path / "damaged.ckpt"
    path.write_bytes(encode_checkpoint(state(), "DP-SGD")[:-1])
    with pytest.raises(ValueError, match=f"checkpoint {str(path)!r}: truncated"):
        read_checkpoint(path)


# ---- journals --------------------------------------------------------------------------------------


def test_a_journal_appends_durably_and_refuses_a_torn_line(tmp_path, monkeypatch):
    journal = Journal(tmp_path / "run.releases")
    assert journal.entries() == []  # no file: nothing journaled
    flushed = []
    real = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: (flushed.append(stat.S_ISDIR(os.fstat(fd).st_mode)), real(fd))
    )
    journal.append({"parts": {"gradient": 1.0}, "event": "a"})
    journal.append({"event": "b"})
    assert flushed == [False, True, False]  # each line; the directory once, when the file was created
    assert journal.entries() == [{"parts": {"gradient": 1.0}, "event": "a"}, {"event": "b"}]
    with open(journal.path, "ab") as f:
        f.write(b'{"event": "c", "pa')  # a crash mid-append
    with pytest.raises(ValueError, match=r"journal .*run\.releases.*: line 3 is not JSON"):
        journal.entries()
    journal.clear()
    assert journal.entries() == [] and os.path.getsize(journal.path) == 0
