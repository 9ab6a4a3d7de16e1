"""The read engine every loader shares: the sample schedule, the ordered read-ahead, the placement into the batch,
the slot ring, the delivery thread, and the loaders built on them.

Import the modules themselves (or the loaders from `h5feed`): this package imports nothing on its own, since
`h5feed.collate` uses `h5feed.loading.placement` and the loaders use `h5feed.collate`.
"""
