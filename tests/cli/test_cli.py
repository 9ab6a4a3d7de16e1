"""The `h5feed` command: convert on bad input and on a full disk, verify, inspect.

Every failure must exit non-zero, say what is wrong and with which file, and
lose nothing that was already converted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import NeedsCode, RunsShell, inner_chunk_span

from h5feed import StoreSettings
from h5feed.conversion.converter import convert
from h5feed.errors import CorruptSampleError, StoreError
from h5feed.store import Store
from h5feed.store.journal import read_journal
from h5feed.testing.synthetic import FileOptions, write_synthetic
from h5feed.verify import describe_store, verify_store

H = 32
K = 3
CHUNK = 16
CHUNKED = StoreSettings(chunk_tokens=CHUNK)  # the store settings of most conversions here
LENGTHS = [3, 20, 16, 40, 17]  # sample 3 spans chunks 4, 5 and 6
LEGACY = "speculators-legacy-pt"
ZSTD = {"name": "blosc", "cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 1 << 20}


def rewrite(path: Path, change) -> None:
    d = torch.load(path, weights_only=True)
    change(d)
    torch.save(d, path)


def _other_hidden_size(d: dict) -> None:
    t = len(d["input_ids"])
    d["hidden_states"] = [torch.randn(t, 48).to(torch.bfloat16) for _ in range(K + 1)]


# kind: (damage the file, the problem h5feed must report)
BAD = {
    "truncated-pt": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
                     "not a readable torch.save file (truncated or corrupt): "),
    "random-bytes": (lambda p: p.write_bytes(np.random.default_rng(0).bytes(4096)),
                     "not a readable torch.save file (truncated or corrupt): UnpicklingError"),
    "missing-key": (lambda p: rewrite(p, lambda d: d.pop("input_ids")),
                    f"missing key(s) 'input_ids' for format {LEGACY} (found keys: 'hidden_states', 'loss_mask')"),
    "hidden-size": (lambda p: rewrite(p, _other_hidden_size), "hidden size 48 differs from 32 of the first sample"),
    "aux-layers": (lambda p: rewrite(p, lambda d: d.update(hidden_states=d["hidden_states"][1:])),
                   "number of aux layers 2 differs from 3 of the first sample"),
    "dtype": (lambda p: rewrite(p, lambda d: d.update(hidden_states=[h.half() for h in d["hidden_states"]])),
              "dtype torch.float16 differs from torch.bfloat16 of the first sample"),
    "needs-code": (lambda p: rewrite(p, lambda d: d.update(meta=NeedsCode())),
                   "refusing to load: the pickle needs code to run (h5feed always loads with weights_only=True)"),
    "truncated-ckpt-gz": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
                          "truncated or corrupt gzip file (EOFError: Compressed file ended before the end-of-stream"),
}


def make_source(root: Path, kind: str = "", lengths: list[int] = LENGTHS) -> list[Path]:
    if kind == "truncated-ckpt-gz":
        return write_synthetic(root, "specforge-ckpt", len(lengths), H, lengths=lengths, seed=1,
                               files=FileOptions(compress=True))
    return write_synthetic(root, LEGACY, len(lengths), H, lengths=lengths, seed=1)


def convert_args(src: Path, dst: Path, *extra) -> tuple:
    return ("convert", src, dst, "--workers", 0, "--chunk-tokens", CHUNK, *extra)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kind", BAD)
def test_bad_file_fails_a_new_conversion_and_is_named(tmp_path, cli, kind):
    src, dst = tmp_path / "src", tmp_path / "store"
    files = make_source(src, kind)
    good = files[3].read_bytes()
    damage, problem = BAD[kind]
    damage(files[3])

    r = cli(*convert_args(src, dst))

    assert r.status == 1
    assert f"h5feed convert: error: {files[3].resolve()}: {problem}" in r.output
    if kind == "needs-code":
        assert "NeedsCode" in r.output
    assert not dst.exists()  # found while probing: nothing was written, nothing can pass for a store

    files[3].write_bytes(good)
    r = cli(*convert_args(src, dst))
    assert r.status == 0 and len(Store(dst)) == 5


@pytest.mark.parametrize("kind", BAD)
def test_bad_file_met_while_resuming_keeps_what_was_converted(
    tmp_path, cli, interrupted_convert, assert_same_tree, kind
):
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    files = make_source(src, kind)
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)
    assert sorted(interrupted_convert(src, dst, after=2, settings=CHUNKED)) == [0, 1]
    good = files[3].read_bytes()
    damage, problem = BAD[kind]
    damage(files[3])  # changed after it was probed and planned

    r = cli(*convert_args(src, dst))

    assert r.status == 1
    assert f"h5feed convert: error: {files[3].resolve()}: {problem}" in r.output
    with pytest.raises(StoreError, match="has not finished"):
        Store(dst)
    done = read_journal(dst)
    assert {0, 1, 2} <= set(done) and 3 not in done

    files[3].write_bytes(good)
    r = cli(*convert_args(src, dst))
    assert r.status == 0
    assert f"({5 - len(done)} converted now, {len(done)} from an earlier run, 0 skipped)" in r.output
    assert_same_tree(dst, ref)


def test_skip_bad_converts_the_rest_and_records_what_it_skipped(tmp_path, cli, assert_sample_matches_source):
    src, dst = tmp_path / "src", tmp_path / "store"
    files = make_source(src, lengths=[3, 20, 16, 40, 17, 1, 9])
    for i, kind in ((1, "truncated-pt"), (3, "hidden-size"), (4, "needs-code"), (6, "missing-key")):
        BAD[kind][0](files[i])

    r = cli("convert", src, dst, "--workers", 2, "--chunk-tokens", CHUNK, "--skip-bad")  # probed in spawned workers

    assert r.status == 0
    assert "(3 converted now, 0 from an earlier run, 4 skipped)" in r.output
    store = Store(dst)
    assert store.source_paths == ["data_0.pt", "data_2.pt", "data_5.pt"]
    assert store.source_indices.tolist() == [0, 2, 5]
    for i in range(3):
        assert_sample_matches_source(store, i, LEGACY, src)
    skipped = describe_store(dst)["skipped"]
    assert [s["path"] for s in skipped] == ["data_1.pt", "data_3.pt", "data_4.pt", "data_6.pt"]
    assert skipped[0]["problem"].startswith(BAD["truncated-pt"][1])
    assert skipped[1]["problem"] == BAD["hidden-size"][1]
    assert skipped[2]["problem"].startswith(BAD["needs-code"][1])
    assert skipped[3]["problem"] == BAD["missing-key"][1]
    assert [s.to_json() for s in store.info.skipped] == skipped
    for s in skipped:
        assert f"skipped {s['path']}: {s['problem']}" in r.output

    r = cli("inspect", dst)
    assert r.status == 0
    for s in skipped:
        assert f"  skipped {s['path']}: {s['problem']}\n" in r.stdout
    assert re.search(r"^skipped\s+4$", r.stdout, re.MULTILINE)
    assert json.loads(cli("inspect", dst, "--json").stdout)["skipped"] == skipped


def test_skip_bad_on_resume_records_a_file_that_went_bad(
    tmp_path, cli, interrupted_convert, assert_sample_matches_source
):
    src, dst = tmp_path / "src", tmp_path / "store"
    files = make_source(src)
    interrupted_convert(src, dst, after=2, settings=CHUNKED)
    BAD["hidden-size"][0](files[3])

    r = cli(*convert_args(src, dst, "--skip-bad"))

    assert r.status == 0
    assert "(2 converted now, 2 from an earlier run, 1 skipped)" in r.output
    store = Store(dst)
    assert store.source_indices.tolist() == [0, 1, 2, 4]
    for i in range(4):
        assert_sample_matches_source(store, i, LEGACY, src)
    assert describe_store(dst)["skipped"] == [{"path": "data_3.pt", "problem": BAD["hidden-size"][1]}]


def test_empty_directory(tmp_path, cli):
    empty, dst = tmp_path / "empty", tmp_path / "store"
    empty.mkdir()
    r = cli(*convert_args(empty, dst))
    assert r.status == 1
    assert (f"h5feed convert: error: {empty.resolve()}: no sample files of any known format found: "
            "expected data_{i}.pt, data_{i}.ckpt[.gz] or hidden_states/hs_{i}.safetensors") in r.output
    r = cli(*convert_args(empty, dst, "--format", LEGACY))
    assert r.status == 1
    assert f"{empty.resolve()}: no data_{{i}}.pt files found (searched all sub-folders)" in r.output
    assert not dst.exists()


def test_skip_bad_with_nothing_readable_fails(tmp_path, cli):
    src, dst = tmp_path / "src", tmp_path / "store"
    for path in make_source(src, lengths=[4, 5]):
        BAD["truncated-pt"][0](path)
    r = cli(*convert_args(src, dst, "--format", LEGACY, "--skip-bad"))
    assert r.status == 1
    assert f"h5feed convert: error: {src.resolve()}: no readable sample files (all were skipped)" in r.output


def test_the_real_command_exits_1_on_a_bad_file(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "store"
    files = make_source(src)
    BAD["truncated-pt"][0](files[2])
    r = subprocess.run([sys.executable, "-m", "h5feed.cli", "-q", "convert", str(src), str(dst), "--workers", "0"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert f"h5feed convert: error: {files[2].resolve()}: {BAD['truncated-pt'][1]}" in r.stderr
    assert "Traceback" not in r.stderr


# --------------------------------------------------------------------------- code in the sources, refused


def test_a_pickle_that_runs_os_system_is_refused_as_needing_code(tmp_path, cli):
    src, dst = tmp_path / "src", tmp_path / "store"
    files = make_source(src)
    marker = tmp_path / "ran"
    rewrite(files[2], lambda d: d.update(meta=RunsShell(marker)))

    r = cli(*convert_args(src, dst))

    assert r.status == 1
    assert (
        f"h5feed convert: error: {files[2].resolve()}: refusing to load: the pickle needs code to run (h5feed always "
        "loads with weights_only=True): it references posix.system, a class or function that is not a tensor or "
        "plain container; re-save it holding only tensors, lists and dicts\n"
    ) in r.output
    assert "truncated or corrupt" not in r.output and "False" not in r.output
    assert not marker.exists() and not dst.exists()


# kind: (make the entry in SRC, its relpath, the problem; {src} and {parent} are SRC and its parent, resolved)
UNUSABLE = {
    "link to the parent folder": (lambda src: os.symlink("..", src / "up"), "up",
                                  "is a symbolic link to the folder {parent}, outside {src}: not followed"),
    "looping link": (lambda src: os.symlink("data_9.pt", src / "data_9.pt"), "data_9.pt",
                     "is a symbolic link that loops: not followed"),
    "broken link": (lambda src: os.symlink("gone.pt", src / "data_9.pt"), "data_9.pt",
                    "is a broken symbolic link: its target gone.pt does not exist"),
    "misnamed file": (lambda src: shutil.copy(src / "data_0.pt", src / "data_x.pt"), "data_x.pt",
                      "has a sample file's extension but its name does not match data_{{i}}.pt"),
}


def make_source_with(tmp_path: Path, kind: str) -> tuple[Path, str, str]:
    """A source of 5 good samples plus the entry of ``kind``, beside a sibling run of 5 more samples."""
    src = tmp_path / "runs" / "run1"
    make_source(src)
    make_source(tmp_path / "runs" / "run2")
    make_entry, relpath, problem = UNUSABLE[kind]
    make_entry(src)
    return src, relpath, problem.format(src=src.resolve(), parent=src.resolve().parent)


@pytest.mark.parametrize("kind", UNUSABLE)
def test_an_entry_discovery_cannot_use_stops_a_conversion_and_is_named(tmp_path, cli, kind):
    src, relpath, problem = make_source_with(tmp_path, kind)
    dst = tmp_path / "store"

    r = cli(*convert_args(src, dst))

    assert r.status == 1
    assert f"h5feed convert: error: {src.resolve() / relpath}: {problem}\n" in r.output
    assert not dst.exists()


@pytest.mark.parametrize("kind", UNUSABLE)
def test_skip_bad_records_an_entry_discovery_cannot_use(tmp_path, cli, kind):
    src, relpath, problem = make_source_with(tmp_path, kind)
    dst = tmp_path / "store"

    r = cli(*convert_args(src, dst, "--skip-bad"))

    assert r.status == 0, r.output
    assert "(5 converted now, 0 from an earlier run, 1 skipped)" in r.output
    store = Store(dst)
    assert list(store.source_paths) == [f"data_{i}.pt" for i in range(5)]  # nothing from the sibling run
    assert describe_store(dst)["skipped"] == [{"path": relpath, "problem": problem}]


def test_skip_bad_with_nothing_readable_and_no_format_given(tmp_path, cli):
    src, dst = tmp_path / "src", tmp_path / "store"
    for path in make_source(src, lengths=[4, 5]):
        BAD["random-bytes"][0](path)
    corrupt = "not a readable torch.save file (truncated or corrupt): UnpicklingError: Unsupported operand 95"

    r = cli(*convert_args(src, dst, "--skip-bad"))

    assert r.status == 1
    assert (f"h5feed convert: error: {src.resolve()}: no readable sample files: 2 skipped, first problems: "
            f"data_0.pt: {corrupt}; data_1.pt: {corrupt}\n") in r.output
    assert not dst.exists()


def test_rerun_is_a_no_op_and_another_codec_is_refused(tmp_path, cli, interrupted_convert):
    src, dst = tmp_path / "src", tmp_path / "store"
    make_source(src)
    interrupted_convert(src, dst, after=2, settings=CHUNKED)
    r = cli(*convert_args(src, dst, "--codec", "lz4"))
    assert r.status == 1
    assert (f"h5feed convert: error: {dst}: was started with codec zstd, not codec lz4: "
            "repeat that command to resume, or pass --overwrite") in r.output

    r = cli(*convert_args(src, dst))
    assert r.status == 0 and "(3 converted now, 2 from an earlier run, 0 skipped)" in r.output
    r = cli(*convert_args(src, dst))
    assert r.status == 0
    assert f"{dst} is already complete: nothing to do" in r.output
    assert "(0 converted now, 5 from an earlier run, 0 skipped)" in r.output
    r = cli(*convert_args(src, dst, "--codec", "lz4"))
    assert r.status == 1
    assert f"h5feed convert: error: {dst}: is complete but was converted with codec zstd, not codec lz4: " in r.output
    assert "choose another DST or pass --overwrite" in r.output
    assert Store(dst).info.codec.to_json() == ZSTD


# --------------------------------------------------------------------------- full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (needs root), unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=False,
                           capture_output=True, text=True)
    except FileNotFoundError as exc:
        pytest.skip(f"cannot mount a small tmpfs: {exc}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {r.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_disk_full_names_the_sample_and_the_same_command_resumes(tmp_path, small_disk, cli, assert_same_tree):
    src, ref, dst = tmp_path / "src", tmp_path / "ref", small_disk / "store"
    write_synthetic(src, LEGACY, 20, 64, lengths=(150, 250), seed=4)  # ~3 MB uncompressed: does not fit in 2 MiB
    convert(src, ref, workers=0, progress=False, settings=StoreSettings(codec="none", chunk_tokens=64))
    args = ("convert", src, dst, "--workers", 0, "--codec", "none", "--chunk-tokens", 64)

    r = cli(*args)

    assert r.status == 1
    m = re.search(rf"h5feed convert: error: {re.escape(str(dst))}: disk full while writing data_(\d+)\.pt: "
                  "free space and run the same command to resume", r.output)
    assert m, r.output
    done = read_journal(dst)
    assert 0 < len(done) < 20 and int(m[1]) not in done
    with pytest.raises(StoreError, match="has not finished"):
        Store(dst)

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    r = cli(*args)
    assert r.status == 0
    assert f"({20 - len(done)} converted now, {len(done)} from an earlier run, 0 skipped)" in r.output
    r = cli("verify", dst, "--against", src)
    assert r.status == 0 and f"{dst}: 20 samples OK (checksums and source files)" in r.output
    assert_same_tree(dst, ref)


# --------------------------------------------------------------------------- verify


def converted(tmp_path: Path, codec: str = "zstd") -> tuple[Path, Path]:
    src, dst = tmp_path / "src", tmp_path / "store"
    make_source(src)
    convert(src, dst, workers=0, progress=False, settings=StoreSettings(codec=codec, chunk_tokens=CHUNK))
    return src, dst


def test_verify_a_clean_store(tmp_path, cli):
    src, dst = converted(tmp_path)
    r = cli("verify", dst)
    assert r.status == 0 and f"{dst}: 5 samples OK (checksums)" in r.output
    r = cli("verify", dst, "--against", src)
    assert r.status == 0 and f"{dst}: 5 samples OK (checksums and source files)" in r.output


def test_verify_finds_a_flipped_byte(tmp_path, cli, flip_byte):
    _src, dst = converted(tmp_path, codec="none")
    shard = flip_byte(dst, 3, "aux_hidden_states", chunk=1, at=1001)  # rows 16..31 of sample 3, stored raw

    with pytest.raises(CorruptSampleError) as err:
        Store(dst).read_sample(3)
    assert (err.value.sample, err.value.source_path, err.value.path) == (3, "data_3.pt", str(shard))
    report = verify_store(dst, progress=False)
    assert [(m.sample, m.source_path) for m in report.mismatches] == [(3, "data_3.pt")]
    assert "inner chunk 1 fails its checksum" in report.mismatches[0].problem

    r = cli("verify", dst)
    assert r.status == 1
    assert f"MISMATCH sample 3 (data_3.pt): {shard}: sample 3 (converted from data_3.pt): inner chunk 1 fails its " \
           "checksum" in r.output
    assert f"{dst}: 1 mismatch(es) in 5 samples (checksums)" in r.output


def test_a_chunk_that_no_longer_decodes_is_refused_even_unchecked(tmp_path, flip_byte):
    _, dst = converted(tmp_path, codec="zstd")
    path, offset, _ = inner_chunk_span(dst, 3, "aux_hidden_states", 1)
    data = path.read_bytes()[offset:]
    assert not data[2] & 0x02  # Blosc header flags: compressed, not stored raw
    block = int.from_bytes(data[16:20], "little")
    assert data[block + 4 : block + 8] == b"\x28\xb5\x2f\xfd"  # after the stream length: the zstd frame magic
    flip_byte(dst, 3, "aux_hidden_states", chunk=1, at=block + 4)

    with pytest.raises(CorruptSampleError, match="inner chunk 1 fails its checksum"):
        Store(dst).read_sample(3)
    with pytest.raises(CorruptSampleError, match=r"sample 3 \(converted from data_3.pt\): .*[Ee]rror"):
        Store(dst, checked=False).read_sample(3)  # checks off (cost measurements): decoding still refuses it
    assert Store(dst).read_sample(2).num_tokens == LENGTHS[2]  # its neighbours are untouched


def test_verify_against_the_source_catches_a_changed_source_file(tmp_path, cli):
    src, dst = converted(tmp_path)

    def flip_one_bit(d: dict) -> None:
        last = d["hidden_states"][-1].clone()
        last.view(torch.int16)[5, 7] ^= 1
        d["hidden_states"][-1] = last

    rewrite(src / "data_2.pt", flip_one_bit)
    (src / "data_4.pt").unlink()

    r = cli("verify", dst)
    assert r.status == 0  # the store itself is intact
    r = cli("verify", dst, "--against", src)
    assert r.status == 1
    assert "MISMATCH sample 2 (data_2.pt): last_hidden_states differs from the source file" in r.output
    assert f"MISMATCH sample 4 (data_4.pt): source cannot be read: {src / 'data_4.pt'}: cannot be opened" in r.output
    assert r.output.count("MISMATCH") == 2


# --------------------------------------------------------------------------- inspect


def test_inspect_prints_what_the_store_holds(tmp_path, cli):
    src, dst = converted(tmp_path)
    tokens = sum(LENGTHS)
    raw = tokens * ((K + 1) * H * 2 + 8 + 8)
    arrays = ("aux_hidden_states", "last_hidden_states", "input_ids", "loss_mask")
    stored = sum(f.stat().st_size for a in arrays for f in (dst / a).rglob("*") if f.is_file())

    r = cli("inspect", dst, "--json")

    assert r.status == 0
    assert json.loads(r.stdout) == {
        "store": str(dst),
        "samples": 5,
        "tokens": tokens,
        "tokens_per_sample": {"min": 3, "mean": 19.2, "max": 40},
        "hidden_size": H,
        "num_aux_layers": K,
        "dtype": "bfloat16",
        "last_state_norm": "pre",
        "source_format": LEGACY,
        "source_root": str(src.resolve()),
        "codec": ZSTD,
        "format_version": 2,
        "chunk_tokens": CHUNK,
        "shard_tokens": 48,  # the longest sample (40 tokens) in whole chunks
        "raw_bytes": raw,
        "stored_bytes": stored,
        "compression_ratio": round(raw / stored, 3),
        "skipped": [],
    }
    r = cli("inspect", dst)
    assert r.status == 0
    for key, value in (("samples", 5), ("tokens", tokens), ("hidden_size", H), ("num_aux_layers", K),
                       ("dtype", "bfloat16"), ("last_state_norm", "pre"),
                       ("codec", "blosc zstd, level 1, byte shuffle, 1 MiB blocks"),
                       ("raw_bytes", f"{raw / 1e3:.3g} kB ({raw:,} bytes)"),
                       ("compression_ratio", f"{round(raw / stored, 3)}x (raw bytes / stored bytes)"), ("skipped", 0)):
        assert re.search(rf"^{key}\s+{re.escape(str(value))}$", r.stdout, re.MULTILINE), key


def test_inspect_and_verify_refuse_what_is_not_a_finished_store(tmp_path, cli, interrupted_convert):
    src, dst = tmp_path / "src", tmp_path / "store"
    make_source(src)
    interrupted_convert(src, dst, after=2, settings=CHUNKED)
    for command in ("inspect", "verify"):
        r = cli(command, dst)
        assert r.status == 1
        assert f"h5feed {command}: error: {dst}: conversion has not finished" in r.output
    r = cli("inspect", src)
    assert r.status == 1 and f"{src}: a folder of speculators-legacy-pt sample files (data_{{i}}.pt), not an h5feed " \
        f"store: convert them into one with `h5feed convert {src} DST`" in r.output
    r = cli("inspect", tmp_path / "missing")  # as `h5feed convert` says of a missing SRC
    assert r.status == 1 and f"{tmp_path / 'missing'}: does not exist: check the path, or create the store" in r.output
    (tmp_path / "empty").mkdir()
    r = cli("inspect", tmp_path / "empty")
    assert r.status == 1 and f"{tmp_path / 'empty'}: not an h5feed store (no zarr.json)" in r.output


def test_h5feed_alone_prints_its_help_and_every_command(capsys):
    from h5feed.cli import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: h5feed")
    assert all(f"    {command}" in out for command in ("convert", "verify", "inspect", "bench", "watch"))


def test_version(capsys):
    from h5feed import __version__
    from h5feed.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"h5feed {__version__}\n"


@pytest.mark.parametrize("command", ["convert", "verify", "inspect", "bench", "watch"])
def test_every_command_help_says_what_it_does_and_shows_examples(capsys, command):
    from h5feed.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]  # after the usage lines
    assert len(description.split()) > 10 and not description.lstrip().startswith(("positional", "options"))
    examples = out[out.index("examples:\n"):].splitlines()[1:]
    assert examples and all(line.startswith((f"  h5feed {command} ", "  (")) for line in examples)


def test_a_file_skipped_while_converting_is_retried_once_repaired(tmp_path, cli, interrupted_convert,
                                                                 assert_sample_matches_source):
    """Damaged after it was planned (here: while the conversion was stopped), it is skipped while converting,
    not while planning; repaired, --retry-skipped plans it again after the last sample, and it is no longer
    reported as skipped."""
    src, dst = tmp_path / "src", tmp_path / "store"
    files = make_source(src)
    assert sorted(interrupted_convert(src, dst, after=2, settings=CHUNKED)) == [0, 1]
    good = files[3].read_bytes()
    BAD["truncated-pt"][0](files[3])
    resumed = cli(*convert_args(src, dst, "--skip-bad"))
    assert resumed.status == 0, resumed.output
    assert [s.path for s in Store(dst).info.skipped] == [files[3].name] and len(Store(dst)) == len(files) - 1

    files[3].write_bytes(good)
    retried = cli(*convert_args(src, dst, "--retry-skipped"))
    assert retried.status == 0, retried.output
    assert "trying the 1 file(s) skipped before again" in retried.output
    store = Store(dst)
    assert len(store) == len(files) and store.info.skipped == []
    assert store.source_paths == [f.name for i, f in enumerate(files) if i != 3] + [files[3].name]
    for i in range(len(store)):
        assert_sample_matches_source(store, i, LEGACY, src)

    again = cli(*convert_args(src, dst, "--retry-skipped"))  # nothing skipped is left: nothing to do
    assert again.status == 0 and "nothing to do" in again.output and len(Store(dst)) == len(files)


def test_a_skipped_file_repaired_later_is_converted_by_retry_skipped(tmp_path, cli, assert_sample_matches_source):
    src, dst = tmp_path / "src", tmp_path / "store"
    files = make_source(src)
    good = files[3].read_bytes()
    damage, problem = BAD["truncated-pt"]
    damage(files[3])
    first = cli(*convert_args(src, dst, "--skip-bad"))
    assert first.status == 0 and len(Store(dst)) == len(files) - 1
    assert [s.path for s in Store(dst).info.skipped] == [files[3].name]

    still_bad = cli(*convert_args(src, dst, "--skip-bad", "--retry-skipped"))  # not repaired yet: still skipped
    assert still_bad.status == 0 and len(Store(dst)) == len(files) - 1
    assert [s.path for s in Store(dst).info.skipped] == [files[3].name]

    files[3].write_bytes(good)  # repaired
    rerun = cli(*convert_args(src, dst))  # a plain rerun leaves it, and says how to take it
    assert rerun.status == 0 and len(Store(dst)) == len(files) - 1
    assert "is already complete: nothing to do; 1 file(s) were skipped: once repaired, --retry-skipped" in rerun.output

    retried = cli(*convert_args(src, dst, "--retry-skipped"))
    assert retried.status == 0, retried.output
    assert "trying the 1 file(s) skipped before again" in retried.output
    store = Store(dst)
    assert len(store) == len(files) and store.info.skipped == []
    assert store.source_paths[-1] == files[3].name  # appended after the samples converted before
    for i in range(len(store)):
        assert_sample_matches_source(store, i, LEGACY, src)
