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
there: the checkpoint cannot know it. The tied weights ``state.ties``
recorded (from `zf.functional`) are saved too, for `consolidate`.

``dir`` must be on a filesystem every rank shares: each rank writes its own
files there. Before anything is committed or deleted, every rank checks it
sees the others' files; if not, every rank raises, saying so, and no older
checkpoint is touched (ranks on node-local disks would otherwise each
"save" and ``keep`` would delete every restorable checkpoint).

**restore(dir, like, step=None, *, strict=True, verify=True, rng=True,
group=None, progress=False, cast=False) -> (state, client_state)**: ``like`` is a state
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
presence, size, header and origin (the rank and part it was written as),
this rank's RNG states and client tensors, and (``verify``) each read file's
SHA-256. A tensor the template holds in a narrower dtype than the checkpoint
(fp32 saved, fp16 template) is refused unless ``cast=True`` (the compute copy
of a template with a master is a cast of the master and always allowed).

Exact resume: K steps, save, restore in fresh processes, M steps gives
bitwise the parameters of K+M uninterrupted steps (same world size), when
the caller restores before drawing any random numbers it wants replayed and
resumes its data from client_state.

**consolidate(dir, out, dtype=torch.float32, *, step=None, aliases="recorded",
model=None, verify=True, progress=True)** writes the full weights (what
``step.gather`` returns) keyed by parameter name to one safetensors file, one
parameter in memory at a time, with every tied alias the checkpoint recorded
(``head.weight`` beside ``embed.weight``; ``aliases="none"`` leaves them out).
A training state holds only trainable parameters: pass ``model=`` (the
model trained) to also write its frozen parameters and buffers, so that
``model.load_state_dict(load_file(out))`` loads strictly; without it, load
with ``strict=False``. See `zfunc.io.export`. Also ``zfunc consolidate DIR
OUT [--model MODULE:FACTORY]`` and ``python -m zfunc.io consolidate DIR OUT``.

Layout on disk (format version 2; 4 adds ``mesh`` and its sections, below)::

    dir/latest                         "step_000123 <SHA-256 of step_000123/manifest.json>\n"
    dir/.zfunc.lock                    the lock a save holds (flock); left in place
    dir/step_000123/manifest.json      format, format_version, zfunc/torch versions, created, step, world_size,
                                       stage (0 = unsharded), layout (units, keys, shapes), params (full
                                       shapes), weights (the group step.gather returns), groups (dtype per
                                       key), leaves (dtype, shape), ties ([alias, key] pairs), files: per rank
                                       {rank, parts: [{file, bytes, sha256}], rng, client_state}
    dir/step_000123/manifest.sha256    "<SHA-256 of manifest.json>  manifest.json" (sha256sum -c checks it)
    dir/step_000123/rank_00000.safetensors, rank_00000.p001.safetensors, ...
        rng/torch_cpu, rng/cuda/<i>, rng/python, rng/numpy, client/<i>
        step, opt_state/0/count, ...   replicated leaves (rank 0's files only)
        params/<key>, opt_state/0/mu/<key>, extras/mixed_precision/master/<key> ...
                                       this rank's 1-D slice [a, b) of each parameter (whole tensors,
                                       in their shapes, in an unsharded save: rank 0's files only)

Format 1 (no ``manifest.sha256``, no ``ties``, ``latest`` holding the name
alone) is still read, with a warning that its manifest is not checksummed;
saving again writes format 2.

Format 3 is format 2 plus one section: ``tensor_parallel`` (a state split
by `tensor_parallel`: ``{size, splits: {key: [dim, parts]}, coords: [[dp rank,
tp rank] per world rank]}``) or ``pipeline`` (a state split into stages by
`pipeline` alone: ``{pp, holders: {key: rank}, stage_blocks: [[block, ...]
per stage]}``, the world's ranks the pipeline's). It is still read.

Format 4, written for any state split by `tensor_parallel` or `pipeline`
(besides `shard` or not), is format 2 plus ``mesh``: ``{dp, pp, tp, coords:
[[dp rank, pp rank, tp rank] per world rank]}``, with either section or both:
``tensor_parallel`` as in format 3 without ``coords``, ``pipeline`` as in
format 3 with ``holders`` naming pipeline ranks. ``params`` holds every
stage's full shapes, ``groups`` every stage's parameters, and ``layout``
(under `shard`) is one layout over the dp ranks whose units are every
pipeline rank's (each parameter in one unit, of its stage; tp-local shapes).
Each rank saves the 1-D range ``[a, b)`` of its tp shard of each parameter
its pipeline rank holds that its dp shard holds (parameters tp replicates:
from tp rank 0 only); a restore maps every saved range to the runs of the
full parameter's flat elements it covers (`zfunc.io.entries.Spans`), so it
reshards across any (dp, pp, tp) layout: pp2 x dp2 -> dp4 -> pp2 x dp2,
tp2 x pp2 -> tp2 x dp2 -> dp4 -> tp2 x pp2, tp2 x dp2 -> one process, pp2 ->
pp1 -> pp2. A state whose dp x pp x tp split does not span the ranks that
save or restore it is refused on every rank, naming the split.

A rank's data is split into parts of about ``part_bytes`` (512 MiB; a larger
tensor gets a part of its own) that are written, hashed and read by parallel
threads. The SHA-256 of each file is computed while it is written and is what
``sha256sum`` prints.

Integrity: every byte a restore trusts is checksummed, in a chain: ``latest``
records the SHA-256 of the manifest it points at, ``manifest.sha256`` that
of the manifest, and the manifest that of every rank file. A flipped bit
anywhere is a `CheckpointError` naming the file (rank files: with
``verify=True``, the default). The manifest is then validated field by field
(types, ranges, cross-references), and the bytes its shapes describe must fit
in the bytes its files hold, so no crafted size is allocated.

Confinement: a checkpoint is read only from the files zfunc names inside its
directory — each rank part has exactly one possible name, and symbolic links
(a rank file, a manifest, a ``step_*`` directory, ``latest``) are refused
before anything is read through them.

Atomicity: ranks write into ``step_<n>.tmp-<token>/``; after all have
written (and fsynced) and checked they see each other's files, rank 0 writes
the manifest and its checksum, renames the directory to ``step_<n>/``, then
replaces ``latest`` (temp file, fsync, rename) and only then deletes old
checkpoints (``keep``) and debris of killed saves, each renamed out of sight
before it is removed. A kill at any moment leaves ``latest`` naming a
complete checkpoint (or, in the instant a re-save of the same step swaps
directories, the parked copy whose manifest checksum ``latest`` records).
One save per directory at a time: rank 0 holds an advisory lock
(``fcntl.flock`` on ``dir/.zfunc.lock``) for the whole save, a second save
raises saying another save is writing there, and the kernel releases the
lock of a killed process.

Ownership: zfunc deletes or replaces only what it provably wrote. A
``latest`` that is not in zfunc's format, or a ``step_<n>`` directory in the
way that is not a checkpoint zfunc wrote (its manifest fails its checksum or
validation, or it holds other files, or it is a link), stops a save before
it writes anything; ``keep`` and the debris cleanup leave such directories
alone, with a warning.

Ranks: every exchange between ranks goes through `zfunc.dist` (JSON, never
pickled) and names the call and phase it belongs to. A rank that never calls
(``if rank == 0: save(...)``) makes the others raise
`zfunc.dist.CollectiveError` after ``$ZFUNC_TIMEOUT_S`` seconds (300 by
default; phases that move data add time for 16 MiB/s), saying that every
rank must call it; ranks in different calls all raise `CheckpointError`.

Hugging Face weights: **load_pretrained(dir, like, *, step=None, model=None, rename=None, ...)
-> (state, LoadReport)** streams a ``save_pretrained`` directory (safetensors, single or sharded)
into a training state, each rank reading only what its shards hold, or into a meta-built model
unit by unit while ``step.init`` builds its state; **export_hf(out_dir, source, *, model=None,
...)** writes a state, a zfunc checkpoint or full weights back as a directory
``from_pretrained`` loads, one parameter at a time. See `zfunc.io.hf`.

Nothing is unpickled: the rank files are plain safetensors (read here with
``readinto`` straight into the target tensors; ``safetensors.safe_open`` reads
them too) and the manifest is JSON. Every problem — a truncated or corrupted
file, a missing rank file, a manifest of a newer format version, a
directory that is not a checkpoint — raises `CheckpointError` (a
``ValueError``) naming the file and what is wrong.
"""

from zfunc.io.export import consolidate
from zfunc.io.format import FORMAT_VERSION, CheckpointError
from zfunc.io.hf import LoadReport, export_hf, load_pretrained
from zfunc.io.manifest import read_manifest
from zfunc.io.reader import list_checkpoints, locate, restore
from zfunc.io.writer import save

__all__ = ["FORMAT_VERSION", "CheckpointError", "LoadReport", "consolidate", "export_hf", "list_checkpoints",
           "load_pretrained", "locate", "read_manifest", "restore", "save"]
