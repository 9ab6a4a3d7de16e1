"""`python -m h5feed.specforge_train train --config RUN.yaml [section.field=value ...]` (its entry module runs `main`):
SpecForge 0.2's own ``specforge train``, with an h5feed store as ``data.hidden_states_path`` (and ``data.eval_hidden_states_path``).

The arguments are SpecForge's (``specforge train --help``), plus two of h5feed's, taken out before SpecForge reads
the rest: ``--h5feed-on-corrupt raise|skip`` (a sample whose stored bytes fail their checks: its error, default,
or a logged and counted skip) and ``--h5feed-cache-dir DIR`` (a node-local cache of a store in a bucket).  h5feed's
reader and feature store are installed in SpecForge's offline runtime (`h5feed.integrations.specforge`), then
SpecForge's CLI runs, its code unchanged.  Before that, for a run on a store, this command says up front what would
fail later: a disaggregated deployment (its producer ingests feature files), a multi-process topology launched
without torchrun (SpecForge would start its ranks as ``specforge.cli``, without the store), and on a machine without
a GPU what SpecForge cannot run there (FSDP sharding, EAGLE-3's Triton loss).  And where SpecForge would derive the
EAGLE-3 draft vocabulary from every feature file before the first step, the mapping is made from the store's ids and
loss masks alone (in SpecForge's order, so it is the mapping SpecForge makes from the files), kept beside SpecForge's
own in ``data.cache_dir``, and given to SpecForge as ``model.vocab_mapping_path``.

Several GPUs: ``torchrun --nproc_per_node N -m h5feed.specforge_train train --config RUN.yaml`` (with
``deployment.trainer.nproc_per_node: N``), as SpecForge itself starts them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from h5feed.errors import H5feedError
from h5feed.integrations.requirements import missing_install

NEEDS = ("SpecForge 0.2 (`pip install --no-deps specforge==0.2.0`: the release pins torch 2.11 and sglang, which "
         "its offline training never imports) and what that training imports: transformers, accelerate, datasets, "
         "pydantic, pyyaml")
_IMPORTED = (("specforge", "specforge"), ("transformers", "transformers"), ("accelerate", "accelerate"),
             ("datasets", "datasets"), ("pydantic", "pydantic"), ("yaml", "pyyaml"))


def unmet_requirement() -> str | None:
    """What this machine lacks for the command, or None: said before SpecForge starts, which would end on an
    import error only once its trainer is being assembled."""
    return missing_install(_IMPORTED, "specforge", "0.2", "h5feed's integration is written for SpecForge 0.2's runtime")


def h5feed_options(argv: Sequence[str]) -> tuple[Any, list[str]]:
    """(h5feed's `StoreAccess`, SpecForge's own arguments)."""
    from h5feed.integrations.specforge import StoreAccess

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--h5feed-on-corrupt", choices=("raise", "skip"), default="raise")
    parser.add_argument("--h5feed-cache-dir", default=None)
    ours, rest = parser.parse_known_args(list(argv))
    return StoreAccess(ours.h5feed_on_corrupt, ours.h5feed_cache_dir), rest


def _train_parser() -> argparse.ArgumentParser:
    """The arguments of ``specforge train`` (SpecForge 0.2's cli.py), to read the run's config as SpecForge will."""
    parser = argparse.ArgumentParser(prog="python -m h5feed.specforge_train train", allow_abbrev=False)
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("--role", default="auto")
    parser.add_argument("--node-rank", type=int, default=None)
    parser.add_argument("--plan", action="store_true")
    parser.add_argument("overrides", nargs="*")
    return parser


def prepared(argv: Sequence[str], access: Any) -> list[str]:
    """SpecForge's arguments for a run on a store, checked, with the store's vocabulary mapping where SpecForge
    would count the files for one; any other command as it is."""
    from specforge.config import load_config

    from h5feed.integrations.specforge import names_store

    if not argv or argv[0] != "train":
        return list(argv)
    args = _train_parser().parse_args(list(argv[1:]))
    cfg = load_config(args.config, args.overrides)
    stores = [path for path in (cfg.data.hidden_states_path, cfg.data.eval_hidden_states_path) if names_store(path)]
    if not stores:
        return list(argv)
    if cfg.deployment.mode == "disaggregated":
        raise H5feedError(f"{stores[0]} is an h5feed store, which SpecForge reads in its colocated offline runtime "
                          "(deployment.mode local_colocated); a disaggregated producer ingests feature files")
    topology = cfg.deployment.trainer
    if topology.nnodes * topology.nproc_per_node > 1 and "WORLD_SIZE" not in os.environ:
        raise H5feedError(f"deployment.trainer asks for {topology.nnodes * topology.nproc_per_node} processes, which "
                          "SpecForge would start as `python -m specforge.cli`, without h5feed's store: start them "
                          f"with torchrun instead: torchrun --nproc_per_node {topology.nproc_per_node} -m "
                          f"h5feed.specforge_train {' '.join(argv)}")
    if args.plan:
        return list(argv)
    _check_device(cfg)
    mapping = _vocab_mapping(cfg, access)
    if mapping is None:
        return list(argv)
    flags = ["--config", args.config, "--role", args.role, *(["--node-rank", str(args.node_rank)]
                                                              if args.node_rank is not None else [])]
    return ["train", *flags, *args.overrides, f"model.vocab_mapping_path={mapping}"]


def _check_device(cfg: Any) -> None:
    """Without a GPU SpecForge trains only where its code runs on a CPU: say so before the models are built."""
    from specforge.utils import get_device_type

    if get_device_type() != "cpu":
        return
    if cfg.training.strategy in ("eagle3", "peagle"):
        raise H5feedError(f"training.strategy {cfg.training.strategy}: SpecForge 0.2's EAGLE-3 objective runs a "
                          "Triton kernel (specforge.core.loss), which needs a CUDA GPU; this machine has none")
    if cfg.training.fsdp_sharding != "NO_SHARD":
        raise H5feedError(f"training.fsdp_sharding {cfg.training.fsdp_sharding}: SpecForge wraps the draft in FSDP, "
                          "which needs a GPU; on a CPU pass training.fsdp_sharding=NO_SHARD (SpecForge then uses DDP)")


def _vocab_mapping(cfg: Any, access: Any) -> str | None:
    """The store's EAGLE-3 vocabulary mapping file, made once, where SpecForge would derive one from its files."""
    from specforge.algorithms.contracts import FeatureMode
    from specforge.application import resolve_run

    registration = resolve_run(cfg).algorithm
    if FeatureMode.OFFLINE not in registration.providers.vocab_mapping_modes or cfg.model.vocab_mapping_path:
        return None
    from specforge.modeling.target.target_utils import load_target_config, target_vocab_size
    from specforge.training.model_loading import resolve_draft_config

    from h5feed.integrations.specforge import OpenStores, count_loss_tokens, store_identity, vocab_mapping_path

    draft_config = resolve_draft_config(cfg, provider=registration.providers.model.draft_config)
    draft_vocab = int(getattr(draft_config, "draft_vocab_size", draft_config.vocab_size))
    target_vocab = target_vocab_size(load_target_config(cfg.model.target_model_path, cache_dir=cfg.model.cache_dir,
                                                        trust_remote_code=cfg.model.trust_remote_code))
    if draft_vocab == target_vocab:
        return None
    store = OpenStores(access).get(cfg.data.hidden_states_path)
    path = vocab_mapping_path(cfg.data.cache_dir, store_identity(store, cfg.data.max_length), draft_vocab, target_vocab)
    if not path.is_file():
        from specforge.data.preprocessing import process_token_dict_to_mappings

        counts = count_loss_tokens(store, cfg.data.max_length, target_vocab, access.on_corrupt)
        d2t, t2d = process_token_dict_to_mappings(counts, draft_vocab, target_vocab)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = Path(f"{path}.{os.getpid()}.tmp")
        torch.save({"d2t": d2t, "t2d": t2d}, temporary)
        os.replace(temporary, path)
    return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run SpecForge's CLI with `argv` (default: this command's arguments) on h5feed's reader and feature store."""
    unmet = unmet_requirement()
    if unmet is not None:
        raise SystemExit(f"python -m h5feed.specforge_train: {unmet}; it needs {NEEDS}")
    access, rest = h5feed_options(sys.argv[1:] if argv is None else argv)
    from specforge.cli import main as specforge_main

    from h5feed.integrations.specforge import install

    try:
        arguments = prepared(rest, access)
        install(access)
    except H5feedError as error:
        raise SystemExit(f"python -m h5feed.specforge_train: {error}") from None
    return specforge_main(arguments)

