"""Where the CPU of a loader's processes goes, by stage, from a `perf record -g` profile (native and kernel frames).

On a 2-core box py-spy cannot keep up with a trainer and four workers (it falls seconds behind and
misses short-lived workers); perf samples every CPU in the kernel, so its shares are the CPU's.  Each
sample is filed by its leaf frame (decode, crc32c, copies, the interpreter) or, for a kernel leaf, by
the system call or fault above it (mapping the shard files, unmapping, page faults, fadvise, ...).

    perf record -F 499 -g -o loader.perf -- python bench/run_loader.py BatchLoader 4 3
    perf script -i loader.perf -F comm,ip,sym > loader.script
    python bench/perf_stages.py loader.script [--comm pt_data_worker]   # the workers; "python": the trainer's process
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterator

# (stage, substrings of the leaf frame's symbol), first match wins
USER_STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("decode: blosc / zstd (its raw-block memcpy included)", ("ZSTD", "HUF_", "FSE_", "blosc", "unshuffle", "HIST_")),
    ("check: crc32c", ("crc32c",)),
    ("copy: memmove (zstd raw blocks, partial chunks)", ("memmove", "memcpy")),
    ("memset (pads)", ("memset",)),
    ("torch kernels", ("at::native", "c10::")),
    ("python interpreter", ("_PyEval", "PyObject", "_Py", "Py", "dict", "tuple", "unicode", "gen_", "frame",
                            "list_", "long_", "type_", "method", "cfunction", "vectorcall")),
    ("garbage collector", ("gc_collect", "visit_decref", "visit_reachable")),
]
# (stage, substrings of any kernel frame of the sample), first match wins
KERNEL_STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("kernel: mmap (MAP_POPULATE of shard files and slots)", ("sys_mmap", "vm_mmap_pgoff")),
    ("kernel: munmap", ("sys_munmap", "vm_munmap")),
    ("kernel: page faults (first touch, copy-on-write)", ("exc_page_fault",)),
    ("kernel: fadvise (read-ahead of shard files)", ("fadvise",)),
    ("kernel: open / close / stat", ("sys_openat", "sys_close", "sys_newfstatat", "sys_fstat")),
    ("kernel: futex / scheduling / polling", ("futex", "schedule", "sys_poll", "sys_epoll", "nanosleep")),
    ("kernel: fork / exit", ("do_exit", "exit_mmap", "copy_process", "kernel_clone")),
    ("kernel: pipe and socket I/O", ("sys_read", "sys_write", "sys_sendmsg", "sys_recvmsg")),
    ("kernel: interrupts", ("irq",)),
]


def samples(path: str) -> Iterator[tuple[str, list[str]]]:
    """(command, frames leaf first) of each sample of `perf script -F comm,ip,sym` output."""
    comm, frames = None, []
    with open(path) as f:
        for line in f:
            if not line.strip():
                if comm is not None:
                    yield comm, frames
                comm, frames = None, []
            elif not line[0].isspace():
                comm, frames = line.split()[0], []
            else:
                frames.append(line.strip())
    if comm is not None:
        yield comm, frames


def stage(frames: list[str]) -> str:
    """A frame reads `ADDRESS SYMBOL`; kernel addresses start with ffffffff."""
    if not frames:
        return "other"
    symbol = frames[0].split(maxsplit=1)[-1]
    if frames[0].startswith("ffffffff"):
        kernel = [frame for frame in frames if frame.startswith("ffffffff")]
        for name, needles in KERNEL_STAGES:
            if any(needle in frame for frame in kernel for needle in needles):
                return name
        return f"kernel: other ({symbol})"
    for name, needles in USER_STAGES:
        if any(needle in symbol for needle in needles):
            return name
    return f"other ({symbol[:60]})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", help="output of `perf script -F comm,ip,sym`")
    parser.add_argument("--comm", default="pt_data_worker", help="the processes' command name")
    parser.add_argument("--top", type=int, default=16)
    args = parser.parse_args()
    stages = Counter(stage(frames) for comm, frames in samples(args.script) if comm == args.comm)
    total = sum(stages.values()) or 1
    print(f"{args.comm}: {total} samples")
    for name, n in stages.most_common(args.top):
        print(f"  {100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
