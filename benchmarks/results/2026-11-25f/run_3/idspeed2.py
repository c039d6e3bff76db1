import time, torch, statistics, operator, weakref, itertools, sys, array
def t(f, n=300, pollute=False):
    junk=[]
    xs=[]
    for _ in range(n):
        if pollute:  # a forward/backward's worth of Python objects made and dropped between checks
            junk = [(i, str(i), [i]) for i in range(30000)]
            junk = None
        s=time.perf_counter(); f(); xs.append((time.perf_counter()-s)*1e6)
    return round(min(xs),1), round(statistics.median(xs),1)
print(sys.version)
ts=[torch.zeros(3) for _ in range(1168)]
ids=tuple(map(id, ts)); arr=array.array('Q', ids)
refs=[weakref.ref(x) for x in ts]; deref=weakref.ref.__call__
held=list(ts)
cands = {
 "tuple(map(id)) == ids": lambda: tuple(map(id, ts)) == ids,
 "array('Q', map(id)) == arr": lambda: array.array('Q', map(id, ts)) == arr,
 "all(map(eq, map(id), ids))": lambda: all(map(operator.eq, map(id, ts), ids)),
 "[*map(deref, refs)] == ts": lambda: [*map(deref, refs)] == ts,
 "held == ts (strong)": lambda: held == ts,
}
for p in (False, True):
    for k, f in cands.items():
        print("polluted" if p else "hot", k, t(f, pollute=p))
