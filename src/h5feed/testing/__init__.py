"""Test and bench tooling: synthetic sample files in every input format (`synthetic`) and the `.pt` loader h5feed
is measured against, speculators 0.4's (`baseline`).

They ship in the wheel, not only in a checkout, because `h5feed bench` builds its embedded default set with
`synthetic.write_synthetic` and runs `baseline`'s loader beside h5feed's on installs that have no checkout.
"""
