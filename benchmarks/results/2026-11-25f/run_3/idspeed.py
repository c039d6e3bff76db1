import time, torch, statistics, operator, weakref, itertools, sys
def t(f, n=2000):
    for _ in range(20): f()
    xs=[]
    for _ in range(5):
        s=time.perf_counter()
        for _ in range(n): f()
        xs.append((time.perf_counter()-s)/n*1e6)
    return round(min(xs),1), round(statistics.median(xs),1)
print(sys.version)
ts=[torch.zeros(3) for _ in range(1168)]
ids=tuple(map(id, ts)); idl=list(ids)
refs=[weakref.ref(x) for x in ts]; deref=weakref.ref.__call__
held=list(ts)
print("tuple(map(id)) == ids", t(lambda: tuple(map(id, ts)) == ids))
print("tuple(map(id)) only", t(lambda: tuple(map(id, ts))))
print("list(map(id)) == idl", t(lambda: list(map(id, ts)) == idl))
print("all(map(is_, map(deref, refs), ts))", t(lambda: all(map(operator.is_, map(deref, refs), ts))))
print("held == ts (strong)", t(lambda: held == ts))
print("False in map(is_, held, ts)", t(lambda: False in map(operator.is_, held, ts)))
ints=[i*7919 for i in range(1168)]; it=tuple(ints)
print("tuple of small ints compare", t(lambda: tuple(ints) == it))
big=[id(x) for x in ts]; bt=tuple(big)
print("tuple(list of big ints) == (no alloc)", t(lambda: tuple(big) == bt))
print("list(map(id)) alloc only", t(lambda: list(map(id, ts))))
import gc; print("gc thresholds", gc.get_threshold())
print("list(map(deref, refs)) == ts", t(lambda: list(map(deref, refs)) == ts))
print("[*map(deref, refs)] == ts", t(lambda: [*map(deref, refs)] == ts))
wr = weakref.WeakValueDictionary()
print("tuple(ts) == tuple(held)", t(lambda: tuple(ts) == tuple(held)))
