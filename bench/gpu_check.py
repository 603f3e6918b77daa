"""The agent on a real GPU: NVML and XID, step time and MFU, the comm split, the cost.

    python bench/gpu_check.py [--layers 8] [--width 8192] [--tokens 8192]

Needs one CUDA GPU (NCCL runs with world size 1). What it checks, each against a
reference measured in the same run:

1. NVML: the agent's ``NvmlDevice.sample()`` on this GPU (every field it read) and its
   XID path (``nvmlDeviceRegisterEvents`` + a wait), and the GPU samples the agent's
   own sampler thread sends during training.
2. Step time and MFU: a bf16 MLP stack whose FLOPs are known exactly. Reference: the
   bare loop timed with CUDA events (the GPU's own clock). Then the same loop under
   ``tw.step`` + ``tw.watch`` two ways: as the agent recommends (no host sync: the
   host queues steps ahead of the GPU) and with a ``loss.item()`` each step (what many
   trainers do). For each: the agent's step time and MFU per step vs the GPU's.
3. Comm split on DDP over NCCL: the sampled profiler window's compute / exposed /
   overlapped / idle and the kernels it classed as NCCL; the hook split beside it.
4. Cost: median step time with the agent ÷ bare, in alternating blocks.
5. Flight Recorder on NCCL: a world-size-1 NCCL group made with ``TORCH_FR_BUFFER_SIZE``
   set, a few all_reduces and a synchronize, then the agent's ``flight.dump`` from a
   second thread (as the exporter thread reads it): the group, the newest entries, and
   PASS / FAIL (available, all_reduce, sequence ids increasing, the newest done).
6. Replica fingerprint (agent/replica.py): 16 bf16 tensors of 8192 x 8192 (1.07 B
   parameters, 2.1 GB; under 3 GB of GPU memory in all) fingerprinted on the GPU: the
   kernel time from CUDA events (median of 10 after a warm-up), GB/s of parameters, and
   the host time to queue it (a checked step's training-thread cost); the fingerprint and
   its capture for the exporter (``capture_ints``) run under
   ``torch.cuda.set_sync_debug_mode("error")``, which raises on any host sync; one flipped
   bit changes word 1 by exactly 2**bit, flipping it back restores it; and the GPU's words
   equal the CPU's for the same bits. PASS / FAIL; SKIP without CUDA.

``--only flight`` (or another check's name, repeatable) runs just those checks.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from itertools import pairwise
from typing import Any

import torch
from torch import nn

import trainwarden.agent as tw


class Collect:
    """A transport that keeps what the agent sends."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        return {}

    def close(self) -> None:
        pass

    def steps(self) -> list[dict[str, Any]]:
        return sorted((s for b in self.bodies for s in b["steps"]), key=lambda s: s["step"])

    def gpu(self) -> list[dict[str, Any]]:
        return [g for b in self.bodies for g in b.get("gpu", [])]

    def events(self) -> list[dict[str, Any]]:
        return [e for b in self.bodies for e in b.get("events", [])]


def section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def nvml_check() -> None:
    section("1. NVML and XID")
    import pynvml

    from trainwarden.agent.gpu import NvmlDevice

    pynvml.nvmlInit()
    print(
        f"driver {pynvml.nvmlSystemGetDriverVersion()}, "
        f"nvidia-ml-py {pynvml.__version__ if hasattr(pynvml, '__version__') else '?'}"
    )
    pynvml.nvmlShutdown()
    device = NvmlDevice(0)
    sample = device.sample()
    print(f"{device.name} ({device.uuid})")
    for key, value in sample.items():
        print(f"   {key:28s} {value}")
    t0 = time.perf_counter()
    try:
        got = device.wait_xid(300)
        print(f"XID path: registered, waited {time.perf_counter() - t0:.2f} s, got {got!r}")
    except Exception as exc:  # noqa: BLE001 - what NVML says is the finding
        print(f"XID path: {type(exc).__name__}: {exc}")
    device.close()


def mlp(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(
        "cuda", torch.bfloat16
    )


def run_steps(
    model: nn.Module, opt: Any, x: torch.Tensor, first: int, n: int, *, agent: bool, sync: bool
) -> tuple[list[float], list[float]]:
    """n steps; (GPU ms per step from our own events, host ms per step)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    host = []
    for i in range(n):
        t0 = time.perf_counter()
        starts[i].record()
        if agent:
            with tw.step(first + i, tokens=x.shape[0]) as s:
                loss = model(x).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                s.loss(loss)
                if sync:
                    loss.item()
        else:
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sync:
                loss.item()
        ends[i].record()
        host.append((time.perf_counter() - t0) * 1000)
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)], host


def mfu_check(layers: int, width: int, tokens: int) -> None:
    section("2. Step time and MFU (bf16 MLP, FLOPs known)")
    torch.manual_seed(0)
    model = mlp(layers, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    flops = 3 * 2 * tokens * width * width * layers  # forward + backward of the linears
    from trainwarden.agent.mfu import resolve_peak

    peak = resolve_peak("bf16")
    assert peak is not None, "no peak FLOP/s for this GPU in the agent's table"
    print(
        f"model: {layers} x Linear({width}, {width}) bf16, {tokens} tokens/step, "
        f"{flops / 1e12:.2f} TFLOP/step; peak {peak.flops / 1e12:.0f} TFLOP/s ({peak.source})"
    )
    run_steps(model, opt, x, 0, 5, agent=False, sync=True)  # warm-up
    gpu, host = run_steps(model, opt, x, 0, 20, agent=False, sync=False)
    bare = statistics.median(gpu)
    print(
        f"bare loop: GPU {bare:.2f} ms/step (host {statistics.median(host):.2f} ms) -> "
        f"MFU {flops / (bare / 1000) / peak.flops:.3f}"
    )

    for sync in (False, True):
        transport = Collect()
        tw.init(
            run=f"gpu-mfu-{int(sync)}",
            transport=transport,
            flops_per_step=flops,
            dtype="bf16",
            profile_every=0,
            gpu_interval_s=0.5,
        )
        tw.watch(model, opt, count_flops=False)
        gpu, host = run_steps(model, opt, x, 0, 40, agent=True, sync=sync)
        tw.shutdown()
        steps = transport.steps()
        mode = "loss.item() every step" if sync else "no host sync (the agent's way)"
        print(f"\nagent, {mode}: {len(steps)} steps reported")
        print("   step  GPU ms  host ms  agent duration ms  agent MFU  GPU MFU  data wait ms")
        for s in steps:
            i = s["step"]
            if i < 3 or i % 6 == 0 or i == len(steps) - 1:
                true_mfu = flops / (gpu[i] / 1000) / peak.flops
                print(
                    f"   {i:4d} {gpu[i]:7.2f} {host[i]:8.2f} {s['duration_s'] * 1000:18.2f}"
                    f" {s.get('mfu', float('nan')):10.3f} {true_mfu:8.3f}"
                    f" {(s.get('data_wait_s') or 0) * 1000:12.2f}"
                )
        reported = [s["mfu"] for s in steps[5:] if "mfu" in s]
        truth = [flops / (g / 1000) / peak.flops for g in gpu[5:]]
        print(
            f"   median MFU: agent {statistics.median(reported):.3f}, GPU events "
            f"{statistics.median(truth):.3f}; agent max {max(reported):.3f}"
        )
        samples = transport.gpu()
        print(f"   GPU samples sent by the sampler thread: {len(samples)}")
        if samples:
            last = samples[-1]
            keys = ("temp_c", "power_w", "sm_clock_mhz", "util_gpu", "throttle", "ecc_uncorrected")
            print("   last: " + ", ".join(f"{k}={last.get(k)}" for k in keys))
        for e in transport.events():
            if e["kind"] in ("gpu_telemetry", "xid"):
                print(f"   event {e['kind']}: {e.get('data')}")
    del model, opt, x
    torch.cuda.empty_cache()


def comm_check(width: int, tokens: int) -> None:
    section("3. Comm split on DDP over NCCL (world size 1)")
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    store = dist.FileStore(tempfile.mktemp(prefix="tw-gpu-store-"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = DDP(mlp(8, width), device_ids=[0], bucket_cap_mb=25)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    transport = Collect()
    profile_dir = tempfile.mkdtemp(prefix="tw-gpu-prof-")
    tw.init(
        run="gpu-comm",
        transport=transport,
        profile_every=10,
        profile_dir=profile_dir,
        dtype="bf16",
        flops_per_step=3 * 2 * tokens * width * width * 8,
    )
    tw.watch(model, opt, count_flops=False)
    run_steps(model, opt, x, 0, 30, agent=True, sync=False)
    tw.shutdown()
    print("   step  source    duration  compute  exposed  overlapped  idle (ms)")
    for s in transport.steps():
        if s["step"] in (5, 9, 18, 19, 20, 29) or s.get("comm_source") == "profiler":

            def ms(k: str, s: dict[str, Any] = s) -> str:
                v = s.get(k)
                return "     -" if v is None else f"{v * 1000:8.2f}"

            print(
                f"   {s['step']:4d}  {s.get('comm_source', '-'):8s} {ms('duration_s')} "
                f"{ms('compute_s')} {ms('exposed_comm_s')} {ms('overlapped_comm_s')} "
                f"{ms('idle_s')}"
            )
    import json

    names: dict[str, float] = {}
    for path in sorted(os.listdir(profile_dir))[:1]:
        with open(os.path.join(profile_dir, path)) as f:
            trace = json.load(f)
        for ev in trace.get("traceEvents", []):
            if ev.get("cat") == "kernel":
                names[ev["name"][:70]] = names.get(ev["name"][:70], 0.0) + ev.get("dur", 0) / 1000
        print(f"   kernels in {path} (ms, NCCL marked *):")
        for name, dur in sorted(names.items(), key=lambda kv: -kv[1])[:12]:
            print(f"     {'*' if 'nccl' in name.lower() else ' '} {dur:8.3f}  {name}")
    del model, opt
    dist.destroy_process_group()


def cost_check(layers: int, width: int, tokens: int, blocks: int) -> None:
    section("4. What the agent costs the step (alternating blocks, GPU events)")
    torch.manual_seed(0)
    model = mlp(layers, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    transport = Collect()
    for grad_norm in (False, True):
        tw.init(
            run="gpu-cost", transport=transport, flops_per_step=1e12, dtype="bf16", profile_every=0
        )
        tw.watch(model, opt, grad_norm=grad_norm, count_flops=False)
        bare: list[float] = []
        agent: list[float] = []
        step = 0
        for _ in range(blocks):
            for use, out in ((False, bare), (True, agent)):
                t0 = time.perf_counter()
                run_steps(model, opt, x, step, 10, agent=use, sync=False)
                out.append((time.perf_counter() - t0) / 10 * 1000)  # wall per step, GPU drained
                step += 10
        tw.shutdown()
        b, a = statistics.median(bare), statistics.median(agent)
        print(
            f"   bare {b:.3f} ms/step; agent + tw.watch(grad_norm={grad_norm}) {a:.3f} ms/step;"
            f" ratio {a / b:.4f}"
        )


def flight_check(backend: str = "nccl", device: str = "cuda") -> None:
    section(f"5. Flight Recorder on {backend.upper()} (world size 1)")
    import torch.distributed as dist

    from trainwarden.agent import flight

    if device == "cuda" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        print("   SKIP: needs a CUDA device and a torch built with NCCL")
        return
    # What tw.init does (flight.enable), here outright: before the group, which reads it.
    os.environ[flight.ENV] = "2000"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    issued = 5
    try:
        x = torch.ones(1024, device=device)
        for _ in range(issued):
            dist.all_reduce(x)
        if device == "cuda":
            torch.cuda.synchronize()  # every all_reduce has run on the GPU now

        def read() -> dict[str, Any]:
            box: dict[str, Any] = {}  # the dump from a second thread, as the exporter's
            reader = threading.Thread(
                target=lambda: box.update(flight.dump(trigger="command")), name="tw-fr-read"
            )
            reader.start()
            reader.join(60)
            return box

        t0 = time.perf_counter()
        dump = first = read()
        # "done" comes from the CUDA end event (state) or the watchdog's retirement: give
        # the watchdog a few seconds, and say how long it took.
        while not _newest_done(dump) and time.perf_counter() - t0 < 5:
            time.sleep(0.1)
            dump = read()
        waited = time.perf_counter() - t0
    finally:
        dist.destroy_process_group()
    print(f"   available {dump.get('available')} ; reason {dump.get('reason')}")
    problems = []
    if not dump.get("available"):
        problems.append(f"unavailable: {dump.get('reason')}")
    groups = {g["pg"]: g for g in dump.get("groups", [])}
    group = groups.get("0")
    if group is None:
        problems.append(f"no group 0 in the dump (groups: {sorted(groups)})")
    else:
        print(
            f"   group {group['pg']} ({group['desc']}), ranks {group['ranks']}, last enqueued "
            f"{group['last_enqueued']}, last completed {group['last_completed']}, "
            f"dropped {group['dropped']}"
        )
        print("   seq  op          sizes      state       done  started         completed")
        entries = group["entries"]
        for e in entries[-8:]:
            print(
                f"   {e['seq']:3d}  {e['op']:<11} {e['in_sizes']!s:<10} {e['state']:<11} "
                f"{e['done']!s:<5} {_clock(e['started']):<15} {_clock(e['completed'])}"
            )
        ops = {e["op"] for e in entries}
        seqs = [e["seq"] for e in entries]
        if ops != {"all_reduce"}:
            problems.append(f"ops {sorted(ops)}, not all_reduce only")
        if len(entries) < issued or any(b != a + 1 for a, b in pairwise(seqs)):
            problems.append(f"{issued} all_reduces issued, sequence ids {seqs}")
        if not _newest_done(dump):
            problems.append("the newest all_reduce is not done after synchronize (+5 s)")
    print(
        f"   newest done at the first read: {_newest_done(first)}; "
        f"{'done' if _newest_done(dump) else 'still not done'} after {waited:.2f} s"
    )
    if problems:
        print("   FAIL: " + "; ".join(problems))
        raise RuntimeError("flight recorder check failed: " + "; ".join(problems))
    print("   PASS")


def replica_check(tensors: int = 16, side: int = 8192, device: str = "cuda") -> None:
    section(f"6. Replica fingerprint: {tensors} bf16 tensors of {side} x {side} on the GPU")
    from trainwarden.agent.replica import as_int_bits, fingerprint, hex_words
    from trainwarden.agent.values import NOT_READY, capture_ints, resolve_ints

    if device == "cuda" and not torch.cuda.is_available():
        print("   SKIP: needs a CUDA device")
        return
    cuda = device == "cuda"
    torch.manual_seed(0)
    params = [torch.randn(side, side, device=device, dtype=torch.bfloat16) for _ in range(tensors)]
    count = sum(p.numel() for p in params)
    size = sum(p.numel() * p.element_size() for p in params)
    problems = []

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(3):  # warm-up: the allocator's blocks, the kernels' first launch
        fingerprint(params)
    sync()
    gpu_ms, host_us = [], []
    for _ in range(10):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fingerprint(params)
        host_us.append((time.perf_counter() - t0) * 1e6)
        if cuda:
            end.record()
            end.synchronize()
            gpu_ms.append(start.elapsed_time(end))
        else:
            gpu_ms.append(host_us[-1] / 1000)
    ms = statistics.median(gpu_ms)
    print(
        f"   {count / 1e9:.3f} B parameters, {size / 1e9:.2f} GB: fingerprint {ms:.2f} ms on the "
        f"{'GPU (CUDA events)' if cuda else 'CPU'}, median of 10 -> {size / ms / 1e6:.0f} GB/s; "
        f"host time to queue it {statistics.median(host_us):.0f} us (median)"
    )
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"   GPU memory: {peak:.2f} GiB at most (parameters {size / 2**30:.2f} GiB)")

    # No host sync: the fingerprint and the capture as the optimizer post-hook does them.
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        captured = capture_ints(fingerprint(params))
    except RuntimeError as exc:
        problems.append(f"a host sync under set_sync_debug_mode('error'): {exc}")
        captured = capture_ints(fingerprint(params))
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    words = resolve_ints(captured)
    waited = 0
    while words is NOT_READY:  # as the exporter thread reads it: the event, polled
        time.sleep(0.001)
        waited += 1
        words = resolve_ints(captured)
    assert isinstance(words, list)
    print(f"   under sync debug mode 'error': {hex_words(words)} ({waited} ms polled)")

    # One flipped bit: word 1 moves by exactly 2**bit; flipping it back restores it.
    victim = params[len(params) // 2]
    bit, index = 6, victim.numel() // 2 + 1  # bf16's highest mantissa bit, mid-tensor
    flat = as_int_bits(victim)
    flat[index] ^= 1 << bit
    flipped = fingerprint(params).tolist()
    flat[index] ^= 1 << bit
    again = fingerprint(params).tolist()
    delta = (flipped[0] - words[0]) % 2**64
    print(f"   one bit flipped: {hex_words(flipped)} (word 1 moved by {delta:#x})")
    if delta not in (2**bit, 2**64 - 2**bit):
        problems.append(f"a flipped bit {bit} moved word 1 by {delta:#x}, not 2**{bit}")
    if again != words:
        problems.append("flipping the bit back did not restore the fingerprint")
    sample = [p[:64] for p in params[:3]]  # the same bits on the CPU: the same words
    on_cpu = fingerprint([t.cpu() for t in sample]).tolist()
    if fingerprint(sample).tolist() != on_cpu:
        problems.append("the GPU's words differ from the CPU's for the same parameters")
    del params, victim, flat
    if problems:
        print("   FAIL: " + "; ".join(problems))
        raise RuntimeError("replica check failed: " + "; ".join(problems))
    print("   PASS")


def _clock(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def _newest_done(dump: dict[str, Any]) -> bool:
    groups = {g["pg"]: g for g in dump.get("groups", [])}
    entries = groups["0"]["entries"] if "0" in groups else []
    return bool(entries) and bool(entries[-1]["done"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument(
        "--only",
        action="append",
        choices=["nvml", "mfu", "comm", "cost", "flight", "replica"],
        help="run only this check (repeatable); all of them by default",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a machine with a GPU", file=sys.stderr)
        return 2
    print(
        f"trainwarden GPU check: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
        f"python {sys.version.split()[0]}"
    )
    failed = 0
    checks = {
        "nvml": nvml_check,
        "mfu": lambda: mfu_check(args.layers, args.width, args.tokens),
        "comm": lambda: comm_check(args.width, args.tokens),
        "cost": lambda: cost_check(args.layers, args.width, args.tokens, args.blocks),
        "flight": flight_check,
        "replica": replica_check,
    }
    for name, check in checks.items():
        if args.only and name not in args.only:
            continue
        try:
            check()
        except Exception:  # noqa: BLE001 - report it and go on to the next check
            traceback.print_exc()
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
