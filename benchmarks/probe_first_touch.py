"""What fresh memory costs on this machine: the floor under every load's time, whatever the loader.

    python benchmarks/probe_first_touch.py [--gb 1.33] [--repeats 6]

Each repeat is a fresh process that allocates ``--gb`` of memory (a model's bytes: the llama2-7b shape of
``bench_shapes.py`` is 1.33 GB in bf16) and faults every page of it in with one ``MADV_POPULATE_WRITE``, the
cheapest way there is to touch fresh memory, then reports the wall time and the kernel CPU time it took. A load
writes its model into exactly such memory, so no loader returns sooner than this. Where the wall time is well above
the kernel's CPU time, the difference is spent outside this machine's kernel (a virtual machine's host backing
the pages), and varies from run to run with which pages the kernel hands out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r"""
import ctypes, json, mmap, resource, sys, time
nbytes = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
memory = mmap.mmap(-1, nbytes)  # anonymous, untouched
address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
if libc.madvise(address, nbytes, 23) != 0:  # MADV_POPULATE_WRITE (Linux 5.14+)
    memory.write(b"\0" * nbytes)  # an older kernel: touch every page by writing it
wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall": wall, "kernel": after.ru_stime - before.ru_stime, "faults": after.ru_minflt - before.ru_minflt}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.33)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args(argv)
    nbytes = int(args.gb * 1e9) // 4096 * 4096
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(nbytes)], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout))
    wall = [r["wall"] for r in runs]
    kernel = [r["kernel"] for r in runs]
    print(f"fresh memory, {args.gb:.2f} GB faulted in, {args.repeats} fresh processes: wall median {statistics.median(wall):.2f} s "
          f"(runs {', '.join(f'{w:.2f}' for w in wall)}), kernel CPU median {statistics.median(kernel):.2f} s, "
          f"{statistics.median(r['faults'] for r in runs):.0f} faults; {args.gb / statistics.median(wall):.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
