"""The device path of ``ps_torch.Worker`` (a model on a GPU: ``ps_torch/_device.py``) run on the
CPU: its GPU operations (``_device.CudaCopies``: page-locking, copies queued on a copy stream,
events) are done here by ``DeferredCopies``, which keeps each queued copy pending until its
event is waited for, as a DMA that has not landed yet. So a push that did not wait for the
copies of its gradient pushes stale values, and the weights below would differ from the CPU
path's: they must be the same bits. Also: each tensor's copy lands in the same range of the
lent push buffer every step (the shared-memory board, or the gRPC push's buffer), the buffer is
registered once and unregistered while still mapped, before the native client unmaps it; and
the path chosen by device (a CPU model keeps the CPU path)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ps
from ps import _native
from ps_torch import _device
from common import REPO, Shards, SmallCNN, config_text, load, run_ranks, train_rank
from test_ddp import Mlp, data as mlp_data
from test_unused import Routed, data as routed_data

DATA = REPO / "data" / "mnist"
STEPS = 12


def mapped_file(address: int):
    """The file mapped at ``address`` in this process ("" for an anonymous mapping), None when
    nothing is mapped there."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) == 6 else ""
    return None


class DeferredCopies:
    """``_device.CudaCopies``'s operations on the host, recorded: a copy is done only when its
    event is waited for (or at ``drain``), as an asynchronous copy lands later."""

    def __init__(self):
        self.log = []
        self.pending = {}
        self.events = 0

    def register(self, address, nbytes):
        self.log.append(("register", address, nbytes, mapped_file(address)))

    def unregister(self, address):
        self.log.append(("unregister", address, mapped_file(address), len(self.pending)))

    def staging(self, n):
        self.log.append(("staging", n))
        return torch.zeros(n, dtype=torch.float32)

    def copy(self, dst, src):
        self.events += 1
        self.pending[self.events] = (dst, src)
        self.log.append(("copy", dst.data_ptr(), src.numel(), self.events))
        return self.events

    def wait(self, event):
        dst, src = self.pending.pop(event)
        dst.copy_(src)
        self.log.append(("wait", event))

    def drain(self):
        for e in list(self.pending):
            self.wait(e)
        self.log.append(("drain",))

    def kinds(self, kind):
        return [e for e in self.log if e[0] == kind]


_real_copies_for = _device.copies_for


@pytest.fixture
def device_path(monkeypatch):
    """Every Worker made in the test takes the device path with its own DeferredCopies
    (returned in the list, in the order the workers were made)."""
    made = []

    def copies_for(params):
        made.append(DeferredCopies())
        return made[-1]

    monkeypatch.setattr(_device, "copies_for", copies_for)
    return made


@pytest.fixture
def cpu_run(monkeypatch):
    """Runs ``fn(...)`` with the real ``copies_for``: the CPU path for a CPU model."""
    def call(fn, *args, **kw):
        with monkeypatch.context() as m:
            m.setattr(_device, "copies_for", _real_copies_for)
            return fn(*args, **kw)
    return call


@pytest.fixture(scope="module")
def mnist():
    torch.set_num_threads(1)
    x, y = load(DATA, "train")
    return x[:2048], y[:2048]


def run(tmp_path, base, x, y, overlap, train_len=None, extra="", global_batch=64,
        optimizer='kind = "sgd"\nlr = 0.05'):
    """2 workers against 2 real shards; returns (models, workers)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    text = config_text(init, DATA, tmp_path, global_batch=global_batch, steps=STEPS,
                       train_len=train_len, optimizer=optimizer)
    cfg.write_text(text.replace("workers = 2\n", "workers = 2\n" + extra))
    models = [copy.deepcopy(base) for _ in range(2)]
    with Shards(cfg, 2, tmp_path) as shards:
        workers = [ps.Worker(cfg, m, rank=r, servers=shards.addrs) for r, m in enumerate(models)]
        run_ranks(lambda r: train_rank(workers[r], models[r], x, y, "mean", overlap=overlap))
        assert shards.wait(60) == [0, 0]
    return models, workers


def assert_same_bits(a, b):
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), f"{n} differs"


def check_log(copies, worker, steps, board):
    """Registered once, every copy into its tensor's range of the buffer and waited for, and
    unregistered after the last copy landed while the buffer was still mapped."""
    (reg,) = copies.kinds("register")
    _, address, nbytes, mapped = reg
    assert nbytes == 4 * sum(p.numel() for _, p in worker._params)
    if board:  # the worker's shared-memory gradient board, mapped from /dev/shm
        assert mapped.endswith("/grad") and "-worker" in mapped, mapped
    starts = {address + 4 * o for o in worker._offsets}
    copied = copies.kinds("copy")
    assert {c[1] for c in copied} <= starts  # the same ranges, step after step
    assert len(copied) <= steps * len(starts)
    assert sorted(e for _, e in copies.kinds("wait")) == [c[3] for c in copied]
    (unreg,) = copies.kinds("unregister")
    assert unreg[1] == address and unreg[2] == mapped and unreg[3] == 0
    assert copies.log[-1][0] == "unregister" and copies.log[-2] == ("drain",)
    assert mapped_file(address) != mapped or not board  # unmapped once closed
    return len(copied)


@pytest.mark.parametrize("flavour", ["step", "backward", "grpc_backward"])
def test_device_path_pushes_the_gradients_exactly(tmp_path, mnist, device_path, cpu_run,
                                                   flavour):
    """SmallCNN, 2 workers, 2 shards: the device path's weights equal the CPU path's, bit for
    bit, with step() (copies queued at step()) and backward() (copies queued by the gradient
    hooks), over shared memory and over gRPC (the buffer the gRPC push encodes from)."""
    x, y = mnist
    torch.manual_seed(3)
    base = SmallCNN()
    overlap = flavour != "step"
    extra = 'transport = "grpc"\n' if flavour.startswith("grpc") else ""
    device, workers = run(tmp_path / "device", base, x, y, overlap, extra=extra)
    assert len(device_path) == 2
    cpu, cpu_workers = cpu_run(run, tmp_path / "cpu", base, x, y, overlap, extra=extra)
    assert len(device_path) == 2 and all(w._copies is None for w in cpu_workers)
    for r in range(2):
        assert_same_bits(device[r], cpu[r])
        n = check_log(device_path[r], workers[r], STEPS, board=not extra)
        assert n == STEPS * len(workers[r]._params)  # every tensor reached, every step
        assert workers[r].transport() == (["gRPC"] * 2 if extra else ["shared memory"] * 2)


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "backward"])
def test_device_path_zeros_unreached_tensors(tmp_path, device_path, cpu_run, overlap):
    """A model whose heads some steps do not reach (their .grad None): the device path zeros
    their range of the push buffer (after any copy still queued into it) and tells the
    shards, as the CPU path does: the same bits, with SGD momentum and weight decay."""
    x, y = routed_data()
    torch.manual_seed(4)
    base = Routed()
    opt = 'kind = "sgd"\nlr = 0.1\nmomentum = 0.9\nweight_decay = 0.01'
    device, workers = run(tmp_path / "device", base, x, y, overlap, train_len=len(x),
                          global_batch=8, optimizer=opt)
    cpu, _ = cpu_run(run, tmp_path / "cpu", base, x, y, overlap, train_len=len(x),
                     global_batch=8, optimizer=opt)
    for r in range(2):
        assert_same_bits(device[r], cpu[r])
        n = check_log(device_path[r], workers[r], STEPS, board=True)
        assert n < STEPS * len(workers[r]._params)  # some heads were not reached


def test_cpu_model_keeps_the_cpu_path(tmp_path):
    """The path by device: the CUDA operations only when every trainable parameter is on a
    CUDA device; a CPU model pushes as before (no buffer lent)."""
    cpu = [torch.zeros(2), torch.zeros(3)]
    meta = [torch.zeros(2, device="meta")]
    assert _device.copies_for(cpu) is None
    assert _device.copies_for(meta) is None
    assert _device.copies_for(cpu + meta) is None
    assert _device.copies_for([]) is None
    x, y = mlp_data()
    torch.manual_seed(3)
    base = Mlp()
    models, workers = run(tmp_path, base, x, y, True, train_len=len(x), global_batch=32)
    assert all(w._copies is None and w._push_buffer is None for w in workers)


def test_exact_terms_copied_through_one_staging_tensor(tmp_path, device_path, cpu_run):
    """[train] exact_sum with the device path: each term's gradients are copied into a staging
    tensor allocated once (no push buffer is lent: the push carries the encoded sum) and
    waited for before they are added: the same bits as the CPU path."""
    x, y = mlp_data()
    torch.manual_seed(5)
    base = Mlp()
    k = len(list(base.parameters()))

    def exact_run(out):
        out.mkdir()
        init = out / "init.safetensors"
        ps.save_init(base, init)
        cfg = out / "run.toml"
        text = config_text(init, None, out, global_batch=48, steps=STEPS, train_len=len(x),
                           optimizer='kind = "adam"\nlr = 0.01\neps = 1e-6')
        cfg.write_text(text.replace('aggregation = "mean"', 'aggregation = "mean"\n'
                                    'exact_sum = true\nexact_micro_batch = 8'))
        models = [copy.deepcopy(base) for _ in range(2)]
        with Shards(cfg, 2, out) as shards:
            def go(r):
                w = ps.Worker(cfg, models[r], rank=r, servers=shards.addrs)
                for _, idx in w.batches():
                    for part in w.terms(idx):
                        F.cross_entropy(models[r](x[part]), y[part]).backward()
                    w.step()

            run_ranks(go)
            assert shards.wait(60) == [0, 0]
        return models

    device = exact_run(tmp_path / "device")
    cpu = cpu_run(exact_run, tmp_path / "cpu")
    for r in range(2):
        assert_same_bits(device[r], cpu[r])
        log = device_path[r]
        n = sum(p.numel() for p in base.parameters())
        assert log.kinds("register") == [] and log.kinds("staging") == [("staging", n)]
        copied = log.kinds("copy")
        assert len(copied) == STEPS * 3 * k  # 3 terms of 8 samples per rank and step
        assert len({c[1] for c in copied}) == k  # into the same views every time
        assert sorted(e for _, e in log.kinds("wait")) == [c[3] for c in copied]


def test_push_buffer_lent_once_and_given_back_before_unmapping(tmp_path):
    """The native client's lending: one borrower; the release callable runs exactly once, in
    close() (or when the client is dropped without it), while the board is still mapped;
    lending is refused before connecting."""
    torch.manual_seed(3)
    base = Mlp()
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, None, tmp_path, workers=1, global_batch=32, steps=STEPS,
                               train_len=640))
    desc = [(n, list(p.shape)) for n, p in base.named_parameters()]
    with Shards(cfg, 2, tmp_path) as shards:
        client = _native.Client(str(cfg), desc, rank=0, servers=shards.addrs)
        with pytest.raises(RuntimeError, match="not connected"):
            client.lend_grad_buffer(lambda: None)
        client.connect(640)
        calls = []
        address, n = client.lend_grad_buffer(lambda: calls.append(mapped_file(address)))
        assert n == 12 * 32 + 32 + 3 * 32 + 3
        board = mapped_file(address)
        assert board.endswith("/grad")
        with pytest.raises(RuntimeError, match="lent already"):
            client.lend_grad_buffer(lambda: None)
        assert calls == []
        client.close()
        assert calls == [board]  # called once, before the board was unmapped
        assert mapped_file(address) != board
        client.close()
        assert calls == [board]
    # a client dropped without close() (its Worker gone): the same, before it unmaps
    (tmp_path / "dropped").mkdir()
    with Shards(cfg, 2, tmp_path / "dropped") as shards:
        dropped = _native.Client(str(cfg), desc, rank=0, servers=shards.addrs)
        dropped.connect(640)
        later = []
        address, _ = dropped.lend_grad_buffer(lambda: later.append(mapped_file(address)))
        board = mapped_file(address)
        del dropped
        assert later == [board] and board.endswith("/grad")
        assert mapped_file(address) != board


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "backward"])
def test_device_path_goes_on_bit_identical_after_a_lost_shard(tmp_path, device_path, cpu_run,
                                                              overlap):
    """Shard 1 killed mid-run and recovered (test_recovery.py's run, rank 1 pushing from
    backward() in the "backward" case): the device path's workers roll back and end with the
    CPU path's weights of a run that lost nothing, the same bits; the push buffer stays lent
    and registered once through the recovery."""
    from test_recovery import run as recovery_run

    torch.manual_seed(11)
    base = SmallCNN()
    x, y = load(DATA, "train")
    (tmp_path / "straight").mkdir()
    straight = cpu_run(recovery_run, tmp_path / "straight", base, x, y, lose_shard=False,
                       overlap=overlap)
    (tmp_path / "lost").mkdir()
    lost = recovery_run(tmp_path / "lost", base, x, y, lose_shard=True, overlap=overlap)
    log = (tmp_path / "lost" / "shard-1.recover.log").read_text()
    assert "every shard rolls back to version" in log, log[-3000:]
    for r in range(2):
        assert_same_bits(lost[r], straight[r])
        copies = device_path[r]
        assert len(copies.kinds("register")) == 1 and len(copies.kinds("unregister")) == 1
        # every copy waited for (before its push, or at the release)
        assert len(copies.kinds("wait")) == len(copies.kinds("copy")) >= 120 * 8
