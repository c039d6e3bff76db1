"""Where the gradients land, step after step: the sequence of distinct gradient-address tables (update_host_time's model)."""
import sys, torch
sys.argv = [sys.argv[0]]
sys.path.insert(0, "benchmarks")
import update_host_time as u
from zfunc.kernels import adam_segments
seen, seq = {}, []
inner = adam_segments.AdamRuns.set_grads
last = [None]
changed = []
def rec(self, ptrs):
    seq.append(seen.setdefault(tuple(ptrs), len(seen)))
    if last[0] is not None:
        moved = [i for i, (a, b) in enumerate(zip(ptrs, last[0])) if a != b]
        changed.append((len(moved), sorted(set(self.lengths[i] for i in moved))[:6]))
    last[0] = list(ptrs)
    inner(self, ptrs)
adam_segments.AdamRuns.set_grads = rec
device = torch.device("cuda")
for name in ("s1",):
    seen.clear(); seq.clear(); changed.clear(); last[0] = None
    phase = u.Phase(device)
    one = u.build(name, device, phase, medium=True)
    tokens = torch.randint(0, u.VOCAB, (u.BATCH, u.SEQ)).to(device)
    allocated = []
    for i in range(16):
        one(tokens)
        allocated.append(torch.cuda.memory_allocated())
    print(name, "allocated after each step, change from the first:", [a - allocated[0] for a in allocated], flush=True)
    torch.cuda.synchronize()
    print(name, "address tables, step by step:", seq, "addresses changed of", len(last[0]), ":", changed, flush=True)
    print(torch.cuda.memory_stats()["num_alloc_retries"], "retries", flush=True)
