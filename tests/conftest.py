"""Shared pytest setup for zfunc. Kept minimal: no autouse fixtures."""

import os

import pytest

# numba's default 'omp' threading layer shares torch's libgomp and is not
# fork-safe: after the pytest process ran a parallel numba kernel, every
# worker forked by zfunc.testing.run_distributed is killed at birth. The
# 'workqueue' layer is fork-safe. Must be set before numba starts its threads;
# an explicit NUMBA_THREADING_LAYER in the environment wins.
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")


def pytest_configure(config):
    if not any(m.split(":")[0].strip() == "slow" for m in config.getini("markers")):
        config.addinivalue_line("markers", "slow: a slow test (deselect with -m 'not slow')")
    # The adversarial suite records what each case ends in (tests/adversarial.py).
    config.addinivalue_line("markers", "outcome(kind): what an adversarial case ends in (tests/adversarial.py)")


@pytest.fixture
def dist():
    """``zfunc.testing.run_distributed``: ``dist(fn, world_size, *args, timeout=..., **kw)``."""
    from zfunc.testing import run_distributed

    return run_distributed


@pytest.fixture
def no_process_group_left():
    """Destroys, after the test, a default process group left in the test process. Lightning's DDP-family
    strategies (zfunc's among them) and accelerate's state make a group of one there and keep it (for a script's
    later ``trainer.test``); every later forked test rank would inherit it, which ``zfunc.testing`` refuses.
    Modules that run those trainers in-process use it (``pytest.mark.usefixtures``)."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
