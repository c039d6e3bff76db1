import sys, time, statistics, torch, weakref, operator
def t(f, n=2000):
    for _ in range(20): f()
    xs=[]
    for _ in range(5):
        s=time.perf_counter()
        for _ in range(n): f()
        xs.append((time.perf_counter()-s)/n*1e6)
    return round(min(xs),1)
ts=[torch.zeros(3, 4) for _ in range(1168)]
gs=[torch.zeros(3, 4) for _ in range(1168)]
from zfunc.tree import SameObjects
so = SameObjects(ts)
refs=[weakref.ref(x, lambda r: None) for x in ts]; deref = weakref.ref.__call__
shape_of = operator.attrgetter("shape")
r = ["ids", t(lambda: so(ts)),
     "deref is_", t(lambda: False not in map(operator.is_, map(deref, refs), ts)),
     "strong is_", t(lambda: False not in map(operator.is_, ts, ts)),
     "shapes", t(lambda: list(map(shape_of, ts)) == list(map(shape_of, gs))),
     "is_same_size", t(lambda: False not in map(torch.Tensor.is_same_size, ts, gs)),
     "versions", t(lambda: list(map(operator.attrgetter("_version"), ts))),
     ]
print(*r)
