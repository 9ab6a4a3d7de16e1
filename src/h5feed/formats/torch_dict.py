"""The formats that are one torch.save dict per sample: speculators' ``.pt``, SpecForge, Model-Optimizer, AngelSlim."""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path

from h5feed.formats.base import SampleShape, SourceFormat, SourceSample
from h5feed.formats.checks import CheckedSample
from h5feed.formats.discovery import SourceFile
from h5feed.formats.safe_load import gz_head_dict, load_torch_dict

__all__ = ["TorchDictFormat"]


class TorchDictFormat(SourceFormat):
    """Formats that are one torch.save dict per sample."""

    def _read(self, path: Path) -> dict:
        return load_torch_dict(path)

    @abstractmethod
    def _check(self, path: Path, d: dict) -> CheckedSample: ...

    def probe(self, source: SourceFile) -> SampleShape:
        head = gz_head_dict(source.path) if source.path.name.endswith(".gz") else None
        return self._check(source.path, head if head is not None else self._read(source.path)).shape

    def load(self, source: SourceFile) -> SourceSample:
        return self.sample_from(self._read(source.path), source.path)

    def sample_from(self, d: dict, where: Path) -> SourceSample:
        """The sample of a dict as the format's files hold it (what the pipeline would `torch.save`), checked
        as a file's would be; `where` names it in errors.  `h5feed.open_writer` appends samples this way."""
        return self._check(where, d).materialize(where)
