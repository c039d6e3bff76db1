import sys, time, statistics, torch, weakref, operator
what = sys.argv[1]
if what == "zfunc.tree": import zfunc.tree
if what == "zfunc": import zfunc
if what == "triton": import triton
if what == "zfunc+cuda": import zfunc; torch.zeros(1, device="cuda")
def t(f, n=2000):
    for _ in range(20): f()
    xs=[]
    for _ in range(5):
        s=time.perf_counter()
        for _ in range(n): f()
        xs.append((time.perf_counter()-s)/n*1e6)
    return round(min(xs),1)
ts=[torch.zeros(3) for _ in range(1168)]
ids=tuple(map(id, ts))
from zfunc.tree import SameObjects
so = SameObjects(ts)
r = [what, "ids", t(lambda: tuple(map(id, ts)) == ids), "SameObjects", t(lambda: so(ts)),
     "is_", t(lambda: False in map(operator.is_, ts, ts)), "ptrs", t(lambda: tuple(map(torch.Tensor.data_ptr, ts))),
     "ints", t(lambda: tuple(map(int, range(10**9, 10**9 + 1168))))]
print(*r)
