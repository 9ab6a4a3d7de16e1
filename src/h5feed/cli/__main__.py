"""`python -m h5feed.cli` is the `h5feed` command."""

import sys

from h5feed.cli.main import main

sys.exit(main())
