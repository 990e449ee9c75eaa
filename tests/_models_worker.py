"""One rank of the gloo tests of ``parallelize`` on real model families (started by
tests/nn/test_models.py): HF transformers' Llama (GQA), Mistral, Qwen2 (q/k/v biases, tied
embeddings), Qwen3 (per-head q/k norms) and GPT-2 (Conv1D, fused ``c_attn``), tiny and built
from their configs (never downloaded), and a model built like torchtitan's Llama (an
``nn.Linear`` subclass, blocks in a ``ModuleDict`` called positionally), one built like
gpt-fast's (a fused GQA ``wqkv``, head counts read in forward) and one like nanoGPT's (the
input's width read in forward), through ``parallelize(model)`` with no plan.

Per family, sequence-parallel and not, against the unsharded model built from the same
seed: logits, loss, every parameter's gradient (``unshard``: gathered back into the
unsharded layout) and 5 AdamW steps (new tokens each step); the number of data
all-gathers in one forward and reductions of the input gradient in one backward (one per
layer input); then the failures that must raise, leaving the model as it was. Prints
``PASS models world=W rank=R`` at the end.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

# run as a script, this folder leads sys.path, and its kernels/ would shadow the `kernels`
# package that transformers imports
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch
import torch.distributed as tdist

from overlap import dist
from overlap.nn import (ColumnParallelLinear, RowParallelLinear, SequenceParallelNorm, VocabParallelEmbedding,
                        functional, parallelize, unshard, vocab_parallel_cross_entropy)
from tests import _model_zoo as zoo
from tests._model_zoo import C, V, FastGPT, NanoGPT, TitanLlama, families, titan_plan

RANK, WS = 0, 1
TOL = {"rtol": 2e-4, "atol": 2e-5}  # fp32, sums over ranks in another order than the unsharded model's
# after AdamW steps: Adam divides by the gradient's own scale, so rounding differences of
# near-zero gradient entries become differences of up to lr in the weights
TOL_STEPS = {"rtol": 2e-3, "atol": 2e-4}
B, T = 2, 8


def build(family: str, kv: int = 0) -> torch.nn.Module:
    return zoo.build(family, WS, kv)


def run(m: torch.nn.Module, ids: torch.Tensor, vocab: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss) of an HF model or the torchtitan-like one (vocab: its logits split over
    the vocabulary, the loss through vocab_parallel_cross_entropy)."""
    if isinstance(m, (TitanLlama, FastGPT, NanoGPT)):
        logits = m(ids)
        flat, t = logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
        if vocab:
            return logits, vocab_parallel_cross_entropy(flat, t).mean()
        return logits, torch.nn.functional.cross_entropy(flat, t)
    out = m(input_ids=ids, labels=ids)
    return out.logits, out.loss

def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1000 + step))  # new every step


def close(got: torch.Tensor, want: torch.Tensor, what: str, tol: dict = TOL) -> None:
    torch.testing.assert_close(got, want, **tol, msg=lambda s: f"rank {RANK}: {what}: {s}")


class CollectiveCount:
    """Counts the collectives on floating-point data torch.distributed runs, by kind
    ("all_gather", "reduce_scatter", "all_reduce"; the ops' agreement checks move ints,
    which are not data)."""

    FNS = {"all_gather": ("all_gather_into_tensor", "all_gather_single", "all_gather"),
           "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter"),
           "all_reduce": ("all_reduce",)}

    def __init__(self) -> None:
        self.n = {kind: 0 for kind in self.FNS}
        self.saved = {}
        for kind, fns in self.FNS.items():
            for fn in fns:
                if hasattr(tdist, fn):
                    self.saved[fn] = getattr(tdist, fn)
                    setattr(tdist, fn, self._wrap(kind, self.saved[fn]))

    def _wrap(self, kind: str, f):
        def g(*a, **k):
            t = a[0] if kind == "all_reduce" else (a[1] if len(a) > 1 else k.get("input_tensor"))
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.n[kind] += 1
            return f(*a, **k)
        return g

    def close(self) -> None:
        for fn, f in self.saved.items():
            setattr(tdist, fn, f)

def check_family(family: str, sp: bool, plan: dict | None = None, vocab: bool = False, kv: int = 0) -> None:
    what = (f"{family} sp={sp}" + (" (a plan)" if plan else "") + (" vocab-parallel" if vocab else "")
            + (f" {kv} kv heads" if kv else ""))
    ref = build(family, kv)
    tp = parallelize(copy.deepcopy(ref), plan=plan, sequence_parallel=sp, vocab_parallel=vocab)
    if vocab:
        embs = [m for m in tp.modules() if isinstance(m, VocabParallelEmbedding)]
        assert len(embs) == 1 and embs[0].weight.shape[0] == V // WS, what
        tied = [p for p in ref.parameters() if p.shape == (V, C)]
        assert len([p for p in tp.parameters() if p.shape[0] == V // WS and p.dim() == 2]) == len(tied), what
    layers = 2
    assert tp.overlap_parallel.recognized == (plan is None), tp.overlap_parallel
    assert plan or len(tp.overlap_parallel.units) == 2 * layers, tp.overlap_parallel
    assert tp.state_dict().keys() == ref.state_dict().keys(), what  # names kept: checkpoints load either way
    cols = [m for m in tp.modules() if isinstance(m, ColumnParallelLinear) and m.out_features != V]  # not the head
    rows = [m for m in tp.modules() if isinstance(m, RowParallelLinear)]
    assert len(rows) == 2 * layers and cols and all(m.sequence_parallel == sp for m in cols + rows), what
    assert sp == any(isinstance(m, SequenceParallelNorm) for m in tp.modules()), what
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    opt_tp = torch.optim.AdamW(tp.parameters(), lr=1e-3, eps=1e-6)
    for step in range(5):
        ids = tokens(step + 10 * sp)
        logits_ref, loss_ref = run(ref, ids)
        count = CollectiveCount()
        try:
            logits, loss = run(tp, ids, vocab)
        finally:
            count.close()
        if vocab:  # this rank's vocabulary columns only; gathered here to compare
            assert logits.shape[-1] == V // WS, f"{what}: logits {tuple(logits.shape)}"
            with torch.no_grad():
                logits = functional.gather_from_region(logits, group=tdist.group.WORLD, dim=-1)
        # one data all-gather per layer input (attention's and MLP's), and the stream's
        # gather after the last block; none without sequence parallelism
        want = 2 * layers + 1 if sp else 0
        got = count.n["all_gather"]
        assert got == want, f"rank {RANK}: {what}: {got} all-gathers in one forward, want {want}"
        tol = TOL if step == 0 else TOL_STEPS
        close(logits, logits_ref, f"{what} step {step}: logits", tol)
        close(loss, loss_ref, f"{what} step {step}: loss", tol)
        loss_ref.backward()
        count = CollectiveCount()
        try:
            loss.backward()
        finally:
            count.close()
        # backward likewise: one reduction of the summed input gradient per layer input (a
        # reduce-scatter, or without sequence parallelism an all-reduce, where nothing else
        # all-reduces: per-head norms and replicated key/value heads add theirs, a
        # vocab-parallel head one; a plan without sequence parallelism reduces per layer)
        if sp:
            got = count.n["reduce_scatter"]
            assert got == 2 * layers, f"rank {RANK}: {what}: {got} reduce-scatters in one backward"
        elif family != "qwen3" and not kv and not plan:
            got, want = count.n["all_reduce"], 2 * layers + vocab
            assert got == want, f"rank {RANK}: {what}: {got} all-reduces in one backward, want {want}"
        grads = unshard(tp, grads=True)
        for name, p in ref.named_parameters():
            assert grads[name] is not None, f"{what}: no gradient for {name}"
            close(grads[name], p.grad, f"{what} step {step}: grad {name}", tol)
        opt_ref.step()
        opt_tp.step()
        opt_ref.zero_grad()
        opt_tp.zero_grad()
    full = unshard(tp)
    for name, p in ref.named_parameters():
        close(full[name], p.detach(), f"{what}: {name} after 5 AdamW steps", TOL_STEPS)


def snapshot(m: torch.nn.Module) -> tuple:
    """What parallelize may change: the module tree, parameters, hooks, head counts."""
    return ([(n, type(x).__name__, len(x._forward_pre_hooks), len(x._forward_hooks),
              {a: v for a, v in vars(x).items() if isinstance(v, int)}) for n, x in m.named_modules()],
            {k: v.clone() for k, v in m.state_dict().items()})


def unchanged(m: torch.nn.Module, before: tuple, what: str) -> None:
    after = snapshot(m)
    assert after[0] == before[0], f"rank {RANK}: {what}: the module tree changed"
    assert after[1].keys() == before[1].keys() and all(torch.equal(after[1][k], v) for k, v in before[1].items()), what
    assert getattr(m, "overlap_parallel", None) is None, what


def raises(fn, exc: type, text: str, what: str) -> Exception:
    try:
        fn()
    except exc as e:
        assert text in str(e), f"rank {RANK}: {what}: {e}"
        return e
    raise AssertionError(f"rank {RANK}: {what}: accepted")


class NotRowWise(torch.nn.Module):
    """A 'norm' with a weight [C] that normalizes over the sequence: no per-token norm."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-2, keepdim=True) * self.weight


def check_failures() -> None:
    """Each of these raised late, or gave a wrong result with no error, before."""
    from torch import nn

    # key/value heads that neither divide over the ranks nor divide them: raised at
    # parallelize, the model unchanged (fewer than ranks, dividing them: replicated, above)
    m = build("llama", kv=1)
    m.model.layers[0].self_attn.num_key_value_heads = 3  # as a model with 3 kv heads would say
    before = snapshot(m)
    e = raises(lambda: parallelize(m), ValueError, "heads", "3 kv heads")
    assert "model.layers.0.self_attn" in str(e) and "tensor-parallel size" in str(e), e
    unchanged(m, before, "3 kv heads")
    # a parameter-holding module in a block that is not a row-wise norm, under sequence
    # parallelism: raised, model unchanged (its gradient would be silently wrong)
    m = build("llama")
    for layer in m.model.layers:
        layer.scale = NotRowWise(C)
    before = snapshot(m)
    raises(lambda: parallelize(m, sequence_parallel=True), ValueError, "not row-wise", "non-row-wise norm")
    unchanged(m, before, "non-row-wise norm")
    parallelize(m)  # without sequence parallelism it is replicated, run on every token: fine
    # a linear in a block outside attention and MLP (a router, an adapter): raised, unchanged
    m = build("llama")
    m.model.layers[1].router = nn.Linear(C, 4)
    before = snapshot(m)
    raises(lambda: parallelize(m), ValueError, "model.layers.1.router", "stray linear")
    unchanged(m, before, "stray linear")
    # an nn.Linear subclass is accepted, one overriding forward is refused by name
    class Plain(nn.Linear):
        pass

    class Lora(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    m, ref = build("llama"), build("llama")
    for mod in (m, ref):
        old = mod.model.layers[0].self_attn.q_proj
        new = Plain(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        mod.model.layers[0].self_attn.q_proj = new
    ids = tokens(77)
    close(parallelize(m)(input_ids=ids).logits, ref(input_ids=ids).logits, "nn.Linear subclass")
    m = build("llama")
    old = m.model.layers[0].mlp.up_proj
    m.model.layers[0].mlp.up_proj = Lora(old.in_features, old.out_features, bias=False)
    before = snapshot(m)
    raises(lambda: parallelize(m), TypeError, "overrides forward", "Linear subclass with its own forward")
    unchanged(m, before, "Linear subclass with its own forward")
    # a vocabulary that does not divide over the ranks: raised, unchanged; a plan with it: raised
    if WS > 1:
        m = build("llama")
        m.resize_token_embeddings(V + 1)
        before = snapshot(m)
        raises(lambda: parallelize(m, vocab_parallel=True), ValueError, "does not divide", "odd vocabulary")
        unchanged(m, before, "odd vocabulary")
    m = build("titan")
    raises(lambda: parallelize(m, plan=titan_plan(False), vocab_parallel=True), ValueError, "vocab_parallel",
           "vocab_parallel with a plan")
    # GPT-2's fused c_attn planned "column" (a contiguous slice: not whole heads of q, k and
    # v; logits off by a quarter before): raised, unchanged; "column_fused": right
    plan = {"*attn.c_attn": "column", "*attn.c_proj": "row", "*mlp.c_fc": "column", "*mlp.c_proj": "row"}
    m = build("gpt2")
    before = snapshot(m)
    raises(lambda: parallelize(m, plan=plan), ValueError, "column_fused", "fused qkv planned column")
    unchanged(m, before, "fused qkv planned column")
    m, ref = parallelize(build("gpt2"), plan={**plan, "*attn.c_attn": "column_fused"}), build("gpt2")
    close(run(m, tokens(8))[0], run(ref, tokens(8))[0], "gpt2, a plan with column_fused")
    # a norm left out of a sequence-parallel plan (its gradient would be wrong): raised, unchanged
    m = build("titan")
    plan = {k: v for k, v in titan_plan(True).items() if k != "layers.*.ffn_norm"}
    before = snapshot(m)
    raises(lambda: parallelize(m, plan=plan, sequence_parallel=True), ValueError, "layers.0.ffn_norm",
           "a norm left out of the plan")
    unchanged(m, before, "a norm left out of the plan")
    # generation (a key/value cache, one new token per step) without sequence parallelism:
    # the unsharded model's tokens
    ref = build("llama").eval()
    m = parallelize(build("llama")).eval()
    ids = tokens(9)[:1, :5]
    assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False),
                       ref.generate(ids, max_new_tokens=6, do_sample=False)), f"rank {RANK}: generate"
    # twice: refused
    m = parallelize(build("gpt2"))
    raises(lambda: parallelize(m), ValueError, "already parallelized", "twice")
    # under sequence parallelism an attention module that computes on its input other than
    # through its projections raises (it would see the shard's values as the sequence's);
    # the model works again once that is gone
    m, ref = parallelize(build("llama"), sequence_parallel=True), build("llama")
    attn = m.model.layers[1].self_attn
    seen = []
    h = attn.register_forward_pre_hook(lambda _m, args, kw: seen.append(float(kw["hidden_states"].abs().sum())),
                                       with_kwargs=True)  # reads the values of its input
    raises(lambda: m(input_ids=tokens(5)), RuntimeError, "model.layers.1.self_attn used its input", "stand-in read")
    h.remove()
    assert not seen, seen
    h = attn.register_forward_pre_hook(lambda _m, args, kw: (args, {**kw, "hidden_states": kw["hidden_states"] * 1}),
                                       with_kwargs=True)  # hands its projections a tensor of its own
    raises(lambda: m(input_ids=tokens(5)), RuntimeError, "model.layers.1.self_attn", "stand-in replaced")
    h.remove()
    close(m(input_ids=tokens(6)).logits, ref(input_ids=tokens(6)).logits, "after the stand-in error")
    # a sequence not divisible by the ranks: a clear error, not a wrong split
    if WS > 1:
        raises(lambda: m(input_ids=tokens(7)[:, :T - 1]), ValueError, "not a multiple", "odd sequence")


def main() -> None:
    global RANK, WS
    warnings.filterwarnings("ignore", message=".*no tile-flag path.*")
    ctx = dist.init(backend="gloo", timeout_s=60)
    RANK, WS = ctx.rank, ctx.world_size
    torch.set_num_threads(1)
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # the test skips before starting ranks; this is the backstop
        print(f"SKIP models: transformers not importable ({e})", flush=True)
        return
    args = sys.argv[1:]
    quick = "--quick" in args  # the families alone, no plans, vocab-parallel or failures
    only = [a for a in args if not a.startswith("--")] or [*families(0, WS), "titan", "gptfast", "nanogpt"]
    for family in only:
        for sp in (False, True):
            check_family(family, sp)
            if family == "titan" and not quick:
                check_family(family, sp, titan_plan(sp))
            if family == "qwen3" and not sp and not quick:  # a plan by HF names: the q/k norms still summed
                check_family(family, sp, {"*self_attn.[qkv]_proj": "column", "*self_attn.o_proj": "row",
                                          "*mlp.gate_proj": "column", "*mlp.up_proj": "column",
                                          "*mlp.down_proj": "row"})
            if family in ("llama", "qwen2", "titan", "nanogpt") and not quick:  # untied, tied, not HF
                check_family(family, sp, vocab=True)
            if family in ("llama", "mistral", "qwen2", "gptfast") and WS == 2:  # fewer kv heads than ranks
                check_family(family, sp, kv=WS // 2)
    if not quick:
        check_failures()
    tdist.barrier()
    dist.shutdown()
    print(f"PASS models world={WS} rank={RANK}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
