"""The read engine every loader shares: the sample schedule, the ordered read-ahead, the placement into the batch."""
