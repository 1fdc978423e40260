"""The pull of ``ps_torch.Worker``'s device path (a model on a GPU) run on the CPU: when the shards
share the host, the native client lends their parameters boards (``register_param_boards``, each
mapping registered once and released while still mapped), and the weights go up straight from
the board slots of the version pulled (``pull_lent``), copying no host byte
(``_native.copied()``); the native client re-checks each slot's version once the uploads
completed (``verify_pulled``), and a torn one makes the step be done again from a copied pull.
``PullCopies`` plays the GPU: the parameters are not views of host memory (as on a GPU), each
upload is a copy logged with where it read from, its event pending until waited for. Every
variant's weights are the same bits as the CPU path's: the lent boards, a refused registration
(the copy path), gRPC, a torn version."""

import copy
import ctypes
import logging

import pytest
import torch

import ps
from ps import _native
from ps_torch import _device
from common import Shards, SmallCNN, config_text, run_ranks, train_rank
from test_device_push import DATA, DeferredCopies, assert_same_bits, cpu_run, mapped_file  # noqa: F401

STEPS = 8


class PullCopies(DeferredCopies):
    """``DeferredCopies`` with the device's uploads: the parameters live "on the device" (not
    views of the memory pulled into); ``upload`` logs each copy's source and its event waits
    until waited for. ``refuse``: the parameters boards' registration fails (the copy path;
    the push buffer is registered as before). ``tear``: the
    upload call (0-based) whose first read from a board slot meets the shard writing that
    slot: its sequence number says "being written" and the copy reads other values."""

    host_params = False

    def __init__(self, refuse=False, tear=None):
        super().__init__()
        self.refuse, self.tear = refuse, tear
        self.uploads = []  # per upload call: its sources (address, values)
        self.waiting = set()
        self.torn = None  # (sequence address, its value before the tear)

    def register(self, address, nbytes):
        if self.refuse and (mapped_file(address) or "").endswith("/params"):
            raise RuntimeError("out of page-lockable memory (refused by the test)")
        super().register(address, nbytes)

    def upload(self, pairs):
        sources = []
        with torch.no_grad():
            for dst, src in pairs:
                if self.tear == len(self.uploads) and self.torn is None and self.board_of(src):
                    self.tear_slot(src)
                    dst.copy_((src + 1000.0).view_as(dst))  # what a DMA racing the writer reads
                else:
                    dst.copy_(src.view_as(dst))
                sources.append((src.data_ptr(), src.numel()))
        self.uploads.append(sources)
        self.events += 1
        self.waiting.add(self.events)
        self.log.append(("upload", len(pairs), self.events))
        return [self.events]

    def wait(self, event):
        if event in self.waiting:
            self.waiting.discard(event)
            self.log.append(("wait", event))
        else:
            super().wait(event)

    def params_boards(self, ever=False):
        """(address, bytes) of each parameters board mapping registered (``ever``: also those
        unregistered since)."""
        live = {e[1]: e for e in self.kinds("register")}
        for e in self.kinds("unregister") if not ever else []:
            live.pop(e[1], None)
        return [(a, e[2]) for a, e in live.items() if e[3].endswith("/params")]

    def board_of(self, src):
        return self.board_of_address(src.data_ptr())

    def board_of_address(self, at, ever=False):
        for address, nbytes in self.params_boards(ever):
            if address <= at < address + nbytes:
                return address, nbytes
        return None

    def tear_slot(self, src):
        """The shard begins writing the next version but one into the slot ``src`` lies in
        (ps-common/net/src/shm.rs: a 4096-byte header with slot k's sequence number at 64 +
        64 k, then 2 slots; "being written" is odd)."""
        address, nbytes = self.board_of(src)
        k = (src.data_ptr() - address - 4096) // ((nbytes - 4096) // 2)
        seq = ctypes.c_uint64.from_address(address + 64 + 64 * k)
        self.torn = (ctypes.addressof(seq), seq.value)
        seq.value += 3

    def restore(self):
        """The writer done with the slot as it was (after the worker refused the version)."""
        address, value = self.torn
        ctypes.c_uint64.from_address(address).value = value


@pytest.fixture
def copies(monkeypatch):
    """Every Worker made in the test takes the device path with its own PullCopies (made by
    ``copies.make(**kw)`` before the workers; the list in the order the workers were made)."""
    made, options = [], {}

    def copies_for(params):
        made.append(PullCopies(**options))
        return made[-1]

    monkeypatch.setattr(_device, "copies_for", copies_for)
    return made, options


@pytest.fixture(scope="module")
def mnist():
    from common import load

    torch.set_num_threads(1)
    x, y = load(DATA, "train")
    return x[:1024], y[:1024]


def train(out, base, x, y, overlap, workers=2, extra=""):
    """``workers`` workers against 2 real shards for STEPS steps; returns (models, workers,
    host bytes the pulls copied in this process)."""
    out.mkdir(parents=True)
    init = out / "init.safetensors"
    ps.save_init(base, init)
    cfg = out / "run.toml"
    text = config_text(init, DATA, out, workers=workers, global_batch=32 * workers, steps=STEPS)
    cfg.write_text(text.replace(f"workers = {workers}\n", f"workers = {workers}\n{extra}"))
    models = [copy.deepcopy(base) for _ in range(workers)]
    with Shards(cfg, 2, out) as shards:
        ws = [ps.Worker(cfg, m, rank=r, servers=shards.addrs) for r, m in enumerate(models)]
        before = _native.copied()[0]
        run_ranks(lambda r: train_rank(ws[r], models[r], x, y, "mean", overlap=overlap),
                  ranks=workers)
        pulled = _native.copied()[0] - before
        assert shards.wait(60) == [0] * 2
    return models, ws, pulled


def check_boards(c, worker):
    """Both shards' parameters boards registered once each and unregistered once, while still
    mapped and after every upload was waited for; the ranges registered are whole mappings of
    the shards' /dev/shm "params" files."""
    regs = [e for e in c.kinds("register") if e[3].endswith("/params")]
    assert len(regs) == 2 and len({e[3] for e in regs}) == 2, regs
    n = sum(p.numel() for _, p in worker._params)
    for _, address, nbytes, mapped in regs:
        (unreg,) = [e for e in c.kinds("unregister") if e[1] == address]
        # still mapped when unregistered (the file removed by then if the shard has ended)
        assert unreg[2].removesuffix(" (deleted)") == mapped, (unreg, mapped)
        assert nbytes > 4096 and mapped_file(address) != mapped  # unmapped since
    assert 4 * n <= sum(e[2] - 4096 for e in regs) // 2  # one slot of each holds its range
    uploads = [e[2] for e in c.kinds("upload")]
    assert sorted(e[1] for e in c.kinds("wait") if e[1] in uploads) == uploads


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "backward"])
def test_board_pull_copies_nothing_and_is_bit_identical(tmp_path, mnist, copies, cpu_run,
                                                        overlap):
    """SmallCNN, 2 workers, 2 shards on this host: each pull's uploads read the shards' board
    slots (no upload from the page-locked pull buffer) and the pulls copy 0 host bytes; with
    the registration refused they go through the buffer (4 bytes per parameter per pull and
    worker); the weights of both, and of the CPU path, are the same bits."""
    x, y = mnist
    torch.manual_seed(3)
    base = SmallCNN()
    made, options = copies
    lent, workers, lent_bytes = train(tmp_path / "lent", base, x, y, overlap)
    options["refuse"] = True
    refused, refused_workers, copied_bytes = train(tmp_path / "refused", base, x, y, overlap)
    cpu, _, _ = cpu_run(train, tmp_path / "cpu", base, x, y, overlap)
    n = sum(p.numel() for p in base.parameters())
    assert lent_bytes == 0
    assert copied_bytes == 2 * (STEPS + 1) * 4 * n  # the first weights and one pull per step
    for r in range(2):
        assert_same_bits(lent[r], cpu[r])
        assert_same_bits(refused[r], cpu[r])
        c, w = made[r], workers[r]
        check_boards(c, w)
        assert len(c.uploads) == STEPS + 1
        flat = (w._flat.data_ptr(), w._flat.data_ptr() + 4 * n)
        for sources in c.uploads:
            assert not any(flat[0] <= a < flat[1] for a, _ in sources)  # none from the buffer
        # every pull read all n values from the two slots
        for sources in c.uploads:
            assert sum(k for a, k in sources if c.board_of_address(a, ever=True)) == n
        refused_copies = made[2 + r]
        assert [e for e in refused_copies.kinds("register") if e[3].endswith("/params")] == []
        fw = refused_workers[r]
        fflat = (fw._flat.data_ptr(), fw._flat.data_ptr() + 4 * n)
        for sources in refused_copies.uploads:
            assert all(fflat[0] <= a < fflat[1] for a, _ in sources)


def test_grpc_pulls_by_copying_the_same_bits(tmp_path, mnist, copies, cpu_run):
    """Over gRPC there is no board to lend: no parameters board registered, each pull copied
    into the page-locked buffer and uploaded from it; the same bits as the CPU path."""
    x, y = mnist
    torch.manual_seed(5)
    base = SmallCNN()
    made, _ = copies
    extra = 'transport = "grpc"\n'
    grpc, workers, _ = train(tmp_path / "grpc", base, x, y, True, extra=extra)
    cpu, _, _ = cpu_run(train, tmp_path / "cpu", base, x, y, True, extra=extra)
    n = sum(p.numel() for p in base.parameters())
    for r in range(2):
        assert workers[r].transport() == ["gRPC"] * 2
        assert_same_bits(grpc[r], cpu[r])
        c = made[r]
        assert [e for e in c.kinds("register") if e[3].endswith("/params")] == []
        assert len(c.uploads) == STEPS + 1
        flat = (workers[r]._flat.data_ptr(), workers[r]._flat.data_ptr() + 4 * n)
        assert all(flat[0] <= a < flat[1] for s in c.uploads for a, _ in s)


class Said(logging.Handler):
    """Keeps the messages of the "ps" logger; ``on_torn`` runs when the worker says a version
    was torn (the test's writer then restores the slot)."""

    def __init__(self, on_torn):
        super().__init__(logging.WARNING)
        self.messages, self.on_torn = [], on_torn

    def emit(self, record):
        text = record.getMessage()
        self.messages.append(text)
        if "overwrote its board slot" in text:
            self.on_torn()


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "backward"])
def test_a_version_torn_under_the_upload_is_redone_exactly(tmp_path, mnist, copies, cpu_run,
                                                           overlap):
    """One worker, 2 shards: at the 4th pull (version 3) the upload from a slot meets the
    shard writing it (the copy reads other values into the parameters, the slot's sequence
    number says "being written"): the worker says so, pulls version 3 again by copying
    (4 bytes per parameter, once), computes step 3 again and ends with the CPU path's weights,
    the same bits."""
    x, y = mnist
    torch.manual_seed(7)
    base = SmallCNN()
    made, options = copies
    options["tear"] = 3
    said = Said(lambda: made[0].restore())
    logger = logging.getLogger("ps")
    logger.addHandler(said)
    try:
        torn, workers, pulled = train(tmp_path / "torn", base, x, y, overlap, workers=1)
    finally:
        logger.removeHandler(said)
    cpu, _, _ = cpu_run(train, tmp_path / "cpu", base, x, y, overlap, workers=1)
    c = made[0]
    assert c.torn is not None, "no upload met the tear"
    assert_same_bits(torn[0], cpu[0])
    n = sum(p.numel() for p in base.parameters())
    notes = [m for m in said.messages if "overwrote its board slot" in m]
    assert len(notes) == 1, said.messages
    assert "of version 3 while the device was copying it" in notes[0], notes
    assert "version 3 pulled again by copying, the step computed from it done again" in notes[0]
    assert pulled == 4 * n  # the one copied pull
    # the pulls: versions 0..STEPS lent, plus version 3 again from the page-locked buffer
    assert len(c.uploads) == STEPS + 2
    flat = (workers[0]._flat.data_ptr(), workers[0]._flat.data_ptr() + 4 * n)
    from_buffer = [i for i, s in enumerate(c.uploads) if any(flat[0] <= a < flat[1] for a, _ in s)]
    assert from_buffer == [4]
    check_boards(c, workers[0])


def test_param_boards_released_once_while_mapped(tmp_path):
    """The native lending: before connecting it is refused; each parameters board is
    registered once however often asked, the slots lent lie inside the registered mappings,
    a version verified after the copies is accepted, and close() calls release once per
    mapping while it is still mapped (a client dropped without close() too)."""
    torch.manual_seed(3)
    base = SmallCNN()
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, DATA, tmp_path, workers=1, global_batch=32, steps=STEPS))
    desc = [(n, list(p.shape)) for n, p in base.named_parameters()]
    n = sum(p.numel() for p in base.parameters())

    class Borrower:
        def __init__(self):
            self.log = []

        def register(self, address, nbytes):
            self.log.append(("register", address, nbytes, mapped_file(address)))

        def release(self, address):
            self.log.append(("release", address, mapped_file(address)))

    for how in ["close", "drop"]:
        out = tmp_path / how
        out.mkdir()
        with Shards(cfg, 2, out) as shards:
            client = _native.Client(str(cfg), desc, rank=0, servers=shards.addrs)
            b = Borrower()
            with pytest.raises(RuntimeError, match="not connected"):
                client.register_param_boards(b)
            client.connect(32 * STEPS)
            assert client.register_param_boards(b) == 2
            assert client.register_param_boards(b) == 2  # registered already: nothing new
            regs = [e for e in b.log if e[0] == "register"]
            assert len(regs) == 2 and all(e[3].endswith("/params") for e in regs), b.log
            dst = torch.zeros(n, dtype=torch.float32)
            spans = client.pull_lent(0, dst.numpy())
            assert [(lo, hi) for lo, hi, _ in spans][0][0] == 0 and spans[-1][1] == n
            # fc1.weight lies in both shards: the training tests above upload it in 2 pieces
            fc1 = sum(p.numel() for p in list(base.parameters())[:4])
            assert fc1 < spans[0][1] < fc1 + base.fc1.weight.numel(), spans
            for (lo, hi, at), (_, address, nbytes, _) in zip(spans, regs):
                assert address + 4096 <= at and at + 4 * (hi - lo) <= address + nbytes
            assert torch.count_nonzero(dst) == 0  # nothing copied into the buffer
            assert client.verify_pulled() is None
            assert client.verify_pulled() is None  # nothing lent any more
            assert b.log == regs
            if how == "close":
                client.close()
            else:
                del client
            released = [e for e in b.log if e[0] == "release"]
            assert sorted(e[1] for e in released) == sorted(e[1] for e in regs)
            assert {e[2] for e in released} == {e[3] for e in regs}  # still mapped then
            assert all(mapped_file(e[1]) != e[3] for e in regs)  # unmapped since


def test_a_refused_parameters_board_leaves_none_registered(tmp_path):
    """All or none: the device refusing the second parameters board makes the call fail
    naming it, and the first board, registered just before, is released at once (while still
    mapped); a later call registers both again."""
    torch.manual_seed(3)
    base = SmallCNN()
    init = tmp_path / "init.safetensors"
    ps.save_init(base, init)
    cfg = tmp_path / "run.toml"
    cfg.write_text(config_text(init, DATA, tmp_path, workers=1, global_batch=32, steps=STEPS))
    desc = [(n, list(p.shape)) for n, p in base.named_parameters()]

    class Refusing:
        def __init__(self, refuse_at):
            self.log, self.refuse_at = [], refuse_at

        def register(self, address, nbytes):
            if len([e for e in self.log if e[0] == "register"]) + 1 == self.refuse_at:
                raise RuntimeError("out of registrable memory")
            self.log.append(("register", address, mapped_file(address)))

        def release(self, address):
            self.log.append(("release", address, mapped_file(address)))

    with Shards(cfg, 2, tmp_path) as shards:
        client = _native.Client(str(cfg), desc, rank=0, servers=shards.addrs)
        client.connect(32 * STEPS)
        b = Refusing(refuse_at=2)
        with pytest.raises(RuntimeError, match="out of registrable memory"):
            client.register_param_boards(b)
        assert [e[0] for e in b.log] == ["register", "release"], b.log
        assert b.log[1][1:] == b.log[0][1:]  # the same board, released while still mapped
        b.refuse_at = 0
        assert client.register_param_boards(b) == 2
        assert [e[0] for e in b.log] == ["register", "release", "register", "register"], b.log
        client.close()
        assert [e[0] for e in b.log].count("release") == 3
