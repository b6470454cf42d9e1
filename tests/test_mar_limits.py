"""build-repo --from-mar refuses archives that expand without bound, before writing them out."""
import json
import os
import struct
import zipfile

import pytest

from builder import cli, mar

MANIFEST = {"model": {"modelName": "bomb", "serializedFile": "weights.pt", "handler": "image_classifier"}}


def _archive(path, weights: bytes, compression=zipfile.ZIP_DEFLATED):
    with zipfile.ZipFile(path, "w", compression) as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps(MANIFEST))
        archive.writestr("weights.pt", weights)
    return path


def _files(folder):
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def test_a_zip_bomb_member_is_refused_before_a_byte_is_extracted(tmp_path):
    bomb = _archive(tmp_path / "bomb.mar", bytes(64 << 20))  # 64 MiB of zeros: ~65 KB compressed
    assert bomb.stat().st_size < (1 << 20)
    with pytest.raises(mar.ArchiveError, match="over 100x"):
        mar.read(bomb, tmp_path / "work")
    assert _files(tmp_path / "work") == []


def test_members_claiming_more_than_the_limit_are_refused_before_extraction(tmp_path):
    archive = _archive(tmp_path / "big.mar", os.urandom(3 << 20), zipfile.ZIP_STORED)
    with pytest.raises(mar.ArchiveError, match="over the 0.00195312 GiB limit"):
        mar.read(archive, tmp_path / "work", max_bytes=2 << 20)
    assert _files(tmp_path / "work") == []
    assert mar.read(archive, tmp_path / "ok", max_bytes=4 << 20).serialized_file.stat().st_size == 3 << 20


def test_a_member_longer_than_it_declares_is_refused_and_nothing_is_left(tmp_path):
    archive = _archive(tmp_path / "liar.mar", os.urandom(3 << 20), zipfile.ZIP_STORED)
    data = bytearray(archive.read_bytes())
    # Declare 1 MiB in the central directory entry of weights.pt (uncompressed size: offset 24).
    entry = data.find(b"PK\x01\x02")
    while data[entry + 46:entry + 46 + struct.unpack_from("<H", data, entry + 28)[0]] != b"weights.pt":
        entry = data.find(b"PK\x01\x02", entry + 4)
    struct.pack_into("<I", data, entry + 24, 1 << 20)
    archive.write_bytes(bytes(data))
    assert {i.filename: i.file_size for i in zipfile.ZipFile(archive).infolist()}["weights.pt"] == 1 << 20
    with pytest.raises(mar.ArchiveError, match="corrupt|expands past"):
        mar.read(archive, tmp_path / "work", max_bytes=2 << 20)
    assert sum(p.stat().st_size for p in _files(tmp_path / "work")) <= 2 << 20


def test_build_repo_refuses_a_bomb_archive_with_one_line_and_keeps_the_repository(tmp_path, capsys):
    bomb = _archive(tmp_path / "bomb.mar", bytes(64 << 20))
    output = tmp_path / "repo"
    status = cli.main(["--from-mar", str(bomb), "--output", str(output)])
    assert status == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refusing to extract" in err[0]
    assert not output.exists() or not any(output.iterdir())
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--from-mar", str(bomb), "--max-archive-gb", "0"])
