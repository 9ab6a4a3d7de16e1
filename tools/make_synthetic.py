"""Write synthetic sample files in every input format: `python tools/make_synthetic.py --help`.

The generator lives in the package (`h5feed.testing.synthetic`) because `h5feed bench` builds
its embedded default set with it on installs that have no checkout.
"""

import sys

from h5feed.testing.synthetic import main

if __name__ == "__main__":
    sys.exit(main())
