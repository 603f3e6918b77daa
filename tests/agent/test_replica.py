"""Replica fingerprints (agent/replica.py): exact, chunk-independent, sensitive to any one
flipped bit; the replica group's text form; the groups of DDP, HSDP and an override on
real gloo ranks; and the check end to end, with the ``sdc=bitflip`` drill."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainwarden.agent as tw
from trainwarden.agent.drills import flip_bit
from trainwarden.agent.replica import (
    MAX_GROUP_CHARS,
    as_int_bits,
    compact,
    expand,
    fingerprint,
    hex_words,
    replica_group_of,
)

from .helpers import RecordingTransport, run_ranks

ROOT = Path(__file__).resolve().parents[2]
MOD = 2**64


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for name in ("RANK", "WORLD_SIZE", "TRAINWARDEN_URL", "TRAINWARDEN_DRILL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TRAINWARDEN_REPLICA_CHECK_EVERY", raising=False)
    yield
    tw.shutdown(timeout_s=1)


def reference(tensors: list[torch.Tensor]) -> str:
    """The fingerprint as the wire contract words it, in plain Python integers."""
    values = [v for t in tensors for v in as_int_bits(t).tolist()]
    return hex_words([sum(values) % MOD, sum(v * v for v in values) % MOD])


def fp(tensors: Any, **kwargs: Any) -> str:
    return hex_words(fingerprint(tensors, **kwargs).tolist())


def flipped(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    out = t.clone()
    bits = as_int_bits(out)  # a view: the flip lands in out
    width = out.element_size() * 8
    mask = 1 << bit
    bits[index] ^= mask - (1 << width) if mask >= 1 << (width - 1) else mask  # signed
    assert not torch.equal(as_int_bits(out), as_int_bits(t))
    return out


def params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(37, 11, generator=g),
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.randn(3, 4, generator=g, dtype=torch.float64),
        torch.randn(1000, generator=g).to(torch.float16),
    ]


# -- the fingerprint ----------------------------------------------------------------------


def test_the_fingerprint_is_the_contracts_two_wrapping_sums() -> None:
    tensors = params()
    text = fp(tensors)
    assert len(text) == 32 and text == text.lower() and int(text, 16) >= 0
    assert text == reference(tensors)
    # Sums past 2**63 wrap, as the contract says: large float64s have large bit patterns.
    big = [torch.tensor([1e300, 3e300, -2e300, 7e307, float("nan")], dtype=torch.float64)]
    assert sum(v for v in as_int_bits(big[0]).tolist() if v > 0) >= 2**64  # it does wrap
    assert fp(big) == reference(big)
    words = fingerprint(big)
    assert words.dtype == torch.int64 and words.shape == (2,)


def test_identical_parameters_give_equal_fingerprints_and_others_do_not() -> None:
    a, b = params(seed=1), params(seed=1)
    assert all(x.data_ptr() != y.data_ptr() for x, y in zip(a, b, strict=True))
    assert fp(a) == fp(b)
    assert fp(params(seed=2)) != fp(a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_flipped_bit_anywhere_changes_word_one(dtype: torch.dtype, where: str) -> None:
    tensors = [torch.randn(257, generator=torch.Generator().manual_seed(3)).to(dtype)]
    tensors.append(torch.randn(64, 3).to(dtype))
    index = {"first": 0, "middle": 128, "last": 256}[where]
    width = tensors[0].element_size() * 8
    before = fingerprint(tensors).tolist()
    for bit in (0, 1, width // 2, width - 2, width - 1):  # lowest ... exponent ... sign
        after = fingerprint([flipped(tensors[0], index, bit), tensors[1]]).tolist()
        delta = (after[0] - before[0]) % MOD
        # Exactly one element moved by 2**bit, up or down: never 0 modulo 2**64.
        assert delta in (2**bit, MOD - 2**bit), (bit, delta)


def test_chunking_and_packing_give_the_same_fingerprint() -> None:
    tensors = [*params(), torch.randn(10_000), torch.randn(300, 7).t()]  # one not contiguous
    whole = fp(tensors, chunk_elements=10**9)
    for chunk in (1, 7, 64, 999, 4096):
        assert fp(tensors, chunk_elements=chunk) == whole
    assert fp(tensors) == whole == reference(tensors)
    assert fp(reversed(tensors)) == whole  # a sum: the order does not matter


def test_no_parameters_and_empty_ones() -> None:
    assert fp([]) == "0" * 32
    assert fp([torch.empty(0), torch.empty(3, 0)]) == "0" * 32


def test_integer_parameters_count_by_their_raw_bits() -> None:
    ints = torch.tensor([-1, 5, 2**40], dtype=torch.int64)
    flags = torch.tensor([True, False, True])
    assert fp([ints, flags]) == reference([ints, flags])
    assert fp([ints, flags]) != fp([ints, ~flags])


# -- the group's text -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        (range(8), "0-7"),
        (range(0, 29, 4), "0-28:4"),
        ([3, 9], "3,9"),
        ([5], "5"),
        ([0, 1], "0,1"),
        ([2, 1, 0, 1], "0-2"),
        ([0, 1, 2, 3, 10, 20, 30], "0-3,10-30:10"),
        ([0, 4, 8, 9, 10, 11], "0-8:4,9-11"),
        ([1, 2, 4, 7], "1,2,4,7"),
    ],
)
def test_compact_writes_the_short_form_and_expand_reads_it(ranks: Any, text: str) -> None:
    assert compact(ranks) == text
    assert expand(text) == sorted(set(ranks))


def test_compact_and_expand_round_trip_random_groups() -> None:
    rng = random.Random(7)
    for _ in range(300):
        ranks = sorted(rng.sample(range(4096), rng.randint(1, 60)))
        if rng.random() < 0.3:  # a strided block, as tensor / pipeline parallel layouts give
            start, stride = rng.randrange(64), rng.randint(1, 16)
            ranks = list(range(start, start + stride * rng.randint(3, 200), stride))
        text = compact(ranks)
        assert expand(text) == ranks
        assert compact(expand(text)) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "non-empty"),
        ("7-3", "a <= b"),
        ("0-10:4", "b on the stride"),
        ("0-8:0", "stride >= 1"),
        ("x", "is not 'a'"),
        ("1,,2", "is not 'a'"),
        ("-1", "is not 'a'"),
        ("0-7 ", "is not 'a'"),
        ("3,1", "ascending"),
        ("0-4,4", "ascending"),
        ("0-2000000000", "names over"),
        (",".join(str(i) for i in range(0, 3000, 2)), "characters, over"),
    ],
)
def test_expand_refuses_what_compact_never_writes(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expand(text)


def test_compact_refuses_negative_ranks() -> None:
    with pytest.raises(ValueError, match="integers >= 0"):
        compact([0, -1])


def test_the_text_module_needs_no_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any import of torch would fail
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('r', {str(ROOT / 'agent/replica.py')!r})\n"
        "r = importlib.util.module_from_spec(spec); spec.loader.exec_module(r)\n"
        "import json; print(json.dumps([r.expand('0-6:2,9'), r.hex_words([-1, 1])]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [[0, 2, 4, 6, 9], "ffffffffffffffff0000000000000001"]


# -- replica groups ---------------------------------------------------------------------


def test_a_single_process_without_torch_distributed_has_no_replica() -> None:
    assert replica_group_of(nn.Linear(2, 2)) is None
    assert replica_group_of(nn.Linear(2, 2), [4, 0, 8], rank=0) == ("0-8:4", [0, 4, 8])
    with pytest.raises(ValueError, match="does not contain this rank"):
        replica_group_of(nn.Linear(2, 2), [1, 2], rank=0)
    with pytest.raises(ValueError, match="ProcessGroup or a list of global ranks"):
        replica_group_of(nn.Linear(2, 2), "0-7")
    with pytest.raises(ValueError, match="integers >= 0"):
        replica_group_of(nn.Linear(2, 2), [0, -1])


def rank_main(mode: str, rank_s: str, world_s: str, port: str, out: str) -> None:
    """One rank of a gloo job (a child process of the tests below)."""
    import gc

    import torch.distributed as dist

    rank, world = int(rank_s), int(world_s)
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    if mode == "train":
        transport = RecordingTransport()
        tw.init(
            run="replica",
            rank=rank,
            world_size=world,
            transport=transport,
            drill="sdc=bitflip@rank=1,step=5",
            gpu_interval_s=0,
            profile_every=0,
            spool_dir="none",
        )
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)  # identical initial weights on every rank
    if mode == "groups":
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        result["ddp"] = replica_group_of(ddp, rank=rank)
        pair = dist.new_group([0, 1])
        result["pg"] = replica_group_of(ddp, pair, rank=rank)
        result["list"] = replica_group_of(ddp, [1, 0], rank=rank)
        result["plain"] = replica_group_of(nn.Linear(4, 4), rank=rank)  # the world
        try:  # torch.distributed's rank wins over the one given (RANK may be unset)
            result["only_0"] = replica_group_of(ddp, [0], rank=0)
        except ValueError as exc:
            result["only_0"] = str(exc)
        del ddp
    elif mode == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        fully_shard(model, mesh=mesh)
        result["group"] = replica_group_of(model, rank=rank)
        result["before"] = hex_words(fingerprint(model.parameters()).tolist())
        if rank == 3:
            result["flipped"] = flip_bit(model)
        result["after"] = hex_words(fingerprint(model.parameters()).tolist())
        plain = nn.Linear(8, 8)
        fully_shard(plain)  # plain FSDP2: a 1-D mesh of shards, no replica
        result["plain_fsdp"] = replica_group_of(plain, rank=rank)
        del model, plain
    else:  # train: DDP, the replica check every 5 steps, rank 1 flips a bit at step 5
        ddp = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        watch = tw.watch(ddp, opt, replica_check_every=5, count_flops=False)
        result["group"] = watch.replica_group
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        for step in range(12):
            with tw.step(step) as s:
                x = torch.randn(8, 16, generator=g)
                loss = ddp(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                s.loss(loss)
        tw.shutdown()
        result["steps"] = {
            s["step"]: [s.get("fingerprint"), s.get("replica_group")] for s in transport.steps()
        }
        result["drills"] = [e["data"] for e in transport.events() if e["kind"] == "drill"]
        del ddp, opt
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(result))
    gc.collect()  # free DDP (it holds the group) before the group goes
    dist.destroy_process_group()


def test_ddp_groups_and_overrides_on_two_gloo_ranks(tmp_path: Path) -> None:
    ranks = run_ranks(2, "groups", tmp_path, module=__name__)
    for r in ranks:
        assert r["ddp"] == ["0,1", [0, 1]]
        assert r["pg"] == ["0,1", [0, 1]]
        assert r["list"] == ["0,1", [0, 1]]
        assert r["plain"] is None  # neither DDP nor FSDP: not guessed (a TP shard?)
    assert ranks[0]["only_0"] == ["0", [0]]
    assert "does not contain this rank (1)" in ranks[1]["only_0"]


def test_hsdp_replicas_are_the_mesh_replicate_dimension(tmp_path: Path) -> None:
    ranks = run_ranks(4, "hsdp", tmp_path, module=__name__)
    # mesh [[0, 1], [2, 3]]: dim 0 replicates, dim 1 shards; 0 and 2 hold one shard.
    assert [r["group"] for r in ranks] == [["0,2", [0, 2]], ["1,3", [1, 3]]] * 2
    assert ranks[0]["before"] == ranks[2]["before"] != ranks[1]["before"] == ranks[3]["before"]
    assert all(r["plain_fsdp"] is None for r in ranks)
    # rank 3 flips a bit of its shard: its group disagrees, the other one still agrees.
    assert ranks[3]["flipped"] == ["0.weight", 0, 22]
    assert ranks[1]["after"] != ranks[3]["after"]
    assert ranks[0]["after"] == ranks[2]["after"] == ranks[0]["before"]


def test_a_flipped_bit_on_one_ddp_rank_shows_at_the_checks_from_then_on(tmp_path: Path) -> None:
    r0, r1 = run_ranks(2, "train", tmp_path, module=__name__)
    assert r0["group"] == r1["group"] == "0,1"
    for r in (r0, r1):
        checked = {int(s) for s, (fp_, _) in r["steps"].items() if fp_ is not None}
        assert checked == {0, 5, 10}
        assert all(r["steps"][str(s)][1] == "0,1" for s in checked)
        assert all(g is None for s, (_, g) in r["steps"].items() if int(s) not in checked)
    a, b = r0["steps"], r1["steps"]
    assert a["0"][0] == b["0"][0]  # DDP made the replicas equal; they stay so until 5
    assert a["5"][0] != b["5"][0]  # the flip, right after rank 1's step 5
    assert a["10"][0] != b["10"][0]  # DDP never re-broadcasts: rank 1 stays diverged
    assert r0["drills"] == []
    (drill,) = r1["drills"]
    assert drill["fault"] == "sdc" and drill["form"] == "bitflip"
    assert (drill["parameter"], drill["element"], drill["bit"]) == ("module.0.weight", 0, 22)


# -- the check through the agent ----------------------------------------------------------


def train(steps: int, **watch: Any) -> tuple[RecordingTransport, dict[int, str]]:
    """A tiny model trained ``steps`` steps under tw.watch; the transport and the reference
    fingerprint of the parameters after each step's update."""
    transport = RecordingTransport()
    tw.init(run="replica", transport=transport, gpu_interval_s=0, spool_dir="none")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tw.watch(model, opt, count_flops=False, **watch)
    after: dict[int, str] = {}
    for step in range(steps):
        with tw.step(step) as s:
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.loss(loss)
        after[step] = reference([p.detach() for p in model.parameters()])
    tw.shutdown()
    return transport, after


def test_checked_steps_carry_the_fingerprint_and_the_group_others_do_not() -> None:
    transport, after = train(12, replica_check_every=5, replica_group=[0])
    steps = {s["step"]: s for s in transport.steps()}
    assert sorted(steps) == list(range(12))
    for step, body in steps.items():
        if step % 5 == 0:
            assert body["fingerprint"] == after[step]  # the parameters after that update
            assert body["replica_group"] == "0"
        else:
            assert "fingerprint" not in body and "replica_group" not in body
    assert len({steps[s]["fingerprint"] for s in (0, 5, 10)}) == 3  # training moved them


def test_the_interval_comes_from_the_argument_else_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def checked(**watch: Any) -> list[int]:
        transport, _ = train(7, replica_group=[0], **watch)
        return [s["step"] for s in transport.steps() if "fingerprint" in s]

    assert checked() == [0]  # the default, every 100 steps
    monkeypatch.setenv("TRAINWARDEN_REPLICA_CHECK_EVERY", "3")
    assert checked() == [0, 3, 6]
    assert checked(replica_check_every=2) == [0, 2, 4, 6]  # the argument wins
    assert checked(replica_check_every=0) == []  # off
    monkeypatch.setenv("TRAINWARDEN_REPLICA_CHECK_EVERY", "0")
    assert checked() == []


@pytest.mark.parametrize("bad", ["-1", "often", "2.5"])
def test_a_bad_interval_says_how_to_fix_it(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    tw.init(run="replica", transport=RecordingTransport(), gpu_interval_s=0, spool_dir="none")
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setenv("TRAINWARDEN_REPLICA_CHECK_EVERY", bad)
    with pytest.raises(tw.ConfigError, match="TRAINWARDEN_REPLICA_CHECK_EVERY"):
        tw.watch(model, opt)
    monkeypatch.delenv("TRAINWARDEN_REPLICA_CHECK_EVERY")
    with pytest.raises(tw.ConfigError, match="replica_check_every"):
        tw.watch(model, opt, replica_check_every=True)


def test_no_check_without_a_replica_or_without_the_optimizer() -> None:
    transport, _ = train(6, replica_check_every=5)  # one process, no torch.distributed
    assert not any("fingerprint" in s for s in transport.steps())
    transport = RecordingTransport()
    tw.init(run="replica", transport=transport, spool_dir="none")
    model = nn.Linear(2, 2)
    watch = tw.watch(model, replica_check_every=1, replica_group=[0], count_flops=False)
    assert watch.replica_check_every == 0 and watch.replica_group is None
    with tw.step(0):
        model(torch.randn(1, 2))
    tw.shutdown()
    assert not any("fingerprint" in s for s in transport.steps())


def test_a_fingerprint_in_flight_holds_its_record_back_as_a_loss_does() -> None:
    from trainwarden.agent.encode import FlopModel, StepEncoder
    from trainwarden.agent.spikes import SpikeDetector
    from trainwarden.agent.step import StepRecord
    from trainwarden.agent.values import Captured

    class Pending:
        done = False

        def query(self) -> bool:
            return self.done

    event = Pending()
    record = StepRecord(10, None)
    record.replica = (Captured(torch.tensor([-1, 2]), event), "0-7")
    encode = StepEncoder(spikes=SpikeDetector(), flop_model=FlopModel(), peak=None)
    assert encode(record, force=False) is None
    forced = encode(record, force=True)
    assert forced is not None and "fingerprint" not in forced
    assert forced["issues"]["fingerprint"] == "device copy did not complete"
    event.done = True
    body = encode(record, force=False)
    assert body is not None
    assert body["fingerprint"] == "ffffffffffffffff0000000000000002"
    assert body["replica_group"] == "0-7"
    assert len(body["replica_group"]) <= MAX_GROUP_CHARS
