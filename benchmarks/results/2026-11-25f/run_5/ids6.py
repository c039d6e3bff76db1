import sys, time, torch, weakref, operator
def t(f, n=2000):
    for _ in range(20): f()
    xs=[]
    for _ in range(5):
        s=time.perf_counter()
        for _ in range(n): f()
        xs.append((time.perf_counter()-s)/n*1e6)
    return round(min(xs),1)
def trial(label, make_refs):
    ts=[torch.zeros(3, 4) for _ in range(1168)]
    ids=tuple(map(id, ts))
    refs = make_refs(ts)
    deref = weakref.ref.__call__
    out = [label, "ids", t(lambda: tuple(map(id, ts)) == ids), "id only", t(lambda: tuple(map(id, ts))),
           "ptrs", t(lambda: tuple(map(torch.Tensor.data_ptr, ts)))]
    if refs:
        out += ["deref is_", t(lambda: False not in map(operator.is_, map(deref, refs), ts))]
    print(*out, flush=True)
trial("no refs", lambda ts: None)
trial("refs", lambda ts: [weakref.ref(x) for x in ts])
trial("refs+cb", lambda ts: [weakref.ref(x, lambda r: None) for x in ts])
trial("no refs again", lambda ts: None)
objs=[object() for _ in range(1168)]; oids=tuple(map(id, objs))
print("objects ids", t(lambda: tuple(map(id, objs)) == oids))
