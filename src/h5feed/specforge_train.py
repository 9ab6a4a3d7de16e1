"""`python -m h5feed.specforge_train train --config RUN.yaml ...`, the command the README and docs name: SpecForge
0.2's own ``specforge train`` on an h5feed store.  It lives in `h5feed.integrations.specforge_train`; this module only
runs it."""

from h5feed.integrations.specforge_train import main

if __name__ == "__main__":
    raise SystemExit(main())
