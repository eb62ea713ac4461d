"""Where a rank's memory goes when it loads from object storage: bench_s3.py's checkpoint, server and shaped proxy,
and in each rank a thread that samples its RssAnon every 2 ms beside the live bytes of the cooperative fetch's
buffers (``pieces.wave_buffer``) and of the stream's staging.

    python benchmarks/probe_s3_memory.py [--size-gb 2.0] [--ranks 1 2 3] [--warm-client] [--chunk-mib N]
        [--readers N] [--wave-mib N] [--checkpoint DIR]

It prints, per rank, the peak RssAnon above the post-import baseline against the rank's bf16 shard, and what was
live at that peak: the model's bytes loaded so far, the wave buffers, and the rest (the client, staging, gloo,
allocator slack). ``--warm-client`` opens the S3 filesystem and lists the prefix before the baseline, so the rest
less the same run without it is what the client costs. A probe, not a benchmark: bench_s3.py's numbers are the ones
the parent samples.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _rss_anon_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def child(args) -> None:
    import weakref

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import lowmem_hf
    from lowmem_hf.sources import exchange, pieces

    torch.set_num_threads(1)
    tp = {}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
        tp = {"tp_plan": "auto"}
    MODEL_FOR_CAUSAL_LM_MAPPING[LlamaConfig]
    import s3fs  # noqa: F401

    if args.warm_client:
        from lowmem_hf.sources.objectstore import ObjectStore

        ObjectStore(args.url).list()
    live = {"wave": 0}
    lock = threading.Lock()
    original = pieces.wave_buffer

    def counted(nbytes: int):
        tensor = original(nbytes)
        with lock:
            live["wave"] += nbytes

        def gone(n=nbytes):
            with lock:
                live["wave"] -= n

        weakref.finalize(tensor.untyped_storage(), gone) if nbytes else None
        return tensor

    pieces.wave_buffer = exchange.wave_buffer = counted
    if args.wave_mib:  # the cooperative fetch's default wave and smallest span, for trying others
        from lowmem_hf.sources import schedule

        schedule.DEFAULT_WAVE_BYTES, schedule._MIN_SPAN_BYTES = args.wave_mib << 20, int(args.min_span_mib * 2**20)
    if args.readers:  # the cooperative fetch's reader threads (``schedule.DIRECT_READERS``), for trying others
        import dataclasses

        exchange.CooperativeRanges.policy = dataclasses.replace(exchange.CooperativeRanges.policy, workers=args.readers)
    base = _rss_anon_kb()
    peak = {"kb": 0, "wave": 0, "t": 0.0}
    stop = threading.Event()
    start = time.perf_counter()

    def sample():
        while not stop.is_set():
            kb = _rss_anon_kb() - base
            if kb > peak["kb"]:
                peak.update(kb=kb, wave=live["wave"], t=time.perf_counter() - start)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    chunk = {"chunk_bytes": args.chunk_mib << 20} if args.chunk_mib else {}
    model = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(args.url, torch_dtype=torch.bfloat16, **tp, **chunk)
    seconds = time.perf_counter() - start
    end = (_rss_anon_kb() - base) * 1024
    stop.set()
    sampler.join()
    model_bytes = sum((p.data.to_local() if hasattr(p.data, "to_local") else p.data).nbytes for p in model.parameters())
    print("RESULT " + json.dumps(dict(rank=int(os.environ.get("RANK", 0)), seconds=seconds, model=model_bytes,
                                      peak=peak["kb"] * 1024, end=end, wave_at_peak=peak["wave"], t_peak=peak["t"])), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--warm-client", action="store_true")
    parser.add_argument("--chunk-mib", type=int, default=None)
    parser.add_argument("--readers", type=int, default=None, help="reader threads of the cooperative fetch")
    parser.add_argument("--wave-mib", type=int, default=None, help="the cooperative fetch's default wave")
    parser.add_argument("--min-span-mib", type=float, default=4, help="with --wave-mib: its smallest span")
    parser.add_argument("--checkpoint", default=None, help="a saved checkpoint folder to load instead (e.g. bench_shapes.py's)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=str(HERE / "_work"))
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    sys.path.insert(0, str(HERE))
    sys.path.append(str(REPO / "tests"))
    import bench_s3
    from measure import free_port
    from s3_server import start_s3_server, weed_binary

    workdir = Path(args.workdir)
    checkpoint = Path(args.checkpoint) if args.checkpoint else bench_s3.make_shaped_checkpoint(workdir, "llama-tp6", args.size_gb)
    server = start_s3_server(weed_binary())
    proxy = bench_s3.ShapedProxy(server.endpoint, rate=100e6, latency_s=0.02)
    try:
        url = server.upload(str(checkpoint), "probe")
        for ranks in args.ranks:
            port, procs = free_port(), []
            with tempfile.TemporaryDirectory(dir=workdir) as home:
                for rank in range(ranks):
                    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HOME=f"{home}/hf{rank}",
                               LOWMEM_HF_STORE_CACHE=f"{home}/store{rank}", AWS_ENDPOINT_URL=proxy.endpoint,
                               AWS_ACCESS_KEY_ID=server.key, AWS_SECRET_ACCESS_KEY=server.secret, AWS_DEFAULT_REGION="us-east-1",
                               RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                    argv = [sys.executable, __file__, "--child", "--url", url]
                    argv += ["--warm-client"] if args.warm_client else []
                    argv += ["--chunk-mib", str(args.chunk_mib)] if args.chunk_mib else []
                    argv += ["--readers", str(args.readers)] if args.readers else []
                    argv += ["--wave-mib", str(args.wave_mib), "--min-span-mib", str(args.min_span_mib)] if args.wave_mib else []
                    procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
                outs = [p.communicate(timeout=1800)[0] for p in procs]
            for out in outs:
                line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(f"ranks={ranks}: a rank printed no result:\n{out[-2000:]}")
                    continue
                r = json.loads(line[7:])
                m = r["model"]
                print(f"ranks={ranks} rank={r['rank']} {r['seconds']:.2f}s  peak RssAnon {r['peak'] / m:.3f}x shard "
                      f"({r['peak'] / 2**20:.0f} MiB, at {r['t_peak']:.2f}s); at the peak: wave buffers "
                      f"{r['wave_at_peak'] / 2**20:.1f} MiB, the rest above the shard "
                      f"{(r['peak'] - m - r['wave_at_peak']) / 2**20:.1f} MiB; after the load {(r['end'] - m) / 2**20:.1f} MiB above the shard",
                      flush=True)
    finally:
        proxy.close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
