"""One host thread's speed at the kind of work vLLM's in-process engine loop does, as one JSON line.

    python -m bench.host_speed          # on the GPU host and on a reference machine; compare the ms

At the configs' rollout the engine's host loop, not the GPU, sets the pace (docs/results.md, "The rollout at
the shipped workload"), so the rollout's wall time moves with the host CPU's single-thread speed. This
times what that loop is made of, best of 5:
  py_loop_ms      1M dict stores (interpreter dispatch)
  py_objs_ms      200k small objects built and walked (allocation, attribute access)
  hash_pickle_ms  50k pickle + sha256 of a block-sized tuple (vLLM's prefix-cache block hashes)
  torch_cpu_small_op_us  one in-place op on a small CPU tensor (PyTorch's dispatch)
  torch_custom_op_us, torch_custom_op_inplace_us  a small op inside a Python torch.library.custom_op called as
                  a compiled graph calls it (torch.ops): out of place (returns a tensor, as torchao's GEMM op
                  torchao::blockwise_scaled_mm), and in place (as fp8_grpo::wgrad_into); less
                  torch_cpu_small_op_us, what the custom op's Python costs the host a call
  torch_library_op_inplace_us  the in-place op defined through torch.library.Library (fp8.linear.inplace_op,
                  as fp8_grpo::wgrad_into is now): no Python autograd and ADInplaceOrView kernels around it
  cuda_launch_us, h2d_copy_us, launch_sync_us   (with CUDA) a kernel launch, a pinned 1 KiB copy, and a
                  launch followed by a synchronize
plus the CPU model, its reported clock, the CPUs this process may run on and any cgroup CPU quota.
"""

import hashlib
import json
import os
import pickle
import platform
import sys
import time


def best_ms(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(min(times) * 1e3, 2)


def py_loop():
    d = {}
    for i in range(1_000_000):
        d[i & 1023] = i


class _Req:
    __slots__ = ("a", "b", "c")

    def __init__(self, a):
        self.a, self.b, self.c = a, [a], {"k": a}


def py_objs():
    return sum(len(r.b) for r in [_Req(i) for i in range(200_000)])


def hash_pickle():
    block = tuple(range(1, 17))
    for i in range(50_000):
        hashlib.sha256(pickle.dumps((i, block, None))).digest()


def host_facts() -> dict:
    out = {"python": sys.version.split()[0], "machine": platform.machine(),
           "cpus_allowed": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count()}
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        if os.path.exists(path):
            with open(path) as f:
                out["cpu_quota"] = f.read().strip()
    out["cpu_model"], out["cpu_mhz"] = cpuinfo("model name"), cpuinfo("cpu MHz")
    return out


def cpuinfo(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo ("" where there is none): "model name" is what benchmark rows
    record as their host's CPU (bench/runner.py, bench/peer.py), since host-bound phases move with it."""
    if not os.path.exists("/proc/cpuinfo"):
        return ""
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), "")


def torch_times() -> dict:
    import torch

    out = {"torch_threads": torch.get_num_threads()}
    a = torch.zeros(256, dtype=torch.int32)
    n_small, n_launch, n_copy, n_sync = 20_000, 20_000, 5_000, 2_000

    def small_ops():
        for _ in range(n_small):
            a.add_(1)
    out["torch_cpu_small_op_us"] = round(best_ms(small_ops) * 1e3 / n_small, 2)

    @torch.library.custom_op("host_speed::plus_one", mutates_args=())
    def plus_one(t: torch.Tensor) -> torch.Tensor:
        return t + 1

    def add_one(t: torch.Tensor) -> None:
        t.add_(1)

    torch.library.custom_op("host_speed::add_one", add_one, mutates_args=("t",))

    lib = torch.library.Library("host_speed", "FRAGMENT")  # as fp8.linear.inplace_op defines its ops
    lib.define("lib_add_one(Tensor(a!) t) -> ()")
    lib.impl("lib_add_one", add_one, "CompositeExplicitAutograd")  # the same body
    for key, op in (("torch_custom_op_us", torch.ops.host_speed.plus_one.default),
                    ("torch_custom_op_inplace_us", torch.ops.host_speed.add_one.default),
                    ("torch_library_op_inplace_us", torch.ops.host_speed.lib_add_one.default)):
        def custom_ops():
            for _ in range(n_small):
                op(a)
        out[key] = round(best_ms(custom_ops) * 1e3 / n_small, 2)
    if not torch.cuda.is_available():
        return out
    g, h = torch.zeros(256, device="cuda"), torch.zeros(256, pin_memory=True)

    def launches():
        for _ in range(n_launch):
            g.add_(1)
        torch.cuda.synchronize()

    def copies():
        for _ in range(n_copy):
            g.copy_(h, non_blocking=True)
        torch.cuda.synchronize()

    def synced():
        for _ in range(n_sync):
            g.add_(1)
            torch.cuda.synchronize()
    out["cuda_launch_us"] = round(best_ms(launches) * 1e3 / n_launch, 2)
    out["h2d_copy_us"] = round(best_ms(copies) * 1e3 / n_copy, 2)
    out["launch_sync_us"] = round(best_ms(synced) * 1e3 / n_sync, 2)
    return out


def main() -> int:
    out = host_facts()
    out.update(py_loop_ms=best_ms(py_loop), py_objs_ms=best_ms(py_objs), hash_pickle_ms=best_ms(hash_pickle))
    try:
        out.update(torch_times())
    except ImportError:
        pass
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
