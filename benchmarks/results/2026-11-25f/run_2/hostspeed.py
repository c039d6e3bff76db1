"""Host speed of the primitives the optimizer phase is made of, on this machine (hot loops)."""
import time, torch, statistics, operator
from zfunc.tree import SameObjects, read_in_c, data_ptr_of
def t(f, n=2000):
    for _ in range(20): f()
    xs=[]
    for _ in range(5):
        s=time.perf_counter()
        for _ in range(n): f()
        xs.append((time.perf_counter()-s)/n*1e6)
    return min(xs), statistics.median(xs)
for dev in ("cpu","cuda"):
    ts=[torch.zeros(3, device=dev) for _ in range(1168)]
    so=SameObjects(ts)
    print(dev, "SameObjects(1168) us", t(lambda: so(ts)))
    print(dev, "data_ptr map(1168) us", t(lambda: tuple(map(data_ptr_of, ts))))
    print(dev, "version map(1168) us", t(lambda: list(map(operator.attrgetter('_version'), ts))))
def loop():
    total=0
    for i in range(200_000): total += i & 7
print("python 200k loop ms", t(loop, 5))
x=torch.zeros(4,4,device="cuda")
print("view us", t(lambda: x.view(16).view(4,4), 20000))
print("add_ launch us", t(lambda: x.add_(1), 5000))
torch.cuda.synchronize()
