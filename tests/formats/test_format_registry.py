"""A format is one module that registers itself: registered here, a tiny format is detected, listed and converted.

Two tiny formats, each registered for its test and unregistered after: one whose files have a name of their own
(``sample_{i}.npz``), one whose files share speculators' ``data_{i}.pt`` and are told apart by their keys.  Neither
is known to any of h5feed's modules: what detection, the CLI and the converter know of them, they know from the
registry alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from h5feed import Store, convert
from h5feed.cli.main import main as cli_main
from h5feed.errors import SourceError
from h5feed.formats import (
    FORMATS,
    Detected,
    Detection,
    SampleShape,
    SourceFile,
    SourceFormat,
    SourceSample,
    detect_format,
    register_format,
    unregister_format,
)
from h5feed.formats.safe_load import load_torch_dict

H, K = 32, 3
LENGTHS = [5, 9, 3]


def layers_of(i: int, t: int) -> torch.Tensor:
    """Sample i's K+1 layers, [K+1, T, H] float32, distinct in every value."""
    return torch.randn(K + 1, t, H, generator=torch.Generator().manual_seed(100 + i))


def sample_of(ids: torch.Tensor, layers: torch.Tensor) -> SourceSample:
    return SourceSample(ids.to(torch.int64), None, [torch.cat(list(layers[:-1]), dim=-1)], layers[-1].contiguous())


class TinyNpz(SourceFormat):
    """``sample_{i}.npz``: ``input_ids`` [T] and ``layers`` [K+1, T, H], the last layer pre-norm."""

    name = "tiny-npz"
    detection = Detection(Detected.BY_NAME, "sample_{i}.npz")
    last_state_norm = "pre"
    pattern = re.compile(r"sample_(\d+)\.npz")
    what = "sample_{i}.npz"
    extensions = (".npz",)

    def probe(self, source: SourceFile) -> SampleShape:
        return self.load(source).shape

    def load(self, source: SourceFile) -> SourceSample:
        with np.load(source.path) as f:
            return sample_of(torch.from_numpy(f["input_ids"]), torch.from_numpy(f["layers"]))

    @staticmethod
    def write(root: Path, i: int, ids: torch.Tensor, layers: torch.Tensor) -> None:
        np.savez(root / f"sample_{i}.npz", input_ids=ids.numpy(), layers=layers.numpy())


class TinyPt(SourceFormat):
    """``data_{i}.pt`` holding ``input_ids`` and ``tiny_layers`` [K+1, T, H]: named as speculators' files are, told
    apart from theirs by its keys."""

    name = "tiny-pt"
    detection = Detection(Detected.BY_NAME, "data_{i}.pt", "data_{i}.pt", ("tiny ('input_ids' + 'tiny_layers')",))
    last_state_norm = "pre"
    pattern = re.compile(r"data_(\d+)\.pt")
    what = "data_{i}.pt"
    extensions = (".pt",)

    def claims(self, keys: Mapping[str, Any]) -> bool:
        return "tiny_layers" in keys

    def probe(self, source: SourceFile) -> SampleShape:
        return self.load(source).shape

    def load(self, source: SourceFile) -> SourceSample:
        d = load_torch_dict(source.path)
        return sample_of(d["input_ids"], d["tiny_layers"])

    @staticmethod
    def write(root: Path, i: int, ids: torch.Tensor, layers: torch.Tensor) -> None:
        torch.save({"input_ids": ids, "tiny_layers": layers}, root / f"data_{i}.pt")


@pytest.fixture(params=[TinyNpz, TinyPt], ids=lambda cls: cls.name)
def tiny(request: pytest.FixtureRequest) -> Iterator[type[SourceFormat]]:
    """A tiny format, registered for the test only."""
    before = list(FORMATS)
    register_format(request.param)
    yield request.param
    unregister_format(request.param.name)
    assert list(FORMATS) == before


def write_source(root: Path, fmt: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    root.mkdir(parents=True)
    samples = []
    for i, t in enumerate(LENGTHS):
        ids, layers = torch.randint(0, 1000, (t,), generator=torch.Generator().manual_seed(i)), layers_of(i, t)
        fmt.write(root, i, ids, layers)
        samples.append((ids, layers))
    return samples


def assert_store_holds(dst: Path, name: str, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    store = Store(dst)
    assert (store.info.source_format, store.info.hidden_size, store.info.num_aux_layers) == (name, H, K)
    assert (store.info.last_state_norm, store.sample_lengths.tolist()) == ("pre", LENGTHS)
    assert store.has_loss_mask.tolist() == [False] * len(LENGTHS)
    for i, (ids, layers) in enumerate(samples):
        got = store.read_sample(i)
        assert torch.equal(got.input_ids, ids) and torch.equal(got.loss_mask, torch.ones(len(ids), dtype=torch.int64))
        aux = torch.cat(list(layers[:-1]), dim=-1)
        assert got.aux_hidden_states.dtype == torch.float32 and torch.equal(got.aux_hidden_states.view(torch.int32),
                                                                          aux.view(torch.int32))
        assert torch.equal(got.last_hidden_state.view(torch.int32), layers[-1].contiguous().view(torch.int32))


def test_a_registered_format_is_detected_and_converted_bit_for_bit(tmp_path: Path, tiny: type[SourceFormat]) -> None:
    samples = write_source(tmp_path / "src", tiny)
    assert detect_format(tmp_path / "src") is FORMATS[tiny.name]

    report = convert(tmp_path / "src", tmp_path / "store", workers=0, progress=False)

    assert (report.num_samples, report.num_tokens, report.skipped) == (3, sum(LENGTHS), [])
    assert_store_holds(tmp_path / "store", tiny.name, samples)


def test_the_cli_offers_and_converts_a_registered_format(tmp_path: Path, tiny: type[SourceFormat], capsys) -> None:
    samples = write_source(tmp_path / "src", tiny)
    with pytest.raises(SystemExit):
        cli_main(["convert", "--help"])
    offered = f"input format, one of {', '.join(FORMATS)} (default: detected)"
    assert "".join(offered.split()) in "".join(capsys.readouterr().out.split())  # argparse wraps at hyphens too
    assert list(FORMATS)[-1] == tiny.name

    status = cli_main(["-q", "convert", str(tmp_path / "src"), str(tmp_path / "store"), "--format", tiny.name,
                       "--workers", "0"])

    assert status == 0
    assert_store_holds(tmp_path / "store", tiny.name, samples)


def test_the_errors_of_detection_name_a_registered_format(tmp_path: Path, tiny: type[SourceFormat]) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError) as nothing:
        detect_format(tmp_path / "empty")
    if tiny is TinyNpz:  # a name of its own: listed with the other names
        assert nothing.value.problem == (
            "no sample files of any known format found: expected data_{i}.pt, data_{i}.ckpt[.gz], sample_{i}.npz or "
            "hidden_states/hs_{i}.safetensors (or Model-Optimizer's <conversation_id>.pt, vLLM's {req_id}.safetensors, "
            "or a NeMo cache: manifest.json + shard-NNNNNN.safetensors)")
        return
    assert nothing.value.problem == (  # the name it shares is listed once
        "no sample files of any known format found: expected data_{i}.pt, data_{i}.ckpt[.gz] or "
        "hidden_states/hs_{i}.safetensors (or Model-Optimizer's <conversation_id>.pt, vLLM's {req_id}.safetensors, "
        "or a NeMo cache: manifest.json + shard-NNNNNN.safetensors)")
    (tmp_path / "other").mkdir()
    torch.save({"input_ids": torch.arange(3), "hidden": torch.zeros(3, H)}, tmp_path / "other" / "data_0.pt")
    with pytest.raises(SourceError) as unclaimed:
        detect_format(tmp_path / "other")
    assert unclaimed.value.problem == (
        "keys ('input_ids', 'hidden') match neither speculators legacy ('hidden_states' list), speculators v0 "
        "('hidden_state' + 'target'), Model-Optimizer ('hidden_states' + 'aux_hidden_states' or "
        "'hidden_state_features') nor tiny ('input_ids' + 'tiny_layers')")


def test_files_of_two_names_are_refused_naming_both(tmp_path: Path) -> None:
    register_format(TinyNpz)
    try:
        write_source(tmp_path / "src", TinyNpz)
        torch.save({"input_ids": torch.arange(3), "hidden_states": [torch.zeros(3, H)] * 2}, tmp_path / "src" / "data_0.pt")
        with pytest.raises(SourceError) as both:
            detect_format(tmp_path / "src")
    finally:
        unregister_format(TinyNpz.name)
    assert both.value.problem == ("holds both data_{i}.pt (1) and sample_{i}.npz (3) files; convert each set from "
                                  "its own folder")


def test_the_registry_refuses_a_format_twice_one_without_detection_and_an_unknown_name() -> None:
    class Inherited(TinyNpz):
        name = "inherited"

    class NoDetection(TinyNpz):
        name = "no-detection"
        detection = None
    with pytest.raises(ValueError, match="a format named 'speculators-legacy-pt' is registered already"):
        register_format(type(FORMATS["speculators-legacy-pt"]))
    with pytest.raises(TypeError, match="NoDetection declares no detection"):
        register_format(NoDetection)
    with pytest.raises(ValueError, match="no format named 'tiny-none' is registered"):
        unregister_format("tiny-none")
    register_format(Inherited)  # a subclass inherits its parent's detection
    unregister_format("inherited")
    assert "inherited" not in FORMATS and "no-detection" not in FORMATS
