"""The GPU backend decodes in whole groups, ahead of need: `decode_in_groups` over a real `ReadAhead`, on the CPU.

The GPU decodes two to three times faster per byte in calls of 8-16 samples than one at a time, and
what it spends decoding it takes from the training step beside it; so a group waits until all its
batches are staged, unless the trainer would otherwise wait.
"""

from __future__ import annotations

import threading
import time

import pytest

from h5feed.loading.backends.cuda import CudaOptions, decode_in_groups
from h5feed.loading.readahead import ReadAhead

GROUP, AHEAD, REGIONS = 4, 8, 8  # regions: the ring of staging memory, a whole number of groups


class Recorder:
    """The decode step: records each group, and checks that no more than AHEAD decoded batches are ever in hand."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []
        self.produced = self.consumed = 0

    def decode(self, group: list[int]) -> list[int]:
        in_hand = self.produced - self.consumed
        assert in_hand == 0 or in_hand + len(group) <= AHEAD, (in_hand, group)
        self.groups.append(list(group))
        self.produced += len(group)
        return list(group)


def groups_of(n: int, read, step_s: float = 0.0, threads: int = 2, depth: int = GROUP) -> Recorder:
    recorder = Recorder()
    with ReadAhead(range(n), read, threads=threads, depth=depth) as staging:
        delivered = []
        for j in decode_in_groups(staging, lambda j: j % REGIONS, recorder.decode, GROUP, AHEAD):
            delivered.append(j)
            recorder.consumed += 1
            time.sleep(step_s)  # the trainer's step: the readers stage ahead meanwhile
    assert delivered == list(range(n))  # every batch once, in order
    return recorder


def test_groups_are_whole_blocks_of_regions_once_the_readers_are_ahead() -> None:
    recorder = groups_of(18, lambda j: j, step_s=0.02)
    assert [j for group in recorder.groups for j in group] == list(range(18))
    for group in recorder.groups:  # one block of regions each: one copy to the GPU
        assert group == list(range(group[0], group[-1] + 1))
        assert group[0] // GROUP == group[-1] // GROUP
    # the first block may go short while the readers start; from then on whole groups, the last what is left
    assert [g for g in recorder.groups if g[0] >= GROUP] == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [16, 17]]


def test_a_trainer_with_nothing_decoded_gets_the_staged_head_without_waiting_for_its_group() -> None:
    gates = [threading.Event() for _ in range(12)]

    def read(j: int) -> int:
        assert gates[j].wait(10), f"batch {j} was never let through"
        return j

    recorder = Recorder()
    got: list[int] = []
    with ReadAhead(range(12), read, threads=GROUP, depth=GROUP) as staging:
        batches = decode_in_groups(staging, lambda j: j % REGIONS, recorder.decode, GROUP, AHEAD)
        gates[0].set()
        taker = threading.Thread(target=lambda: got.append(next(batches)))
        taker.start()
        taker.join(5)
        assert got == [0] and recorder.groups == [[0]]  # batches 1-3 are not staged: the head alone
        recorder.consumed += 1
        for gate in gates:
            gate.set()
        for j in batches:
            got.append(j)
            recorder.consumed += 1
    assert got == list(range(12))


def test_reads_slower_than_the_trainer_still_deliver_every_batch_in_order() -> None:
    def read(j: int) -> int:
        time.sleep(0.01 if j % 3 else 0.03)
        return j

    recorder = groups_of(25, read, threads=3, depth=6)
    assert sum(len(g) for g in recorder.groups) == 25


@pytest.mark.parametrize(("given", "group", "ahead"), [
    ({}, 8, 16),
    ({"prefetch": 4}, 4, 8),  # a smaller prefetch makes smaller groups
    ({"decode_ahead": 4}, 4, 4),  # and so does holding fewer decoded batches
    ({"prefetch": 12, "decode_group": 6}, 6, 12),
    ({"decode_group": 2, "decode_ahead": 5}, 2, 5),
])
def test_the_group_and_how_far_ahead_follow_prefetch_unless_given(given, group, ahead) -> None:
    options = CudaOptions(**given)
    assert (options.decode_group, options.decode_ahead) == (group, ahead)


@pytest.mark.parametrize(("given", "message"), [
    ({"prefetch": 4, "decode_group": 8}, r"prefetch \(4\) must be at least decode_group \(8\)"),
    ({"decode_group": 8, "decode_ahead": 4}, r"decode_ahead \(4\) must be at least decode_group \(8\)"),
    ({"decode_group": 0}, "decode_group must be >= 1"),
])
def test_groups_that_cannot_be_staged_or_held_are_refused(given, message) -> None:
    with pytest.raises(ValueError, match=message):
        CudaOptions(**given)
