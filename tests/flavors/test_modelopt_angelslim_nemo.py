"""Model-Optimizer, AngelSlim and NeMo Automodel: their files converted bit for bit, and the flavors' items and
batches equal, key by key, to those of re-implementations of each trainer's released dataset and collate run
on the source files (notes/trainer_semantics.md §6-8).  Also: the norm that must be stated or must match, the
NeMo cache's missing last state and token 0, and cross-serving between pipelines."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, angelslim_collate, assert_same, bits, modelopt_collate, nemo_collate

import h5feed
from h5feed import HiddenStatesDataset, HiddenStatesStream, StreamLoader, TrainerCollate, trainer_collate
from h5feed.errors import SourceError, StoreError
from h5feed.flavors import FLAVORS
from h5feed.flavors.base import register_flavors
from h5feed.store import Store
from h5feed.store.writer_state import LOCK_FILE
from h5feed.testing.synthetic import PipelineOptions, write_synthetic
from h5feed.verify import describe_store, verify_store

H, K, N = 16, 3, 6
LENGTHS = [6, 30, 11, 25, 9, 17]
CHUNK = 8


# --------------------------------------------------------------------------- the trainers, restated
# Each function restates the released code named in its docstring, on the source files, without h5feed (their
# collates: conftest's modelopt_collate, angelslim_collate and nemo_collate).


def modelopt_item(path: Path, answer_only_loss: bool = False, release: str = "0.46") -> dict[str, Any]:
    """Model-Optimizer `OfflineSupervisedDataset.__getitem__` (modelopt/torch/speculative/eagle/utils.py, 0.46.0;
    0.45.0 has no `base_hidden_prenorm`).  A TRT-LLM dump's `hidden_state_features` is read as the
    `aux_hidden_states` the post-processing meant it to be (the released dataset would raise KeyError)."""
    data = torch.load(path, weights_only=True)
    if "hidden_state_features" in data:
        data["aux_hidden_states"] = data.pop("hidden_state_features")
    labels = torch.full_like(data["input_ids"], -100)
    labels[..., :-1] = data["input_ids"][..., 1:]
    loss_mask = data["loss_mask"].to(data["input_ids"].dtype) if answer_only_loss else torch.ones_like(data["input_ids"])
    item = {
        "input_ids": data["input_ids"],
        "base_model_hidden_states": data["hidden_states"],
        "aux_hidden_states": data["aux_hidden_states"],
        "attention_mask": torch.ones_like(data["input_ids"]),
        "loss_mask": loss_mask,
        "labels": labels,
    }
    if release == "0.46":
        item["base_hidden_prenorm"] = bool(data.get("hidden_states_prenorm", False))
    return item


def angelslim_item(path: Path) -> dict[str, Any]:
    """AngelSlim `OfflineEagle3Dataset._load_ckpt` (offline_dataset_builder.py): the file's dict plus
    `attention_mask` (it loads with torch.load's default, weights_only=True since torch 2.6)."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    data["attention_mask"] = torch.ones_like(data["input_ids"])
    return data


class NemoCachedDataset:
    """NeMo Automodel `CachedEagle3Dataset` (components/datasets/llm/eagle3_cache.py, cache format 2)."""

    keys = ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask")

    def __init__(self, cache_dir: Path) -> None:
        self.dir = cache_dir
        m = json.loads((cache_dir / "manifest.json").read_text())
        self.vocab, self.shard_size = int(m["draft_vocab_size"]), int(m["shard_size"])
        topk = m.get("target_probs_topk")
        self.compressed = topk is not None and 0 < int(topk) < self.vocab
        probs = ("target_probs_values", "target_probs_indices") if self.compressed else ("target_probs",)
        self.disk_keys = self.keys + probs

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        shard, offset = divmod(index, self.shard_size)
        with safe_open(str(self.dir / f"shard-{shard:06d}.safetensors"), framework="pt") as handle:
            sample = {key: handle.get_slice(key)[offset] for key in self.disk_keys}
        if self.compressed:
            values, indices = sample.pop("target_probs_values"), sample.pop("target_probs_indices")
            full = torch.zeros((*values.shape[:-1], self.vocab), dtype=values.dtype)
            sample["target_probs"] = full.scatter_(-1, indices.to(torch.long), values)
        return sample


def without_pad_activations(item: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The cache's item as h5feed keeps it: the pad tokens' aux states and distributions (rows the trainer
    masks out: attention_mask 0, position_mask False) are zeros; everything else as stored."""
    t = int(item["attention_mask"].sum())
    assert not item["position_mask"][t:].any() and not item["loss_mask"][t:].any()
    out = dict(item)
    for key in ("aux_hidden_states", "target_probs"):
        out[key] = item[key].clone()
        out[key][t:] = 0
    return out


# --------------------------------------------------------------------------- sources and stores


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`made(name, fmt, variant=None, last_state_norm=None, **write)` -> (source, store): written and converted once."""
    cache: dict[str, tuple[Path, Path]] = {}

    def make(name: str, fmt: str, variant: str | None = None, last_state_norm: str | None = None,
             **write: Any) -> tuple[Path, Path]:
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            write_synthetic(root / "src", fmt, N, H, K, lengths=LENGTHS, seed=5,
                            pipeline=PipelineOptions(variant=variant, **write))
            h5feed.convert(root / "src", root / "store", workers=0, progress=False,
                           settings=h5feed.StoreSettings(chunk_tokens=CHUNK, last_state_norm=last_state_norm))
            cache[name] = (root / "src", root / "store")
        return cache[name]

    return make


def items(store: Path, flavor: str, **kwargs: Any) -> list[dict[str, Any]]:
    dataset = HiddenStatesDataset(store, flavor, **kwargs)
    return [dataset[i] for i in range(len(dataset))]


def sources(store: Path, src: Path) -> list[Path]:
    return [src / p for p in Store(store).source_paths]


# --------------------------------------------------------------------------- conversion, bit for bit

STORES = {  # name: (format, variant, --last-state-norm, norm the store records, optional arrays)
    "modelopt-hf": ("modelopt-pt", "hf", "post", "post", {}),
    "modelopt-vllm": ("modelopt-pt", "vllm", "pre", "pre", {}),
    "modelopt-trtllm": ("modelopt-pt", "trtllm", None, "post", {}),
    "angelslim-hf": ("angelslim-ckpt", "hf", None, "post", {}),
    "angelslim-vllm": ("angelslim-ckpt", "vllm", "post", "post",
                       {"inputs_embeds": {"dtype": "bfloat16", "width": H}, "position_ids": {"dtype": "int64", "width": 1}}),
    "nemo-full": ("nemo-eagle3-cache", "full", None, None,
                  {"position_mask": {"dtype": "bool", "width": 1}, "target_probs": {"dtype": "bfloat16", "width": 64}}),
    "nemo-topk": ("nemo-eagle3-cache", "topk", None, None,
                  {"position_mask": {"dtype": "bool", "width": 1}, "target_probs_values": {"dtype": "bfloat16", "width": 8},
                   "target_probs_indices": {"dtype": "int32", "width": 8}}),
}


def file_arrays(fmt: str, path: Path) -> dict[str, torch.Tensor]:
    """What each array of the store must hold for one source sample, read from the file as those pipelines write it."""
    if fmt == "nemo-eagle3-cache":
        from safetensors import safe_open

        shard, _, row = path.name.partition("#")
        with safe_open(str(path.with_name(shard)), framework="pt") as f:
            d = {key: f.get_slice(key)[int(row)] for key in f.keys()}  # noqa: SIM118 (a safetensors handle)
        t = int(d["attention_mask"].sum())
        out = {"aux_hidden_states": d["aux_hidden_states"], "input_ids": d["input_ids"], "loss_mask": d["loss_mask"],
               "position_mask": d["position_mask"][:, 0]}
        out.update({k: v for k, v in d.items() if k.startswith("target_probs")})
        return {k: v[:t] for k, v in out.items()}
    d = torch.load(path, weights_only=True)
    if fmt == "modelopt-pt":
        aux = d.get("aux_hidden_states", d.get("hidden_state_features"))
        mask = d.get("loss_mask", torch.ones_like(d["input_ids"]))
        return {"aux_hidden_states": aux, "last_hidden_states": d["hidden_states"], "input_ids": d["input_ids"],
                "loss_mask": mask}
    out = {"aux_hidden_states": d["hidden_states"][0], "last_hidden_states": d["target_hiddens"][0],
           "input_ids": d["input_ids"][0], "loss_mask": d["loss_mask"][0]}
    if "inputs_embeds" in d:
        out["inputs_embeds"], out["position_ids"] = d["inputs_embeds"][0], d["position_ids"]
    return out


@pytest.mark.parametrize("name", STORES)
def test_each_pipeline_converts_bit_for_bit(made: Any, name: str) -> None:
    fmt, variant, given, norm, extras = STORES[name]
    src, dst = made(name, fmt, variant, given)
    store = Store(dst)
    info = store.info
    nemo = fmt == "nemo-eagle3-cache"
    assert (info.source_format, info.hidden_size, info.num_aux_layers, info.last_state_norm) == (fmt, H, K, norm)
    stored = {name: extra.record() for name, extra in info.extra_arrays.items()}
    assert (info.has_last_state, info.ids_shifted, stored) == (not nemo, nemo, extras)
    assert info.format_version == (3 if extras or nemo or fmt == "angelslim-ckpt" else 2)
    # AngelSlim's two generator ranks took samples 0-2 and 3-5, each numbering its own from 0; NeMo keeps the
    # rows its attention_mask marks (the first of which holds token 1: the ids are shifted)
    order = [0, 3, 1, 4, 2, 5] if fmt == "angelslim-ckpt" else list(range(N))
    assert store.sample_lengths.tolist() == [LENGTHS[g] for g in order]
    for i, path in enumerate(sources(dst, src)):
        want = file_arrays(fmt, path)
        got = store.read_sample(i)
        stored = {"aux_hidden_states": got.aux_hidden_states, "last_hidden_states": got.last_hidden_state,
                  "input_ids": got.input_ids, "loss_mask": got.loss_mask, **got.extras}
        assert list(want) == list(info.array_names) or set(want) == set(info.array_names)
        for key in info.array_names:
            assert_same(stored[key], want[key], f"{name} sample {i} {key}")
    report = verify_store(dst, against=src, progress=False)
    assert (report.ok, report.samples_checked) == (True, N)


def test_angelslim_sample_order_and_kept_vocab_mapping(made: Any) -> None:
    src, dst = made("angelslim-hf", "angelslim-ckpt", "hf")
    store = Store(dst)
    # data_<i> counts within each generator rank: the store orders by (i, path), and keeps both
    assert store.source_paths[:3] == ["rank_0/rows_0-5000/data_0.ckpt", "rank_1/rows_0-5000/data_0.ckpt",
                                      "rank_0/rows_0-5000/data_1.ckpt"]
    assert store.source_indices.tolist() == [0, 0, 1, 1, 2, 2]
    kept = (dst / "companions" / "vocab_mapping.pt").read_bytes()
    assert kept == (src / "vocab_mapping.pt").read_bytes()
    record = store.info.companions["vocab_mapping.pt"].to_json()
    assert record == {"source": "vocab_mapping.pt", "bytes": len(kept), "crc32c": h5feed.store.crc32c(kept),
                      "copy": "companions/vocab_mapping.pt"}
    (dst / "companions" / "vocab_mapping.pt").write_bytes(kept[:-1] + bytes([kept[-1] ^ 1]))
    try:
        report = verify_store(dst, progress=False)
        assert [str(m) for m in report.mismatches] == [
            "companions/vocab_mapping.pt: differs from the vocab_mapping.pt recorded at conversion"]
    finally:
        (dst / "companions" / "vocab_mapping.pt").write_bytes(kept)


def test_nemo_store_keeps_the_manifest_and_says_what_it_is(made: Any, cli: Any) -> None:
    src, dst = made("nemo-topk", "nemo-eagle3-cache", "topk")
    assert (dst / "companions" / "manifest.json").read_bytes() == (src / "manifest.json").read_bytes()
    summary = describe_store(dst)
    assert (summary["has_last_state"], summary["ids_shifted"], summary["last_state_norm"]) == (False, True, None)
    assert summary["source_info"] == {"seq_length": 30, "draft_vocab_size": 64, "target_probs_topk": 8,
                                      "manifest_format_version": 2, "aux_layer_ids": [1, 2, 3]}
    embeddings = summary["companions"]["target_embeddings.safetensors"]
    assert "copy" not in embeddings and embeddings["bytes"] == (src / "target_embeddings.safetensors").stat().st_size
    assert Store(dst).source_paths[:5] == [f"shard-000000.safetensors#{r}" for r in range(4)] + [
        "shard-000001.safetensors#0"]
    r = cli("inspect", dst)
    assert r.status == 0
    for key, value in (("has_last_state", False), ("ids_shifted", True), ("format_version", 3),
                       ("extra_arrays", len(STORES["nemo-topk"][4]))):
        assert re.search(rf"^{key}\s+{re.escape(str(value))}$", r.stdout, re.MULTILINE), key
    for name in STORES["nemo-topk"][4]:  # each extra array on a line of its own below
        assert re.search(rf"^  {name}: dtype \w+, width \d+$", r.stdout, re.MULTILINE), name


def test_conversion_in_worker_processes_writes_the_same_store(made: Any, tmp_path: Path) -> None:
    """Spawned workers open NeMo shards and AngelSlim extras as the in-process conversion does: same bytes."""
    for name in ("nemo-full", "angelslim-vllm"):
        fmt, variant, given, _, _ = STORES[name]
        src, dst = made(name, fmt, variant, given)
        again = tmp_path / name
        h5feed.convert(src, again, workers=2, progress=False,
                       settings=h5feed.StoreSettings(chunk_tokens=CHUNK, last_state_norm=given))

        def tree(root: Path) -> dict[str, bytes]:
            return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
                    if p.is_file() and p.name != LOCK_FILE}

        assert tree(again) == tree(dst)


# --------------------------------------------------------------------------- items and batches, key by key


@pytest.mark.parametrize("name", ["modelopt-hf", "modelopt-trtllm", "modelopt-flagged"])
def test_modelopt_items_and_batches(made: Any, name: str) -> None:
    write = {"prenorm_flag": True, "variant": "vllm"} if name == "modelopt-flagged" else {"variant": name[9:]}
    src, dst = made(name, "modelopt-pt", last_state_norm="post" if name == "modelopt-hf" else None, **write)
    files = sources(dst, src)
    want = [modelopt_item(p) for p in files]
    assert_same(items(dst, "modelopt"), want)
    assert want[0]["base_hidden_prenorm"] is (name == "modelopt-flagged")  # the flag decides, read from the file
    for train_len in (12, 40):  # shorter than some samples, longer than all: only train_len + 1 tokens are read
        got = items(dst, "modelopt", max_len=train_len)
        assert_same(trainer_collate("modelopt", train_len)(got[:4]), modelopt_collate(want[:4], train_len))
    if name == "modelopt-hf":
        assert_same(items(dst, "modelopt-answer-only"), [modelopt_item(p, answer_only_loss=True) for p in files])
        assert_same(items(dst, "modelopt-0.45"), [modelopt_item(p, release="0.45") for p in files])
        got = items(dst, "modelopt-0.45", max_len=12)
        assert_same(trainer_collate("modelopt-0.45", 12)(got), modelopt_collate([modelopt_item(p, release="0.45")
                                                                                   for p in files], 12))


def test_modelopt_vllm_dumps_are_flagged_pre_norm_as_stated(made: Any) -> None:
    """The vLLM dumper writes the pre-norm state without the flag, so Model-Optimizer's own dataset would call it
    post-norm (base_hidden_prenorm False) and skip the final norm: served from a store converted with
    --last-state-norm pre, the items say True, as they would for the same dumps with the flag written."""
    src, dst = made("modelopt-vllm", "modelopt-pt", "vllm", "pre")
    flagged_src, _ = made("modelopt-flagged", "modelopt-pt", variant="vllm", prenorm_flag=True)
    got = items(dst, "modelopt")
    assert_same(got, [modelopt_item(p) for p in sources(dst, flagged_src)])
    assert [modelopt_item(p)["base_hidden_prenorm"] for p in sources(dst, src)] == [False] * N
    with pytest.raises(StoreError) as info:
        HiddenStatesDataset(dst, "modelopt-0.45")  # releases before the flag assume post-norm
    assert info.value.problem == (
        "flavor 'modelopt-0.45' needs the verifier's last hidden state after the final norm (post-norm), but this "
        "store holds it before the final norm (pre-norm) (converted from modelopt-pt); the two cannot be converted "
        "into each other without the verifier's final-norm weight. Flavors that fit this store: speculators-legacy, "
        "speculators, specforge-dflash, modelopt, modelopt-answer-only")


@pytest.mark.parametrize("name", ["angelslim-hf", "angelslim-vllm"])
def test_angelslim_items_and_batches(made: Any, name: str) -> None:
    fmt, variant, given, _, _ = STORES[name]
    src, dst = made(name, fmt, variant, given)
    want = [angelslim_item(p) for p in sources(dst, src)]
    got = items(dst, "angelslim")
    assert_same(got, want)
    assert_same(trainer_collate("angelslim")(got[:4]), angelslim_collate(want[:4]))
    assert_same(trainer_collate("angelslim")(got[3:]), angelslim_collate(want[3:]))
    with pytest.raises(ValueError, match="flavor 'angelslim' yields whole samples"):
        HiddenStatesDataset(dst, "angelslim", max_len=16)


def test_angelslim_position_ids_come_back_in_their_own_shape(tmp_path: Path) -> None:
    """AngelSlim's backends write position_ids as [T], [1, T], [3, T] (mrope) or [3, 1, T], or None."""
    src = tmp_path / "src"
    write_synthetic(src, "angelslim-ckpt", 4, H, K, lengths=[5, 9, 7, 3], seed=2,
                    pipeline=PipelineOptions(variant="vllm", ranks=1))
    for path in src.rglob("data_*.ckpt"):
        d = torch.load(path, weights_only=True)
        t = d["input_ids"].shape[1]
        d["position_ids"] = torch.stack([torch.arange(t) + 100 * j for j in range(3)])[:, None, :]  # [3, 1, T]
        torch.save(d, path)
    h5feed.convert(src, tmp_path / "store", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=CHUNK, last_state_norm="post"))
    store = tmp_path / "store"
    assert Store(store).info.extra_arrays["position_ids"].record() == {"dtype": "int64", "width": 3}
    assert_same(items(store, "angelslim"), [angelslim_item(p) for p in sources(store, src)])
    none_src = tmp_path / "none"
    write_synthetic(none_src, "angelslim-ckpt", 2, H, K, lengths=[5, 9], seed=2,
                    pipeline=PipelineOptions(variant="vllm", ranks=1))
    for path in none_src.rglob("data_*.ckpt"):
        d = torch.load(path, weights_only=True)
        d["position_ids"] = None  # the vLLM backend when its hook did not capture them
        torch.save(d, path)
    h5feed.convert(none_src, tmp_path / "none-store", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=CHUNK, last_state_norm="post"))
    assert list(Store(tmp_path / "none-store").info.extra_arrays) == ["inputs_embeds"]
    got = items(tmp_path / "none-store", "angelslim")
    assert_same(got, [angelslim_item(p) for p in sources(tmp_path / "none-store", none_src)])
    assert got[0]["position_ids"] is None


@pytest.mark.parametrize("name", ["nemo-full", "nemo-topk"])
def test_nemo_items_and_batches(made: Any, name: str) -> None:
    fmt, variant, _, _, _ = STORES[name]
    src, dst = made(name, fmt, variant)
    cache = NemoCachedDataset(src)
    want = [without_pad_activations(cache[i]) for i in range(N)]
    got = items(dst, "nemo-eagle3")
    assert_same(got, want)
    assert_same(trainer_collate("nemo-eagle3")(got[:4]), nemo_collate(want[:4]))
    full = nemo_collate([cache[i] for i in range(4)])  # the trainer's own batch: equal wherever it is not padding
    batch = trainer_collate("nemo-eagle3")(got[:4])
    seen = full["attention_mask"].bool()
    for key in ("aux_hidden_states", "target_probs"):
        assert torch.equal(bits(batch[key][seen]), bits(full[key][seen]))
    for key in ("input_ids", "attention_mask", "loss_mask", "position_mask"):
        assert torch.equal(batch[key], full[key])
    assert HiddenStatesDataset(dst, "nemo-eagle3", max_len=30).approx_lengths == LENGTHS
    with pytest.raises(ValueError, match=r"max_len must be None or 30, not 16"):
        HiddenStatesDataset(dst, "nemo-eagle3", max_len=16)


def test_each_trainers_module_registers_its_flavors_once() -> None:
    assert list(FLAVORS) == ["speculators-legacy", "speculators", "specforge", "specforge-shifted", "specforge-dflash",
                             "specforge-dspark", "modelopt", "modelopt-answer-only", "modelopt-0.45", "angelslim",
                             "nemo-eagle3"]
    with pytest.raises(ValueError, match="a flavor named 'speculators' is registered already"):
        register_flavors(FLAVORS["speculators"])
    with pytest.raises(ValueError, match="unknown flavor 'speculator'"):
        trainer_collate("speculator", 16)


def test_trainer_collate_is_the_collate_of_every_flavor() -> None:
    """One entry point: every flavor's collate has the batch layout BatchLoader decodes into (test_batch_layouts)."""
    for flavor in FLAVORS:
        max_len = None if flavor in ("angelslim", "nemo-eagle3") else 16
        assert isinstance(trainer_collate(flavor, max_len), TrainerCollate)


def test_a_stream_in_spawned_workers_serves_the_same_items(made: Any) -> None:
    """Flavors travel to spawned DataLoader workers by name (Model-Optimizer's builders are closures)."""
    src, dst = made("modelopt-trtllm", "modelopt-pt", "trtllm")
    stream = HiddenStatesStream(dst, "modelopt", max_len=40, schedule=h5feed.ScheduleOptions(shuffle=False))
    loader = StreamLoader(stream, batch_size=3, num_workers=1, multiprocessing_context="spawn",
                          collate_fn=trainer_collate("modelopt", 40))
    batches = list(loader)
    want = [modelopt_item(p) for p in sources(dst, src)]
    assert_same(batches, [modelopt_collate(want[:3], 40), modelopt_collate(want[3:], 40)])


# --------------------------------------------------------------------------- cross-serving


def test_a_speculators_legacy_store_serves_model_optimizer(tmp_path: Path) -> None:
    """Same aux layers, same (pre-norm) last state: Model-Optimizer 0.46 gets the dump it would have read,
    flagged pre-norm; the releases before the flag, and AngelSlim, need the post-norm state and refuse."""
    src = tmp_path / "src"
    write_synthetic(src, "speculators-legacy-pt", N, H, K, lengths=LENGTHS, seed=5)
    h5feed.convert(src, tmp_path / "store", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=CHUNK))
    store = tmp_path / "store"
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for i, path in enumerate(sources(store, src)):
        d = torch.load(path, weights_only=True)
        torch.save({"input_ids": d["input_ids"], "hidden_states": d["hidden_states"][-1],
                    "aux_hidden_states": torch.cat(d["hidden_states"][:-1], dim=-1), "loss_mask": d["loss_mask"],
                    "hidden_states_prenorm": True}, dumps / f"{i}.pt")
    want = [modelopt_item(dumps / f"{i}.pt") for i in range(N)]
    assert_same(items(store, "modelopt"), want)
    assert_same(trainer_collate("modelopt", 16)(items(store, "modelopt", max_len=16)), modelopt_collate(want, 16))
    for flavor in ("modelopt-0.45", "angelslim"):
        with pytest.raises(StoreError, match="after the final norm .post-norm., but this store holds it before"):
            HiddenStatesDataset(store, flavor)


def test_a_specforge_store_serves_angelslim_and_model_optimizer(tmp_path: Path) -> None:
    """SpecForge's post-norm last state and aux concat are exactly AngelSlim's target_hiddens and hidden_states."""
    src = tmp_path / "src"
    write_synthetic(src, "specforge-ckpt", N, H, K, lengths=LENGTHS, seed=5)
    h5feed.convert(src, tmp_path / "store", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=CHUNK))
    store = tmp_path / "store"
    ckpts = []
    for i, path in enumerate(sources(store, src)):
        d = torch.load(path, weights_only=True)
        ckpts.append(tmp_path / f"angelslim_{i}.ckpt")
        torch.save({"input_ids": d["input_ids"][None], "loss_mask": d["loss_mask"][None],
                    "hidden_states": d["aux_hidden_state"], "target_hiddens": d["hidden_state"]}, ckpts[-1])
    want = [angelslim_item(p) for p in ckpts]
    assert_same(items(store, "angelslim"), want)
    assert_same(trainer_collate("angelslim")(items(store, "angelslim")), angelslim_collate(want))
    assert [item["base_hidden_prenorm"] for item in items(store, "modelopt")] == [False] * N


@pytest.mark.parametrize("flavor", [f for f in FLAVORS if f != "nemo-eagle3"])
def test_a_nemo_store_is_refused_by_every_other_flavor(made: Any, flavor: str) -> None:
    _, dst = made("nemo-full", "nemo-eagle3-cache", "full")
    with pytest.raises(StoreError) as info:
        HiddenStatesDataset(dst, flavor)
    assert info.value.problem == (
        f"flavor {flavor!r} needs the verifier's last hidden state and every token from token 0, but this store "
        "(converted from nemo-eagle3-cache) holds no last hidden state and its input_ids and loss_mask are shifted "
        "left by one (token 0 is gone), as a NeMo Automodel EAGLE-3 cache stores them: serve it with flavor "
        "'nemo-eagle3'")


def test_the_nemo_flavor_refuses_other_stores(made: Any) -> None:
    _, dst = made("angelslim-hf", "angelslim-ckpt", "hf")
    with pytest.raises(StoreError) as info:
        HiddenStatesDataset(dst, "nemo-eagle3")
    assert info.value.problem == (
        "flavor 'nemo-eagle3' serves NeMo Automodel's cached EAGLE-3 items: it needs the draft-vocab target "
        "distribution, position_mask and ids shifted left by one, which only a store converted from a NeMo EAGLE-3 "
        "cache holds (converted from angelslim-ckpt)")


# --------------------------------------------------------------------------- the last state's norm: stated, never guessed


def test_model_optimizer_dumps_need_the_norm_stated(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_synthetic(src, "modelopt-pt", 3, H, K, lengths=[5, 7, 9], seed=1, pipeline=PipelineOptions(variant="vllm"))
    with pytest.raises(SourceError) as info:
        h5feed.convert(src, tmp_path / "store", workers=0, progress=False)
    assert (info.value.path, info.value.problem) == (str(src.resolve() / "conv_000000.pt"), (
        "does not say whether its last hidden state is taken before or after the verifier's final norm "
        "(Model-Optimizer's HF and TRT-LLM dumpers write the post-norm state and its vLLM dumper the pre-norm one; "
        "only the optional 'hidden_states_prenorm' flag says which): state it with --last-state-norm pre|post "
        "(Python: last_state_norm='pre' or 'post')"))
    assert not (tmp_path / "store").exists()
    report = h5feed.convert(src, tmp_path / "store", workers=0, progress=False,
                            settings=h5feed.StoreSettings(last_state_norm="pre"))
    assert (report.num_samples, Store(tmp_path / "store").info.last_state_norm) == (3, "pre")
    with pytest.raises(StoreError, match="was converted with last state norm pre, not last state norm post: "):
        h5feed.convert(src, tmp_path / "store", workers=0, progress=False,
                       settings=h5feed.StoreSettings(last_state_norm="post"))


def test_a_norm_that_contradicts_the_files_or_the_format_is_refused(tmp_path: Path) -> None:
    flagged = tmp_path / "flagged"
    write_synthetic(flagged, "modelopt-pt", 2, H, K, lengths=[5, 7], seed=1,
                    pipeline=PipelineOptions(prenorm_flag=False))
    with pytest.raises(SourceError) as info:
        h5feed.convert(flagged, tmp_path / "a", workers=0, progress=False,
                       settings=h5feed.StoreSettings(last_state_norm="pre"))
    assert (Path(info.value.path).name, info.value.problem) == (
        "conv_000000.pt", "says its last hidden state is post-norm, but --last-state-norm pre was given")
    h5feed.convert(flagged, tmp_path / "a", workers=0, progress=False)  # the flag says it
    assert Store(tmp_path / "a").info.last_state_norm == "post"
    mixed = tmp_path / "mixed"
    write_synthetic(mixed, "modelopt-pt", 2, H, K, lengths=[5, 7], seed=1,
                    pipeline=PipelineOptions(prenorm_flag=True))
    d = torch.load(mixed / "conv_000001.pt", weights_only=True)
    torch.save({**d, "hidden_states_prenorm": False}, mixed / "conv_000001.pt")
    with pytest.raises(SourceError, match="says its last hidden state is post-norm, but conv_000000.pt says pre-norm"):
        h5feed.convert(mixed, tmp_path / "b", workers=0, progress=False)
    legacy = tmp_path / "legacy"
    write_synthetic(legacy, "speculators-legacy-pt", 2, H, K, lengths=[5, 7], seed=1)
    with pytest.raises(SourceError) as info:
        h5feed.convert(legacy, tmp_path / "c", workers=0, progress=False,
                       settings=h5feed.StoreSettings(last_state_norm="post"))
    assert info.value.problem == ("speculators-legacy-pt files hold the pre-norm last hidden state; "
                                  "--last-state-norm post contradicts them")
    nemo = tmp_path / "nemo"
    write_synthetic(nemo, "nemo-eagle3-cache", 2, H, K, lengths=[5, 7], seed=1)
    with pytest.raises(SourceError) as info:
        h5feed.convert(nemo, tmp_path / "d", workers=0, progress=False,
                       settings=h5feed.StoreSettings(last_state_norm="pre"))
    assert info.value.problem == "--last-state-norm pre was given, but nemo-eagle3-cache stores no last hidden state"


def test_the_cli_names_the_missing_option(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_synthetic(src, "angelslim-ckpt", 2, H, K, lengths=[5, 7], seed=1, pipeline=PipelineOptions(variant="vllm"))

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "h5feed.cli", "-q", "convert", str(src), str(tmp_path / "store"),
                               "--workers", "0", *extra], cwd=REPO / "src", capture_output=True, text=True, timeout=120,
                              check=False)

    r = run()
    assert r.returncode == 1
    assert (f"h5feed convert: error: {src.resolve()}/rank_0/rows_0-5000/data_0.ckpt: does not say whether its last "
            "hidden state is taken before or after the verifier's final norm (AngelSlim's vLLM backend") in r.stderr
    assert "state it with --last-state-norm pre|post" in r.stderr
    r = run("--last-state-norm", "post")
    assert r.returncode == 0, r.stderr
    assert Store(tmp_path / "store").info.last_state_norm == "post"

