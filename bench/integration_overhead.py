"""What each framework integration costs a step, against ``tw.step`` written by hand.

    python bench/integration_overhead.py [--blocks 12] [--steps 30]
    python bench/agent_overhead.py --integrations        # the same, as its part 6

Issue 36's bar: the callback costs the step no more than ``tw.step`` does in a
hand-written loop. For each framework (Hugging Face Trainer, Lightning, Accelerate, DeepSpeed),
four arms on the same tiny model, in rotating blocks (A B C D D C B A ...) in one
process, the agent started once and sending to a transport that encodes and discards:

- ``without``: the framework's own loop, no trainwarden;
- ``with``: the same loop with trainwarden's callback (tracker, for Accelerate);
- ``bare``: a plain PyTorch loop over the same model, optimizer and batches;
- ``hand``: that loop with trainwarden written in: ``with tw.step(i, tokens=...)``,
  ``s.loss(loss.detach())`` and ``tw.watch(model, opt, grad_norm=True)`` — what the
  callback does for you (Accelerate's ``without`` loop is already hand-written: there
  ``bare`` is ``without``).

Ray Train's integration (``tw_ray.wrap``) adds no per-step code: a worker's steps are
its loop's own ``tw.step`` lines, the ``hand`` arm's cost (said in a line, not measured).

Each block is a fresh trainer (loop) of ``--steps`` steps; its figure is the median step
period (one step's start to the next's, so work at both ends of a step counts). Printed
per framework: each arm's median over blocks and its blocks, the callback's extra cost
(``with`` minus ``without``) and the hand-written one's (``hand`` minus ``bare``), each
the median over the rotation's cycles (an arm's i-th block comes from the i-th cycle, so
a cycle's differences cancel the machine's drift), in ms and as a share of the step, and
the median of the cycles' ``(with - without) - (hand - bare)`` with its standard error:
the callback passes where that is within two standard errors of zero or below it; the
script exits 1 where one does not.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

import trainwarden.agent as tw
from trainwarden.agent.wire import dumps

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class NullTransport:
    """Encodes what the HTTP transport would send, and discards it."""

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        dumps(body)
        return {}

    def close(self) -> None:
        pass


def _period_ms(starts: list[float]) -> float:
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    return statistics.median(gaps) * 1000


def rotate(arms: dict[str, Callable[[], float]], blocks: int) -> dict[str, list[float]]:
    """Each arm run ``blocks`` times, in the order A B C D D C B A A B ...: a drift of the
    machine's speed over the run weighs on every arm alike."""
    names = list(arms)
    order = names + names[::-1]
    out: dict[str, list[float]] = {name: [] for name in names}
    for i in range(blocks * len(names)):
        name = order[i % len(order)]
        out[name].append(arms[name]())
    return out


def four_arms(
    trainer: Callable[[bool], float], loop: Callable[[bool], float], blocks: int
) -> dict[str, list[float]]:
    """A framework's four arms: its ``trainer`` without and with the callback, and the
    plain ``loop`` bare and with trainwarden written in."""
    return rotate(
        {
            "without": lambda: trainer(False),
            "with": lambda: trainer(True),
            "bare": lambda: loop(False),
            "hand": lambda: loop(True),
        },
        blocks,
    )


def _se_of_median(values: list[float]) -> float:
    """The standard error of a median of ``values`` (normal approximation)."""
    if len(values) < 2:
        return math.nan
    return 1.2533 * statistics.stdev(values) / math.sqrt(len(values))


def summary(name: str, periods: dict[str, list[float]]) -> dict[str, Any]:
    """Each arm's median, and the callback's excess over the hand-written cost from the
    blocks paired in time: the i-th block of each arm comes from the same cycle of the
    rotation, so a cycle's ``(with - without) - (hand - bare)`` cancels the machine's
    drift; the median over cycles, with its standard error."""
    med = {arm: statistics.median(v) for arm, v in periods.items()}
    bare = "bare" if "bare" in periods else "without"
    cycles = list(
        zip(periods["with"], periods["without"], periods["hand"], periods[bare], strict=True)
    )
    excess = [(w - wo) - (h - b) for w, wo, h, b in cycles]
    callback = statistics.median(w - wo for w, wo, _, _ in cycles)
    hand = statistics.median(h - b for _, _, h, b in cycles)
    se = _se_of_median(excess)
    return {
        "name": name,
        "median_ms": med,
        "blocks_ms": periods,
        "callback_ms": callback,
        "hand_ms": hand,
        "excess_ms": statistics.median(excess),
        "excess_se_ms": se,
        "passes": None if math.isnan(se) else statistics.median(excess) <= 2 * se,
        "bare": bare,
    }


def print_summary(r: dict[str, Any]) -> None:
    med = r["median_ms"]
    arms = " ; ".join(f"{arm} {ms:.2f} ms" for arm, ms in med.items())
    print(f"   {r['name']}: {arms}")
    for arm, values in r["blocks_ms"].items():
        print(f"      {arm:>7} blocks: {' '.join(f'{v:.2f}' for v in values)}")
    step = med["without"]
    print(
        f"      the callback: {r['callback_ms']:+.3f} ms a step ({r['callback_ms'] / step:+.2%}); "
        f"tw.step + s.loss + tw.watch(grad_norm=True) by hand: {r['hand_ms']:+.3f} ms "
        f"({r['hand_ms'] / med[r['bare']]:+.2%}); callback - by hand: {r['excess_ms']:+.3f} "
        f"± {r['excess_se_ms']:.3f} ms (median of the cycles' differences) -> "
        + {
            True: "no more than by hand",
            False: "MORE than by hand",
            None: "(one block: no spread)",
        }[r["passes"]]
    )


def quiet() -> None:
    """Frameworks' banners and warnings off (Lightning sets its loggers' level when it is
    imported: called again after each import)."""
    warnings.filterwarnings("ignore")
    for name in ("trainwarden", "lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def hand_loop(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batches: Iterator[torch.Tensor],
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    steps: int,
    *,
    observed: bool,
    clip: float | None = None,
) -> float:
    """A plain loop over ``steps`` batches: the ``bare`` arm, or with trainwarden written
    in (``observed``): the ``hand`` arm. Its median step period in ms."""
    handle = tw.watch(model, opt, grad_norm=True) if observed else None
    starts = []
    for i in range(steps + 1):
        ids = next(batches)
        starts.append(time.perf_counter())
        step = tw.step(i, tokens=ids.numel()) if observed else contextlib.nullcontext()
        with step as s:
            loss = loss_of(ids)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if s is not None:
                s.loss(loss.detach())
    if handle is not None:
        handle.remove()
    return _period_ms(starts)


# -- Hugging Face ---------------------------------------------------------------------------


def hf(blocks: int, steps: int) -> dict[str, Any]:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
    from transformers.utils import logging as hf_logging

    from trainwarden.agent.integrations.hf import TrainwardenCallback

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    class Periods(TrainerCallback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.starts.append(time.perf_counter())

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 100_000

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.arange(i, i + 64) % 256
            return {"input_ids": ids, "labels": ids}

    def model() -> Any:
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=256,
            n_positions=64,
            n_embd=128,
            n_layer=2,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(config)

    out = tempfile.mkdtemp(prefix="tw-bench-hf-")

    def trainer(with_callback: bool) -> float:
        periods = Periods()
        callbacks: list[Any] = [periods] + ([TrainwardenCallback()] if with_callback else [])
        args = TrainingArguments(
            output_dir=out,
            max_steps=steps + 1,
            per_device_train_batch_size=8,
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        t = Trainer(model=model(), args=args, train_dataset=Tokens(), callbacks=callbacks)
        t.remove_callback(PrinterCallback)  # its summary line on stdout
        t.train()
        return _period_ms(periods.starts)

    def loop(observed: bool) -> float:
        m = model()
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=5e-5)  # the Trainer's defaults
        data = Tokens()
        batches = (
            torch.stack([data[8 * b + j]["input_ids"] for j in range(8)]) for b in range(10**6)
        )

        def loss_of(ids: torch.Tensor) -> torch.Tensor:
            return m(input_ids=ids, labels=ids).loss

        return hand_loop(m, opt, batches, loss_of, steps, observed=observed, clip=1.0)

    periods = four_arms(trainer, loop, blocks)
    import transformers

    return summary(
        f"Hugging Face Trainer (transformers {transformers.__version__}, tiny GPT-2)", periods
    )


# -- Lightning ----------------------------------------------------------------------------------


def lightning(blocks: int, steps: int) -> dict[str, Any]:
    import lightning as L

    from trainwarden.agent.integrations.lightning import TrainwardenCallback

    sys.path.insert(0, str(EXAMPLES))
    from lightning_trainer import Synthetic, TinyLM

    quiet()

    class Periods(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
            self.starts.append(time.perf_counter())

    data = Synthetic(4096)

    def trainer(with_callback: bool) -> float:
        torch.manual_seed(0)
        periods = Periods()
        callbacks: list[Any] = [periods] + ([TrainwardenCallback()] if with_callback else [])
        t = L.Trainer(
            max_steps=steps + 1,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        t.fit(TinyLM(width=128), torch.utils.data.DataLoader(data, batch_size=8))
        return _period_ms(periods.starts)

    def loop(observed: bool) -> float:
        torch.manual_seed(0)
        m = TinyLM(width=128)
        opt = m.configure_optimizers()
        batches = (batch["input_ids"] for batch in torch.utils.data.DataLoader(data, batch_size=8))

        def loss_of(ids: torch.Tensor) -> torch.Tensor:
            logits = m(ids[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

        return hand_loop(m, opt, batches, loss_of, steps, observed=observed)

    periods = four_arms(trainer, loop, blocks)
    return summary(f"Lightning Trainer (lightning {L.__version__}, tiny transformer)", periods)


# -- Accelerate ---------------------------------------------------------------------------------


def accelerate(blocks: int, steps: int) -> dict[str, Any]:
    import accelerate as acc
    from accelerate import Accelerator

    from trainwarden.agent.integrations.accelerate import TrainwardenTracker

    sys.path.insert(0, str(EXAMPLES))
    from accelerate_trainer import VOCAB, Synthetic, TinyLM

    data = Synthetic(1024)

    def loss_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def loop(arm: str) -> float:
        """The Accelerate loop: ``without`` trainwarden, ``with`` the tracker, or with
        trainwarden written in by ``hand``."""
        tracker = TrainwardenTracker("bench-accelerate") if arm == "with" else None
        accelerator = Accelerator(log_with=[tracker] if tracker else None, cpu=True)
        if tracker is not None:
            accelerator.init_trackers("bench")
        torch.manual_seed(0)
        model = TinyLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(data, batch_size=8)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        if tracker is not None:
            tracker.watch(accelerator, model, opt)
        inner = getattr(opt, "optimizer", opt)  # Accelerate's wrapper holds the torch one
        handle = tw.watch(model, inner, grad_norm=True) if arm == "hand" else None
        starts = []
        for i, batch in enumerate(loader):
            if i > steps:
                break
            starts.append(time.perf_counter())
            ids = batch["input_ids"]
            step = tw.step(i, tokens=ids.numel()) if arm == "hand" else contextlib.nullcontext()
            with step as s:
                loss = loss_of(model, ids)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
                if s is not None:
                    s.loss(loss.detach())
        if handle is not None:
            handle.remove()
        accelerator.end_training()
        return _period_ms(starts)

    periods = rotate(
        {arm: (lambda arm=arm: loop(arm)) for arm in ("without", "with", "hand")}, blocks
    )
    return summary(f"Accelerate loop (accelerate {acc.__version__}, tiny model)", periods)


# -- DeepSpeed ----------------------------------------------------------------------------------


def deepspeed_(blocks: int, steps: int) -> dict[str, Any]:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks its accelerator
    import deepspeed

    from trainwarden.agent.integrations import deepspeed as tw_deepspeed

    sys.path.insert(0, str(EXAMPLES))
    from tiny_lm import TinyLM, synthetic

    quiet()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    if not torch.distributed.is_initialized():  # one rank: DeepSpeed uses the group it finds
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0")
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    data = synthetic(1024, seed=0)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }

    def batches() -> Iterator[torch.Tensor]:
        while True:
            yield from data.split(8)

    def engine_loop(with_watch: bool) -> float:
        """ZeRO-1's loop (``engine(ids)``, ``engine.backward``, ``engine.step``), with or
        without ``tw_deepspeed.watch(engine)``."""
        torch.manual_seed(0)
        model = TinyLM(width=128)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        watch = tw_deepspeed.watch(engine) if with_watch else None
        starts = []
        source = batches()
        for _ in range(steps + 1):
            ids = next(source)
            starts.append(time.perf_counter())
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
        if watch is not None:
            watch.remove()
        return _period_ms(starts)

    def loop(observed: bool) -> float:
        torch.manual_seed(0)
        m = TinyLM(width=128)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        return hand_loop(m, opt, batches(), m, steps, observed=observed)

    periods = four_arms(engine_loop, loop, blocks)
    return summary(
        f"DeepSpeed ZeRO-1 (deepspeed {deepspeed.__version__}, tiny transformer)", periods
    )


# -- the report ---------------------------------------------------------------------------------

FRAMEWORKS: dict[str, tuple[str, Callable[[int, int], dict[str, Any]]]] = {
    "transformers": ("hf", hf),
    "lightning": ("lightning", lightning),
    "accelerate": ("accelerate", accelerate),
    "deepspeed": ("deepspeed", deepspeed_),
}


def print_integrations(blocks: int, steps: int) -> list[dict[str, Any]]:
    print(
        f"\n6. framework loops: without / with trainwarden's callback, and a plain loop "
        f"bare / with tw.step by hand ({blocks} blocks an arm of {steps} steps, rotating; "
        "median step period)"
    )
    results = []
    quiet()
    tw.init(
        run="bench-integrations", transport=NullTransport(), queue_size=1_000_000, gpu_interval_s=0
    )
    try:
        for package, (extra, measure) in FRAMEWORKS.items():
            try:
                __import__(package)
            except ImportError:
                print(f"   {package}: not installed (pip install 'trainwarden[{extra}]')")
                continue
            r = measure(blocks, steps)
            print_summary(r)
            results.append(r)
    finally:
        tw.shutdown()
    print(
        "   Ray Train (tw_ray.wrap): no per-step code of its own; its workers' steps cost "
        "the hand-written tw.step lines above"
    )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=12, help="blocks an arm")
    p.add_argument("--steps", type=int, default=30, help="steps a block")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"trainwarden integrations overhead (torch {torch.__version__})")
    results = print_integrations(args.blocks, args.steps)
    sys.exit(1 if any(r["passes"] is False for r in results) else 0)


if __name__ == "__main__":
    main()
