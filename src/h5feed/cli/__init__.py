"""The `h5feed` command (`main`): `main` holds the parser and the commands, `options` the flags they share."""

from h5feed.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
