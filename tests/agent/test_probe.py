"""The determinism probe (agent/probe.py) and the ``sdc=arith`` drill: what a probed step
sends, that it is the fingerprint of the model's output on a fixed input, that the step
itself is left as it was, bad settings, a probe that fails; and on two real gloo DDP
ranks, a rank whose arithmetic is one unit in the last place off: its probes differ from
the drill on while its parameters stay equal to its replica's."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainwarden.agent as tw
from trainwarden.agent.drills import DrillError, nudge_output, parse
from trainwarden.agent.probe import Probe, decode, float_tensors
from trainwarden.agent.replica import fingerprint, hex_words

from .helpers import RecordingTransport, run_ranks


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for name in (
        "RANK",
        "WORLD_SIZE",
        "TRAINWARDEN_URL",
        "TRAINWARDEN_DRILL",
        "TRAINWARDEN_REPLICA_CHECK_EVERY",
        "TRAINWARDEN_DETERMINISM_PROBE_EVERY",
        "TRAINWARDEN_PROBE_RTOL",
    ):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)


class Net(nn.Module):
    """Dropout (off in the probe's eval mode) and an integer input (token ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.embed(ids) * scale)).squeeze(-1)


def expected(model: nn.Module, *args: Any) -> tuple[str, list[float]]:
    """The probe's fields, computed here in plain torch from the model's eval output."""
    model.eval()
    with torch.no_grad():
        out = model(*args)
    model.train()
    flat = out.reshape(-1).double()
    g = torch.Generator().manual_seed(20261127 + 1)
    signs = (torch.randint(0, 2, (flat.numel(),), generator=g) * 2 - 1).double()
    sums = [flat.sum().item(), flat.abs().sum().item(), (flat * signs).sum().item()]
    return hex_words(fingerprint([out]).tolist()), sums


def train(steps: int, probe_input: Any = None, **watch: Any) -> tuple[RecordingTransport, dict]:
    """``Net`` trained ``steps`` steps; what each step's probe should be, computed after
    that step's update from the input the probe uses."""
    transport = RecordingTransport()
    tw.init(run="probe", transport=transport, gpu_interval_s=0, spool_dir="none")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tw.watch(model, opt, count_flops=False, replica_group=[0], probe_input=probe_input, **watch)
    g = torch.Generator().manual_seed(1)
    want: dict[int, tuple[str, list[float]]] = {}
    built = None
    for step in range(steps):
        ids = torch.randint(0, 16, (4, 3), generator=g)
        scale = torch.rand(4, 3, 1, generator=g)
        if built is None and probe_input is None:  # what the probe builds from step 0's
            probe = Probe(model)
            probe.learn_input((ids, scale), {})
            built = probe.args
        with tw.step(step) as s:
            loss = model(ids, scale).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.loss(loss)
        assert model.training and model.drop.training  # the probe put the modes back
        given = probe_input if isinstance(probe_input, tuple) else (probe_input,)
        args = given if built is None else built
        want[step] = expected(model, *args)
    tw.shutdown()
    return transport, want


def test_a_probed_step_sends_the_fingerprint_and_sums_of_the_output_on_a_fixed_input() -> None:
    transport, want = train(7, determinism_probe_every=3, replica_check_every=0)
    steps = {s["step"]: s for s in transport.steps()}
    assert sorted(steps) == list(range(7))
    for step, body in steps.items():
        if step % 3:
            assert not {"probe", "probe_sums", "fingerprint"} & set(body), step
            continue
        bits, sums = want[step]
        assert body["probe"] == bits
        assert body["probe_sums"] == pytest.approx(sums, rel=1e-12, abs=1e-12)
        assert "probe_rtol" not in body  # bit-exact, the default
        assert body["replica_group"] == "0" and len(body["fingerprint"]) == 32  # checked too
        # The probe's forward left the step's phases alone: they still cover the step.
        phases = body["fwd_s"] + body["bwd_s"] + body["opt_s"] + body["other_s"]
        assert abs(phases - body["duration_s"]) < 1e-6
    assert len({steps[s]["probe"] for s in (0, 3, 6)}) == 3  # training moved the output


def test_a_given_probe_input_is_used_and_rtol_is_sent() -> None:
    ids = torch.arange(6).reshape(2, 3) % 16
    given = (ids, torch.full((2, 3, 1), 0.5))
    transport, want = train(3, probe_input=given, determinism_probe_every=2, probe_rtol=1e-6)
    steps = {s["step"]: s for s in transport.steps()}
    for step in (0, 2):
        assert steps[step]["probe"] == want[step][0]
        assert steps[step]["probe_rtol"] == 1e-6
    assert "probe" not in steps[1]


def test_the_sums_are_float64_bit_patterns_read_back_exactly() -> None:
    values = [1.5, -0.0, 1e-300]
    words = [7, -8] + [struct.unpack("<q", struct.pack("<d", v))[0] for v in values]
    bits, sums = decode(words)
    assert bits == [7, -8] and sums == values and math.copysign(1, sums[1]) == -1


def test_output_tensors_are_found_in_nested_outputs_in_order() -> None:
    a, b, c = torch.ones(2), torch.zeros(3), torch.full((1,), 2.0)
    out = {"loss": a, "rest": (b, torch.arange(3), [c, None]), "empty": torch.empty(0)}
    assert [t.numel() for t in float_tensors(out)] == [2, 3, 1]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1e-3, "probe_rtol"),
        (0.5, "between 0 and 0.1"),
        ("tight", "must be a number"),
        (True, "a number"),
    ],
)
def test_a_bad_rtol_says_what_to_give(value: Any, message: str) -> None:
    tw.init(run="probe", transport=RecordingTransport(), gpu_interval_s=0, spool_dir="none")
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tw.ConfigError, match=message):
        tw.watch(model, opt, replica_group=[0], determinism_probe_every=1, probe_rtol=value)


def test_the_interval_and_rtol_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINWARDEN_DETERMINISM_PROBE_EVERY", "2")
    monkeypatch.setenv("TRAINWARDEN_PROBE_RTOL", "1e-5")
    transport, _ = train(3, replica_check_every=0)
    probed = {s["step"]: s.get("probe_rtol") for s in transport.steps() if "probe" in s}
    assert probed == {0: 1e-5, 2: 1e-5}
    monkeypatch.setenv("TRAINWARDEN_DETERMINISM_PROBE_EVERY", "soon")
    tw.init(run="probe", transport=RecordingTransport(), gpu_interval_s=0, spool_dir="none")
    model = nn.Linear(2, 2)
    with pytest.raises(tw.ConfigError, match="TRAINWARDEN_DETERMINISM_PROBE_EVERY"):
        tw.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), replica_group=[0])


class Fragile(nn.Module):
    """Trains normally; fails in eval mode (the probe's), or returns no float there."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.how = how

    def forward(self, x: torch.Tensor) -> Any:
        if not self.training:
            if self.how == "raise":
                raise RuntimeError("this model cannot run in eval mode")
            return torch.arange(3)
        return self.lin(x)


@pytest.mark.parametrize(
    ("how", "issue"),
    [
        ("raise", "the probe's forward failed: RuntimeError('this model cannot run in eval mode')"),
        ("ints", "the model's output has no floating-point tensor"),
    ],
)
def test_a_probe_that_cannot_run_is_an_issue_and_training_goes_on(how: str, issue: str) -> None:
    transport = RecordingTransport()
    tw.init(run="probe", transport=transport, gpu_interval_s=0, spool_dir="none")
    model = Fragile(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tw.watch(model, opt, count_flops=False, replica_group=[0], determinism_probe_every=2)
    for step in range(5):
        with tw.step(step) as s:
            loss = model(torch.randn(2, 4)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.loss(loss)
    tw.shutdown()
    steps = {s["step"]: s for s in transport.steps()}
    assert sorted(steps) == list(range(5))
    for step in (0, 2, 4):
        assert "probe" not in steps[step] and steps[step]["issues"]["probe"] == issue
        assert len(steps[step]["fingerprint"]) == 32  # the parameter check goes on
    assert model.training


def test_nudge_moves_element_zero_one_ulp_and_nothing_else() -> None:
    x = torch.tensor([[1.0, -2.0], [3.0, 0.0]]).t()  # not contiguous
    y = nudge_output({"out": (x, torch.arange(2))})["out"][0]
    assert y[0, 0].item() == 1 + 2**-23  # float32's next value above 1.0
    assert torch.equal(y.reshape(-1)[1:], x.reshape(-1)[1:])
    w = torch.ones(3, requires_grad=True)
    (nudge_output(w * 2).sum()).backward()
    assert w.grad is not None and torch.equal(
        w.grad, torch.full((3,), 2.0)
    )  # gradients flow unchanged


def test_the_drill_takes_arith_from_a_step_on_and_refuses_an_unknown_form() -> None:
    (fault,) = parse("sdc=arith@rank=1,step=20")
    assert fault.form == "arith" and fault.covers(20) and fault.covers(10**6)
    assert not fault.covers(19)
    with pytest.raises(DrillError, match="sdc=bitflip or sdc=arith"):
        parse("sdc=melt@rank=1,step=2")


def rank_main(mode: str, rank_s: str, world_s: str, port: str, out: str) -> None:
    """One of 2 gloo DDP ranks; rank 1's arithmetic is off from step 4 on."""
    import gc

    import torch.distributed as dist

    rank, world = int(rank_s), int(world_s)
    torch.set_num_threads(1)
    transport = RecordingTransport()
    tw.init(
        run="probe",
        rank=rank,
        world_size=world,
        transport=transport,
        drill="sdc=arith@rank=1,step=4",
        gpu_interval_s=0,
        profile_every=0,
        spool_dir="none",
    )
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    tw.watch(ddp, opt, replica_check_every=2, determinism_probe_every=2, count_flops=False)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(8):
        with tw.step(step) as s:
            loss = ddp(torch.randn(8, 16, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.loss(loss)
    tw.shutdown()
    result = {
        "steps": {
            s["step"]: [s.get("fingerprint"), s.get("probe"), s.get("probe_sums")]
            for s in transport.steps()
        },
        "drills": [e["data"] for e in transport.events() if e["kind"] == "drill"],
    }
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(result))
    del ddp, opt
    gc.collect()
    dist.destroy_process_group()


def test_wrong_arithmetic_on_one_ddp_rank_shows_in_its_probes_not_its_parameters(
    tmp_path: Path,
) -> None:
    r0, r1 = run_ranks(2, "arith", tmp_path, module=__name__)
    a, b = r0["steps"], r1["steps"]
    for step in ("0", "2", "4", "6"):
        assert a[step][0] == b[step][0], step  # the parameters agree throughout
    for step in ("0", "2"):
        assert a[step][1] == b[step][1] and a[step][2] == b[step][2]
    for step in ("4", "6"):  # from the drill on, rank 1's output is off
        assert a[step][1] != b[step][1]
        # by one unit in the last place of one float32: the sums all but agree
        assert a[step][2] == pytest.approx(b[step][2], rel=1e-6)
    assert r0["drills"] == []
    (drill,) = r1["drills"]
    assert drill["form"] == "arith" and drill["spec"] == "sdc=arith@rank=1,step=4"
