"""overlap.models (the GPT, the corpus) and launch/train_gpt.py, on CPU.

In-process: shapes, determinism, the qkv layout that contiguous column sharding needs,
the corpus and tokenizer. Subprocesses: training runs of launch/train_gpt.py, one process
and tensor-parallel under launch/torchrun.sh / launch/mpirun.sh on gloo.

Loss match, TP against one process (20 steps, fp32, gloo, OMP_NUM_THREADS=1): measured
worst relative difference 8.9e-8 (absolute 2.4e-7) at TP 2 on every path (plain,
overlap, with and without --sp), TP 4 and TP 2 x DP 2. The tests allow rtol 1e-5: a hundred
times that, and far below what a broken shard or a missing reduction gives (1e-3 and more).
A resumed run matches the uninterrupted one exactly.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from overlap.models import GPT, GPTConfig, checkpoint, corpus, get_batch
from overlap.models.corpus import CharTokenizer, corpus_text
from tests._procs import REPO, run_cmd
from tests.conftest import mpi_missing

LOSS_RTOL = 1e-5
SHORT = ("--steps", "10")
"""The runs compared with the reference take its first 10 steps (a run's steps do not
depend on --steps: the resume tests show it) and its validation loss at step 10."""
CFG = GPTConfig(vocab_size=33, block_size=32, n_layer=2, n_head=4, n_embd=32)


def _load_train():
    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "launch/train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_gpt", mod)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------


def test_forward_backward_shapes() -> None:
    model = GPT(CFG, seed=0)
    idx = torch.randint(CFG.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, CFG.vocab_size) and loss is None
    logits, loss = model(idx, idx.roll(-1, dims=1))
    assert loss.shape == () and loss.item() == pytest.approx(torch.log(torch.tensor(33.0)).item(), rel=0.05)
    loss.backward()
    names = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0}
    assert not names, f"parameters without gradient: {names}"
    assert model.lm_head.weight is model.wte.weight  # tied
    assert model.h[0].attn.qkv.weight.shape == (3 * 32, 32) and model.h[1].mlp.fc2.weight.shape == (32, 128)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.int64))


def test_init_and_forward_are_deterministic() -> None:
    torch.manual_seed(1)
    a = GPT(CFG, seed=5)
    torch.manual_seed(2)  # the global RNG is not consulted
    b = GPT(CFG, seed=5)
    c = GPT(CFG, seed=6)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
        if "ln" not in name and "bias" not in name:
            assert not torch.equal(pa, pc), name
    idx = torch.randint(CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    assert torch.equal(a(idx, idx)[1], b(idx, idx)[1])


def test_causal() -> None:
    model = GPT(CFG, seed=0)
    idx = torch.randint(CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    idx2 = idx.clone()
    idx2[:, 12:] = (idx2[:, 12:] + 1) % CFG.vocab_size  # change the future only
    la, lb = model(idx)[0], model(idx2)[0]
    torch.testing.assert_close(la[:, :12], lb[:, :12], rtol=0, atol=0)
    assert not torch.allclose(la[:, 12:], lb[:, 12:])


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=3, n_embd=32)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=0, n_head=2, n_embd=32)
    with pytest.raises(TypeError):
        GPTConfig(10, 8, 1, 2, 32)  # keyword-only


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_with_contiguous_qkv_shard(tp: int) -> None:
    """What a column-parallel qkv holds, a contiguous block of 3C/R output rows, is whole
    heads; the attention finds its head count from the output, and the row-parallel
    proj partial sums add up to the unsharded output (ranks simulated one by one)."""
    cfg = GPTConfig(vocab_size=33, block_size=16, n_layer=1, n_head=4, n_embd=32)
    attn = GPT(cfg, seed=3).h[0].attn.double()
    with torch.no_grad():
        attn.qkv.bias.normal_(generator=torch.Generator().manual_seed(4))  # biases are sharded too
    x = torch.randn(2, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ref = attn(x)
    total = attn.proj.bias.expand_as(ref).clone()
    n, k = 3 * 32 // tp, 32 // tp
    for r in range(tp):
        shard = GPT(cfg, seed=3).h[0].attn.double()
        shard.qkv = torch.nn.Linear(32, n, dtype=torch.float64)
        shard.proj = torch.nn.Linear(k, 32, bias=False, dtype=torch.float64)
        with torch.no_grad():
            shard.qkv.weight.copy_(attn.qkv.weight[r * n:(r + 1) * n])  # [3C/R, C]
            shard.qkv.bias.copy_(attn.qkv.bias[r * n:(r + 1) * n])
            shard.proj.weight.copy_(attn.proj.weight[:, r * k:(r + 1) * k])  # [C, C/R]
        total += shard(x)
    torch.testing.assert_close(total, ref, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------
# the corpus
# --------------------------------------------------------------------------------------


def test_corpus_and_tokenizer() -> None:
    text = corpus_text()
    assert len(text) == corpus.DEFAULT_CHARS and text == corpus_text()
    assert text.startswith("The owl is quiet by the river. ")  # the same text everywhere
    assert corpus_text(seed=7, n_chars=5000) != text[:5000]
    tok = corpus.tokenizer()
    assert tok.vocab_size == 33 and tok.chars == "".join(sorted(set(text)))
    assert tok.decode(tok.encode(text[:1000])) == text[:1000]
    assert CharTokenizer.from_text("bca").encode("abc") == [0, 1, 2]
    train, val = corpus.tokens("train"), corpus.tokens("val")
    assert len(train) + len(val) == len(text) and len(val) == pytest.approx(0.1 * len(text), abs=1)


def test_get_batch() -> None:
    state = torch.get_rng_state()
    x, y = get_batch("train", 4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(torch.get_rng_state(), state)  # only the generator is drawn from
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64 and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])  # y: x shifted by one token
    x2, _ = get_batch("train", 4, 16, torch.Generator().manual_seed(0))
    x3, _ = get_batch("train", 4, 16, torch.Generator().manual_seed(1))
    assert torch.equal(x, x2) and not torch.equal(x, x3)
    xv, _ = get_batch("val", 2, 16, torch.Generator().manual_seed(0))
    assert corpus.tokenizer().decode(xv[0]) in corpus_text()[-len(corpus.tokens("val")):]
    with pytest.raises(ValueError, match="split"):
        get_batch("test", 1, 4, torch.Generator())


# --------------------------------------------------------------------------------------
# launch/train_gpt.py
# --------------------------------------------------------------------------------------


def test_train_args_checked() -> None:
    train = _load_train()
    for argv in (["--sp"], ["--tp", "3"], ["--n-embd", "30"], ["--tp", "2", "--sp", "--block", "33"],
                 ["--eval-every", "-1"]):
        with pytest.raises(SystemExit) as e:
            train.parse_args(argv)
        assert e.value.code == 2, argv


def test_train_help_names_outputs(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _load_train().parse_args(["--help"])
    text = capsys.readouterr().out
    for s in ("train.json", "loss.png", "ckpt/rank{r}.pt", "checkpoints are off by default", "launch/torchrun.sh"):
        assert s in text, (s, text)


def test_train_tp2_without_launcher() -> None:
    """--tp 2 in one process: the reason and the launcher commands, no traceback."""
    r = run_cmd([sys.executable, "launch/train_gpt.py", "--tp", "2", "--steps", "3"], timeout_s=60)
    assert r.returncode == 2, r
    assert "Traceback" not in r.out and "does not divide world_size=1" in r.out, r
    assert "bash launch/torchrun.sh 2 launch/train_gpt.py --tp 2 --steps 3" in r.out, r


_RUNS: dict[tuple, dict] = {}


def train_run(tmp_path_factory: pytest.TempPathFactory, nproc: int, *args: str,
              launcher: str = "torchrun", out: Path | None = None, timeout_s: float = 150) -> dict:
    """launch/train_gpt.py's train.json (plus its output as "log"); one run per argument
    list, shared by the tests that ask for the same one."""
    key = (nproc, launcher, *args, str(out))
    if key in _RUNS:
        return _RUNS[key]
    out = out or tmp_path_factory.mktemp("train")
    if nproc == 0:  # plain python: one process, no launcher
        cmd = [sys.executable, "launch/train_gpt.py"]
    else:
        cmd = ["bash", f"launch/{launcher}.sh", str(nproc), "launch/train_gpt.py"]
    r = run_cmd([*cmd, *args, "--out", str(out)], timeout_s=timeout_s)
    assert r.returncode == 0, r
    result = json.loads((out / "train.json").read_text())
    result["log"], result["out"] = r.out, out
    _RUNS[key] = result
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """20 steps in one process (plain `python`, no launcher): the curve the others match."""
    return train_run(tmp_path_factory, 0)


def _match(losses: list[float], ref: list[float]) -> float:
    assert len(losses) == len(ref)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    assert worst <= LOSS_RTOL, f"worst relative loss difference {worst:.2e} > {LOSS_RTOL:.0e}: {losses} vs {ref}"
    return worst


@pytest.mark.slow
def test_single_process_training(reference: dict) -> None:
    losses = reference["losses"]
    assert len(losses) == 20 and reference["context"]["world_size"] == 1
    assert losses[0] == pytest.approx(3.52, abs=0.05)  # about log(33): nothing learned yet
    assert sum(losses[-5:]) / 5 < losses[0] - 0.6, losses  # it learns: ~3.5 -> ~2.7
    assert reference["val_loss"] < losses[0] - 0.6
    assert all(s["tokens_per_s"] > 0 for s in reference["steps"])
    ctx = reference["context"]
    assert ctx["torch"] == torch.__version__ and ctx["device"].startswith("cpu") and ctx["date"]
    assert "step    20/20  loss" in reference["log"] and "tokens/s" in reference["log"]
    assert (reference["out"] / "loss.png").stat().st_size > 0
    assert [v["step"] for v in reference["val"]] == [10, 20]  # --eval-every 10, and at the end
    assert reference["val"][-1]["loss"] == reference["val_loss"]
    assert "step    10/20  val loss" in reference["log"]


@pytest.mark.slow
def test_single_process_resume(reference: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Stop at step 10, resume to 20: the same curve as the uninterrupted run, exactly."""
    out = tmp_path_factory.mktemp("resume1")
    first = train_run(tmp_path_factory, 0, "--steps", "10", "--save-every", "5", out=out)
    assert first["losses"] == reference["losses"][:10]
    resumed = train_run(tmp_path_factory, 0, "--resume", "--save-every", "5", out=out)
    assert "resumed at step 10" in resumed["log"]
    assert resumed["losses"] == reference["losses"]
    assert resumed["val_loss"] == reference["val_loss"]
    other = run_cmd([sys.executable, "launch/train_gpt.py", "--resume", "--batch", "4", "--steps", "21",
                     "--out", str(out)], timeout_s=60)  # another layout: refused, with the reason
    assert other.returncode not in (0, None) and "was written by" in other.out, other
    before = (out / "train.json").read_bytes()
    back = run_cmd([sys.executable, "launch/train_gpt.py", "--resume", "--steps", "15", "--out", str(out)],
                   timeout_s=60)  # a checkpoint at step 20, --steps 15: refused, nothing written
    assert back.returncode not in (0, None) and "is at step 20, --steps is 15" in back.out, back
    assert (out / "train.json").read_bytes() == before


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("path", ["plain", "overlap"])
def test_tp2_matches_single_process(reference: dict, tmp_path_factory: pytest.TempPathFactory,
                                    path: str, sp: bool) -> None:
    run = train_run(tmp_path_factory, 2, "--tp", "2", "--path", path, *(["--sp"] if sp else []), *SHORT)
    assert run["context"]["tp_size"] == 2 and run["context"]["launcher"] == "torchrun"
    _match(run["losses"], reference["losses"][:10])
    assert reference["val"][0]["step"] == 10
    assert run["val_loss"] == pytest.approx(reference["val"][0]["loss"], rel=LOSS_RTOL)
    ops = {r["op"] for r in run["ops"]}
    if path == "overlap":  # the layers went through the library's ops (their reference on CPU)
        assert ops, "no overlap op was called on --path overlap"
    else:
        assert not ops, run["ops"]


@pytest.mark.slow
def test_tp2_checkpoint_round_trip(reference: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Sharded checkpoints at TP 2: each rank holds its own slices; resuming continues the
    uninterrupted TP-2 curve exactly. The job restarts under mpirun where it can (a
    checkpoint does not depend on the launcher, and that run is the mpirun test)."""
    full = train_run(tmp_path_factory, 2, "--tp", "2", "--path", "plain", *SHORT)
    out = tmp_path_factory.mktemp("resume2")
    first = train_run(tmp_path_factory, 2, "--tp", "2", "--steps", "5", "--save-every", "5", out=out)
    assert first["losses"] == full["losses"][:5]
    shards = [checkpoint.load(out / "ckpt" / f"rank{r}.pt")[0] for r in (0, 1)]
    w0, w1 = (s["model"]["h.0.attn.qkv.weight"] for s in shards)
    assert w0.shape == w1.shape == (3 * 64 // 2, 64) and not torch.equal(w0, w1)
    assert shards[0]["model"]["h.0.attn.proj.weight"].shape == (64, 32)
    assert all(s["step"] == 5 for s in shards)
    launcher = "torchrun" if mpi_missing() else "mpirun"
    resumed = train_run(tmp_path_factory, 2, "--tp", "2", "--resume", *SHORT, launcher=launcher, out=out)
    assert "resumed at step 5" in resumed["log"] and resumed["context"]["launcher"] == launcher
    assert resumed["losses"] == full["losses"]
    _match(resumed["losses"], reference["losses"][:10])

    # a damaged shard on rank 0 only: both ranks stop within seconds, each saying which rank's
    # file is bad (rank 1's file is fine and it would otherwise wait in a collective)
    raw = bytearray((out / "ckpt" / "rank0.pt").read_bytes())
    w = shards[0]["model"]["h.0.mlp.fc1.weight"]
    at = bytes(raw).find(w.numpy().tobytes())
    assert at > 0
    raw[at + 256:at + 320] = b"\x7f" * 64
    (out / "ckpt" / "rank0.pt").write_bytes(bytes(raw))
    r = run_cmd(["bash", "launch/torchrun.sh", "2", "launch/train_gpt.py", "--tp", "2", "--resume",
                 "--steps", "12", "--timeout", "120", "--out", str(out)], timeout_s=60)
    assert r.returncode not in (0, None) and r.elapsed_s < 30, r
    assert "rank0.pt is corrupt" in r.out and r.out.count("checkpoints of rank(s) [0] cannot be used") == 2, r


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "4", "--sp"], ["--tp", "2", "--sp", "--path", "overlap"]],
                         ids=["tp4-sp-plain", "tp2xdp2-sp-overlap"])
def test_four_ranks(reference: dict, tmp_path_factory: pytest.TempPathFactory, layout: list[str]) -> None:
    """4 ranks. TP 4: one head per rank. TP 2 x DP 2: each DP rank trains on half of the
    global batch and the gradients are averaged. Both: the single-process curve."""
    run = train_run(tmp_path_factory, 4, *layout, *SHORT, timeout_s=240)
    tp = int(layout[1])
    assert (run["context"]["tp_size"], run["context"]["dp_size"]) == (tp, 4 // tp)
    _match(run["losses"], reference["losses"][:10])
