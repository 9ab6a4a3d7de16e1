"""The read engine every loader shares: the sample schedule, the ordered read-ahead, the slot ring, the delivery
thread, the option objects (`options`), the decode backends (`backends`) and the loaders built on them; each
batch is laid out by `placement` (which the trainers' collates use too).

Import the modules themselves (or the loaders from `h5feed`): this package's loaders import `h5feed.flavors`,
which the package's face must not pull in.
"""
