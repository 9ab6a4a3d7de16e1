"""`python -m h5feed` is the `h5feed` command."""

import sys

from h5feed.cli import main

sys.exit(main())
