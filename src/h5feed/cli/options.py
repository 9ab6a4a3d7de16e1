"""Flags that several commands share: how a command reaches a store or sources in a bucket."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

from h5feed.errors import H5feedError, unknown_name


def one_of(kind: str, choices: Iterable[str]) -> Callable[[str], str]:
    """An argparse type for a name among `choices`: a mistyped one is refused with a "did you mean"."""
    known = list(choices)

    def parse(text: str) -> str:
        if text not in known:
            raise argparse.ArgumentTypeError(unknown_name(kind, text, known))
        return text

    return parse


def add_storage_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", metavar="KEY=VALUE", action="append", default=[],
                   help="an option of the URL's fsspec backend, e.g. endpoint_url=http://host:9000 or "
                   "client_kwargs.region_name=eu-west-1 (VALUE is JSON when it parses); repeatable")


def add_location_options(p: argparse.ArgumentParser, cache_flag: str = "--cache-dir") -> None:
    """How a read command reaches a store in a bucket: the backend's options and the node cache."""
    add_storage_option(p)
    p.add_argument(cache_flag, dest="read_cache_dir", metavar="DIR",
                   help="node-local cache of a remote store's objects (later reads are local); default: none")
    p.add_argument(cache_flag.replace("-dir", "-limit"), dest="read_cache_limit", type=byte_count, metavar="BYTES",
                   help="the cache's size limit, e.g. 500G (least recently used objects are evicted)")


def byte_count(text: str) -> int:
    """`500G`, `1.5T`, `123456`: bytes (K, M, G, T are powers of 1000)."""
    units = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    scale = units.get(text[-1:].upper(), 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 500G)") from None


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `--storage-option KEY=VALUE` flags as fsspec storage options."""
    from h5feed.io import parse_storage_options

    try:
        return parse_storage_options(args.storage_option)
    except ValueError as exc:
        raise H5feedError(str(exc)) from None


def location_options(args: argparse.Namespace) -> dict[str, Any]:
    """`Store`'s storage_options, cache_dir and cache_limit, from the flags `add_location_options` adds."""
    return {"storage_options": storage_options(args), "cache_dir": args.read_cache_dir,
            "cache_limit": args.read_cache_limit}
