"""`python -m h5feed.speculators_train ARGS`, the command the README and docs name: speculators' `train`, able to
read an h5feed store.  It lives in `h5feed.integrations.speculators_train`; this module only runs it."""

from h5feed.integrations.speculators_train import main

if __name__ == "__main__":
    main()
