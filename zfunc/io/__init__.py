"""Saving and restoring training state: `save`, `restore`, `consolidate`.

Named ``io`` so it cannot be confused with the activation-``checkpoint``
transform. ::

    from zfunc.io import save, restore, consolidate

    save("runs/a", state, client_state={"data_pos": pos}, keep=3)        # on every rank
    state = step.init(zf.TrainState.create(params, opt))                  # the target layout
    state, client = restore("runs/a", like=state)                         # latest; or step=1200
    consolidate("runs/a", "model.safetensors")                            # full fp32 weights

**save(dir, state, client_state=None, keep=None, *, group=None, progress=False, part_bytes=512 MiB)**
is called on every rank of the (data-parallel) group with the same
``state.step`` (else every rank raises `CheckpointError`). It writes
``dir/step_<step>/``: one file per rank and a manifest, and points
``dir/latest`` at it. Besides the state (parameters, optimizer state, the
transforms' extras: fp32 master, loss scale, step and schedule counts) each
rank saves its RNG states — torch CPU, CUDA (every device, if CUDA is in use),
Python's `random` and NumPy's global generator — and its own
``client_state``: a JSON-able dict (str keys; tuples come back as lists)
that may hold tensors (they come back on the CPU). Put the data position
there: the checkpoint cannot know it.

**restore(dir, like, step=None, *, strict=True, verify=True, rng=True,
group=None, progress=False) -> (state, client_state)**: ``like`` is a state
made by the target step's ``.init`` on this rank (it knows its world size,
stage and placement). The checkpoint's values are written into ``like``'s
own tensors with ``copy_`` (so `shard`'s per-key views of one flat buffer per
unit stay views, and tensors stay on their devices and in their dtypes) and
``like`` is returned. Any world size and stage restores from any other
(stage 3 on 4 ranks -> stage 2 on 2 ranks -> one plain process): each rank
file holds, for every param-shaped entry, the rank's flat element range
``[a, b)`` of each parameter (known from the layout in the manifest), and a
target rank reads the ranges it needs from whichever files hold them.
Replicated entries (step, counts, loss scale) come from rank 0. RNG states
are restored per rank when the world size is unchanged (warned and skipped
otherwise), and so is each rank's client_state (rank 0's otherwise). Before
anything is written, everything is checked: parameter names and shapes (a
mismatch lists the differences), the state's structure (a different
optimizer or transform stack; ``strict=False`` restores what both hold, and
then a master copy stands in for params and vice versa), every rank file's
presence and size, headers, and (``verify``) each read file's SHA-256.

Exact resume: K steps, save, restore in fresh processes, M steps gives
bitwise the parameters of K+M uninterrupted steps (same world size), when
the caller restores before drawing any random numbers it wants replayed and
resumes its data from client_state.

**consolidate(dir, out, dtype=torch.float32, *, step=None, aliases=None,
verify=True, progress=True)** writes the full weights (what ``step.gather``
returns) keyed by parameter name to one safetensors file, one parameter in
memory at a time; see `zfunc.io.export`. Also ``zfunc consolidate DIR
OUT`` and ``python -m zfunc.io consolidate DIR OUT``.

Layout on disk (format version 1)::

    dir/latest                         "step_000123\\n"
    dir/step_000123/manifest.json      format, format_version, zfunc/torch versions, step, world_size,
                                       stage (0 = unsharded), layout (units, keys, shapes), params (full
                                       shapes), weights (the group step.gather returns), groups (dtype per
                                       key), leaves (dtype, shape), files: per rank {rank, parts: [{file,
                                       bytes, sha256}], rng, client_state}
    dir/step_000123/rank_00000.safetensors, rank_00000.p001.safetensors, ...
        rng/torch_cpu, rng/cuda/<i>, rng/python, rng/numpy, client/<i>
        step, opt_state/0/count, ...   replicated leaves (rank 0's files only)
        params/<key>, opt_state/0/mu/<key>, extras/mixed_precision/master/<key> ...
                                       this rank's 1-D slice [a, b) of each parameter (whole tensors,
                                       in their shapes, in an unsharded save: rank 0's files only)

A rank's data is split into parts of about ``part_bytes`` (512 MiB; a larger
tensor gets a part of its own) that are written, hashed and read by parallel
threads. The SHA-256 of each file is computed while it is written and is what
``sha256sum`` prints.

Atomicity: ranks write into ``step_<n>.tmp-<token>/``; after all have
written (and fsynced), rank 0 writes the manifest, renames the directory to
``step_<n>/``, then replaces ``latest`` (temp file, fsync, rename) and only
then deletes old checkpoints (``keep``) and debris of killed saves, each
renamed out of sight before it is removed. A kill at any moment leaves
``latest`` naming a complete checkpoint (or, in the instant a re-save of
the same step swaps directories, `restore` falls back to the newest complete
one). One writer per directory at a time.

Nothing is unpickled: the rank files are plain safetensors (read here with
``readinto`` straight into the target tensors; ``safetensors.safe_open`` reads
them too) and the manifest is JSON. Every problem — a truncated or corrupted
file, a missing rank file, a manifest of a newer format version, a
directory that is not a checkpoint — raises `CheckpointError` (a
``ValueError``) naming the file and what is wrong.
"""

from zfunc.io.export import consolidate
from zfunc.io.format import FORMAT_VERSION, CheckpointError
from zfunc.io.manifest import read_manifest
from zfunc.io.reader import list_checkpoints, locate, restore
from zfunc.io.writer import save

__all__ = ["FORMAT_VERSION", "CheckpointError", "consolidate", "list_checkpoints", "locate", "read_manifest",
           "restore", "save"]
