"""Storage tiers for training state: the NVMe tier (ZeRO-Infinity's disk) and its pipeline.

State on the NVMe tier lives in scratch files and passes through a few host
buffers once per optimizer step. Per unit (a group of parameters with one
flat fp32 buffer each for master, exp_avg and exp_avg_sq): read the three
buffers, update them with the host Adam kernel, write them back; reading
unit k+1 and writing unit k-1 overlap the update of unit k.

- `DiskStore` (`zfunc.tiers.disk`): named, preallocated files in a fresh
  scratch directory; asynchronous ``write`` / ``read_into`` between files and
  contiguous host tensors, returning Futures; removal of exactly its own
  files (on close, context exit, garbage collection or interpreter exit).
- `ThreadedIO` behind the `FileIO` interface (`zfunc.tiers.fileio`): the
  byte mover (threads of ``pwrite``/``preadv`` straight from/into the
  tensors' memory; O_DIRECT for 4096-aligned pieces); `aligned_empty` makes
  buffers that qualify. KvikIO would be another `FileIO` (see there).
- `stream_units` (`zfunc.tiers.pipeline`): the load -> compute -> store loop
  over units with 2-3 buffer sets, its `Timeline`, and `PipelineError`,
  which says what the files hold after a failure.
- `find_stale` / `remove_stale` (`zfunc.tiers.scratch`): scratch directories
  left by killed processes.

Wiring the Adam NVMe tier (a sketch of what `offload` does with it)::

    names = ("master", "exp_avg", "exp_avg_sq")
    store = DiskStore(nvme_dir)                                   # once, at init
    store.ensure_space(3 * 4 * sum(padded))                       # fail early, with the numbers
    for k, n in enumerate(padded):                                # numels padded to a multiple of 1024
        for x in names:                                           # (4096 bytes): every piece O_DIRECT
            store.allocate(f"{k}.{x}", shape=(n,), dtype=torch.float32)
    bufs = [{x: aligned_empty(max(padded), pin_memory=True) for x in names} for _ in range(3)]

    def load(k, b):                                               # every step
        return [store.read_into(f"{k}.{x}", b[x][:padded[k]]) for x in names]
    def update(k, b):
        n = numels[k]
        adamw_(b["master"][:n], grads[k], b["exp_avg"][:n], b["exp_avg_sq"][:n], lr=lr, step=t,
               out_lowp=lowp[k])                                  # bf16 copy for the device, same pass
    def save(k, b):
        return [store.write(f"{k}.{x}", b[x][:padded[k]]) for x in names]
    timeline = stream_units(range(len(padded)), load, update, save, buffers=bufs)

Choosing the directory: a local NVMe drive (``lsblk -d -o NAME,ROTA,TRAN``
shows ``nvme``; ``findmnt -T DIR`` its filesystem: ext4 or XFS), with room
for 12 bytes per parameter on it. Not a network filesystem (slow;
preallocation and O_DIRECT may be emulated or refused) and not tmpfs/ramfs
(RAM: the tier would save no host memory; ``/tmp`` is tmpfs on many
distributions, and ``/dev/shm`` always). `DiskStore` warns for both kinds.

Measured (this box: 2-core VM, 24 GiB RAM, ext4 on a virtio disk, Linux 6.18;
the disk is throttled by its host and drifted during the session, from 1.1
GB/s for a fresh ``dd oflag=direct`` write to 0.2-0.7 GB/s later, so only
large differences mean anything)::

    python benchmarks/disk_tier.py --only throughput --repeat 3   # 2 GiB file; median GB/s (10^9 B/s)

    method (direct, threads, chunk)     write+sync   read cold   read warm
    store, O_DIRECT, 2-8 thr., 8-64M    0.46-0.65    1.22-1.81   1.13-1.37   (no page cache)
    store, buffered, 1-8 thr., 1-64M    0.21-0.52    0.39-1.54   1.35-3.64
    single thread, O_DIRECT             0.68         1.43        1.02
    single thread, buffered             0.21         1.10        2.91
    numpy tofile / fromfile + copy      0.21         0.20        0.46

"write+sync": until the data is on the device (the sustained rate of a tier
bigger than RAM); "read cold": after the file's pages were evicted.

    python benchmarks/disk_tier.py --only pipeline --repeat 2
    # 12 units x 3 x 32 MiB: 1.1 GiB read + 1.1 GiB written per pass; 4 threads, 8 MiB chunks

    compute per unit     time (s) with 1 / 2 / 3 buffer sets   I/O rate (3)   page cache growth
    100 ms sleep, auto   7.6 / 5.1 / 5.2                       0.46 GB/s      0
    100 ms sleep, off    9.3 / 6.8 / 8.3                       0.29 GB/s      +1.1 GiB
    numba AdamW, auto    7.3 / 5.5 / 6.2                       0.39 GB/s      0
    numba AdamW, off     9.4 / 7.8 / 7.2                       0.34 GB/s      +1.1 GiB

Times run until the last write is on the device (buffered writes can still
sit dirty in the page cache when the loop ends). These loops are I/O-bound
(AdamW computes for 0.6-1.4 s of them): pipelined, they keep the disk busy
(reads, computes and writes overlap: sum of phases / wall 1.7x with 2 sets,
2.0x with 3) and move data at about the disk's rate. Compute-bound
(``--only pipeline --compute sleep:600 --units 8 --repeat 2``: 4.8 s of
compute, ~3.5 s of I/O): O_DIRECT, 2 or 3 sets take 5.5 s against 8.9 s
serially, computing 90-93% of the time (the rest is the first load and the
last store, which nothing can hide); buffered: 7.7 s (the writes wait in
the page cache, then for the device).

Choices, and why:

- threaded ``pwrite``/``preadv`` into the tensor's own memory: zero copies,
  the GIL released during each call, and several requests in flight, so
  the read of unit k+1 does not queue behind the whole write of unit k-1
  (one I/O thread would serve them one after the other). numpy's
  ``tofile``/``fromfile`` is single threaded, and ``fromfile`` returns a new
  array that must be copied into the pinned buffer: slowest here (0.20 GB/s
  cold reads).
- O_DIRECT by default (``direct="auto"``): faster here for everything that
  reaches the device (write+sync, cold reads, every pipeline run), and it
  does not grow the page cache, where buffered I/O put each whole 1.1 GiB
  pass: host RAM the disk tier exists to save, and dirty pages the kernel
  throttles writers on. Its DMA also needs no kernel memcpy, leaving the
  CPU to the Adam kernel. Only "read warm" favours buffered I/O, and warm
  reads mean the state fits in RAM, where the host tier belongs. Unaligned
  pieces still go through the page cache.
- 4 threads, 8 MiB chunks: no thread count or chunk size stood out on this
  disk beyond its noise (the kernel splits a large O_DIRECT request into
  many device requests, so even one thread keeps a queue); on a real NVMe
  drive (3-7 GB/s, deep queues) several requests in flight are what reaches
  the rated bandwidth. Re-measure on the target machine with the commands
  above (``--dir`` on the drive, ``--size-gib`` above its page cache).
- buffer sets: 2 and 3 were within this disk's noise of each other (it
  serves one stream at a time, so the third set has nothing to add); 3 lets
  the read of unit k+1 run beside the write of unit k-1, which a drive with
  parallel queues serves together. One set costs 12 bytes per element of the
  largest unit, little next to the state it streams: 3 is the suggestion.
"""

from zfunc.tiers.disk import DiskSpaceError, DiskStore, filesystem_type
from zfunc.tiers.fileio import ALIGN, DiskIOError, FileIO, ThreadedIO, aligned_empty
from zfunc.tiers.pipeline import PipelineError, Timeline, UnitTimes, stream_units
from zfunc.tiers.scratch import StaleDir, find_stale, remove_stale

__all__ = [
    "ALIGN", "DiskIOError", "DiskSpaceError", "DiskStore", "FileIO", "PipelineError", "StaleDir",
    "ThreadedIO", "Timeline", "UnitTimes", "aligned_empty", "filesystem_type", "find_stale", "remove_stale",
    "stream_units",
]
