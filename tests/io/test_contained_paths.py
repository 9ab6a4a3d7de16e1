"""Nothing outside its own folders: names from a bucket or a store never lead a path out of its folder.

A hostile source bucket (keys with `..`, absolute keys, empty segments), a hostile destination bucket
rebuilt into a new staging folder, a store whose index and companions name files outside SRC, symbolic
links out of SRC and FIFOs: each is refused with a message naming it (or, with --skip-bad, a recorded
skip), nothing is written or read outside the folders h5feed owns, and nothing hangs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from conftest import REPO
from s3_server import S3, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)

import h5feed
from h5feed.errors import SourceError, StoreError
from h5feed.io import open_url
from h5feed.io.paths import UnsafeName, contained_path, regular_file
from h5feed.store.attributes import KeptCompanion
from h5feed.store.layout import INDEX_COLUMNS, IndexDigest, crc32c, read_info, write_info
from h5feed.testing.synthetic import write_synthetic

H = 32


def tree(root: Path) -> set[str]:
    """Every file and folder under root, relative to it."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def storage_flags(s3: S3) -> list[str]:
    options = s3.storage_options
    return ["--storage-option", f"endpoint_url={options['endpoint_url']}", "--storage-option", "key=testing",
            "--storage-option", "secret=testing", "--storage-option", "client_kwargs.region_name=us-east-1"]


def h5feed_cli(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`h5feed ARGS` in its own process, killed after `timeout` seconds (a FIFO opened would block it for ever)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "h5feed", "-q", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


# =========================================================================== the rule


@pytest.mark.parametrize(("name", "problem"), [
    ("../outside.pt", "has a '..' segment"),
    ("runs/../../x.txt", "has a '..' segment"),
    ("/etc/passwd", "is an absolute path"),
    ("a//b.pt", "has an empty segment (// or a / at an end)"),
    ("a/", "has an empty segment (// or a / at an end)"),
    ("", "has an empty segment (// or a / at an end)"),
    ("./a.pt", "has a '.' segment"),
    ("a\0.pt", "holds a NUL byte"),
])
def test_a_name_that_leaves_its_folder_or_has_two_spellings_is_refused(tmp_path, name, problem):
    with pytest.raises(UnsafeName) as err:
        contained_path(tmp_path, name)
    assert str(err.value) == f"{name!r} {problem}: refused as a path inside {tmp_path}"
    assert (err.value.name, err.value.root, err.value.problem) == (name, str(tmp_path), problem)
    assert contained_path(tmp_path, "rows_0/data_1.pt") == tmp_path / "rows_0/data_1.pt"


def test_a_symbolic_link_on_the_way_out_is_refused_and_one_inside_is_followed(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    (root / "real").mkdir(parents=True)
    elsewhere.mkdir()
    (root / "out").symlink_to(elsewhere)
    (root / "in").symlink_to(root / "real")
    with pytest.raises(UnsafeName, match=f"^'out/x.pt' leads through a symbolic link to {elsewhere}/x.pt: refused "
                                         f"as a path inside {root}$"):
        contained_path(root, "out/x.pt")
    assert contained_path(root, "in/x.pt") == root / "in/x.pt"


def test_a_fifo_is_refused_without_opening_it(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "link").symlink_to(tmp_path / "pipe")
    for name in ("pipe", "link"):
        with pytest.raises(SourceError, match=f"^{tmp_path}/{name}: is a named pipe \\(FIFO\\), not a regular file: "
                                              "refused without opening it$"):
            regular_file(tmp_path / name)
    assert regular_file(tmp_path / "missing") == tmp_path / "missing"  # its reader says it is missing


# =========================================================================== a hostile source bucket


@pytest.fixture
def hostile_src(s3: S3, bucket: str, tmp_path: Path) -> dict[str, Path]:
    """s3://BUCKET/runs: 3 sound samples, 2 keys whose local paths would be files outside every folder h5feed owns,
    and `a//b.pt`, a second spelling of `a/b.pt`; returns the would-be target of each of the first two."""
    source = tmp_path / "src"
    write_synthetic(source, "speculators-legacy-pt", 3, H, lengths=(10, 30), seed=3)
    objects = open_url(f"s3://{bucket}/runs", s3.storage_options)
    for path in sorted(source.iterdir()):
        objects.put_atomic(path.name, path.read_bytes())
    # the shadow is STAGING/h5feed-sources-XXXX/shadow: three levels below tmp_path
    targets = {"runs/../../../elsewhere/x.txt": tmp_path / "elsewhere" / "x.txt",
               f"runs/{tmp_path}/abs/y.pt": tmp_path / "abs" / "y.pt"}  # runs//tmp/...: an absolute key
    for key in [*targets, "runs/a//b.pt"]:
        s3.client.put_object(Bucket=bucket, Key=key, Body=b"planted by the bucket")
    (tmp_path / "staging").mkdir()
    return targets


def test_a_bucket_source_with_traversal_keys_is_refused_writing_nothing(hostile_src, s3, bucket, tmp_path, cli):
    before = tree(tmp_path)
    result = cli("convert", f"s3://{bucket}/runs", tmp_path / "dst", "--workers", "0", "--staging-dir",
                 tmp_path / "staging", *storage_flags(s3))
    assert result.status == 1
    assert (f"h5feed convert: error: s3://{bucket}/runs/../../../elsewhere/x.txt: its key has a '..' segment, so it "
            f"cannot be read as a file under s3://{bucket}/runs: rename or delete the object, or pass --skip-bad to "
            "convert the others and record it as skipped") in result.output
    assert [t for t in hostile_src.values() if t.exists()] == []
    assert tree(tmp_path) == before


def test_with_skip_bad_the_traversal_keys_are_recorded_skips_and_the_rest_converts(hostile_src, s3, bucket, tmp_path,
                                                                                  cli):
    before = tree(tmp_path)
    result = cli("convert", f"s3://{bucket}/runs", tmp_path / "dst", "--workers", "0", "--skip-bad", "--staging-dir",
                 tmp_path / "staging", *storage_flags(s3))
    assert result.status == 0, result.output
    url = f"s3://{bucket}/runs"
    assert [s.to_json() for s in h5feed.Store(tmp_path / "dst").info.skipped] == [
        {"path": "../../../elsewhere/x.txt", "problem": f"its key has a '..' segment, so it cannot be read as a file "
                                                        f"under {url}"},
        {"path": f"{tmp_path}/abs/y.pt", "problem": f"its key is an absolute path, so it cannot be read as a file "
                                                    f"under {url}"},
        {"path": "a//b.pt", "problem": "its key has an empty segment (// or a / at an end), so it cannot be read as a "
                                       f"file under {url}"},
    ]
    assert f"skipping {url}/a//b.pt: its key has an empty segment" in result.output
    assert [t for t in hostile_src.values() if t.exists()] == []
    assert {p for p in tree(tmp_path) if not p.startswith("dst")} == before

    local = tmp_path / "local"
    h5feed.convert(tmp_path / "src", local, workers=0, progress=False)
    got, want = h5feed.Store(tmp_path / "dst"), h5feed.Store(local)
    assert got.source_paths == want.source_paths == ["data_0.pt", "data_1.pt", "data_2.pt"]
    for i in range(len(want)):
        x, y = got.read_sample(i), want.read_sample(i)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.equal(x.aux_hidden_states.view(torch.int16), y.aux_hidden_states.view(torch.int16))


def test_folder_markers_in_a_source_bucket_are_passed_over(s3, bucket, tmp_path):
    source = tmp_path / "src"
    write_synthetic(source, "speculators-legacy-pt", 2, H, lengths=(10, 30), seed=8)
    objects = open_url(f"s3://{bucket}/runs", s3.storage_options)
    for path in sorted(source.iterdir()):
        objects.put_atomic(f"sub/{path.name}", path.read_bytes())
    for marker in ("runs/", "runs/sub/"):  # what an S3 console's "Create folder" leaves
        s3.client.put_object(Bucket=bucket, Key=marker, Body=b"")
    report = h5feed.convert(f"s3://{bucket}/runs", tmp_path / "dst", workers=0, progress=False,
                            bucket=h5feed.BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "staging"))
    assert (report.num_samples, report.skipped) == (2, [])
    assert h5feed.Store(tmp_path / "dst").source_paths == ["sub/data_0.pt", "sub/data_1.pt"]


# =========================================================================== a hostile destination bucket


def test_a_destination_bucket_with_traversal_keys_is_refused_when_rebuilt_into_staging(s3, bucket, tmp_path):
    source = tmp_path / "src"
    write_synthetic(source, "speculators-legacy-pt", 2, H, lengths=(10, 30), seed=4)
    dst = f"s3://{bucket}/hs.zarr"
    options = s3.storage_options
    h5feed.convert(source, dst, workers=0, progress=False,
                   bucket=h5feed.BucketOptions(storage_options=options, staging_dir=tmp_path / "first"))
    targets = {"hs.zarr/../evil": tmp_path / "second" / "evil",  # beside the staging store
               "hs.zarr/../../planted/evil": tmp_path / "planted" / "evil",
               f"hs.zarr/{tmp_path}/abs/evil": tmp_path / "abs" / "evil"}
    for key in targets:
        s3.client.put_object(Bucket=bucket, Key=key, Body=b"planted by the bucket")
    before = tree(tmp_path)
    with pytest.raises(StoreError) as err:
        h5feed.convert(source, dst, workers=0, progress=False,
                       bucket=h5feed.BucketOptions(storage_options=options, staging_dir=tmp_path / "second"))
    assert str(err.value) == (
        f"{dst}/../../planted/evil: its key has a '..' segment, so it is not an object of the store {dst}: delete that "
        "object from the bucket, or pass --overwrite to convert the store again from scratch")
    assert [t for t in targets.values() if t.exists()] == []
    assert tree(tmp_path) - before == {"second", "second/destination", "second/store"}  # nothing fetched


def test_a_resumed_plan_naming_a_file_out_of_src_is_refused(tmp_path, interrupted_convert):
    """An unfinished store's plan is the store's word (a bucket DST's plan comes from the bucket)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    write_synthetic(src, "speculators-legacy-pt", 4, H, lengths=(10, 30), seed=9)
    interrupted_convert(src, dst, after=2)
    shutil.copy(src / "data_3.pt", tmp_path / "outside.pt")  # a resume that read it would convert it
    plan_file = dst / "h5feed-plan.json"
    plan = json.loads(plan_file.read_text())
    plan["samples"][3]["relpath"] = "../outside.pt"
    plan_file.write_text(json.dumps(plan))
    with pytest.raises(UnsafeName, match=f"^'../outside.pt' has a '..' segment: refused as a path inside {src}$"):
        h5feed.convert(src, dst, workers=0, progress=False, skips=h5feed.SkipPolicy(skip_bad=True))
    assert read_info(dst).status != "complete"


# =========================================================================== verify --against


@pytest.fixture
def hostile_store(tmp_path: Path) -> tuple[Path, Path]:
    """A store of 5 samples whose index names `../outside.pt` and `/etc/passwd`; in SRC, data_2.pt is a symbolic
    link out of SRC and data_3.pt a FIFO.  Every file outside SRC holds the sample's true bytes, so a verify that
    read it would pass."""
    src, store = tmp_path / "src", tmp_path / "store"
    write_synthetic(src, "speculators-legacy-pt", 5, H, lengths=(10, 30), seed=5)
    h5feed.convert(src, store, workers=0, progress=False)
    shutil.copy(src / "data_0.pt", tmp_path / "outside.pt")
    (tmp_path / "elsewhere").mkdir()
    shutil.move(src / "data_2.pt", tmp_path / "elsewhere" / "data_2.pt")
    (src / "data_2.pt").symlink_to(tmp_path / "elsewhere" / "data_2.pt")
    (src / "data_3.pt").unlink()
    os.mkfifo(src / "data_3.pt")  # opening it waits for a writer for ever
    zarr.open_array(store / "index" / "source_path", mode="r+")[:] = np.array(
        ["../outside.pt", "/etc/passwd", "data_2.pt", "data_3.pt", "data_4.pt"])
    index = zarr.open_group(store / "index", mode="r+")  # an editor who records the index digest again
    index.update_attributes(IndexDigest.of({name: index[name][...] for name in INDEX_COLUMNS}).to_attributes())
    return src, store


def test_verify_against_refuses_index_paths_out_of_src_links_out_and_fifos(hostile_store):
    src, store = hostile_store
    result = h5feed_cli("verify", store, "--against", src, timeout=120)
    assert result.returncode == 1
    assert [line for line in result.stderr.splitlines() if line.startswith("MISMATCH")] == [
        (f"MISMATCH sample 0 (../outside.pt): source cannot be read: '../outside.pt' has a '..' segment: refused as "
         f"a path inside {src}"),
        (f"MISMATCH sample 1 (/etc/passwd): source cannot be read: '/etc/passwd' is an absolute path: refused as a "
         f"path inside {src}"),
        (f"MISMATCH sample 2 (data_2.pt): source cannot be read: 'data_2.pt' leads through a symbolic link to "
         f"{src.parent}/elsewhere/data_2.pt: refused as a path inside {src}"),
        (f"MISMATCH sample 3 (data_3.pt): source cannot be read: {src}/data_3.pt: is a named pipe (FIFO), not a "
         "regular file: refused without opening it"),
    ]
    assert f"{store}: 4 mismatch(es) in 5 samples (checksums and source files)" in result.stderr


def test_verify_refuses_companion_copies_outside_the_store_and_fifos(tmp_path):
    src, store = tmp_path / "src", tmp_path / "store"
    write_synthetic(src, "speculators-legacy-pt", 2, H, lengths=(10, 30), seed=6)
    h5feed.convert(src, store, workers=0, progress=False)
    passwd = Path("/etc/passwd").read_bytes()
    record = {"bytes": len(passwd), "crc32c": crc32c(passwd)}  # what /etc/passwd holds: a read of it would pass
    os.mkfifo(store / "companions.pipe")
    companions = {"vocab_mapping.pt": {"source": "vocab_mapping.pt", **record, "copy": "/etc/passwd"},
                  "up.pt": {"source": "up.pt", **record, "copy": "../../../../../../../../etc/passwd"},
                  "pipe.pt": {"source": "pipe.pt", **record, "copy": "companions.pipe"}}
    companions = {name: KeptCompanion.from_json(record) for name, record in companions.items()}
    write_info(store, dataclasses.replace(read_info(store), companions=companions), durable=False)
    result = h5feed_cli("verify", store, timeout=120)
    assert result.returncode == 1
    assert [line for line in result.stderr.splitlines() if line.startswith("MISMATCH")] == [
        "MISMATCH /etc/passwd: is an absolute path: not a file of the store, not read",
        "MISMATCH ../../../../../../../../etc/passwd: has a '..' segment: not a file of the store, not read",
        "MISMATCH companions.pipe: is a named pipe (FIFO), not a regular file: refused without opening it",
    ]


# =========================================================================== the formats


def test_a_nemo_shard_that_is_a_fifo_is_refused_without_opening_it(tmp_path):
    src = tmp_path / "nemo"
    write_synthetic(src, "nemo-eagle3-cache", 4, H, lengths=(10, 30), seed=7)
    shard = min(src.glob("shard-*.safetensors"))
    shard.unlink()
    os.mkfifo(shard)
    result = h5feed_cli("convert", src, tmp_path / "dst", "--workers", "0", timeout=120)
    assert result.returncode == 1
    assert (f"h5feed convert: error: {shard}: is a named pipe (FIFO), not a regular file: refused without opening "
            "it") in result.stderr
    assert not (tmp_path / "dst").exists()
